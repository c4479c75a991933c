"""The MLX side: mlx-lm's BatchGenerator, every decode step sampled in one call.

mlx-lm samples a step with one call only when every row holds the same sampler object;
rows with their own samplers send the step down a per-row loop. mlxq gives every row one
:class:`~mlxq.batching.sampler.RowSampler` and binds it to the rows of the next call in
the two places mlx-lm samples: ``GenerationBatch._step`` (every decode step) and
``PromptProcessingBatch.generate`` (the first token after prefill). Pinned to mlx-lm
0.32.2, whose ``filter`` re-indexes every per-row list; ``tests/test_engine.py`` pins the
alignment.

The engine works on :class:`~mlxq.worker.jobs.Job` records: it detokenizes each row's
tokens, cuts at stop strings, and hands each job its output; it keeps no record of its own
beyond the uid of each job's row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from mlxq.batching.sampler import RowSampler
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest
from mlxq.worker.jobs import Job


@dataclass
class StepCounters:
    decode_steps: int = 0
    vectorized_steps: int = 0
    sampler_calls: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
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


class _BoundGenerationBatch(GenerationBatch):  # type: ignore[misc]
    def _step(self) -> Any:
        return _counted_step(self, super()._step)


class _BoundPromptBatch(PromptProcessingBatch):  # type: ignore[misc]
    def generate(self, tokens: list[list[int]]) -> Any:
        # The new generation batch samples its first token inside its constructor.
        return _counted_step(self, lambda: super(_BoundPromptBatch, self).generate(tokens))


class _Generator(BatchGenerator):  # type: ignore[misc]
    def __init__(self, model: Any, sampler: RowSampler, **kw: Any) -> None:
        super().__init__(model, sampler=sampler, **kw)
        self._prompt_batch = _BoundPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._generation_batch = _BoundGenerationBatch.empty(self.model, self.sampler)


class Engine:
    """A model, its tokenizer and one continuous batch of jobs.

    Args:
        model: An mlx-lm model (``mlx_lm.load(path)[0]``).
        tokenizer: Its ``TokenizerWrapper``.
        max_batch: Most rows decoding at once (``completion_batch_size``).
        prefill_step_size: Prompt tokens per prefill forward pass.
        max_kv_size: Rotating KV cache size, None for the full context.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 32,
        prefill_step_size: int = 2048,
        max_kv_size: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r}: must be >= 1")
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.counters = StepCounters()
        self.max_context = _context_length(model)
        self._kw = dict(
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_step_size,
            max_kv_size=max_kv_size,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        )
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._rows: dict[int, Job] = {}
        self._uid_of: dict[str, int] = {}
        self.reset()

    @classmethod
    def load(cls, path_or_repo: str, **kw: Any) -> Engine:
        """Load any mlx-lm model path or Hugging Face repo id."""
        from mlx_lm import load

        loaded = load(path_or_repo)
        return cls(loaded[0], loaded[1], **kw)

    def reset(self) -> None:
        """Drop every row and start a fresh generator (after an MLX error)."""
        self.sampler = RowSampler()
        self.sampler.counters = self.counters  # type: ignore[attr-defined]
        self._gen = _Generator(self.model, self.sampler, **self._kw)
        self._rows.clear()
        self._uid_of.clear()

    @property
    def active(self) -> int:
        return len(self._rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self._rows)

    def holds(self, job_id: str) -> bool:
        return job_id in self._uid_of

    def encode(self, req: GenerationRequest) -> list[int]:
        """Tokenize a request's prompt (or render its chat through the template).

        Thread-safe: the worker tokenizes ahead of need, off the decode thread.

        Raises:
            PayloadError: the prompt is empty once tokenized, or with ``max_tokens``
                longer than the model's context.
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
        return list(ids)

    def new_detokenizer(self) -> Any:
        return self.tokenizer.detokenizer

    def add(self, jobs: Sequence[Job]) -> None:
        """Queue jobs' prompts for the next prefill, all in one insert; they decode from
        then on."""
        if not jobs:
            return
        uids = self._gen.insert(
            [j.prompt_ids for j in jobs], max_tokens=[j.request.max_tokens for j in jobs]
        )
        for uid, job in zip(uids, jobs, strict=True):
            self.sampler.add(uid, job.request.sampling)
            self._rows[uid] = job
            self._uid_of[job.id] = uid
            self.counters.prompt_tokens += len(job.prompt_ids)

    def remove(self, jobs: Iterable[Job]) -> None:
        """Take jobs out of the batch now (cancel, deadline, failure)."""
        uids = [self._uid_of[j.id] for j in jobs if j.id in self._uid_of]
        if uids:
            self._gen.remove(uids)
        for u in uids:
            self._forget(u)

    def step(self) -> list[Job]:
        """Run one scheduling step (decode, then admit prefill work). Returns the jobs that
        made output; those that ended have ``finish_reason`` set and left the batch."""
        _, responses = self._gen.next()
        touched = []
        for r in responses:
            job = self._rows.get(r.uid)
            if job is not None:
                self._on_token(r.uid, job, r.token, r.finish_reason)
                touched.append(job)
        self.counters.tokens_generated += len(responses)
        return touched

    def _on_token(self, uid: int, job: Job, token: int, finish: str | None) -> None:
        job.generated += 1
        detok = job.detok
        if finish == "stop" and token in self._eos:
            ids = []
        else:
            detok.add_token(token)
            ids = [token]
        if finish is not None:
            detok.finalize()
        stops = job.stops
        assert stops is not None  # set when the job took its row
        text, stopped = stops.feed(detok.last_segment)
        if stopped and finish is None:
            self._gen.remove([uid])
            finish = "stop"
        elif finish is not None:
            text += stops.flush()
        job.emit(text, ids)
        if finish is not None:
            job.finish_reason = finish
            self._forget(uid)

    def _forget(self, uid: int) -> None:
        job = self._rows.pop(uid, None)
        if job is not None:
            self._uid_of.pop(job.id, None)
        self.sampler.drop(uid)


def _context_length(model: Any) -> int | None:
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None
