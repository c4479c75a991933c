"""One decode step of the whole batch, sampled in one call: mlx-lm's ``GenerationBatch``
bound to mlxq's :class:`~mlxq.batching.rows.RowSampler` (see :mod:`mlxq.worker.generator`).

Each step runs the forward pass, then on the logits of every row at once: logits
processors (penalties, logit_bias, min_tokens), constraints' token masks (filled on the host
while the pass runs), log-probs, and the one sampling call.
:class:`~mlxq.worker.step_counters.StepCounters` counts what the steps and prefills did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from mlxq.batching.grammar import apply_bitmask
from mlxq.batching.history import TokenHistory
from mlxq.batching.logits import apply
from mlxq.batching.logprobs import LogprobRows, StepLogprobs, TokenLogprob, step_logprobs, to_host
from mlxq.batching.rows import RowSampler
from mlxq.worker.fused_pass import FusedPass
from mlxq.worker.kv_pack import row_cache, schedule_caches
from mlxq.worker.kv_slots import Slots
from mlxq.worker.prompt_cache import MIN_REUSE
from mlxq.worker.step_counters import StepCounters


class _PendingLogprobs:
    """One step's log-probs, still on the device; read once, when its tokens are."""

    def __init__(self, step: StepLogprobs, rows: LogprobRows) -> None:
        self.step, self.rows = step, rows
        self._host: list[TokenLogprob | None] | None = None

    def row(self, i: int) -> _RowLogprobs:
        return _RowLogprobs(self, i)

    def resolve(self) -> list[TokenLogprob | None]:
        if self._host is None:
            self._host = to_host(self.step, self.rows)
        return self._host


@dataclass(frozen=True, slots=True)
class _RowLogprobs:
    pending: _PendingLogprobs
    index: int

    def get(self) -> TokenLogprob | None:
        return self.pending.resolve()[self.index]


