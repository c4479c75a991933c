"""OpenAI-style log-probs for the rows that asked, one vectorized op per step.

Which distribution: the log-softmax of the logits after
:func:`mlxq.batching.logits.apply` (logit bias, penalties, min_tokens), before
temperature and the top-p / top-k / min-p filters. That is exactly the (B, V)
array mlx-lm's ``GenerationBatch`` hands its sampler and returns per row as
``Response.logprobs``, and what ``mlx_lm.server`` reports; so the chosen token's
value is its log-probability under the distribution the sampler drew from at
temperature 1. vLLM calls this ``processed_logprobs`` (its default,
``raw_logprobs``, is taken before any processing). OpenAI does not say; its
log-probs are likewise reported independent of temperature and top_p. A token
that ``min_tokens`` masks has -inf, and so may appear in a top list only when
fewer than k tokens are left unmasked.

Cost: only the rows that asked pay, in one call for all of them: a gather of
those rows, one max over their vocabulary and two small argpartitions (see
``_top_k``), then a sort of the k. The chosen token's log-prob is one gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

#: OpenAI's cap on ``top_logprobs``.
MAX_TOP_LOGPROBS = 20
#: Chunk sizes tried for the top-k search, largest first (see ``_top_k``).
_CHUNKS = (128, 64, 32)


def top_logprobs(
    logprobs: mx.array, tokens: mx.array, k: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Each row's chosen-token log-prob and its k most likely tokens, in one op.

    Args:
        logprobs: (B, V) normalized log-probabilities.
        tokens: (B,) the tokens sampled from them.
        k: How many top tokens per row, 0 to V (0: the chosen token's only).

    Returns:
        ``(chosen, top_ids, top_values)``: (B,) float32, (B, k) int32 and (B, k)
        float32, each row's top tokens most likely first. Which of several tokens
        tied at the k-th value make the list is unspecified.

    Raises:
        ValueError: If the shapes do not match or k is out of range.
    """
    if logprobs.ndim != 2 or tokens.shape != (logprobs.shape[0],):
        raise ValueError(f"logprobs {logprobs.shape}, tokens {tokens.shape}: want (B, V), (B,)")
    vocab = logprobs.shape[1]
    if not 0 <= k <= vocab:
        raise ValueError(f"k={k!r}: must be in [0, {vocab}]")
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32).reshape(-1, 1), axis=1)
    chosen = chosen.reshape(-1).astype(mx.float32)
    if k == 0:
        b = logprobs.shape[0]
        return chosen, mx.zeros((b, 0), dtype=mx.int32), mx.zeros((b, 0), dtype=mx.float32)
    idx = _top_k(logprobs, k)
    vals = mx.take_along_axis(logprobs, idx, axis=1)
    order = mx.argsort(-vals.astype(mx.float32), axis=1)
    top_ids = mx.take_along_axis(idx, order, axis=1).astype(mx.int32)
    return chosen, top_ids, mx.take_along_axis(vals, order, axis=1).astype(mx.float32)


def _top_k(x: mx.array, k: int) -> mx.array:
    """The ids of each row's k largest values, in no order.

    Through chunk maxima when V splits into chunks of 128 (or 64, 32): the k
    largest values lie in the k chunks with the largest maxima (a chunk left out
    has k chunks above it, each holding a value at least its max), so one max
    over (B, V) and two small argpartitions replace an argpartition over (B, V)
    (several times cheaper; docs/benchmarks.md).
    """
    b, vocab = x.shape
    for c in _CHUNKS:
        if vocab % c == 0 and vocab >= 4 * k * c:
            n = vocab // c
            top = mx.argpartition(x.reshape(b, n, c).max(axis=2), kth=n - k, axis=1)[:, n - k :]
            cand = (top[:, :, None] * c + mx.arange(c, dtype=top.dtype)).reshape(b, k * c)
            vals = mx.take_along_axis(x, cand, axis=1)
            pick = mx.argpartition(vals, kth=k * c - k, axis=1)[:, k * c - k :]
            return mx.take_along_axis(cand, pick, axis=1)
    if k == vocab:
        return mx.argsort(x, axis=1)
    # Partitioning at V - k keeps the k largest on the right, without negating (B, V).
    return mx.argpartition(x, kth=vocab - k, axis=1)[:, vocab - k :]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One row's log-probs at one step, as OpenAI's ``logprobs.content[i]`` carries them.

    Attributes:
        token: The sampled token id.
        logprob: Its log-probability.
        top: (token id, log-prob) of the row's ``top_logprobs`` most likely tokens,
            most likely first (empty when it asked for 0).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """One step's log-probs for the rows that asked, still on the device (lazy).

    Attributes:
        tokens, chosen: (R,) the asking rows' tokens and their log-probs.
        top_ids, top_values: (R, k) for k = the largest request in the batch.
    """

    tokens: mx.array
    chosen: mx.array
    top_ids: mx.array
    top_values: mx.array

    def arrays(self) -> list[mx.array]:
        """What to hand ``mx.async_eval`` alongside the step's tokens."""
        return [self.tokens, self.chosen, self.top_ids, self.top_values]


