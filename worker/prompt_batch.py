"""The new rows' prefill: mlx-lm's ``PromptProcessingBatch``, bound to mlxq's counters,
bucketed shapes, riders, and the pass that feeds rows' last prompt tokens.

A prefill pass runs new rows' prompt chunks through the model, padded to a bucketed shape
where asked (:mod:`mlxq.batching.prefill`); where a pass ends rows' prompts (and they do
not ride) it feeds their last tokens too, and keeps their logits at those positions
(:mod:`mlxq.worker.model_head`), so their first tokens need no pass of their own.
:meth:`BoundPromptBatch.generate` hands the rows to a
:class:`~mlxq.worker.decode_batch.BoundGenerationBatch`, whose first step samples their
first tokens. The :class:`~mlxq.worker.generator.Generator` owns one and decides when it
runs. Pinned to mlx-lm 0.32.2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch, _extend_cache

from mlxq.batching.prefill import prefill_shape
from mlxq.worker.decode_batch import BoundGenerationBatch
from mlxq.worker.fused_pass import FusedPass
from mlxq.worker.kv_pack import filter_rows
from mlxq.worker.mlx_settings import trim_cache
from mlxq.worker.model_head import Head
from mlxq.worker.step_counters import StepCounters


@dataclass(frozen=True, slots=True)
class Buckets:
    """Prefills padded to bucketed shapes (:func:`mlxq.batching.prefill.prefill_shape`).

    Args:
        max_rows: Rows a prefill pass may hold (the batch's size).
        blank: Empty caches for this many rows, merged as a batch's: the padding rows.
    """

    max_rows: int
    blank: Callable[[int], list[Any]]


class BoundPromptBatch(PromptProcessingBatch):  # type: ignore[misc]
    #: Where the generation batches it makes count their steps; set by the
    #: :class:`~mlxq.worker.generator.Generator` and kept by every copy mlx-lm makes.
    counters: StepCounters
    #: Pad each prefill to a bucketed shape; None: to its longest prompt, as mlx-lm does.
    buckets: Buckets | None = None
    #: Rows whose first token may come from the batch's next decode step instead of a
    #: pass of their own (:meth:`~mlxq.worker.generator.Generator.ride`); shared with
    #: the generator.
    riders: set[int]
    #: The prompt segments each row has left after the chunk being prefilled, row by row
    #: (the generator's ``_currently_processing``); None: no pass feeds a last token.
    remaining: Callable[[], list[Any]] | None = None
    #: The model's body and head apart (:mod:`mlxq.worker.model_head`), for the logits
    #: of a pass that feeds last tokens.
    head: Head | None = None
    #: The model's layers over a batch's tokens as one sequence, for the decode steps of
    #: the generation batches it makes; set by the generator, kept by every copy.
    fused: FusedPass | None = None
    #: For this call only, set by the generator: runs one new row's padded prompt (its
    #: tokens, its caches, the index of its last token) in the running batch's decode pass
    #: and returns the row's logits there (``Generator._prefill_then_decode``).
    fuse: Callable[[list[int], list[Any], int], mx.array] | None = None
    #: Rows whose prefill fed their last prompt token too: the logits it left them, kept
    #: until their first token is sampled (:meth:`generate`); shared with every copy.
    first: dict[int, mx.array]

    def _copy(self) -> Any:
        moved = super()._copy()
        moved.counters, moved.buckets, moved.riders = self.counters, self.buckets, self.riders
        moved.fused = self.fused
        # Not remaining nor head: a copy's rows are handed over (generate), never fed.
        moved.first = self.first
        return moved

    def prompt(self, tokens: list[list[int]]) -> None:
        with self.counters.stages.on("prefill"):
            last = self._last_tokens(tokens)
            if last is None:
                self._prompt(tokens)
            else:
                self._prompt_fed(tokens, last)

    def _last_tokens(self, tokens: list[list[int]]) -> list[int | None] | None:
        """Each row's last prompt token where this pass may feed it too (the row ends its
        prompt with this chunk and does not ride), None for a row it does not feed; None
        for a pass that feeds none.

        mlx-lm prefills all but a prompt's last token, then runs a pass of the rows alone
        for it, whose logits give the first token; fed here, that pass is not needed."""
        if (
            not tokens
            or self.remaining is None
            or self.head is None
            or len(tokens) != len(self.uids)
        ):
            return None
        rest = self.remaining()
        if len(rest) != len(tokens):
            return None
        last: list[int | None] = []
        for uid, seq in zip(self.uids, rest, strict=True):
            segments = seq[0]
            ends = len(segments) == 1 and len(segments[0]) == 1 and uid not in self.riders
            last.append(segments[0][0] if ends else None)
        return None if all(x is None for x in last) else last

    def _shape(self, rows: int, longest: int) -> tuple[int, int]:
        b = self.buckets
        if b is None:
            return rows, longest
        return prefill_shape(rows, longest, b.max_rows, self.prefill_step_size)

    def _prompt_fed(self, tokens: list[list[int]], last: list[int | None]) -> None:
        """Prefill the rows' chunks, and the last prompt tokens of the rows that end with
        them, in one pass; keep those rows' logits after their last token for
        :meth:`generate`."""
        fed = [t if x is None else [*t, x] for t, x in zip(tokens, last, strict=True)]
        rows, width = self._shape(len(fed), max(len(t) for t in fed))
        self.counters.count_prefill(rows, width, _held(self.prompt_cache) + width)
        logits = self._prompt_as(fed, rows, width, self.buckets, logits=True)
        assert logits is not None
        for i, (held, uid, x) in enumerate(zip(self.tokens, self.uids, last, strict=True)):
            if x is not None:
                held.pop()  # the first decode step appends it, as it would have fed it
                self.first[uid] = logits[i]

    def _prompt(self, tokens: list[list[int]]) -> None:
        b = self.buckets
        if not tokens or b is None or len(tokens) != len(self.uids):
            if tokens:  # mlx-lm's own pass (and its error for a mismatch)
                n = max(len(t) for t in tokens)
                self.counters.count_prefill(len(tokens), n, _held(self.prompt_cache) + n)
            super().prompt(tokens)
            return
        rows, width = self._shape(len(tokens), max(len(t) for t in tokens))
        self.counters.count_prefill(rows, width, _held(self.prompt_cache) + width)
        self._prompt_as(tokens, rows, width, b)

    def _prompt_as(
        self,
        tokens: list[list[int]],
        rows: int,
        width: int,
        b: Buckets | None,
        *,
        logits: bool = False,
    ) -> mx.array | None:
        """Prefill ``tokens`` in one pass of ``rows`` x ``width``: each prompt right-padded
        to ``width`` (mlx-lm's right padding, rolled to the left once the pass is done, so
        a row's cache is as an unpadded pass leaves it), under it rows of padding, dropped
        after the pass. ``logits``: in one model call, whatever its width, and return each
        prompt's logits after its last token (rows x vocabulary)."""
        real = len(tokens)
        for held, new in zip(self.tokens, tokens, strict=True):
            held += new  # the tokens each row's cache holds
        if rows > real:
            assert b is not None
            self.prompt_cache = _extend_cache(self.prompt_cache, b.blank(rows - real))
        lengths = [len(t) for t in tokens] + [width] * (rows - real)
        padded = min(lengths) < width
        if padded:
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
        padded_rows = [t + [0] * (width - len(t)) for t in tokens] + [[0] * width] * (rows - real)
        last = self._pass(padded_rows, tokens, width, logits)
        if padded:
            for c in self.prompt_cache:
                c.finalize()
        if rows > real:  # the padding rows out, the padding known from the host
            filter_rows(self.prompt_cache, list(range(real)), [len(t) for t in self.tokens])
        # Queued, not waited for: the host goes on to the rows' first-token pass (or, for
        # rows this pass fed, the sampling of their first token) while the device runs
        # this one (and the decode step before it).
        mx.async_eval([c.state for c in self.prompt_cache], *([] if last is None else [last]))
        if rows * width > self.prefill_step_size:
            trim_cache()  # a large pass: MLX's cached buffers go back (mlx_settings)
        return last

    def _pass(
        self, padded: list[list[int]], tokens: list[list[int]], width: int, logits: bool
    ) -> mx.array | None:
        """The model pass of :meth:`_prompt_as` over the padded rows; with ``logits``, each
        prompt's logits after its last token (one row alone: in the running batch's decode
        pass where the generator asks, :attr:`fuse`)."""
        if logits and self.fuse is not None and len(padded) == 1:
            self.counters.fused_prefills += 1
            return self.fuse(padded[0], self.prompt_cache, len(tokens[0]) - 1)
        x = mx.array(padded)
        if logits:
            assert self.head is not None
            return self.head.last_logits(x, self.prompt_cache, [len(t) - 1 for t in tokens])
        for start in range(0, width, self.prefill_step_size):
            if start:  # a long prompt: one chunk's activations at a time
                mx.eval([c.state for c in self.prompt_cache])
            self.model(x[:, start : start + self.prefill_step_size], cache=self.prompt_cache)
        return None

    def split(self, indices: list[int]) -> Any:
        # Every row at once (a burst's rows all reach their last prompt token together):
        # hand the rows over as they are; mlx-lm copies the whole batch's cache first.
        if sorted(indices) != list(range(len(self.uids))):
            return super().split(indices)
        moved = copy.copy(self)
        moved.remaining = None
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        self.stop_sequences = []
        return moved

    def generate(self, tokens: list[list[int]]) -> Any:
        # mlx-lm's own, but the new rows join a BoundGenerationBatch, whose constructor
        # samples (and counts) their first token; rows that all ride take no pass of their
        # own: the batch's next decode step feeds their last prompt token; rows whose
        # prefill fed it take none either: their first token comes from its logits.
        fed = [u in self.first for u in self.uids]
        if any(fed) and not all(fed):  # rows of two prefills: each kind its own way
            theirs = self.split([i for i, f in enumerate(fed) if f])
            generation = self.generate([t for t, f in zip(tokens, fed, strict=True) if not f])
            generation.extend(theirs.generate([t for t, f in zip(tokens, fed, strict=True) if f]))
            return generation
        first = mx.stack([self.first.pop(u) for u in self.uids]) if any(fed) else None
        if first is None and any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        ride = bool(self.uids) and self.riders.issuperset(self.uids)
        self.riders.difference_update(self.uids)
        generation = BoundGenerationBatch(
            self.model,
            self.uids,
            # The dtype the sampler's tokens have, which riders' join in one array.
            mx.array([t[-1] for t in tokens], dtype=mx.uint32),
            self.prompt_cache,
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
            counters=self.counters,
            stage="first_token",
            ride=ride,
            first_logits=first,
            fused=self.fused,
        )
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return generation


def _held(caches: list[Any]) -> int:
    """Positions a batch's caches hold (its first layer's), 0 for none or a kind of cache
    that does not say."""
    held = getattr(caches[0], "_idx", 0) if caches else 0
    return held if isinstance(held, int) else 0
