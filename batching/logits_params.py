"""What a row may ask of its logits before sampling, validated once at admission.

The names and meanings are mlx-lm's ``make_logits_processors`` arguments, plus
vLLM's ``min_tokens`` and ``stop_token_ids``; the ranges are OpenAI's where it
has one. :mod:`mlxq.batching.logits` turns a batch of these into arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

MAX_CONTEXT_SIZE = 4096
#: OpenAI's ranges: presence/frequency in [-2, 2], bias values in [-100, 100].
MAX_ABS_PENALTY = 2.0
MAX_ABS_BIAS = 100.0
MAX_LOGIT_BIAS = 300
MAX_REPETITION_PENALTY = 100.0
MAX_MIN_TOKENS = 1 << 20
MAX_STOP_TOKEN_IDS = 256


def bad(name: str, value: Any, why: str) -> ValueError:
    """The ValueError every check here raises: field, value, why."""
    return ValueError(f"{name}={value!r}: {why}")


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, value, "must be a number")
    f = float(value)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise bad(name, value, f"must be in [{lo}, {hi}]")
    return f + 0.0  # -0.0 -> 0.0, so equal params compare equal


def _integer(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(name, value, f"must be an integer in [{lo}, {hi}]")
    return value


def token_id(name: str, value: Any) -> int:
    """A token id >= 0 (a decimal string is read as one)."""
    # OpenAI's JSON bodies key logit_bias by decimal strings.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    return _integer(name, value, 0, 2**31 - 1)


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
        logit_bias: Token id (int, or a decimal string as in OpenAI's JSON) to a
            value in [-100, 100] added to its logit; at most 300 entries.
        min_tokens: Until the row has generated this many tokens, its
            ``stop_token_ids`` and the model's EOS ids get logit -inf.
        stop_token_ids: Token ids that end the row (masked by ``min_tokens``).

    Raises:
        ValueError: Naming the field and the bad value.
    """

    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.repetition_penalty is not None:
            p = _number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
            if p == 0:
                raise bad("repetition_penalty", self.repetition_penalty, "must be > 0")
            put("repetition_penalty", p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is None:  # mlx-lm's "off"
                value = 0.0
            put(name, _number(name, value, -MAX_ABS_PENALTY, MAX_ABS_PENALTY))
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            _integer(name, getattr(self, name), 1, MAX_CONTEXT_SIZE)
        put("logit_bias", self._bias(self.logit_bias))
        _integer("min_tokens", self.min_tokens, 0, MAX_MIN_TOKENS)
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise bad("stop_token_ids", ids, "must be a list of token ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"<{len(ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS}")
        put("stop_token_ids", tuple(token_id("stop_token_ids", t) for t in ids))

    @staticmethod
    def _bias(bias: Any) -> Mapping[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise bad("logit_bias", bias, "must be a map of token id to bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"<{len(bias)} entries>", f"at most {MAX_LOGIT_BIAS}")
        out: dict[int, float] = {}
        for k, v in bias.items():
            tok = token_id("logit_bias key", k)
            if tok in out:
                raise bad("logit_bias key", k, "names a token id twice")
            out[tok] = _number(f"logit_bias[{k!r}]", v, -MAX_ABS_BIAS, MAX_ABS_BIAS)
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
