"""The job payload schema: what a producer may ask for, checked the same way on both sides.

A producer validates before anything reaches Redis; the worker validates again
what it reads back, because a rogue producer can write Redis directly. Both go
through :meth:`GenerationRequest.from_payload`, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from mlxq.producer.errors import PayloadError
from mlxq.producer.logits_params import NOTHING, LogitsParams
from mlxq.producer.validate import bad, integer, number, text

PAYLOAD_VERSION = 1
#: Default cap on ``max_tokens``; a Client or worker may set its own.
MAX_TOKENS_CAP = 32_768
#: Longest prompt (characters, over all chat messages) a job may carry.
MAX_PROMPT_CHARS = 1_000_000
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1_024
MAX_SEED = 2**63 - 1
#: Above any vocabulary; past the vocabulary size top_k keeps everything.
MAX_TOP_K = 1 << 20
#: Largest metadata map, msgpack-encoded.
MAX_METADATA_BYTES = 64 * 1024
#: Longest ``timeout`` / ``ttl`` a job may ask for, in seconds (a week).
MAX_DEADLINE_S = 7 * 24 * 3600.0
#: Most samples (``n``) of one prompt a job may ask for.
MAX_N = 16
#: Most alternatives per position ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The LogitsParams fields a payload carries as plain values.
LOGITS_FIELDS = (
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "min_tokens",
)
ROLES = ("system", "user", "assistant", "tool", "developer")
#: The keys a chat message may carry: OpenAI's, less those needing tools or images.
MESSAGE_KEYS = frozenset({"role", "content", "name"})
#: Longest ``name`` of a chat message (OpenAI's limit).
MAX_NAME_CHARS = 64

#: A sampling-parameter key: jobs with equal keys can share one plain sampler.
ParamKey = tuple[float, float, int, float]


def _metadata(value: Any) -> dict[str, Any]:
    # Checked by a msgpack round trip: what passes here is exactly what the worker reads back.
    if not isinstance(value, Mapping):
        raise bad("metadata", value, "must be a map with string keys")
    try:
        packed = msgpack.packb(dict(value), use_bin_type=True)
        out = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise bad("metadata", value, f"must be msgpack data with string keys ({e})") from None
    if len(packed) > MAX_METADATA_BYTES:
        raise bad("metadata", f"<{len(packed)} bytes>", f"at most {MAX_METADATA_BYTES} bytes")
    return dict(out)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one job's next token is drawn; each field means what it means to
    mlx-lm's ``make_sampler``.

    Args:
        temperature: 0 draws the argmax (greedy); above 0 divides the log-probs.
        top_p: Nucleus mass kept, in (0, 1]; 1 keeps everything.
        top_k: Keep the k most likely tokens; 0 keeps everything.
        min_p: Drop tokens less likely than ``min_p`` times the top token; 0 keeps all.
        seed: Makes the draw a function of (seed, position, token) alone, so a
            seeded job gives the same tokens alone or batched. None: unseeded.

    Raises:
        PayloadError: (a ``ValueError``) naming the field and the bad value.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = number("temperature", self.temperature)
        if t < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        p = number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= integer("top_k", self.top_k) <= MAX_TOP_K:
            raise bad("top_k", self.top_k, f"must be in [0, {MAX_TOP_K}] (0 disables it)")
        m = number("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not 0 <= integer("seed", self.seed) <= MAX_SEED:
            raise bad("seed", self.seed, f"must be in [0, {MAX_SEED}]")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "min_p", m)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def key(self) -> ParamKey:
        """The batching key. Greedy ignores the filters, so all greedy jobs share
        one key; the seed is per-row noise and never splits a batch."""
        if self.greedy:
            return (0.0, 1.0, 0, 0.0)
        return (self.temperature, self.top_p, self.top_k, self.min_p)


def _content(name: str, value: Any) -> str:
    """A message's content: a string, or OpenAI's list of text parts, joined as mlx-lm's
    server joins them (no separator)."""
    if isinstance(value, str):
        return text(name, value)
    if not isinstance(value, Sequence) or isinstance(value, bytes) or not value:
        raise bad(name, value, "must be a string or a non-empty list of text parts")
    if len(value) > MAX_MESSAGES:
        raise bad(name, f"<{len(value)} parts>", f"at most {MAX_MESSAGES}")
    texts = []
    for j, part in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(part, Mapping) or set(part) != {"type", "text"}:
            raise bad(where, part, "must be a map with exactly 'type' and 'text'")
        if part["type"] != "text":
            raise bad(f"{where}.type", part["type"], "only 'text' parts are supported")
        texts.append(text(f"{where}.text", part["text"]))
    return "".join(texts)


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise bad("messages", value, "must be a non-empty list of {role, content} maps")
    if len(value) > MAX_MESSAGES:
        raise bad("messages", f"<{len(value)} messages>", f"at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m) <= MESSAGE_KEYS:
            raise bad(
                f"messages[{i}]", m, "must be a map with 'role' and 'content' (and optional 'name')"
            )
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            raise bad(f"messages[{i}].role", m["role"], f"must be one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _content(f"messages[{i}].content", m["content"])}
        if "name" in m:
            if not isinstance(m["name"], str) or not 0 < len(m["name"]) <= MAX_NAME_CHARS:
                raise bad(f"messages[{i}].name", m["name"], f"must be 1 to {MAX_NAME_CHARS} chars")
            msg["name"] = text(f"messages[{i}].name", m["name"])
        out.append(msg)
    return tuple(out)


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise bad("stop", value, "must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise bad("stop", value, f"at most {MAX_STOP_STRINGS} stop strings")
    for s in value:
        if not isinstance(s, str) or not 0 < len(text("stop", s)) <= MAX_STOP_CHARS:
            raise bad("stop", s, f"each stop string must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation job: the input, how long, how to sample.

    Exactly one of ``prompt`` (raw text, tokenized as is) and ``messages`` (chat,
    rendered through the model's chat template) is set. ``timeout`` bounds the
    seconds a job may run, ``ttl`` the seconds it may wait in the queue; past
    either it fails with a reason that says which.

    Raises:
        PayloadError: (a ``ValueError``) naming the field and the bad value.
    """

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    metadata: dict[str, Any] | None = None
    timeout: float | None = None
    ttl: float | None = None
    max_tokens_cap: int = MAX_TOKENS_CAP
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    logits: LogitsParams | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad("prompt", self.prompt, "give exactly one of prompt and messages")
        if self.prompt is not None:
            if not text("prompt", self.prompt):
                raise bad("prompt", self.prompt, "must not be empty")
            chars = len(self.prompt)
        else:
            object.__setattr__(self, "messages", _messages(self.messages))
            chars = sum(len(m["content"]) for m in self.messages or ())
        if chars > MAX_PROMPT_CHARS:
            raise bad("prompt", f"<{chars} characters>", f"at most {MAX_PROMPT_CHARS}")
        cap = integer("max_tokens_cap", self.max_tokens_cap)
        if not 1 <= integer("max_tokens", self.max_tokens) <= cap:
            raise bad("max_tokens", self.max_tokens, f"must be in [1, {cap}]")
        if not isinstance(self.sampling, SamplingParams):
            raise bad("sampling", self.sampling, "must be SamplingParams")
        object.__setattr__(self, "stop", _stop(self.stop))
        for name in ("timeout", "ttl"):
            value = getattr(self, name)
            if value is not None:
                v = number(name, value)
                if not 0 < v <= MAX_DEADLINE_S:
                    raise bad(name, value, f"must be in (0, {MAX_DEADLINE_S:.0f}] seconds")
                object.__setattr__(self, name, v)
        if self.metadata is not None:
            object.__setattr__(self, "metadata", _metadata(self.metadata))
        self._check_samples()

    def _check_samples(self) -> None:
        if not 1 <= integer("n", self.n) <= MAX_N:
            raise bad("n", self.n, f"must be in [1, {MAX_N}]")
        if not isinstance(self.logprobs, bool):
            raise bad("logprobs", self.logprobs, "must be true or false")
        if not 0 <= integer("top_logprobs", self.top_logprobs) <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", self.top_logprobs, f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", self.top_logprobs, "needs logprobs=True")
        if self.logits is not None and not isinstance(self.logits, LogitsParams):
            raise bad("logits", self.logits, "must be LogitsParams")
        if self.logits is not None and not (self.logits.active or self.logits.stop_token_ids):
            object.__setattr__(self, "logits", None)

    @property
    def choice_seeds(self) -> list[int | None]:
        """Each choice's seed: the job's seed plus the choice's index (None: unseeded)."""
        seed = self.sampling.seed
        return [None if seed is None else (seed + i) % (MAX_SEED + 1) for i in range(self.n)]

    def to_payload(self) -> dict[str, Any]:
        """The msgpack-ready map stored as the rq job's only argument."""
        s = self.sampling
        return {
            "v": PAYLOAD_VERSION,
            "prompt": self.prompt,
            "messages": list(self.messages) if self.messages is not None else None,
            "max_tokens": self.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "seed": s.seed,
            "stop": list(self.stop),
            "metadata": dict(self.metadata) if self.metadata is not None else None,
            "timeout": self.timeout,
            "ttl": self.ttl,
            **self._extras(),
        }

    def _extras(self) -> dict[str, Any]:
        # Written only when set, so a job asking for none of them reads as before.
        out: dict[str, Any] = {}
        if self.n != 1:
            out["n"] = self.n
        if self.logprobs:
            out["logprobs"], out["top_logprobs"] = True, self.top_logprobs
        lp = self.logits
        if lp is not None:
            for name in LOGITS_FIELDS:
                value = getattr(lp, name)
                if value != getattr(NOTHING, name):
                    out[name] = value
            if lp.logit_bias:
                out["logit_bias"] = [[k, v] for k, v in lp.logit_bias.items()]
            if lp.stop_token_ids:
                out["stop_token_ids"] = list(lp.stop_token_ids)
        return out

    @classmethod
    def from_payload(
        cls, payload: Any, *, max_tokens_cap: int = MAX_TOKENS_CAP
    ) -> GenerationRequest:
        """Check a payload read back from Redis; the inverse of :meth:`to_payload`.

        Raises:
            PayloadError: on anything but a well-formed version-1 payload.
        """
        if not isinstance(payload, Mapping):
            raise bad("payload", payload, "must be a map")
        v = payload.get("v")
        if type(v) is not int or v != PAYLOAD_VERSION:
            raise bad("v", payload.get("v"), f"unsupported version (want {PAYLOAD_VERSION})")
        known = {
            "v",
            "prompt",
            "messages",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "metadata",
            "timeout",
            "ttl",
            "n",
            "logprobs",
            "top_logprobs",
            "logit_bias",
            "stop_token_ids",
            *LOGITS_FIELDS,
        }
        unknown = sorted(str(k) for k in payload if k not in known)
        if unknown:
            raise bad("payload", unknown, "unknown fields")
        sampling = SamplingParams(
            temperature=payload.get("temperature", 0.0),
            top_p=payload.get("top_p", 1.0),
            top_k=payload.get("top_k", 0),
            min_p=payload.get("min_p", 0.0),
            seed=payload.get("seed"),
        )
        return cls(
            prompt=payload.get("prompt"),
            messages=payload.get("messages"),
            max_tokens=payload.get("max_tokens", 256),
            sampling=sampling,
            stop=() if payload.get("stop") is None else payload["stop"],
            metadata=payload.get("metadata"),
            timeout=payload.get("timeout"),
            ttl=payload.get("ttl"),
            max_tokens_cap=max_tokens_cap,
            n=payload.get("n", 1),
            logprobs=payload.get("logprobs", False),
            top_logprobs=payload.get("top_logprobs", 0),
            logits=logits_params(
                **{k: payload[k] for k in LOGITS_FIELDS if k in payload},
                logit_bias=_bias_pairs(payload.get("logit_bias")),
                stop_token_ids=payload.get("stop_token_ids", ()),
            ),
        )


def logits_params(**kw: Any) -> LogitsParams | None:
    """The :class:`LogitsParams` of a request, None when it asks for nothing.

    Raises:
        PayloadError: naming the field and the bad value.
    """
    try:
        lp = LogitsParams(**kw)
    except ValueError as e:
        raise PayloadError(str(e)) from None
    return lp if lp.active or lp.stop_token_ids else None


def _bias_pairs(value: Any) -> Any:
    # logit_bias travels as [[id, bias], ...] (msgpack maps need string keys here).
    if value is None or isinstance(value, Mapping):
        return value
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise bad("logit_bias", value, "must be a map of token id to bias")
    return {k: v for k, v in value}
