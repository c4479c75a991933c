"""The one record a job is inside the worker, from its claim to its committed end.

A :class:`Job` is created when the worker claims it (BUFFERED: decoded, tokenized,
waiting for a row), moves to RUNNING when it takes a batch row, and to ENDING when it
leaves the batch (its row is free at once; its end is being committed behind it). It owns
everything about that run: request, prompt tokens, rq execution, attempt, deadline, the
text made so far, and it alone numbers its chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mlxq.batching.stops import StopMatcher
from mlxq.producer.codec import Chunk, first_seq
from mlxq.producer.params import GenerationRequest, ParamKey


class Status(str, Enum):
    BUFFERED = "buffered"
    RUNNING = "running"
    ENDING = "ending"


@dataclass(slots=True, eq=False)
class Job:
    """One claimed job.

    Args:
        id: The rq job id.
        request: Its checked payload.
        prompt_ids: Its prompt, tokenized (or its chat, rendered and tokenized).
        attempts_before: Runs started before this claim (the job hash's count).
        clean_requeues: Of those, runs handed back by a clean shutdown (not failures).
        enqueued_at: When it entered the queue (unix seconds), if known.
        epoch: The worker's lease epoch it was claimed under.
    """

    id: str
    request: GenerationRequest
    prompt_ids: list[int]
    attempts_before: int = 0
    clean_requeues: int = 0
    enqueued_at: float | None = None
    epoch: int = 0
    status: Status = Status.BUFFERED
    arrived_step: int = 0
    claimed_at: float = field(default_factory=time.monotonic)
    attempt: int = 0
    execution_id: str = ""
    started_at: float = 0.0  # unix seconds, as rq records it
    started_mono: float = 0.0
    first_token_at: float | None = None
    deadline: float | None = None  # time.monotonic() past which it fails (its timeout)
    seq: int = 0  # the last seq handed out
    generated: int = 0  # tokens sampled, end-of-sequence included (usage counts it)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    detok: Any = None
    stops: StopMatcher | None = None
    finish_reason: str | None = None
    _out_text: list[str] = field(default_factory=list)
    _out_ids: list[int] = field(default_factory=list)
    _streamed: bool = False
    last_chunk_at: float = 0.0
    ttl_refreshed_at: float = 0.0
    note: str = ""  # why it failed or went back, for its log line
    timed_out: bool = False  # it ran past its timeout (it ends failed, logged timed_out)

    @property
    def job_id(self) -> str:
        return self.id

    @property
    def key(self) -> ParamKey:
        return self.request.sampling.key()

    @property
    def failed_attempts(self) -> int:
        """Runs that ended because a worker died or a batch failed (not clean handovers)."""
        return self.attempts_before - self.clean_requeues

    @property
    def has_output(self) -> bool:
        return bool(self._out_text or self._out_ids)

    def start(self, execution_id: str, detok: Any) -> list[Chunk]:
        """Take a batch row. Returns the chunks to write first: a ``reset`` when an
        earlier run streamed text listeners must now discard."""
        self.status = Status.RUNNING
        self.attempt = self.attempts_before + 1
        self.execution_id = execution_id
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        timeout = self.request.timeout
        self.deadline = None if timeout is None else self.started_mono + timeout
        self.seq = first_seq(self.attempt) - 1
        self.detok = detok
        self.stops = StopMatcher(self.request.stop)
        if self.attempt == 1:
            return []
        return [self._next(kind="reset")]

    def emit(self, text: str, token_ids: list[int]) -> None:
        """Output made by one step, kept until the next chunk goes out."""
        if text:
            self._out_text.append(text)
            self.text.append(text)
        if token_ids:
            self._out_ids.extend(token_ids)
            self.token_ids.extend(token_ids)

    def chunk_due(self, now: float, interval: float) -> Chunk | None:
        """The chunk to write now, if any: its first output at once, later output once
        ``interval`` seconds passed since the last chunk."""
        if not self.has_output or (self._streamed and now - self.last_chunk_at < interval):
            return None
        self._streamed = True
        self.last_chunk_at = now
        if self.first_token_at is None:
            self.first_token_at = now
        return self._take()

    def finish(self, finish_reason: str, usage: dict[str, int]) -> Chunk:
        """Its last chunk: what is left of its output, with the reason it ended."""
        self.status = Status.ENDING
        self.finish_reason = finish_reason
        return self._take(finish_reason=finish_reason, usage=usage)

    def fail(self, reason: str) -> Chunk:
        self.status = Status.ENDING
        self.finish_reason = "error"
        self._out_text.clear()
        self._out_ids.clear()
        return self._next(kind="error", finish_reason="error", error=reason)

    def cancel(self) -> Chunk:
        self.status = Status.ENDING
        self.finish_reason = "canceled"
        return self._take(finish_reason="canceled")

    def canceled_instead(self, final: Chunk) -> Chunk:
        """The last chunk to write in place of ``final`` should a cancel win the race to
        the job's end (same seq)."""
        return Chunk(final.seq, final.text, final.token_ids, "canceled", attempt=self.attempt)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.generated}

    def result(self) -> dict[str, Any]:
        """The rq return value. Built from the very text streamed, so the two are equal."""
        return {
            "text": "".join(self.text),
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage(),
        }

    def _take(self, **kw: Any) -> Chunk:
        text, ids = "".join(self._out_text), self._out_ids
        self._out_text, self._out_ids = [], []
        return self._next(text=text, token_ids=ids, **kw)

    def _next(self, **kw: Any) -> Chunk:
        # The one place a chunk of this job gets its seq.
        self.seq += 1
        return Chunk(self.seq, attempt=self.attempt, **kw)
