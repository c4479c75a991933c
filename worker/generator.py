"""mlx-lm's BatchGenerator, bound so that every decode step samples in one call.

mlx-lm samples a step with one call only when every row holds the same sampler object;
rows with their own samplers send the step down a per-row loop. mlxq gives every row one
:class:`~mlxq.batching.rows.RowSampler` and binds it to the rows of the next call in
the two places mlx-lm samples: ``GenerationBatch._step`` (every decode step) and
``PromptProcessingBatch.generate`` (the first token after prefill). Pinned to mlx-lm
0.32.2, whose ``filter`` re-indexes every per-row list; ``tests/test_engine.py`` pins the
alignment.

Logits processors (penalties, logit_bias, min_tokens), constraints' token masks and
log-probs are batched too: see :class:`_BoundGenerationBatch`. mlx-lm's own per-row
``logits_processors`` are never used, since any of them would send every step down a
Python loop over rows.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
    _extend_cache,
    _merge_caches,
)
from mlx_lm.models.cache import make_prompt_cache

from mlxq.batching.grammar import apply_bitmask
from mlxq.batching.history import TokenHistory
from mlxq.batching.logits import apply
from mlxq.batching.logprobs import LogprobRows, StepLogprobs, TokenLogprob, step_logprobs, to_host
from mlxq.batching.prefill import prefill_shape
from mlxq.batching.rows import RowSampler
from mlxq.worker.kv_pack import row_cache
from mlxq.worker.prompt_cache import MIN_REUSE


@dataclass
class StepCounters:
    decode_steps: int = 0
    vectorized_steps: int = 0
    sampler_calls: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    #: Prompt cache: rows looked up, rows that found a prefix, the tokens those held,
    #: and prompt tokens run through the model (rows' rests and shared prefixes).
    prompt_cache_queries: int = 0
    prompt_cache_hits: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_prefilled: int = 0
    #: Rows taken out of the batch with their KV for a while, rows put back, and the
    #: tokens prefilled again for rows put back without their KV.
    preemptions: int = 0
    resumes: int = 0
    resume_tokens_recomputed: int = 0
    #: Rows that decoded under a constraint, constraints compiled for this model (each
    #: once, then cached), and milliseconds the decode thread spent filling their masks.
    constrained_rows: int = 0
    constraint_compiles: int = 0
    mask_ms: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    #: Prefill forward passes by rows (how many passes prefilled that many prompts at
    #: once), and the distinct (rows, padded length) shapes among them: each new shape
    #: may cost a GPU backend a kernel build or an attention plan.
    prefill_batch_sizes: dict[int, int] = field(default_factory=dict)
    prefill_shapes: set[tuple[int, int]] = field(default_factory=set)

    def count_prefill(self, rows: int, length: int) -> None:
        """One prefill pass over ``rows`` prompts, right-padded to ``length`` tokens."""
        self.prefill_batch_sizes[rows] = self.prefill_batch_sizes.get(rows, 0) + 1
        self.prefill_shapes.add((rows, length))

    def count_step(self, rows: int, sampler_calls: int) -> None:
        """One decode step of ``rows`` rows, which called the sampler that many times."""
        self.decode_steps += 1
        self.sampler_calls += sampler_calls
        self.vectorized_steps += sampler_calls == 1
        self.batch_sizes[rows] = self.batch_sizes.get(rows, 0) + 1


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


class _BoundGenerationBatch(GenerationBatch):  # type: ignore[misc]
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

    def __init__(self, *args: Any, counters: StepCounters, **kw: Any) -> None:
        self._history: TokenHistory | None = None
        self.counters = counters  # before mlx-lm's constructor, which samples a first step
        super().__init__(*args, **kw)

    def extract_cache(self, idx: int) -> list[Any]:
        n = len(self.tokens[idx])  # exactly the tokens its cache holds
        if not self.keep_caches or n < MIN_REUSE:  # a row too short to keep costs nothing
            return []
        return [row_cache(c, idx, n) for c in self.prompt_cache]

    def _step(self) -> Any:
        sampler = cast(RowSampler, self.fallback_sampler)
        sampler.bind(self.uids)
        rows, before = len(self.uids), sampler.calls
        out = self._batched_step()
        self.counters.count_step(rows, sampler.calls - before)
        return out

    def _batched_step(self) -> tuple[list[int], list[TokenLogprob | None]]:
        sampler = cast(RowSampler, self.fallback_sampler)
        self._current_tokens = self._next_tokens  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs
        inputs: Any = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
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
            logits = apply_bitmask(logits, bitmask)
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
        mx.async_eval(self._next_tokens, *pending)
        mx.eval(inputs)
        tokens = cast(list[int], inputs.tolist())
        for sti, ti in zip(self.tokens, tokens, strict=True):
            sti.append(ti)
        return tokens, [None if h is None else h.get() for h in self._current_logprobs]

    def _history_for(self, sampler: RowSampler, inputs: mx.array) -> TokenHistory:
        if self._history is None:
            self._history = _history(sampler, self.uids, self.tokens, _ints(inputs))
        return self._history

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        if self._history is not None:
            self._history = self._history.select(keep) if keep else None

    def extend(self, batch: Any) -> None:
        sampler = cast(RowSampler, self.fallback_sampler)
        mine, theirs = self._history, getattr(batch, "_history", None)
        if (mine is None) != (theirs is None) and self.uids and batch.uids:
            # The side without a history has no row with processors: any window will do.
            if mine is None:
                mine = _history(sampler, self.uids, self.tokens, _ints(self._next_tokens))
            else:
                theirs = _history(sampler, batch.uids, batch.tokens, _ints(batch._next_tokens))
        super().extend(batch)
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


@dataclass(frozen=True, slots=True)
class Buckets:
    """Prefills padded to bucketed shapes (:func:`mlxq.batching.prefill.prefill_shape`).

    Args:
        max_rows: Rows a prefill pass may hold (the batch's size).
        blank: Empty caches for this many rows, merged as a batch's: the padding rows.
    """

    max_rows: int
    blank: Callable[[int], list[Any]]


class _BoundPromptBatch(PromptProcessingBatch):  # type: ignore[misc]
    #: Where the generation batches it makes count their steps; set by :class:`Generator`
    #: and kept by every copy mlx-lm makes of this batch.
    counters: StepCounters
    #: Pad each prefill to a bucketed shape; None: to its longest prompt, as mlx-lm does.
    buckets: Buckets | None = None

    def _copy(self) -> Any:
        moved = super()._copy()
        moved.counters, moved.buckets = self.counters, self.buckets
        return moved

    def prompt(self, tokens: list[list[int]]) -> None:
        b = self.buckets
        if not tokens or b is None or len(tokens) != len(self.uids):
            if tokens:  # mlx-lm's own pass (and its error for a mismatch)
                self.counters.count_prefill(len(tokens), max(len(t) for t in tokens))
            super().prompt(tokens)
            return
        longest = max(len(t) for t in tokens)
        rows, width = prefill_shape(len(tokens), longest, b.max_rows, self.prefill_step_size)
        self.counters.count_prefill(rows, width)
        self._prompt_as(tokens, rows, width, b)

    def _prompt_as(self, tokens: list[list[int]], rows: int, width: int, b: Buckets) -> None:
        """Prefill ``tokens`` in one pass of ``rows`` x ``width``: each prompt right-padded
        to ``width`` (mlx-lm's right padding, rolled to the left once the pass is done, so
        a row's cache is as an unpadded pass leaves it), under it rows of padding, dropped
        after the pass."""
        real = len(tokens)
        for held, new in zip(self.tokens, tokens, strict=True):
            held += new  # the tokens each row's cache holds
        if rows > real:
            self.prompt_cache = _extend_cache(self.prompt_cache, b.blank(rows - real))
        lengths = [len(t) for t in tokens] + [width] * (rows - real)
        padded = min(lengths) < width
        if padded:
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
        x = mx.array([t + [0] * (width - len(t)) for t in tokens] + [[0] * width] * (rows - real))
        for start in range(0, width, self.prefill_step_size):
            self.model(x[:, start : start + self.prefill_step_size], cache=self.prompt_cache)
            mx.eval([c.state for c in self.prompt_cache])
        for c in self.prompt_cache:
            if padded:
                c.finalize()
            if rows > real:
                c.filter(list(range(real)))
        mx.eval([c.state for c in self.prompt_cache])
        if rows * width > self.prefill_step_size:
            mx.clear_cache()  # a large pass: its buffers go back, as mlx-lm's do

    def split(self, indices: list[int]) -> Any:
        # Every row at once (a burst's rows all reach their last prompt token together):
        # hand the rows over as they are; mlx-lm copies the whole batch's cache first.
        if sorted(indices) != list(range(len(self.uids))):
            return super().split(indices)
        moved = copy.copy(self)
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        self.stop_sequences = []
        return moved

    def generate(self, tokens: list[list[int]]) -> Any:
        # mlx-lm's own, but the new rows join a _BoundGenerationBatch, whose constructor
        # samples (and counts) their first token.
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        generation = _BoundGenerationBatch(
            self.model,
            self.uids,
            mx.array([t[-1] for t in tokens]),
            self.prompt_cache,
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
            counters=self.counters,
        )
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return generation


class Generator(BatchGenerator):  # type: ignore[misc]
    """mlx-lm's BatchGenerator over bound batches: one sampler call per decode step.

    Args:
        model: The mlx-lm model.
        sampler: The batch's one sampler, which also keeps each row's requests.
        counters: Where decode steps and sampler calls are counted.
        keep_caches: Whether finished rows' caches are handed back (a prompt cache).
        buckets: Pad each prefill pass to a bucketed (rows, length) shape, so passes of
            new rows repeat a few shapes (see :mod:`mlxq.batching.prefill`).
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
        **kw: Any,
    ) -> None:
        super().__init__(model, sampler=sampler, **kw)
        self._prompt_batch = _BoundPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._prompt_batch.counters = counters
        if buckets:
            self._prompt_batch.buckets = Buckets(self.prefill_batch_size, self._blank)
        self._generation_batch = _BoundGenerationBatch(  # mlx-lm's empty batch, counting
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
            counters=counters,
        )
        self._generation_batch.keep_caches = keep_caches

    def _next(self) -> Any:
        prompt_responses, generation_responses = super()._next()
        self._start_ready(prompt_responses)
        return prompt_responses, generation_responses

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

    def _blank(self, n: int) -> list[Any]:
        caches = [make_prompt_cache(self.model, self.max_kv_size) for _ in range(n)]
        return cast(list[Any], _merge_caches(caches))

    def take_out(self, uids: list[int]) -> dict[int, tuple[list[Any], list[int]]]:
        """Take rows out of the batch, each decoding row with a copy of its KV state and
        the tokens that state holds (its prompt and every token it emitted); a row still
        in its prefill is taken out with nothing (it has emitted nothing yet)."""
        gen = self._generation_batch
        where = {u: i for i, u in enumerate(gen.uids)}
        kept = {
            u: ([c.extract(where[u]) for c in gen.prompt_cache], list(gen.tokens[where[u]]))
            for u in uids
            if u in where
        }
        self.remove(uids)
        return kept
