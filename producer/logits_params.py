"""What a row may ask of its logits before sampling, validated once at admission.

The names and meanings are mlx-lm's ``make_logits_processors`` arguments, plus
vLLM's ``min_tokens`` and ``stop_token_ids``; the ranges are OpenAI's where it
has one. It lives with :class:`~mlxq.producer.params.SamplingParams`, in the contract
both sides read; :mod:`mlxq.batching.logits` turns a batch of these into arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mlxq.producer.fields import option
from mlxq.producer.validate import bad, integer_in, logit_number, token_id, value_error

MAX_CONTEXT_SIZE = 4096
#: OpenAI's ranges: presence/frequency in [-2, 2], bias values in [-100, 100].
MAX_ABS_PENALTY = 2.0
MAX_ABS_BIAS = 100.0
MAX_LOGIT_BIAS = 300
MAX_REPETITION_PENALTY = 100.0
MAX_MIN_TOKENS = 1 << 20
MAX_STOP_TOKEN_IDS = 256


def _bias_to_pairs(bias: Mapping[int, float]) -> list[list[Any]]:
    # logit_bias travels as [[id, bias], ...] (msgpack maps need string keys here).
    return [[k, v] for k, v in bias.items()]


def _bias_from_pairs(value: Any) -> Any:
    if value is None or isinstance(value, Mapping):
        return value
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise bad("logit_bias", value, "must be a map of token id to bias")
    return {k: v for k, v in value}


def _ids(value: Any) -> tuple[Any, ...]:
    return () if value is None else tuple(value)


@dataclass(frozen=True, slots=True)
class LogitsParams:
    """How one row's logits are changed before sampling (mlx-lm's names and meaning).

    A field at its default costs nothing: ``repetition_penalty`` None or 1,
    presence/frequency 0, no ``logit_bias``, ``min_tokens`` 0.

    Args:
        repetition_penalty: > 0; each distinct token among the last
            ``repetition_context_size`` has its logit x made x * p if x < 0,
            else x / p (so p > 1 discourages repeats).
        presence_penalty: In [-2, 2] (None reads as 0); subtracted once from the logit of each
            distinct token among the last ``presence_context_size``.
        frequency_penalty: In [-2, 2]; subtracted from a token's logit once per
            time it occurs among the last ``frequency_context_size``.
        repetition_context_size, presence_context_size, frequency_context_size:
            In [1, 4096]; counted over prompt and generated tokens together.
        min_tokens: Until the row has generated this many tokens, its
            ``stop_token_ids`` and the model's EOS ids get logit -inf.
        logit_bias: Token id (int, or a decimal string as in OpenAI's JSON) to a
            value in [-100, 100] added to its logit; at most 300 entries.
        stop_token_ids: Token ids that end the row (masked by ``min_tokens``).

    Raises:
        ValueError: Naming the field and the bad value.
    """

    # A payload carries each only when set; the context sizes are no submit keywords.
    repetition_penalty: float | None = field(default=None, metadata=option(sparse=True))
    repetition_context_size: int = field(default=20, metadata=option(sparse=True, submit=False))
    presence_penalty: float = field(default=0.0, metadata=option(sparse=True))
    presence_context_size: int = field(default=20, metadata=option(sparse=True, submit=False))
    frequency_penalty: float = field(default=0.0, metadata=option(sparse=True))
    frequency_context_size: int = field(default=20, metadata=option(sparse=True, submit=False))
    min_tokens: int = field(default=0, metadata=option(sparse=True))
    logit_bias: Mapping[int, float] | None = field(
        default=None,
        hash=False,
        metadata=option(sparse=True, encode=_bias_to_pairs, decode=_bias_from_pairs),
    )
    stop_token_ids: tuple[int, ...] = field(
        default=(), metadata=option(sparse=True, given=_ids, encode=list)
    )

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.repetition_penalty is not None:
            p = logit_number(
                "repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY
            )
            if p == 0:
                raise value_error("repetition_penalty", self.repetition_penalty, "must be > 0")
            put("repetition_penalty", p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is None:  # mlx-lm's "off"
                value = 0.0
            put(name, logit_number(name, value, -MAX_ABS_PENALTY, MAX_ABS_PENALTY))
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            integer_in(name, getattr(self, name), 1, MAX_CONTEXT_SIZE)
        put("logit_bias", self._bias(self.logit_bias))
        integer_in("min_tokens", self.min_tokens, 0, MAX_MIN_TOKENS)
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise value_error("stop_token_ids", ids, "must be a list of token ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise value_error(
                "stop_token_ids", f"<{len(ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS}"
            )
        put("stop_token_ids", tuple(token_id("stop_token_ids", t) for t in ids))

    @staticmethod
    def _bias(bias: Any) -> Mapping[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise value_error("logit_bias", bias, "must be a map of token id to bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise value_error("logit_bias", f"<{len(bias)} entries>", f"at most {MAX_LOGIT_BIAS}")
        out: dict[int, float] = {}
        for k, v in bias.items():
            tok = token_id("logit_bias key", k)
            if tok in out:
                raise value_error("logit_bias key", k, "names a token id twice")
            out[tok] = logit_number(f"logit_bias[{k!r}]", v, -MAX_ABS_BIAS, MAX_ABS_BIAS)
        return MappingProxyType(dict(sorted(out.items()))) if out else None

    @property
    def repetition(self) -> bool:
        return self.repetition_penalty not in (None, 1.0)

    @property
    def context_size(self) -> int:
        """How many trailing tokens this row's penalties read (0: none)."""
        sizes = [
            self.repetition_context_size if self.repetition else 0,
            self.presence_context_size if self.presence_penalty else 0,
            self.frequency_context_size if self.frequency_penalty else 0,
        ]
        return max(sizes)

    @property
    def active(self) -> bool:
        """Whether this row changes any logit (min_tokens needs stop or EOS ids too)."""
        return bool(self.context_size or self.logit_bias or self.min_tokens)


#: A row that asks for nothing.
NOTHING = LogitsParams()
