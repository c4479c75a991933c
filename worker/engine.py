"""The MLX side: mlx-lm's BatchGenerator, with every decode step sampled in one call.

mlx-lm samples a step with one call only when every row holds the same sampler
object; rows with their own samplers send the step down a per-row loop. mlxq
gives every row the same object, a :class:`RowSampler`, and tells it which
rows (by uid, in batch order) the next call samples. Two places in mlx-lm sample:
``GenerationBatch._step`` (every decode step) and ``PromptProcessingBatch.generate``
(the first token after prefill); the two small subclasses below bind the rows
there and nowhere else. Pinned to mlx-lm 0.32.2, whose ``filter`` re-indexes every
per-row list; ``tests/test_engine.py`` pins the alignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from mlxq.batching.sampler import RowParams, sample
from mlxq.batching.stops import StopMatcher
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest, SamplingParams


class RowSampler:
    """One sampler object for the whole batch that knows each row's own params.

    ``bind(uids)`` names the rows of the next call; ``__call__`` samples them all
    at once. Per-row arrays are rebuilt only when the rows change.
    """

    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}
        self._done: dict[int, int] = {}  # tokens sampled per uid before the current binding
        self._uids: list[int] = []
        self._rows: RowParams | None = None
        self._positions: Any = None
        self._calls_bound = 0
        self.calls = 0

    def add(self, uid: int, params: SamplingParams) -> None:
        self._params[uid] = params
        self._done[uid] = 0

    def drop(self, uid: int) -> None:
        self._params.pop(uid, None)
        self._done.pop(uid, None)

    def bind(self, uids: Sequence[int]) -> None:
        if uids == self._uids:  # the common case, every decode step: no copy
            return
        for u in self._uids:  # fold the calls since the last binding into each row's count
            if u in self._done:
                self._done[u] += self._calls_bound
        self._uids = list(uids)
        self._calls_bound = 0
        self._rows = RowParams.from_params([self._params[u] for u in self._uids])
        self._positions = mx.array([self._done[u] for u in self._uids], dtype=mx.uint32)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._rows is None or logprobs.shape[0] != len(self._uids):
            raise RuntimeError(f"sampler bound to {len(self._uids)} rows, got {logprobs.shape[0]}")
        self.calls += 1
        tokens: mx.array = sample(logprobs, self._rows, self._positions + self._calls_bound)
        self._calls_bound += 1
        return tokens


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


@dataclass(frozen=True, slots=True)
class Event:
    """What one step made for one job: text to stream, and the end when it ended."""

    job_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


@dataclass(slots=True)
class _Row:
    job_id: str
    detok: Any
    stops: StopMatcher
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    generated: int = 0


class Engine:
    """A model, its tokenizer and one continuous batch.

    Args:
        model: An mlx-lm model (``mlx_lm.load(path)[0]``).
        tokenizer: Its ``TokenizerWrapper``.
        max_batch: Most rows decoding at once (``completion_batch_size``).
        prefill_step_size: Prompt tokens per prefill forward pass.
        max_kv_size: Rotating KV cache size, None for the full context.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 32,
                 prefill_step_size: int = 2048, max_kv_size: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r}: must be >= 1")
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.counters = StepCounters()
        self.max_context = _context_length(model)
        self._kw = dict(completion_batch_size=max_batch, prefill_batch_size=max_batch,
                        prefill_step_size=prefill_step_size, max_kv_size=max_kv_size,
                        stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)])
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._rows: dict[int, _Row] = {}
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

    def encode(self, req: GenerationRequest) -> list[int]:
        """Tokenize a request's prompt (or render its chat through the template).

        Raises:
            PayloadError: the prompt is empty once tokenized, or with ``max_tokens``
                longer than the model's context.
        """
        tok = self.tokenizer
        if req.messages is not None:
            text = tok.apply_chat_template(list(req.messages), add_generation_prompt=True,
                                           tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt)
        if not ids:
            raise PayloadError("prompt: tokenizes to nothing")
        if self.max_context and len(ids) + req.max_tokens > self.max_context:
            raise PayloadError(f"prompt: {len(ids)} tokens + max_tokens={req.max_tokens} exceed "
                               f"the model's context of {self.max_context}")
        return list(ids)

    def add(self, job_id: str, req: GenerationRequest, prompt_ids: list[int]) -> None:
        """Queue a job's prompt for the next prefill; it decodes from then on."""
        (uid,) = self._gen.insert([prompt_ids], max_tokens=[req.max_tokens])
        self.sampler.add(uid, req.sampling)
        self._rows[uid] = _Row(job_id, self.tokenizer.detokenizer, StopMatcher(req.stop),
                               len(prompt_ids))
        self._uid_of[job_id] = uid
        self.counters.prompt_tokens += len(prompt_ids)

    def remove(self, job_ids: Sequence[str]) -> list[str]:
        """Take jobs out of the batch now (cancel, deadline); returns those it held."""
        held = [j for j in job_ids if j in self._uid_of]
        uids = [self._uid_of[j] for j in held]
        if uids:
            self._gen.remove(uids)
        for u in uids:
            self._forget(u)
        return held

    def step(self) -> list[Event]:
        """Run one scheduling step (decode, then admit prefill work); one event per row
        that made a token."""
        _, responses = self._gen.next()
        events = []
        for r in responses:
            ev = self._on_token(r.uid, r.token, r.finish_reason)
            if ev is not None:
                events.append(ev)
        self.counters.tokens_generated += len(responses)
        return events

    def _on_token(self, uid: int, token: int, finish: str | None) -> Event | None:
        row = self._rows.get(uid)
        if row is None:
            return None
        row.generated += 1
        text = ""
        if not (finish == "stop" and token in self._eos):
            row.detok.add_token(token)
            row.token_ids.append(token)
            new_ids = [token]
        else:
            new_ids = []
        if finish is not None:
            row.detok.finalize()
        text, stopped = row.stops.feed(row.detok.last_segment)
        if stopped and finish is None:
            self._gen.remove([uid])
            finish = "stop"
        elif finish is not None:
            text += row.stops.flush()
        if finish is None:
            return Event(row.job_id, text, new_ids)
        usage = {"prompt_tokens": row.prompt_tokens, "completion_tokens": row.generated}
        self._forget(uid)
        return Event(row.job_id, text, new_ids, finish, usage)

    def _forget(self, uid: int) -> None:
        row = self._rows.pop(uid, None)
        if row is not None:
            self._uid_of.pop(row.job_id, None)
        self.sampler.drop(uid)


def _context_length(model: Any) -> int | None:
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None
