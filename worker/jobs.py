"""The one record a job is inside the worker, from its claim to its committed end.

A :class:`Job` is created when the worker claims it (BUFFERED: decoded, tokenized,
waiting for rows), moves to RUNNING when its rows join the batch, and to ENDING when it
leaves the batch (its rows are free at once; its end is being committed behind it). It
owns everything about that run: request, prompt tokens, rq execution, attempt, deadline,
one :class:`Choice` per sample (``n``) with the text made so far, and it alone numbers
its chunks. The engine's rows decode for it; each step's output reaches it as
:class:`~mlxq.worker.rows.Delta` records (:meth:`Job.apply`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mlxq.producer.codec import Chunk, first_seq
from mlxq.producer.params import GenerationRequest, ParamKey
from mlxq.worker.rows import Delta


class Status(str, Enum):
    BUFFERED = "buffered"
    RUNNING = "running"
    PAUSED = "paused"  # out of the batch for a higher level's job; its KV kept or dropped
    ENDING = "ending"


@dataclass(slots=True, eq=False)
class Choice:
    """One sample of the job's prompt: one batch row's output."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    generated: int = 0  # tokens sampled, end-of-sequence included (usage counts it)
    closed: bool = False  # its last chunk went out
    out_text: list[str] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def has_output(self) -> bool:
        return bool(self.out_text or self.out_ids)

    @property
    def due(self) -> bool:
        """It has output to send, or an end not yet sent."""
        return self.has_output or (self.finish_reason is not None and not self.closed)

    def emit(self, text: str, token_ids: list[int], logprobs: list[dict[str, Any]]) -> None:
        if text:
            self.out_text.append(text)
            self.text.append(text)
        if token_ids:
            self.out_ids.extend(token_ids)
            self.token_ids.extend(token_ids)
        if self.logprobs is not None and logprobs:
            self.out_logprobs.extend(logprobs)
            self.logprobs.extend(logprobs)

    def take(self) -> tuple[str, list[int], list[dict[str, Any]] | None]:
        """What it made since its last chunk."""
        text, ids, lps = "".join(self.out_text), self.out_ids, self.out_logprobs
        self.out_text, self.out_ids, self.out_logprobs = [], [], []
        return text, ids, (lps if self.logprobs is not None else None)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "text": "".join(self.text),
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


