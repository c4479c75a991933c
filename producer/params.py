"""The job payload schema: what a producer may ask for, checked the same way on both sides.

A producer validates before anything reaches Redis; the worker validates again
what it reads back, because a rogue producer can write Redis directly. Both go
through :meth:`GenerationRequest.from_payload`, so the two can never disagree.

:class:`GenerationRequest` is the one list of request fields: each of its fields, and each
field of its :class:`SamplingParams` and :class:`~mlxq.producer.logits_params.LogitsParams`,
declares its submit keyword, payload key and ``mlxq submit`` flag
(:mod:`mlxq.producer.fields`). A new option is one field here plus its docs
(:meth:`Client.submit`'s docstring) and its type in :class:`SubmitOptions` (a test fails
until it has one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from mlxq.producer import validate
from mlxq.producer.constraint_options import ConstraintOptions
from mlxq.producer.constraints import Constraint, from_options
from mlxq.producer.errors import PayloadError
from mlxq.producer.fields import assemble, decoded, encode, flag, given, group, option, specs
from mlxq.producer.logits_params import LogitsParams
from mlxq.producer.tools import constrained
from mlxq.producer.validate import bad, integer, number, text

PAYLOAD_VERSION = 1
#: Default cap on ``max_tokens``; a Client or worker may set its own.
MAX_TOKENS_CAP = 32_768
#: Longest prompt (characters, over all chat messages) a job may carry.
MAX_PROMPT_CHARS = 1_000_000
MAX_SEED = 2**63 - 1
#: Above any vocabulary; past the vocabulary size top_k keeps everything.
MAX_TOP_K = 1 << 20
#: Longest ``timeout`` / ``ttl`` a job may ask for, in seconds (a week).
MAX_DEADLINE_S = 7 * 24 * 3600.0
#: Most samples (``n``) of one prompt a job may ask for.
MAX_N = 16
#: Most alternatives per position ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The LogitsParams fields a payload carries as plain values.
LOGITS_FIELDS = tuple(s.name for s in specs(LogitsParams) if s.option.encode is None)

#: A sampling-parameter key: jobs with equal keys can share one plain sampler.
ParamKey = tuple[float, float, int, float]


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

    temperature: float = field(
        default=0.0,
        metadata=flag("0 is greedy (default: %(default)s)", type=float),
    )
    top_p: float = field(
        default=1.0,
        metadata=flag("nucleus mass; 1 disables (default: %(default)s)", type=float),
    )
    top_k: int = field(
        default=0,
        metadata=flag("keep the k likeliest; 0 disables (default: %(default)s)", type=int),
    )
    min_p: float = field(
        default=0.0,
        metadata=flag("relative floor; 0 disables (default: %(default)s)", type=float),
    )
    seed: int | None = field(
        default=None,
        metadata=flag("per-job seed (default: none, unseeded)", type=int),
    )

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


def _maybe(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else convert(v)


def _strings(value: Any) -> tuple[Any, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _or_empty(value: Any) -> Any:
    return () if value is None else value


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

    prompt: str | None = field(default=None, metadata=option())
    messages: tuple[dict[str, Any], ...] | None = field(
        default=None, metadata=option(given=_maybe(tuple), encode=_maybe(list))
    )
    max_tokens: int = field(
        default=256,
        metadata=flag("most tokens to generate (default: %(default)s)", type=int),
    )
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=group(SamplingParams))
    stop: tuple[str, ...] = field(
        default=(),
        metadata=option(
            given=_strings,
            encode=list,
            decode=_or_empty,
            cli=dict(action="append", default=[], help="stop string, repeatable (default: none)"),
        ),
    )
    metadata: dict[str, Any] | None = field(
        default=None, metadata=option(given=_maybe(dict), encode=_maybe(dict))
    )
    timeout: float | None = field(
        default=None,
        metadata=flag(
            "seconds the job may run once started; past it, it fails (default: no limit)",
            type=float,
            metavar="S",
        ),
    )
    ttl: float | None = field(
        default=None,
        metadata=flag(
            "seconds the job may wait in the queue; past it, it fails (default: no limit)",
            type=float,
            metavar="S",
        ),
    )
    max_tokens_cap: int = MAX_TOKENS_CAP
    # Written only when set, so a job asking for none of these reads as before them.
    n: int = field(default=1, metadata=option(sparse=True))
    logprobs: bool = field(default=False, metadata=option(sparse=True))
    top_logprobs: int = field(default=0, metadata=option(rides_with="logprobs"))
    logits: LogitsParams | None = field(
        default=None, metadata=group(LogitsParams, build=logits_params)
    )
    # Given as one of ConstraintOptions' keywords (or a Constraint itself); the payload
    # carries only the constraint, and only when there is one.
    constraint: Constraint | None = field(
        default=None,
        metadata={
            **group(ConstraintOptions, build=from_options),
            **option(sparse=True, encode=_maybe(Constraint.to_payload)),
        },
    )
    tools: tuple[dict[str, Any], ...] | None = field(
        default=None, metadata=option(encode=_maybe(list), sparse=True)
    )
    tool_choice: str | dict[str, Any] | None = field(default=None, metadata=option(sparse=True))
    parallel_tool_calls: bool = field(default=True, metadata=option(sparse=True))

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad("prompt", self.prompt, "give exactly one of prompt and messages")
        if self.prompt is not None:
            if not text("prompt", self.prompt):
                raise bad("prompt", self.prompt, "must not be empty")
            chars = len(self.prompt)
        else:
            object.__setattr__(self, "messages", validate.messages(self.messages))
            chars = validate.message_chars(self.messages or ())
        if chars > MAX_PROMPT_CHARS:
            raise bad("prompt", f"<{chars} characters>", f"at most {MAX_PROMPT_CHARS}")
        cap = integer("max_tokens_cap", self.max_tokens_cap)
        if not 1 <= integer("max_tokens", self.max_tokens) <= cap:
            raise bad("max_tokens", self.max_tokens, f"must be in [1, {cap}]")
        if not isinstance(self.sampling, SamplingParams):
            raise bad("sampling", self.sampling, "must be SamplingParams")
        object.__setattr__(self, "stop", validate.stop_strings(self.stop))
        for name in ("timeout", "ttl"):
            value = getattr(self, name)
            if value is not None:
                v = number(name, value)
                if not 0 < v <= MAX_DEADLINE_S:
                    raise bad(name, value, f"must be in (0, {MAX_DEADLINE_S:.0f}] seconds")
                object.__setattr__(self, name, v)
        if self.metadata is not None:
            object.__setattr__(self, "metadata", validate.metadata(self.metadata))
        self._check_samples()
        self._check_tools()

    def _check_tools(self) -> None:
        if self.tools is not None:
            if self.messages is None:
                raise bad("tools", "<tools>", "need messages (a chat), not a prompt")
            object.__setattr__(self, "tools", validate.tools(self.tools))
        if self.tool_choice is not None:
            choice = validate.tool_choice(self.tool_choice, self.tools)
            object.__setattr__(self, "tool_choice", choice)
        if not isinstance(self.parallel_tool_calls, bool):
            raise bad("parallel_tool_calls", self.parallel_tool_calls, "must be true or false")
        held = constrained(self.tools, self.tool_choice, self.parallel_tool_calls, self.constraint)
        object.__setattr__(self, "constraint", held)

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
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise bad("constraint", self.constraint, "must be a Constraint")
            if self.logits is not None and self.logits.min_tokens:
                # A finished constraint allows only end-of-sequence, which min_tokens forbids.
                why = "cannot go with a constraint, which decides where the answer ends"
                raise bad("min_tokens", self.logits.min_tokens, why)

    @property
    def choice_seeds(self) -> list[int | None]:
        """Each choice's seed: the job's seed plus the choice's index (None: unseeded)."""
        seed = self.sampling.seed
        return [None if seed is None else (seed + i) % (MAX_SEED + 1) for i in range(self.n)]

    def to_payload(self) -> dict[str, Any]:
        """The msgpack-ready map stored as the rq job's only argument."""
        return {"v": PAYLOAD_VERSION, **encode(self)}

    @classmethod
    def from_arguments(
        cls, arguments: Mapping[str, Any], *, max_tokens_cap: int = MAX_TOKENS_CAP
    ) -> GenerationRequest:
        """The request :meth:`Client.submit`'s keyword ``arguments`` ask for (their names
        already checked, see :func:`check_names`).

        Raises:
            TypeError: an argument of the wrong shape to convert (``stop=5``).
            PayloadError: naming the field and the bad value.
        """
        values = given(cls, arguments)
        request: GenerationRequest = assemble(cls, values, max_tokens_cap=max_tokens_cap)
        return request

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
        unknown = sorted(str(k) for k in payload if k != "v" and k not in PAYLOAD_KEYS)
        if unknown:
            raise bad("payload", unknown, "unknown fields")
        request: GenerationRequest = assemble(
            cls, decoded(cls, payload), max_tokens_cap=max_tokens_cap
        )
        return request


