"""The MLX side: a model, its tokenizer and one continuous batch, row by row.

The :class:`Engine` tokenizes requests, inserts each job's choices as batch rows
(through a prompt cache when it has one), and runs the batch a step at a time on a
:class:`~mlxq.worker.generator.Generator` (every decode step sampled in one call). It owns
a :class:`~mlxq.worker.rows.Row` per row: detokenizes each row's tokens, cuts at stop
strings and stop tokens, and hands each step's output back as plain
:class:`~mlxq.worker.rows.Delta` records, which the jobs turn into chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from mlx_lm.generate import StopSequences

from mlxq.batching.logprobs import TokenLogprob
from mlxq.batching.rows import RowSampler
from mlxq.batching.stops import StopMatcher
from mlxq.producer.params import GenerationRequest
from mlxq.worker.chat import tool_format
from mlxq.worker.config import WorkerConfig
from mlxq.worker.detok import Detokenizer, special_ids
from mlxq.worker.encode import context_length, encode, vocab_size
from mlxq.worker.fused_pass import FUSED_PREFILL, fused_pass
from mlxq.worker.generator import Generator
from mlxq.worker.grammars import Grammars
from mlxq.worker.jobs import Job
from mlxq.worker.logprob_entries import LogprobEntries
from mlxq.worker.mlx_settings import on_cuda
from mlxq.worker.model_head import model_head
from mlxq.worker.prompt_cache import PromptCache, default_budget
from mlxq.worker.rows import Delta, Row, RowStatus, fit_paused_kv, kv_nbytes
from mlxq.worker.step_counters import StepCounters

log = logging.getLogger("mlxq.worker")

#: Paused rows' KV budget for a worker without a prompt cache.
DEFAULT_PAUSED_KV_BYTES = 1 << 30


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
        paused_kv_bytes: Bytes of KV state paused rows may keep (beside the prompt
            cache's); past it the oldest pauses' KV is dropped (:meth:`pause`). None: the
            prompt cache's budget, or :data:`DEFAULT_PAUSED_KV_BYTES` with no prompt cache.
        prefill_buckets: Pad prefill passes to a few bucketed shapes (see
            :mod:`mlxq.batching.prefill`); None: on where MLX runs on CUDA, whose cuDNN
            attention plans are built for each new shape.
        fed_prefill: New rows that do not ride take their first token from the prefill
            that ends their prompts, not a pass of their own, where the model splits into
            a body and a head (:mod:`mlxq.worker.model_head`); False: mlx-lm's extra pass.
        one_sequence: Decode steps run the batch's tokens as one sequence through the
            model's token-wise layers (:mod:`mlxq.worker.fused_pass`), where its layers
            are the common decoder layout; False: mlx-lm's call of a token a row.
        fused_prefill: With ``one_sequence``, a row that does not ride and starts alone
            beside a busy batch runs its prompt in the batch's decode pass; None: off (see
            :data:`~mlxq.worker.fused_pass.FUSED_PREFILL`).
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
        paused_kv_bytes: int | None = None,
        prefill_buckets: bool | None = False,
        fed_prefill: bool = True,
        one_sequence: bool = True,
        fused_prefill: bool | None = None,
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
        if paused_kv_bytes is None:
            paused_kv_bytes = prompt_cache_bytes or DEFAULT_PAUSED_KV_BYTES
        self.paused_kv_budget = paused_kv_bytes
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.prefill_step_size = prefill_step_size
        self.counters = StepCounters()
        #: Whether MLX runs this model on CUDA (where defaults that weigh a pass's cost
        #: differ: ``prefill_buckets``, the scheduler's ``admit_hold_steps``).
        self.on_cuda = on_cuda()
        if prefill_buckets is None:
            prefill_buckets = self.on_cuda
        self.prefill_buckets = prefill_buckets
        #: The model's body and head apart, where its call is those two: a prefill that
        #: ends new rows' prompts feeds their last tokens and gives their first tokens.
        self.head = model_head(model) if fed_prefill else None
        #: The model's layers run over the batch's tokens as one sequence: on MLX's CUDA
        #: backend a 4-bit model's projections of 64 rows a token each ran as 64 products
        #: of a vector (an H100: 19.1 ms a 0.5B step against 9.6 as one sequence).
        self.fused = fused_pass(model) if one_sequence else None
        if fused_prefill is None:
            fused_prefill = FUSED_PREFILL
        self.fused_prefill = fused_prefill and self.fused is not None
        log.info(
            "decode steps as one sequence: %s; a chat row's prompt in the batch's pass: %s",
            "on" if self.fused is not None else "off",
            "on" if self.fused_prefill else "off",
        )
        if self.fused is not None:
            log.info("decode pass: %s", self.fused.describe())
        self.max_context = context_length(model)
        self.vocab_size = vocab_size(model, tokenizer)
        self.tool_format = tool_format(tokenizer)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._special = special_ids(tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size, self._eos, self.counters)
        self._kw = dict(
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_step_size,
            max_kv_size=max_kv_size,
            stop_tokens=[[t] for t in sorted(self._eos)],
        )
        self._rows: dict[int, Row] = {}  # by mlx-lm uid: the rows running, and paused
        self._running = 0  # of those, the rows in the batch
        self._entries = LogprobEntries(tokenizer)
        self.reset()

    @classmethod
    def for_worker(cls, config: WorkerConfig) -> Engine:
        """The engine a worker's config asks for: its model, batch and prompt cache,
        warmed up unless it says not to."""
        engine = cls.load(
            config.model,
            max_batch=config.max_batch,
            prompt_cache_bytes=config.prompt_cache_bytes,
            paused_kv_bytes=config.paused_kv_bytes,
            prefill_buckets=config.prefill_buckets,
            fused_prefill=config.fused_prefill,
        )
        if config.warm_up:
            from mlxq.worker.warmup import warm_up

            try:
                warm_up(engine)
            except Exception as e:  # a model it cannot warm still serves; start clean
                log.warning("warm-up skipped: %s: %s", type(e).__name__, e)
                engine.reset()
                engine.counters.reset()
        return engine

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
        self._gen = Generator(
            self.model,
            self.sampler,
            self.counters,
            keep_caches=self.prompt_cache is not None,
            buckets=self.prefill_buckets,
            head=self.head,
            fused=self.fused,
            fused_prefill=self.fused_prefill,
            **self._kw,
        )
        for row in self._rows.values():
            row.status = RowStatus.FINISHED
        self._rows.clear()
        self._running = 0

    @property
    def prompt_cache_bytes(self) -> int:
        """Bytes the prompt cache holds now."""
        return 0 if self.prompt_cache is None else self.prompt_cache.nbytes

    @property
    def active(self) -> int:
        """Rows in the batch (running; paused rows are not)."""
        return self._running

    @property
    def free_slots(self) -> int:
        return self.max_batch - self._running

    def steps_left(self) -> list[int]:
        """Each running row's most decode steps still to run (its ``max_tokens`` left,
        and the step a riding row is fed its last prompt token; it may end sooner)."""
        riding = self._gen.riding()
        return [
            r.job.request.max_tokens - r.generated + (uid in riding)
            for uid, r in self._rows.items()
            if r.status is RowStatus.RUNNING
        ]

    def encode(self, req: GenerationRequest) -> list[int]:
        """The request's prompt as token ids, checked against the model
        (:func:`mlxq.worker.encode.encode`); thread-safe: the worker tokenizes ahead of
        need, off the decode thread."""
        return encode(
            self.tokenizer,
            req,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            grammars=self.grammars,
        )

    def add(self, jobs: Sequence[Job], *, ride: bool = False) -> None:
        """Queue jobs' prompts for the next prefill, all in one insert (one row per
        choice); they decode from then on. ``ride``: their first token comes from the
        batch's next decode step, not a pass of their own (:meth:`Generator.ride`): for
        jobs no one waits on the first token of."""
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
        if ride:
            self._gen.ride(uids)
        for uid, (job, i), stop in zip(uids, rows, stops, strict=True):
            detok = Detokenizer(self.tokenizer, self._special)
            c = job.request.constraint
            grammar = self.grammars.row(c) if c is not None else None
            self.counters.constrained_rows += grammar is not None
            self._join(Row(uid, job, i, detok, StopMatcher(job.request.stop), stop, grammar))
        self.counters.prompt_tokens += sum(len(job.prompt_ids) for job, _ in rows)

    def _join(self, row: Row) -> None:
        """A row is in the batch under its uid: the sampler learns what it asked for."""
        req = row.job.request
        sampling = dataclasses.replace(req.sampling, seed=req.choice_seeds[row.index])
        # Stop token ids alone change no logit: such a row costs the step nothing.
        logits = req.logits if req.logits is not None and req.logits.active else None
        top = req.top_logprobs if req.logprobs else None
        self.sampler.add(row.uid, sampling, logits, top, row.generated, row.grammar)
        row.status = RowStatus.RUNNING
        self._rows[row.uid] = row
        self._running += 1

    def pause(self, jobs: Iterable[Job], *, keep_kv: bool = True) -> int:
        """Take jobs' rows out of the batch for now; each keeps its detokenizer, stop
        matcher and counters, and (``keep_kv``) its KV state, so :meth:`resume` goes on
        where it stopped. A row that rides and was not yet fed its last token
        (:meth:`riding`) stays: its KV lacks that token. Returns how many rows were
        paused."""
        rows = self._rows_of(jobs, RowStatus.RUNNING)
        riding = self._gen.riding()
        if any(r.uid in riding for r in rows):
            log.warning("a row not yet fed its last token was asked to pause; it runs on")
            rows = [r for r in rows if r.uid not in riding]
        kept = self._gen.take_out([row.uid for row in rows]) if rows else {}
        for row in rows:
            self.sampler.drop(row.uid)
            self._running -= 1
            row.status = RowStatus.PAUSED
            row.kv, row.kv_tokens = kept.get(row.uid, (None, None))
            if not keep_kv:
                row.kv = None
        self.counters.preemptions += len(rows)
        fit_paused_kv(self._rows.values(), self.paused_kv_budget)
        return len(rows)

    @property
    def paused(self) -> int:
        """Rows paused now."""
        return sum(r.status is RowStatus.PAUSED for r in self._rows.values())

    @property
    def paused_kv_bytes(self) -> int:
        """Bytes of KV state the paused rows keep."""
        return sum(kv_nbytes(r.kv) for r in self._rows.values() if r.status is RowStatus.PAUSED)

    def resume(self, jobs: Iterable[Job]) -> None:
        """Put paused rows back into the batch. A row with its KV feeds its last token
        again on that state (trimmed by one); one without prefills its prompt and what it
        emitted; one paused in its prefill starts it again. Its next token is the one it
        would have sampled unpaused."""
        rows = self._rows_of(jobs, RowStatus.PAUSED)
        if not rows:
            return
        prompts, caches, before = [], [], []
        for row in rows:
            tokens = row.kv_tokens or row.job.prompt_ids
            kv = row.kv if row.kv is not None and all(c.is_trimmable() for c in row.kv) else None
            if kv is not None:
                for c in kv:
                    c.trim(1)
            elif row.kv_tokens is not None:
                self.counters.resume_tokens_recomputed += len(tokens)
            prompts.append(tokens[-1:] if kv is not None else tokens)
            caches.append(kv)
            before.append(tokens[:-1] if kv is not None else [])
            self._rows.pop(row.uid)
            row.kv = row.kv_tokens = None
        uids = self._gen.insert(
            prompts,
            max_tokens=[row.job.request.max_tokens - row.generated for row in rows],
            caches=caches,  # type: ignore[arg-type]  # None: mlx-lm makes a fresh one
            all_tokens=before,
            stop_sequences=[StopSequences([[t] for t in sorted(r.stop_tokens)]) for r in rows],
        )
        self._gen.ride(uids)  # no one waits on a resumed row's next token: no pass of its own
        for uid, row in zip(uids, rows, strict=True):
            row.uid = uid
            self._join(row)
        self.counters.resumes += len(rows)

    def riding(self) -> set[str]:
        """The jobs with a row that rides and was not yet fed its last token by a decode
        step, so it may not pause yet."""
        return {self._rows[u].job.id for u in self._gen.riding() if u in self._rows}

    def _rows_of(self, jobs: Iterable[Job], status: RowStatus) -> list[Row]:
        ids = {j.id for j in jobs}
        return [r for r in self._rows.values() if r.job.id in ids and r.status is status]

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
        ids = {j.id for j in jobs}
        rows = [row for row in self._rows.values() if row.job.id in ids]
        running = [row.uid for row in rows if row.status is RowStatus.RUNNING]
        if running:
            self._gen.remove(running)
        for row in rows:
            self._forget(row)

    def step(self) -> list[Delta]:
        """Run one scheduling step (decode, then admit prefill work). Returns what each
        row made, one delta per row that sampled a token; a row whose delta has a
        ``finish_reason`` left the batch."""
        stages = self.counters.stages
        with stages.on("step_other"):  # mlx-lm's own bookkeeping around the passes
            _, responses = self._gen.next()
        deltas: list[Delta] = []
        with stages.on("detokenize"):
            for r in responses:
                row = self._rows.get(r.uid)
                if row is not None:
                    deltas.append(self._on_token(row, r.token, r.finish_reason, r.logprobs))
        with stages.on("prompt_cache"):
            self._keep(
                (r.all_tokens, r.prompt_cache) for r in responses if r.finish_reason is not None
            )
        self.counters.tokens_generated += len(responses)
        return deltas

    def _on_token(self, row: Row, token: int, finish: str | None, logprob: Any) -> Delta:
        row.generated += 1
        detok = row.detok
        stop_token = finish == "stop" and token in row.stop_tokens
        if not stop_token:  # a stop token is no part of the text
            detok.add_token(token)
        if finish is not None:
            detok.finalize()
        segment = detok.last_segment
        ids, lps = ([], []) if stop_token else ([token], [])
        if not stop_token and isinstance(logprob, TokenLogprob):
            # The token's text is what it added to the completion, so a choice's tokens
            # joined give its text (a byte of a multi-byte character adds none yet).
            lps = [self._entries.entry(logprob, segment)]
        text, stopped = row.stops.feed(segment)
        if stopped and finish is None:
            kept = self._gen.remove([row.uid], return_prompt_caches=self.prompt_cache is not None)
            if row.uid in kept:
                cache, tokens = kept[row.uid]
                self._keep([(tokens, cache)])
            finish = "stop"
        elif finish is not None:
            text += row.stops.flush()
        if finish is not None:
            self._forget(row)
        return Delta(row.job, row.index, text, ids, lps, finish, row.generated)

    def _forget(self, row: Row) -> None:
        self._rows.pop(row.uid, None)
        if row.status is RowStatus.RUNNING:
            self._running -= 1
            self.sampler.drop(row.uid)
        row.status = RowStatus.FINISHED
        row.kv = row.kv_tokens = None