@dataclass(frozen=True, slots=True)
class LogprobRows:
    """Which rows of one batch composition want log-probs, built once per composition.

    Attributes:
        requested: Per row, None (no log-probs) or its ``top_logprobs`` (0 to 20).
        rows: (R,) int32 indices of the rows that asked; None when every row did.
        k: The largest ``top_logprobs`` asked (0 if none or no row asked).
    """

    requested: tuple[int | None, ...]
    rows: mx.array | None
    k: int

    @classmethod
    def from_requests(cls, requested: Sequence[int | None]) -> LogprobRows:
        """Build from each row's request, in row order.

        Args:
            requested: Per row, None for no log-probs, else how many top
                alternatives it wants (OpenAI's ``top_logprobs``, 0 to 20).

        Returns:
            The LogprobRows to pass to :func:`step_logprobs`.

        Raises:
            ValueError: If a request is not None or an integer in [0, 20].
        """
        for i, k in enumerate(requested):
            if k is not None and (
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS
            ):
                raise ValueError(f"requested[{i}]={k!r}: must be None or 0 to {MAX_TOP_LOGPROBS}")
        asked = [i for i, k in enumerate(requested) if k is not None]
        every = len(asked) == len(requested)
        return cls(
            requested=tuple(requested),
            rows=None if every else mx.array(asked, dtype=mx.int32),
            k=max((k for k in requested if k is not None), default=0),
        )

    @property
    def any_requested(self) -> bool:
        """False when no row wants log-probs: skip :func:`step_logprobs` altogether."""
        return any(k is not None for k in self.requested)


def step_logprobs(logprobs: mx.array, tokens: mx.array, rows: LogprobRows) -> StepLogprobs:
    """The asking rows' log-probs for one step: one gather, one :func:`top_logprobs`.

    Args:
        logprobs: (B, V) the step's normalized log-probs (what the sampler got).
        tokens: (B,) the tokens sampled from them.
        rows: The batch's :class:`LogprobRows`; call only if ``rows.any_requested``.

    Returns:
        Lazy arrays for the asking rows, in row order.

    Raises:
        ValueError: If ``logprobs`` does not have one row per request.
    """
    if logprobs.ndim != 2 or logprobs.shape[0] != len(rows.requested):
        raise ValueError(f"logprobs {logprobs.shape}: want ({len(rows.requested)}, V)")
    if rows.rows is not None:
        logprobs, tokens = logprobs[rows.rows], tokens[rows.rows]
    chosen, ids, vals = top_logprobs(logprobs, tokens, rows.k)
    return StepLogprobs(tokens, chosen, ids, vals)


def to_host(step: StepLogprobs, rows: LogprobRows) -> list[TokenLogprob | None]:
    """Per batch row, its :class:`TokenLogprob` (None where it did not ask).

    One wait for the device, then one host copy per array; each row's top list
    is cut to its own request.

    Args:
        step: What :func:`step_logprobs` returned for this composition.
        rows: The same :class:`LogprobRows`.

    Returns:
        One entry per batch row, in row order.
    """
    mx.eval(step.arrays())  # one wait for all four, not one each
    tokens, chosen, ids, vals = (cast(list[Any], a.tolist()) for a in step.arrays())
    out: list[TokenLogprob | None] = []
    j = 0
    for k in rows.requested:
        if k is None:
            out.append(None)
            continue
        top = tuple(zip(ids[j][:k], vals[j][:k], strict=True))
        out.append(TokenLogprob(int(tokens[j]), float(chosen[j]), top))
        j += 1
    return out
