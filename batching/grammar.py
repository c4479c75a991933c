"""Constrained rows: each step's packed token bitmask, filled on the host, applied in one op.

A constrained row has a :class:`RowMatcher` (llguidance's ``LLMatcher`` for its
constraint, compiled once per (model, constraint) by the worker and copied per row). Each
decode step, :class:`GrammarRows` advances every constrained row's matcher by the token the
row is being fed (the one it sampled last step) and fills the row's line of one packed
``(C, ceil(V / 32))`` int32 bitmask, one line per constrained row (llguidance's parallel
fill, off the GIL). :func:`apply_bitmask` unpacks those lines only, gives every other row
a line that allows everything, and masks the whole batch's logits in one ``where``, before
log-probs and sampling, so reported log-probs are those of the masked distribution, a
batch with no constrained row pays nothing, and one with a few copies and unpacks their
lines only (on this CPU, 16 constrained rows of 64 over a 151,936-token vocabulary: 28 ms a
step against 48 ms for a line per row; a scatter into the constrained rows cost 33 ms).

A row's first step after it joins the batch (after its prefill, or put back after a
pause) is fed a token its matcher has already seen (the prompt's last, or the last it
emitted before the pause), so that one is not consumed again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

log = logging.getLogger("mlxq.worker")

_SHIFTS = mx.arange(32, dtype=mx.int32)


def bitmask_width(vocab_size: int) -> int:
    """Int32 words per row of a packed bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: mx.array, bitmask: mx.array, lines: mx.array | None = None) -> mx.array:
    """``logits`` with every token whose bit is 0 set to -inf, in one pass.

    Args:
        logits: (B, V) logits of a batch.
        bitmask: (C, ceil(V / 32)) int32; bit ``j % 32`` of word ``j // 32`` of line i
            allows token j (llguidance's layout).
        lines: (B,) each batch row's line of ``bitmask``, C for a row that nothing masks;
            None: line i is row i's (C = B).

    Returns:
        (B, V) logits, the same dtype.
    """
    vocab = logits.shape[-1]
    bits = (bitmask[:, :, None] >> _SHIFTS) & 1
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].astype(mx.bool_)
    if lines is not None:
        allowed = mx.concatenate([allowed, mx.ones((1, vocab), dtype=mx.bool_)])[lines]
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


@cache
def _executor() -> LLExecutor:
    # One pool of mask-filling threads per process (llguidance picks its size).
    return LLExecutor()


@dataclass(slots=True, eq=False)
class RowMatcher:
    """One row's constraint state: its matcher and whether its next step is its first
    since it joined the batch (whose fed token the matcher has seen already)."""

    matcher: LLMatcher
    fresh: bool = True
    failed: bool = False

    def feed(self, token: int) -> None:
        """The row is fed ``token``: the matcher consumes it, unless it is the row's
        first step since joining."""
        if self.fresh:
            self.fresh = False
            return
        if not self.failed and not self.matcher.consume_token(token):
            # The mask allowed it, so this is llguidance's own limit (a parser too
            # complex); its mask from now on allows only end-of-sequence.
            self.failed = True
            log.warning("constraint matcher failed: %s", self.matcher.get_error()[:300])


@dataclass(slots=True, eq=False)
class GrammarRows:
    """The constrained rows of one batch composition and their bitmask buffer.

    Args:
        rows: (batch index, matcher) of each constrained row.
        batch: Rows in the batch.
        vocab_size: The logits' width.
    """

    rows: list[tuple[int, RowMatcher]]
    batch: int
    vocab_size: int
    _buffer: Any = field(init=False)
    #: Each batch row's line of the bitmask (:func:`apply_bitmask`'s ``lines``); None
    #: when every row is constrained.
    lines: mx.array | None = field(init=False)

    def __post_init__(self) -> None:
        self._buffer = np.full((len(self.rows), bitmask_width(self.vocab_size)), -1, np.int32)
        self.lines = None
        if len(self.rows) < self.batch:
            line = [len(self.rows)] * self.batch  # the all-allowing line, unless constrained
            for n, (i, _) in enumerate(self.rows):
                line[i] = n
            self.lines = mx.array(line, dtype=mx.uint32)

    @classmethod
    def bind(cls, matchers: Sequence[RowMatcher | None], vocab_size: int) -> GrammarRows | None:
        """The batch's constrained rows (``matchers`` in batch order, None: unconstrained);
        None when there are none."""
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        return cls(rows, len(matchers), vocab_size) if rows else None

    def masks(self, fed: Sequence[int]) -> mx.array:
        """Advance each constrained row by the token it is fed (``fed``, in batch order)
        and return the constrained rows' bitmask for the token each samples next, one
        line per row of :attr:`rows` (for :func:`apply_bitmask` with :attr:`lines`)."""
        for i, row in self.rows:
            row.feed(fed[i])
        fill_next_token_bitmask_par(
            _executor(),
            [(row.matcher, line) for line, (_, row) in enumerate(self.rows)],
            self._buffer,
        )
        return mx.array(self._buffer)  # a copy: the buffer is refilled next step
