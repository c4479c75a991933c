"""mlx-lm's BatchGenerator, bound so that every decode step samples in one call.

mlx-lm samples a step with one call only when every row holds the same sampler object;
rows with their own samplers send the step down a per-row loop. mlxq gives every row one
:class:`~mlxq.batching.rows.RowSampler` and binds it to the rows of the next call in
the two places mlx-lm samples: ``GenerationBatch._step`` (every decode step) and
``PromptProcessingBatch.generate`` (the first token after prefill: the prefill's side is
:mod:`mlxq.worker.prompt_batch`). Pinned to mlx-lm
0.32.2, whose ``filter`` re-indexes every per-row list; ``tests/test_engine.py`` pins the
alignment.

Logits processors (penalties, logit_bias, min_tokens), constraints' token masks and
log-probs are batched too: see :mod:`mlxq.worker.decode_batch`. mlx-lm's own per-row
``logits_processors`` are never used, since any of them would send every step down a
Python loop over rows.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import (
    BatchGenerator,
    PromptProcessingBatch,
    _merge_caches,
)
from mlx_lm.models.cache import make_prompt_cache

from mlxq.batching.rows import RowSampler
from mlxq.worker.decode_batch import BoundGenerationBatch
from mlxq.worker.fused_pass import FusedPass
from mlxq.worker.kv_pack import row_copy
from mlxq.worker.mlx_settings import trim_cache
from mlxq.worker.model_head import Head
from mlxq.worker.prompt_batch import BoundPromptBatch, Buckets
from mlxq.worker.step_counters import StepCounters


class Generator(BatchGenerator):  # type: ignore[misc]
    """mlx-lm's BatchGenerator over bound batches: one sampler call per decode step.

    Args:
        model: The mlx-lm model.
        sampler: The batch's one sampler, which also keeps each row's requests.
        counters: Where decode steps and sampler calls are counted.
        keep_caches: Whether finished rows' caches are handed back (a prompt cache).
        buckets: Pad each prefill pass to a bucketed (rows, length) shape, so passes of
            new rows repeat a few shapes (see :mod:`mlxq.batching.prefill`).
        head: The model's body and head apart (:func:`~mlxq.worker.model_head.model_head`):
            a prefill that ends rows' prompts feeds their last tokens too (rows that do
            not ride), and their first tokens come from its logits at those positions: one
            pass fewer per new row. None: mlx-lm's way, a pass of the new rows alone.
        fused: The model's layers over a batch's tokens as one sequence
            (:mod:`mlxq.worker.fused_pass`), for every decode step; None: mlx-lm's call.
        fused_prefill: With ``fused``, a row that does not ride and starts alone beside a
            busy batch runs its prompt in the batch's decode pass (no pass of its own).
        **kw: mlx-lm's own ``BatchGenerator`` arguments.
    """

    def __init__(
        self,
        model: Any,
        sampler: RowSampler,
        counters: StepCounters,
        *,
        keep_caches: bool = False,
        buckets: bool = False,
        head: Head | None = None,
        fused: FusedPass | None = None,
        fused_prefill: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(model, sampler=sampler, **kw)
        self._prompt_batch = BoundPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._prompt_batch.counters = counters
        self._prompt_batch.fused = fused
        self._prompt_batch.riders = set()
        self._prompt_batch.first = {}
        if head is not None:
            self._prompt_batch.head = head
            self._prompt_batch.remaining = lambda: self._currently_processing
        if buckets:
            self._prompt_batch.buckets = Buckets(self.prefill_batch_size, self._blank)
        self._counters_mine, self._keep_caches, self._fused = counters, keep_caches, fused
        self._fused_prefill = fused_prefill and fused is not None
        #: Riders that waited out a call for rows that do not ride (:meth:`_riders_wait`).
        self._waited: set[int] = set()
        self._generation_batch = self._empty_batch()

    def _empty_batch(self) -> BoundGenerationBatch:
        """mlx-lm's empty generation batch, bound and counting."""
        batch = BoundGenerationBatch(
            model=self.model,
            fallback_sampler=self.sampler,
            uids=[],
            inputs=mx.array([], dtype=mx.uint32),
            prompt_cache=[],
            tokens=[],
            samplers=[],
            logits_processors=[],
            max_tokens=[],
            stop_sequences=[],
            counters=self._counters_mine,
            fused=self._fused,
        )
        batch.keep_caches = self._keep_caches
        return batch

    def _next(self) -> Any:
        later = self._riders_wait()
        try:
            if self._new_rows_first():
                return self._prefill_then_decode()
            prompt_responses, generation_responses = super()._next()
            self._start_ready(prompt_responses)
            return prompt_responses, generation_responses
        finally:
            if later:  # back at the front, for the next call
                self._unprocessed_sequences.extendleft(reversed(later))

    def _riders_wait(self) -> list[Any]:
        """Where rows that ride wait beside rows that do not, take the riders out of the
        rows waiting for a prefill until this call is done, and return them.

        A chat job that starts beside a sweep's refill (a job of a higher level makes the
        free rows fill at once) would otherwise share its prefill with the refill's rows,
        and since rows started together ride only if all do, they would all take a
        first-token pass: the chat job's first token waits for two passes of many rows,
        and the refill loses its ride. Apart, the chat job's passes are of its own rows,
        and the riders' prefill runs in the next call, riding the step after it. A rider
        waits out one call at most: should rows that do not ride come again in the next,
        all go in together."""
        riders = self._prompt_batch.riders
        waiting = self._unprocessed_sequences
        later = [seq for seq in waiting if seq[0] in riders]
        if (
            not later
            or len(later) == len(waiting)  # riders only: nothing to step aside for
            or any(seq[0] in self._waited for seq in later)
        ):
            self._waited.clear()
            return []
        self._waited = {seq[0] for seq in later}
        kept = [seq for seq in waiting if seq[0] not in riders]
        waiting.clear()
        waiting.extend(kept)
        return later

    def _new_rows_first(self) -> bool:
        """Whether this call prefills before the batch's decode step: rows that do not
        ride (:meth:`ride`) wait to start beside a decoding batch with room for them."""
        gen = self._generation_batch
        return (
            0 < len(gen) < self.completion_batch_size
            and bool(self._unprocessed_sequences)
            and any(seq[0] not in self._prompt_batch.riders for seq in self._unprocessed_sequences)
        )

    def _prefill_then_decode(self) -> Any:
        """New rows' prefill and first-token pass first, then the batch's decode step with
        them in it: their first token comes out of this call, where mlx-lm's order
        (decode, then prefill) has it come out of the next, behind a decode step of the
        whole batch. The same passes either way; the running rows' token of this call
        waits for the new rows' passes instead."""
        main, self._generation_batch = self._generation_batch, self._empty_batch()
        if self._fused_prefill:
            # One new row that the pass ends: its prompt runs in the batch's decode pass.
            self._prompt_batch.fuse = main.fused_step
        try:
            prompt_responses, _ = super()._next()  # an empty batch: no decode step
            self._start_ready(prompt_responses)
            joined = self._generation_batch
        finally:
            self._generation_batch = main
            self._prompt_batch.fuse = None
        if main.has_given_logits:
            # The rows' step ran in the new row's pass: theirs first, then the new row's
            # first token (sampled from that pass), which it feeds in the next step.
            responses = main.next()
            responses += joined.emit_next()
            if len(joined):
                main.extend(joined)
        else:
            if len(joined):
                main.extend(joined)
            responses = main.next()
        self._counters.generation_tokens += len(responses)  # as mlx-lm's own step counts
        self._counters.generation_steps += 1
        if self._counters.generation_steps % 512 == 0:
            trim_cache()
        return prompt_responses, responses

    def _start_ready(self, responses: list[Any]) -> None:
        """Rows whose prefill this call finished start decoding in this call.

        mlx-lm moves a row from its prefill to the generation batch at the start of the
        call after its prefill, behind that call's decode step; the first token then comes
        out of the decode step after that one. Moving it here, as soon as only its last
        prompt token is left, runs that token's pass (which samples the first token) now:
        beside a busy batch a new row's first token comes one decode step of the whole
        batch sooner, and the tokens are the same.
        """
        if len(self._generation_batch) >= self.completion_batch_size:
            return  # as mlx-lm: no new rows while the batch is full
        ready = [
            i
            for i, (segments, _, _) in enumerate(self._currently_processing)
            if len(segments) == 1 and len(segments[0]) == 1
        ]
        if not ready:
            return
        starting = [self._currently_processing[i] for i in ready]
        self._currently_processing = [
            seq for i, seq in enumerate(self._currently_processing) if i not in set(ready)
        ]
        batch = self._prompt_batch.split(ready).generate([seq[0][0] for seq in starting])
        for uid, (_, _, total) in zip(batch.uids, starting, strict=True):
            responses.append(PromptProcessingBatch.Response(uid, (total, total), True, True))
        self._generation_batch.extend(batch)

    def ride(self, uids: list[int]) -> None:
        """These inserted rows take their first token in the batch's next decode step, not
        in a pass of their own (one model pass fewer while the batch waits; their first
        token comes a step later): for rows no one waits on, such as a sweep's or a
        resumed row's. Rows started together ride only if all of them do."""
        self._prompt_batch.riders.update(uids)

    def riding(self) -> set[int]:
        """The rows that ride and were not yet fed their last token: waiting for their
        prefill, or in the batch before its next decode step."""
        waiting: set[int] = self._prompt_batch.riders
        riding: set[int] = self._generation_batch.riding
        return waiting | riding

    def remove(self, uids: list[int], *args: Any, **kw: Any) -> Any:
        self._prompt_batch.riders.difference_update(uids)
        for u in uids:
            self._prompt_batch.first.pop(u, None)
        return super().remove(uids, *args, **kw)

    def _blank(self, n: int) -> list[Any]:
        caches = [make_prompt_cache(self.model, self.max_kv_size) for _ in range(n)]
        return cast(list[Any], _merge_caches(caches))

    def take_out(self, uids: list[int]) -> dict[int, tuple[list[Any], list[int]]]:
        """Take rows out of the batch, each decoding row with a copy of its KV state and
        the tokens that state holds (its prompt and every token it emitted); a row still
        in its prefill is taken out with nothing (it has emitted nothing yet)."""
        with self._generation_batch.counters.stages.on("pause"):
            return self._take_out(uids)

    def _take_out(self, uids: list[int]) -> dict[int, tuple[list[Any], list[int]]]:
        gen = self._generation_batch
        where = {u: i for i, u in enumerate(gen.uids)}
        kept = {}
        for u in uids:
            if (i := where.get(u)) is not None:
                held = list(gen.tokens[i])
                slot = gen.slots.slot(i)
                kept[u] = ([row_copy(c, slot, len(held)) for c in gen.prompt_cache], held)
        self.remove(uids)
        return kept
