"""The MLX side: mlx-lm's BatchGenerator, every decode step sampled in one call.

mlx-lm samples a step with one call only when every row holds the same sampler object;
rows with their own samplers send the step down a per-row loop. mlxq gives every row one
:class:`~mlxq.batching.rows.RowSampler` and binds it to the rows of the next call in
the two places mlx-lm samples: ``GenerationBatch._step`` (every decode step) and
``PromptProcessingBatch.generate`` (the first token after prefill). Pinned to mlx-lm
0.32.2, whose ``filter`` re-indexes every per-row list; ``tests/test_engine.py`` pins the
alignment.

Logits processors (penalties, logit_bias, min_tokens) and log-probs are batched too:
see :class:`_BoundGenerationBatch`. mlx-lm's own per-row ``logits_processors`` are never
used, since any of them would send every step down a Python loop over rows.

The engine works on :class:`~mlxq.worker.jobs.Job` records (one row per choice of a
job): it detokenizes each row's tokens, cuts at stop strings, and hands each choice its
output; it keeps no record of its own beyond the uid of each row.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
)

from mlxq.batching.history import TokenHistory
from mlxq.batching.logits import apply
from mlxq.batching.logprobs import LogprobRows, StepLogprobs, TokenLogprob, step_logprobs, to_host
from mlxq.batching.rows import RowSampler
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest
from mlxq.worker.config import WorkerConfig
from mlxq.worker.jobs import Job
from mlxq.worker.prompt_cache import MIN_REUSE, PromptCache, default_budget, row_cache

log = logging.getLogger("mlxq.worker")

#: What OpenAI reports for a token that cannot be sampled at all (log-prob -inf).
LOGPROB_FLOOR = -9999.0


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
    batch_sizes: dict[int, int] = field(default_factory=dict)


def _counted_step(batch: Any, step: Any) -> Any:
    sampler: RowSampler = batch.fallback_sampler
    counters: StepCounters = sampler.counters  # type: ignore[attr-defined]
    sampler.bind(batch.uids)
    n = len(batch.uids)
    before = sampler.calls
    out = step()
    calls = sampler.calls - before
    counters.decode_steps += 1
    counters.sampler_calls += calls
    counters.vectorized_steps += calls == 1
    counters.batch_sizes[n] = counters.batch_sizes.get(n, 0) + 1
    return out


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
    (none asked: nothing is computed)."""

    #: Whether finished rows' caches are wanted (the engine keeps a prompt cache). mlx-lm
    #: copies every layer of each finished row, waiting for the device once a layer; kept
    #: rows are views here (the prompt cache copies what it keeps), and unwanted ones cost
    #: nothing.
    keep_caches = False

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._history: TokenHistory | None = None
        super().__init__(*args, **kw)

    def extract_cache(self, idx: int) -> list[Any]:
        n = len(self.tokens[idx])  # exactly the tokens its cache holds
        if not self.keep_caches or n < MIN_REUSE:  # a row too short to keep costs nothing
            return []
        return [row_cache(c, idx, n) for c in self.prompt_cache]

    def _step(self) -> Any:
        return _counted_step(self, self._batched_step)

    def _batched_step(self) -> tuple[list[int], list[TokenLogprob | None]]:
        sampler = cast(RowSampler, self.fallback_sampler)
        self._current_tokens = self._next_tokens  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs
        inputs: Any = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        rows = sampler.logits_rows(logits.shape[-1])
        if rows is not None:
            logits = apply(logits, self._history_for(sampler, inputs), rows)
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
        vocab_size=sampler.vocab_size,
    )


def _ints(tokens: Any) -> list[int]:
    return cast(list[int], tokens.tolist())


class _BoundPromptBatch(PromptProcessingBatch):  # type: ignore[misc]
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
        )
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return generation