class BoundGenerationBatch(GenerationBatch):  # type: ignore[misc]
    """mlx-lm's generation batch, with every row's processors and log-probs batched.

    ``_step`` is mlx-lm 0.32.2's, but for two stages: the per-row logits processor loop
    becomes one :func:`~mlxq.batching.logits.apply` over the batch (rows' token windows
    in a :class:`~mlxq.batching.history.TokenHistory` that follows the rows through
    ``filter`` and ``extend``), and the per-row split of the full-vocabulary log-probs
    becomes one :func:`~mlxq.batching.logprobs.step_logprobs` for the rows that asked
    (none asked: nothing is computed). Each step is counted in ``counters``."""

    #: Whether finished rows' caches are wanted (the engine keeps a prompt cache). mlx-lm
    #: copies every layer of each finished row, waiting for the device once a layer; kept
    #: rows are views here (the prompt cache copies what it keeps), and unwanted ones cost
    #: nothing.
    keep_caches = False

    def __init__(
        self,
        *args: Any,
        counters: StepCounters,
        stage: str = "decode",
        ride: bool = False,
        first_logits: mx.array | None = None,
        fused: FusedPass | None = None,
        **kw: Any,
    ) -> None:
        self._history: TokenHistory | None = None
        #: The rows' logits after their last prompt token, where their prefill fed it: the
        #: constructor's step samples from these instead of a pass of its own.
        self._first_logits = first_logits
        #: The model's layers over the rows' tokens as one sequence (None: mlx-lm's call
        #: of a token a row); kept by the batch this one joins, which has its own.
        self._fused = fused
        #: The next step's logits where a pass that also ran a new row's prompt fed the
        #: rows their inputs already (:meth:`fused_step`).
        self._given_logits: mx.array | None = None
        #: Each row's place in the caches: rows that leave leave their slots dead and rows
        #: that join write into them (:mod:`mlxq.worker.kv_slots`).
        self.slots = Slots()
        # Before mlx-lm's constructor, which samples a first step: a batch of new rows
        # counts that step as their ``first_token`` stage, the running batch as ``decode``;
        # a batch that rides takes no step of its own (``riding``).
        self.counters, self._stage, self._no_first_step = counters, stage, ride
        super().__init__(*args, **kw)
        self._no_first_step = False
        #: Rows fed their last prompt token by the next step of the batch they join
        #: instead of a pass of their own: that step samples their first token and emits
        #: nothing for them (their first token is emitted the step after).
        self.riding: set[int] = set(self.uids) if ride else set()
        if ride:
            self._next_logprobs = [None] * len(self.uids)

    def extract_cache(self, idx: int) -> list[Any]:
        n = len(self.tokens[idx])  # exactly the tokens its cache holds
        if not self.keep_caches or n < MIN_REUSE:  # a row too short to keep costs nothing
            return []
        return [row_cache(c, self.slots.slot(idx), n) for c in self.prompt_cache]

    def next(self) -> list[Any]:
        """mlx-lm 0.32.2's ``next``, but a riding row's first step emits nothing: the
        token it was fed is its prompt's last, not one it generated."""
        if not self.uids:
            return []
        riding, self.riding = self.riding, set()
        if self.slots.tick():  # dead slots no row came for: the batch has shrunk
            with self.counters.stages.on("rows_leave"):
                self.slots.drop_dead(self.prompt_cache, [len(t) for t in self.tokens])
                schedule_caches(self.prompt_cache)
            self.counters.slot_gathers += 1
        tokens, logprobs = self._step()
        return self._emit(tokens, logprobs, riding)

    def _emit(self, tokens: list[int], logprobs: list[Any], riding: set[int]) -> list[Any]:
        """A response for each row's token (none for rows in ``riding``: theirs was a
        prompt token); rows that end with it leave the batch, handing back their caches."""
        keep, responses = [], []
        for i, uid in enumerate(self.uids):
            if uid in riding:
                keep.append(i)
                continue
            finish = None
            self._num_tokens[i] += 1
            if self._num_tokens[i] >= self.max_tokens[i]:
                finish = "length"
            if self._matchers[i].advance(tokens[i]):
                finish = "stop"
            if finish is None:
                keep.append(i)
            ended = finish is not None
            responses.append(
                self.Response(
                    uid=uid,
                    token=tokens[i],
                    logprobs=logprobs[i],
                    finish_reason=finish,
                    prompt_cache=self.extract_cache(i) if ended else None,
                    all_tokens=self.tokens[i] if ended else None,
                )
            )
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _step(self) -> Any:
        if self._no_first_step:  # mlx-lm's constructor, for a batch that rides
            return [], []
        sampler = cast(RowSampler, self.fallback_sampler)
        sampler.bind(self.uids)
        rows, before = len(self.uids), sampler.calls
        with self.counters.stages.on(self._stage):
            if self.counters.stages.tracing:  # nothing on the decode step otherwise
                seen = (rows,) in self.counters.seen
                self.counters.stages.note(
                    rows=rows,
                    new=not seen,
                    sampled=sampler.sampled_count,
                    slots=self.slots.width(rows),
                )
                self.counters.seen.add((rows,))
            fed = self._first_logits is not None
            out = self._batched_step()
        if fed:  # no model pass: the rows' first tokens, sampled from their prefill's logits
            self.counters.first_tokens_from_prefill += rows
            return out
        self.counters.count_step(rows, sampler.calls - before)
        self.counters.first_token_passes += self._stage == "first_token"
        return out

    def _batched_step(self) -> tuple[list[int], list[TokenLogprob | None]]:
        sampler = cast(RowSampler, self.fallback_sampler)
        self._current_tokens = self._next_tokens  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs
        inputs: Any = self._current_tokens
        # After rows joined or left, the inputs are a new array (mlx-lm's extend and filter
        # join or index the last step's tokens). Scheduled with this step's evaluation,
        # the wait for them below would wait for the whole step, the host idle meanwhile
        # (on an H100 the step after a chat row joined or left took ~6 ms more); scheduled
        # on their own, it waits for the last step only. Once evaluated, this is a no-op.
        mx.async_eval(inputs)
        part = self.counters.stages.part  # the trace's detail: host or device (stages.py)
        if self._first_logits is not None:  # the prefill fed the inputs: their pass ran
            logits, self._first_logits = self._first_logits, None
        elif self._given_logits is not None:
            logits, self._given_logits = self._given_logits, None
        elif self._fused is not None:
            with part("graph"):
                logits = self._fused.decode(
                    self.slots.feed(inputs), self.prompt_cache, self.slots.rows()
                )
        else:
            with part("graph"):
                out = self.model(self.slots.feed(inputs)[:, None], cache=self.prompt_cache)
                logits = self.slots.select(out[:, -1, :])
        grammar = sampler.grammar_rows
        if grammar is not None:
            # The forward pass runs while the host reads the fed tokens and fills masks.
            mx.async_eval(logits)
            fed = _ints(inputs)
            start = time.perf_counter()
            bitmask = grammar.masks(fed)
            self.counters.mask_ms += (time.perf_counter() - start) * 1000
        rows = sampler.logits_rows(logits.shape[-1])
        if rows is not None:
            logits = apply(logits, self._history_for(sampler, inputs), rows)
        if grammar is not None:
            logits = apply_bitmask(logits, bitmask, grammar.lines)
        with part("sample"):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = sampler(logprobs)
        pending: list[mx.array] = []
        lp_rows = sampler.logprob_rows
        if lp_rows is not None:
            step = step_logprobs(logprobs, sampled, lp_rows)
            handle = _PendingLogprobs(step, lp_rows)
            self._next_logprobs = [handle.row(i) for i in range(len(self.uids))]
            pending += step.arrays()
        else:
            self._next_logprobs = [None] * len(self.uids)
        if self._history is not None:
            self._history = self._history.append(sampled)
            pending.append(self._history.tokens)
        self._next_tokens = sampled
        with part("launch"):
            mx.async_eval(self._next_tokens, *pending)
        with part("wait"):
            mx.eval(inputs)
            tokens = cast(list[int], inputs.tolist())
        for sti, ti in zip(self.tokens, tokens, strict=True):
            sti.append(ti)
        return tokens, [None if h is None else h.get() for h in self._current_logprobs]

    def emit_next(self) -> list[Any]:
        """Emit each row's next token now, without a pass (its logits came from a pass
        that ran the rows' prompts): ``next``'s responses for it, and rows that end with it
        leave. The rows then ride their next step, which feeds those tokens and emits
        nothing. Rows that ride already (their next input is their last prompt token) emit
        nothing here."""
        riding = self.riding  # fed their last prompt token next step: nothing to emit
        if not set(self.uids) - riding:
            return []
        tokens = cast(list[int], self._next_tokens.tolist())
        logprobs = [None if h is None else h.get() for h in self._next_logprobs]
        self.riding = riding | set(self.uids)
        return self._emit(tokens, logprobs, riding)

    @property
    def has_given_logits(self) -> bool:
        """Whether the next step's logits came from a pass that ran a new row's prompt."""
        return self._given_logits is not None

    def fused_step(self, prompt: list[int], caches: list[Any], end: int) -> mx.array:
        """Run the rows' next pass with a new row's ``prompt`` in it (into ``caches``, its
        token ``end`` its last); keep the rows' logits for the next step and return the new
        row's. The next step samples from them: it must come before rows join or leave."""
        assert self._fused is not None
        assert self._given_logits is None and self._first_logits is None
        self._given_logits, new = self._fused(
            self.slots.feed(self._next_tokens),
            self.prompt_cache,
            prompt,
            caches,
            end,
            keep=self.slots.rows(),
        )
        return new

    def _history_for(self, sampler: RowSampler, inputs: mx.array) -> TokenHistory:
        if self._history is None:
            self._history = _history(sampler, self.uids, self.tokens, _ints(inputs))
        return self._history

    def filter(self, keep: list[int]) -> None:
        with self.counters.stages.on("rows_leave"):
            self._filter(keep)

    def _filter(self, keep: list[int]) -> None:
        # mlx-lm's, but rows that leave leave their slots in the caches dead (kv_slots);
        # where they are gathered, each layer's padding is known from the tokens each row
        # holds, not read from the device once a layer (kv_pack.filter_rows).
        held, rows = [len(self.tokens[i]) for i in keep], len(self.uids)
        caches, self.prompt_cache = self.prompt_cache, []
        try:
            super().filter(keep)  # every per-row list (on no cache)
        finally:
            self.prompt_cache = caches
        done = self.slots.leave(caches, rows, keep, held)
        if done in ("gathered", "cut"):
            schedule_caches(caches)  # the copies apart from the next step
        self.counters.slot_gathers += done == "gathered"
        self.riding &= set(self.uids)
        if self._history is not None:
            self._history = self._history.select(keep) if keep else None

    def extend(self, batch: Any) -> None:
        with self.counters.stages.on("rows_join"):
            self._extend(batch)

    def _extend(self, batch: Any) -> None:
        sampler = cast(RowSampler, self.fallback_sampler)
        mine, theirs = self._history, getattr(batch, "_history", None)
        if (mine is None) != (theirs is None) and self.uids and batch.uids:
            # The side without a history has no row with processors: any window will do.
            if mine is None:
                mine = _history(sampler, self.uids, self.tokens, _ints(self._next_tokens))
            else:
                theirs = _history(sampler, batch.uids, batch.tokens, _ints(batch._next_tokens))
        held, their_held = [len(t) for t in self.tokens], [len(t) for t in batch.tokens]
        if self.slots.join(self.prompt_cache, held, batch.prompt_cache, their_held):
            self.counters.rows_joined_in_place += len(their_held)
            caches, self.prompt_cache, batch.prompt_cache = self.prompt_cache, [], []
            try:
                super().extend(batch)  # every per-row list (on no cache)
            finally:
                self.prompt_cache = caches
        else:
            self.counters.slot_gathers += bool(self.slots.free)
            if self.uids:  # rows copied beside rows already here; the trace says why
                self.counters.rows_joined_by_copy += len(their_held)
                self.counters.stages.note(copy=self.slots.refused, rows=len(their_held))
            self.slots.drop_dead(self.prompt_cache, held)
            rows = len(self.uids)
            super().extend(batch)
            self.slots.appended(rows, len(batch.uids))
        schedule_caches(self.prompt_cache)
        self.riding |= getattr(batch, "riding", set())
        if mine is not None and theirs is not None:
            self._history = mine.extend(theirs)
        else:
            self._history = mine if mine is not None else theirs


def _history(
    sampler: RowSampler, uids: list[int], tokens: list[list[int]], next_inputs: list[int]
) -> TokenHistory:
    """The rows' windows: every token in their caches, then the input being decoded."""
    sizes = [sampler.context(u) for u in uids]
    return TokenHistory.from_prompts(
        [[*t, x] for t, x in zip(tokens, next_inputs, strict=True)],
        sizes,
        generated=[sampler.generated_before(u) for u in uids],
        vocab_size=sampler.vocab_size,
    )


def _ints(tokens: Any) -> list[int]:
    return cast(list[int], tokens.tolist())