def apply_deltas(deltas: Iterable[Delta]) -> list[Job]:
    """Hand each delta to its job. Returns the jobs that made output, each once, in the
    order of their first delta."""
    touched: dict[str, Job] = {}
    for delta in deltas:
        delta.job.apply(delta)
        touched[delta.job.id] = delta.job
    return list(touched.values())


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
        queue: The queue it was claimed from (its rq ``origin``).
    """

    id: str
    request: GenerationRequest
    prompt_ids: list[int]
    attempts_before: int = 0
    clean_requeues: int = 0
    enqueued_at: float | None = None
    epoch: int = 0
    queue: str = ""
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
    choices: list[Choice] = field(default_factory=list)
    finish_reason: str | None = None
    _streamed: bool = False
    last_chunk_at: float = 0.0
    ttl_refreshed_at: float = 0.0
    note: str = ""  # why it failed or went back, for its log line
    timed_out: bool = False  # it ran past its timeout (it ends failed, logged timed_out)
    pauses: int = 0  # times it was paused for a higher level's job
    charged: int = 0  # tokens its queue's share was charged for it (levels.Shares)

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
    def generated(self) -> int:
        return sum(c.generated for c in self.choices)

    @property
    def text(self) -> list[str]:
        """The first choice's text so far (the only one unless ``n > 1``)."""
        return self.choices[0].text if self.choices else []

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def has_output(self) -> bool:
        return any(c.has_output for c in self.choices)

    @property
    def all_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def start(self, execution_id: str) -> list[Chunk]:
        """Take batch rows. Returns the chunks to write first: a ``reset`` when an earlier
        run streamed text listeners must now discard."""
        self.status = Status.RUNNING
        self.attempt = self.attempts_before + 1
        self.execution_id = execution_id
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        timeout = self.request.timeout
        self.deadline = None if timeout is None else self.started_mono + timeout
        self.seq = first_seq(self.attempt) - 1
        self.choices = [
            Choice(i, logprobs=[] if self.request.logprobs else None) for i in range(self.request.n)
        ]
        if self.attempt == 1:
            return []
        return [self._next(kind="reset")]

    def rebase(self, attempt: int) -> list[Chunk]:
        """Go on under a new run number (the Redis master changed and its log may lack
        chunks): the chunks that open it, a ``reset`` and each choice's whole text so far,
        so a listener clears what it showed and gets the full text, never a gap."""
        self.attempt = attempt
        self.seq = first_seq(attempt) - 1
        out = [self._next(kind="reset")]
        for c in self.choices:
            c.out_text, c.out_ids, c.out_logprobs = [], [], []
            kw: dict[str, Any] = {"finish_reason": c.finish_reason if c.closed else None}
            if len(self.choices) > 1:
                kw["done"] = False
            lps = list(c.logprobs) if c.logprobs is not None else None
            text, ids = "".join(c.text), list(c.token_ids)
            out.append(self._next(text=text, token_ids=ids, index=c.index, logprobs=lps, **kw))
        return out

    def apply(self, delta: Delta) -> None:
        """Output one step made for one choice, kept until its next chunk goes out; the
        choice ends with the delta's ``finish_reason``."""
        choice = self.choices[delta.index]
        choice.generated = delta.generated
        choice.emit(delta.text, delta.token_ids, delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason

    def chunks_due(self, now: float, interval: float) -> list[Chunk]:
        """The chunks to write now: its first output at once, later output once
        ``interval`` seconds passed since the last chunk (one per choice with output)."""
        if not self.has_output or (self._streamed and now - self.last_chunk_at < interval):
            return []
        self._streamed = True
        self.last_chunk_at = now
        if self.first_token_at is None:
            self.first_token_at = now
        return [self._take(c) for c in self.choices if c.due]

    def finish(self) -> tuple[list[Chunk], Chunk]:
        """Every choice ended: the chunks still owed, and the job's last chunk (with the
        usage) to commit with its end."""
        self.status = Status.ENDING
        self.finish_reason = self.choices[0].finish_reason or "stop"
        owed = [c for c in self.choices if c.due] or [self.choices[-1]]
        before = [self._take(c) for c in owed[:-1]]
        return before, self._take(owed[-1], usage=self.usage(), done=True)

    def fail(self, reason: str) -> Chunk:
        self.status = Status.ENDING
        self.finish_reason = "error"
        for c in self.choices:
            c.take()
        return self._next(kind="error", finish_reason="error", error=reason, done=True)

    def cancel(self) -> Chunk:
        self.status = Status.ENDING
        self.finish_reason = "canceled"
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "canceled"
        return self._take(self.choices[0], finish_reason="canceled", done=True)

    def canceled_instead(self, final: Chunk) -> Chunk:
        """The last chunk to write in place of ``final`` should a cancel win the race to
        the job's end (same seq)."""
        return Chunk(
            final.seq,
            final.text,
            final.token_ids,
            "canceled",
            attempt=self.attempt,
            index=final.index,
            logprobs=final.logprobs,
            done=True,
        )

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.generated}

    def result(self) -> dict[str, Any]:
        """The rq return value. Built from the very text streamed, so the two are equal."""
        first = self.choices[0].result()
        out = {
            "text": first["text"],
            "token_ids": first["token_ids"],
            "finish_reason": first["finish_reason"],
            "usage": self.usage(),
        }
        if "logprobs" in first:
            out["logprobs"] = first["logprobs"]
        if len(self.choices) > 1:
            out["choices"] = [c.result() for c in self.choices]
        return out

    def _take(self, choice: Choice, **kw: Any) -> Chunk:
        text, ids, lps = choice.take()
        kw.setdefault("finish_reason", choice.finish_reason)
        if kw["finish_reason"] is not None:
            choice.closed = True
        if len(self.choices) > 1:
            kw.setdefault("done", False)
        return self._next(text=text, token_ids=ids, index=choice.index, logprobs=lps, **kw)

    def _next(self, **kw: Any) -> Chunk:
        # The one place a chunk of this job gets its seq.
        self.seq += 1
        return Chunk(self.seq, attempt=self.attempt, **kw)


def unstarted_error(attempts_before: int, reason: str) -> Chunk:
    """The error chunk of a job that fails before it starts: it opens a run of its own,
    after the last one."""
    attempt = attempts_before + 1
    return Chunk(
        first_seq(attempt), kind="error", finish_reason="error", attempt=attempt, error=reason
    )