class _Generator(BatchGenerator):  # type: ignore[misc]
    def __init__(
        self, model: Any, sampler: RowSampler, *, keep_caches: bool = False, **kw: Any
    ) -> None:
        super().__init__(model, sampler=sampler, **kw)
        self._prompt_batch = _BoundPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._generation_batch = _BoundGenerationBatch.empty(self.model, self.sampler)
        self._generation_batch.keep_caches = keep_caches


class Engine:
    """A model, its tokenizer and one continuous batch of jobs.

    Args:
        model: An mlx-lm model (``mlx_lm.load(path)[0]``).
        tokenizer: Its ``TokenizerWrapper``.
        max_batch: Most rows decoding at once (``completion_batch_size``).
        prefill_step_size: Prompt tokens per prefill forward pass.
        max_kv_size: Rotating KV cache size, None for the full context.
        prompt_cache_bytes: Bytes of KV state kept for later jobs that start with the
            same tokens (see :mod:`mlxq.worker.prompt_cache`); 0: no prompt cache;
            None: :func:`~mlxq.worker.prompt_cache.default_budget`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 32,
        prefill_step_size: int = 2048,
        max_kv_size: int | None = None,
        prompt_cache_bytes: int | None = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r}: must be >= 1")
        if prompt_cache_bytes is None:
            prompt_cache_bytes = default_budget()
            if prompt_cache_bytes:
                log.info("prompt cache: %d MiB (auto)", prompt_cache_bytes >> 20)
            else:
                log.warning("prompt cache off: the model leaves the device too little memory")
        if prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes={prompt_cache_bytes!r}: must be >= 0")
        self.prompt_cache = (
            PromptCache(
                model,
                prompt_cache_bytes,
                max_kv_size=max_kv_size,
                prefill_step_size=prefill_step_size,
            )
            if prompt_cache_bytes
            else None
        )
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.counters = StepCounters()
        self.max_context = _context_length(model)
        self.vocab_size = _vocab_size(model, tokenizer)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._kw = dict(
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_step_size,
            max_kv_size=max_kv_size,
            stop_tokens=[[t] for t in sorted(self._eos)],
        )
        self._rows: dict[int, tuple[Job, int]] = {}
        self._uids_of: dict[str, list[int]] = {}
        self._stops: dict[int, frozenset[int]] = {}  # rows that end on more than EOS
        self._token_info: dict[int, tuple[str, list[int]]] = {}
        self.reset()

    @classmethod
    def for_worker(cls, config: WorkerConfig) -> Engine:
        """The engine a worker's config asks for: its model, batch and prompt cache."""
        return cls.load(
            config.model,
            max_batch=config.max_batch,
            prompt_cache_bytes=config.prompt_cache_bytes,
        )

    @classmethod
    def load(cls, path_or_repo: str, **kw: Any) -> Engine:
        """Load any mlx-lm model path or Hugging Face repo id."""
        from mlx_lm import load

        loaded = load(path_or_repo)
        return cls(loaded[0], loaded[1], **kw)

    def reset(self) -> None:
        """Drop every row and start a fresh generator (after an MLX error), and empty the
        prompt cache: after an error its entries are no longer trusted."""
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        self.sampler = RowSampler(self.vocab_size, self._eos)
        self.sampler.counters = self.counters  # type: ignore[attr-defined]
        self._gen = _Generator(
            self.model, self.sampler, keep_caches=self.prompt_cache is not None, **self._kw
        )
        self._rows.clear()
        self._uids_of.clear()
        self._stops.clear()

    @property
    def prompt_cache_bytes(self) -> int:
        """Bytes the prompt cache holds now."""
        return 0 if self.prompt_cache is None else self.prompt_cache.nbytes

    @property
    def active(self) -> int:
        return len(self._rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self._rows)

    def holds(self, job_id: str) -> bool:
        return job_id in self._uids_of

    def encode(self, req: GenerationRequest) -> list[int]:
        """Tokenize a request's prompt (or render its chat through the template), and
        check what else of it depends on the model.

        Thread-safe: the worker tokenizes ahead of need, off the decode thread.

        Raises:
            PayloadError: the prompt is empty once tokenized, or with ``max_tokens``
                longer than the model's context; a token id past the vocabulary.
        """
        tok = self.tokenizer
        if req.messages is not None:
            text = tok.apply_chat_template(
                list(req.messages), add_generation_prompt=True, tokenize=False
            )
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt)
        if not ids:
            raise PayloadError("prompt: tokenizes to nothing")
        if self.max_context and len(ids) + req.max_tokens > self.max_context:
            raise PayloadError(
                f"prompt: {len(ids)} tokens + max_tokens={req.max_tokens} exceed "
                f"the model's context of {self.max_context}"
            )
        lp = req.logits
        if lp is not None:
            for name, t in [("logit_bias", t) for t in lp.logit_bias or ()] + [
                ("stop_token_ids", t) for t in lp.stop_token_ids
            ]:
                if t >= self.vocab_size:
                    raise PayloadError(
                        f"{name}: token id {t} is past the vocabulary ({self.vocab_size} tokens)"
                    )
        return list(ids)

    def new_detokenizer(self) -> Any:
        return self.tokenizer.detokenizer

    def add(self, jobs: Sequence[Job]) -> None:
        """Queue jobs' prompts for the next prefill, all in one insert (one row per
        choice); they decode from then on."""
        rows = [(job, i) for job in jobs for i in range(job.request.n)]
        if not rows:
            return
        caches, held = self._cached([job.prompt_ids for job, _ in rows])
        cached = caches is not None
        if caches is not None:
            # Hits first: mlx-lm merges a batch by its first row's cache type, and the
            # prompt cache's merge takes misses beside hits in one copy; mlx-lm's, row by row.
            missed = [c is None for c in caches]
            order = sorted(range(len(rows)), key=lambda i: missed[i])
            rows = [rows[i] for i in order]
            caches, held = [caches[i] for i in order], [held[i] for i in order]
        stops = [self._stop_tokens(job) for job, _ in rows]
        prompts = [job.prompt_ids for job, _ in rows]
        uids = self._gen.insert(
            [p[n:] for p, n in zip(prompts, held, strict=True)] if cached else prompts,
            max_tokens=[job.request.max_tokens for job, _ in rows],
            caches=caches,
            all_tokens=[p[:n] for p, n in zip(prompts, held, strict=True)] if cached else None,
            stop_sequences=[StopSequences([[t] for t in sorted(s)]) for s in stops],
        )
        for uid, (job, i), stop in zip(uids, rows, stops, strict=True):
            req = job.request
            sampling = dataclasses.replace(req.sampling, seed=req.choice_seeds[i])
            # Stop token ids alone change no logit: such a row costs the step nothing.
            logits = req.logits if req.logits is not None and req.logits.active else None
            self.sampler.add(uid, sampling, logits, req.top_logprobs if req.logprobs else None)
            self._rows[uid] = (job, i)
            self._uids_of.setdefault(job.id, []).append(uid)
            if stop != self._eos:
                self._stops[uid] = stop
        self.counters.prompt_tokens += sum(len(job.prompt_ids) for job, _ in rows)

    def _cached(self, prompts: list[list[int]]) -> tuple[list[list[Any]] | None, list[int]]:
        """Each row's cache of its longest cached prefix (None: none) and how many tokens
        that holds; prefixes the rows share and the cache lacks are prefilled first, once
        each."""
        c, pc = self.counters, self.prompt_cache
        if pc is None:
            c.prompt_tokens_prefilled += sum(len(p) for p in prompts)
            return None, [0] * len(prompts)
        c.prompt_tokens_prefilled += pc.prefill_shared(prompts)
        caches: list[Any] = []
        held: list[int] = []
        for p in prompts:
            cache, n = pc.fetch(p)
            caches.append(cache)
            held.append(n)
            c.prompt_cache_queries += 1
            c.prompt_cache_hits += cache is not None
            c.prompt_tokens_cached += n
            c.prompt_tokens_prefilled += len(p) - n
        return caches, held

    def _keep(self, rows: Iterable[tuple[list[int] | None, list[Any] | None]]) -> None:
        """Keep finished rows' caches (prompt and completion, as ``(tokens, cache)``) for
        later jobs; rows that finished in one step are passed together."""
        if self.prompt_cache is not None:
            kept = [(tokens, cache) for tokens, cache in rows if tokens and cache]
            if kept:
                self.prompt_cache.store_many(kept)

    def _stop_tokens(self, job: Job) -> frozenset[int]:
        lp = job.request.logits
        return self._eos | frozenset(lp.stop_token_ids) if lp is not None else self._eos

    def remove(self, jobs: Iterable[Job]) -> None:
        """Take jobs (every row of each) out of the batch now (cancel, deadline, failure)."""
        uids = [u for j in jobs for u in self._uids_of.get(j.id, ())]
        if uids:
            self._gen.remove(uids)
        for u in uids:
            self._forget(u)

    def step(self) -> list[Job]:
        """Run one scheduling step (decode, then admit prefill work). Returns the jobs that
        made output; a choice that ended has its ``finish_reason`` set and left the batch."""
        _, responses = self._gen.next()
        touched: dict[str, Job] = {}
        for r in responses:
            row = self._rows.get(r.uid)
            if row is not None:
                self._on_token(r.uid, row[0], row[1], r.token, r.finish_reason, r.logprobs)
                touched[row[0].id] = row[0]
        self._keep((r.all_tokens, r.prompt_cache) for r in responses if r.finish_reason is not None)
        self.counters.tokens_generated += len(responses)
        return list(touched.values())

    def _on_token(
        self, uid: int, job: Job, index: int, token: int, finish: str | None, logprob: Any
    ) -> None:
        choice = job.choices[index]
        choice.generated += 1
        detok = choice.detok
        stop_token = finish == "stop" and token in self._stops.get(uid, self._eos)
        if not stop_token:  # a stop token is no part of the text
            detok.add_token(token)
        if finish is not None:
            detok.finalize()
        segment = detok.last_segment
        ids, lps = ([], []) if stop_token else ([token], [])
        if not stop_token and isinstance(logprob, TokenLogprob):
            # The token's text is what it added to the completion, so a choice's tokens
            # joined give its text (a byte of a multi-byte character adds none yet).
            lps = [self._logprob_entry(logprob, segment)]
        text, stopped = choice.stops.feed(segment)
        if stopped and finish is None:
            kept = self._gen.remove([uid], return_prompt_caches=self.prompt_cache is not None)
            if uid in kept:
                cache, tokens = kept[uid]
                self._keep([(tokens, cache)])
            finish = "stop"
        elif finish is not None:
            text += choice.stops.flush()
        choice.emit(text, ids, lps)
        if finish is not None:
            choice.finish_reason = finish
            self._forget(uid)

    def _logprob_entry(self, lp: TokenLogprob, text: str) -> dict[str, Any]:
        """OpenAI's chat shape; alternatives are shown as each decodes alone."""
        return {
            "token": text,
            "logprob": _finite(lp.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": t, "logprob": _finite(v), "bytes": b}
                for t, b, v in ((*self._token(i), v) for i, v in lp.top)
            ],
        }

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        info = self._token_info.get(token_id)
        if info is None:
            text = self.tokenizer.decode([token_id])
            info = self._token_info[token_id] = (text, list(text.encode("utf-8")))
        return info

    def _forget(self, uid: int) -> None:
        row = self._rows.pop(uid, None)
        if row is not None:
            uids = self._uids_of.get(row[0].id, [])
            if uid in uids:
                uids.remove(uid)
            if not uids:
                self._uids_of.pop(row[0].id, None)
        self._stops.pop(uid, None)
        self.sampler.drop(uid)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def _context_length(model: Any) -> int | None:
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _vocab_size(model: Any, tokenizer: Any) -> int:
    n = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(n) if isinstance(n, int) and n > 0 else len(tokenizer.vocab)