#: Every option's name, as a payload key.
PAYLOAD_KEYS = frozenset(s.name for s in specs(GenerationRequest) if s.option.payload)
#: The keyword arguments :meth:`Client.submit` takes.
SUBMIT_OPTIONS = frozenset(s.name for s in specs(GenerationRequest) if s.option.submit)


def check_names(names: Iterable[str], caller: str) -> None:
    """Refuse a keyword that is no submit option, as Python refuses one.

    Raises:
        TypeError: ``"{caller} got an unexpected keyword argument 'name'"``.
    """
    for name in names:
        if name not in SUBMIT_OPTIONS:
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}")


class SubmitOptions(TypedDict, total=False):
    """The types of :meth:`Client.submit`'s keyword arguments after ``prompt`` (what a
    caller may give, before conversion), for type checkers and IDEs; documented there."""

    messages: Sequence[Mapping[str, Any]] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: str | Sequence[str]
    metadata: Mapping[str, Any] | None
    timeout: float | None
    ttl: float | None
    n: int
    logprobs: bool
    top_logprobs: int
    repetition_penalty: float | None
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    logit_bias: Mapping[int, float] | None
    stop_token_ids: Sequence[int] | None
    response_format: Mapping[str, Any] | str | None
    json_schema: Mapping[str, Any] | str | None
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None
    constraint: Constraint | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool


class JobOptions(SubmitOptions, total=False):
    """One job's map for :meth:`Client.submit_many`: its ``prompt`` and
    :class:`SubmitOptions`; its keys are :data:`SUBMIT_OPTIONS`."""

    prompt: str | None
