"""The stream-follow protocol, once, with no I/O: replay, then live, gap fill, reset.

A job's chunks live in two places: its replay log (a Redis stream, the truth) and its
pub/sub channel (liveness only: a message is lost for good if nobody listens). A listener
subscribes first, reads the log from where it is, then follows the channel; any doubt (a
gap in seqs, a message it cannot decode, a notice, a quiet spell) sends it back to the
log, and an ended job's state closes a stream whose log lacks the last chunk.

:class:`Follow` is that protocol as a state machine. The sync and async clients are thin
shells that perform the action it asks for and feed it the reply, so the two can never
drift apart::

    follow = Follow(job_id, timeout)
    while (action := follow.next()) != DONE:
        if action == READ_LOG: chunks = follow.on_log(XRANGE(log, min=f"0-{follow.after}"))
        elif action == WAIT:   chunks = follow.on_message(pubsub.get(follow.wait_s()))
        elif action == STATUS: chunks = follow.on_status(HGET(job, "status"))
        elif action == END:    chunks = follow.on_end(status, result, failure reason)
        yield from chunks
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from mlxq.producer.codec import Chunk, decode_chunk, decode_message, first_seq
from mlxq.producer.errors import JobFailed, JobTimeout, NoSuchJob, PayloadError
from mlxq.producer.errors import StreamGap as StreamGap
from mlxq.producer.outcome import TERMINAL, Outcome

log = logging.getLogger("mlxq.producer")

#: How long a listener waits on its channel before it reads the log again anyway.
POLL_S = 0.5

READ_LOG, WAIT, STATUS, END, DONE = "read_log", "wait", "status", "end", "done"


class StreamCursor:
    """Where a listener is in one job's stream: dedupes and orders by ``seq``, keeps
    the deadline, and follows re-runs (see :func:`~mlxq.producer.codec.first_seq`):
    a superseded run's chunks are skipped when replayed, and a listener that already
    showed some of them gets one ``kind="reset"`` chunk, meaning "clear what you showed".

    Within a run only the next seq is accepted; a new run is accepted only from the log
    (the worker's), never on a message's word.
    """

    def __init__(self, job_id: str, timeout: float | None) -> None:
        self.job_id = job_id
        self.last = 0
        self.attempt = 0
        self.done = False
        self.shown = False
        self.gap = False
        self.text = ""  # what the caller was shown since the last reset
        self.num_tokens = 0
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def wait_s(self) -> float:
        """Seconds to block on pub/sub before reading the log again.

        Raises:
            JobTimeout: the deadline passed.
        """
        if self.deadline is None:
            return POLL_S
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise JobTimeout(f"job {self.job_id}: no end within {self.timeout} s")
        return min(POLL_S, left)

    def accept(self, chunks: Sequence[Chunk], from_log: bool) -> list[Chunk]:
        """The chunks a caller should see, in order, each once; sets ``gap`` when one
        is missing.

        Raises:
            JobFailed: on an error chunk.
        """
        if from_log:
            chunks = self._latest_run(chunks)
        out: list[Chunk] = []
        self.gap = False
        for c in chunks:
            if self.done or c.seq <= self.last:
                continue
            new_run = from_log and c.attempt > self.attempt and c.seq == first_seq(c.attempt)
            follows = c.seq == self.last + 1 and (c.attempt == self.attempt or self.last == 0)
            if not (new_run or follows):
                self.gap = True
                break
            self.last, self.attempt = c.seq, c.attempt
            if c.kind == "reset":
                if self.shown:  # the caller saw text that is now void: tell it to clear
                    self.shown, self.text, self.num_tokens = False, "", 0
                    out.append(c)
                continue
            if c.kind == "error":
                self.done = True
                raise JobFailed(self.job_id, c.error or "unknown")
            self.shown = True
            self.text += c.text
            self.num_tokens += len(c.token_ids)
            self.done = c.final
            out.append(c)
        return out

    def _latest_run(self, chunks: Sequence[Chunk]) -> Sequence[Chunk]:
        # Replayed text of a run that a later run superseded is never shown.
        starts = [
            i
            for i, c in enumerate(chunks)
            if c.attempt > self.attempt and c.seq == first_seq(c.attempt)
        ]
        return chunks[starts[-1] :] if starts else chunks


class Follow:
    """The follow protocol for one job; see the module docstring.

    Args:
        job_id: The job's id.
        timeout: Seconds to wait in all; None waits as long as it takes.
    """

    def __init__(self, job_id: str, timeout: float | None) -> None:
        self.cur = StreamCursor(job_id, timeout)
        self._action = READ_LOG
        self._ending = False  # the job ended: one last log read, then its state closes it

    @property
    def after(self) -> int:
        """Read the log from this seq on."""
        return self.cur.last + 1

    def wait_s(self) -> float:
        return self.cur.wait_s()

    def next(self) -> str:
        return DONE if self.cur.done else self._action

    def on_log(self, entries: Any) -> list[Chunk]:
        """An XRANGE reply of the job's log from :attr:`after`."""
        chunks = []
        for entry_id, fields in entries or ():
            try:
                chunks.append(decode_chunk(fields[b"c"]))
            except (PayloadError, KeyError, TypeError):
                log.warning(
                    "job %s: skipped log entry %r it cannot decode", self.cur.job_id, entry_id
                )
        out = self.cur.accept(chunks, from_log=True)
        self._action = END if self._ending else STATUS
        return out

    def on_message(self, data: bytes | None) -> list[Chunk]:
        """A pub/sub message's data, or None when the wait timed out."""
        if data is None:
            self._action = READ_LOG
            return []
        try:
            chunk = decode_message(data)
        except PayloadError:
            log.warning("job %s: skipped a channel message it cannot decode", self.cur.job_id)
            chunk = None
        if chunk is None:  # a notice (or junk): what changed is in the log and the state
            self._action = READ_LOG
            return []
        out = self.cur.accept([chunk], from_log=False)
        if self.cur.gap:
            self._action = READ_LOG
        return out

    def on_status(self, status: str | None) -> list[Chunk]:
        """The job's status (None: no such job)."""
        if status is None or status in TERMINAL:
            self._ending = True
            self._action = READ_LOG
        else:
            self._action = WAIT
        return []

    def on_end(
        self,
        status: str | None,
        text: str | None,
        token_ids: Sequence[int] | None,
        finish_reason: str | None,
        usage: dict[str, int] | None,
        reason: str | None,
    ) -> list[Chunk]:
        """Close a stream whose job ended without (readable) last chunk: canceled before
        it ran, or its log expired. ``text`` etc. are its result's, when finished.

        Raises:
            JobFailed: it failed.
            NoSuchJob: it never existed (or its records expired).
            StreamGap: chunks are missing that only the log could have given (the job
                ended, and no result holds its text).
        """
        cur = self.cur
        cur.done = True
        if cur.gap and status == Outcome.FINISHED and text is not None:
            # The log lost chunks (a failover took them, or they were refused): the result
            # holds the whole text. What was shown stands if the text goes on from it;
            # else the listener is told to clear it, then given all of it.
            if not text.startswith(cur.text):
                return self._restart(text, token_ids, finish_reason, usage)
        elif cur.gap and status not in (Outcome.FAILED, Outcome.CANCELED, None):
            raise StreamGap(
                cur.job_id,
                f"its stream lacks chunks after seq {cur.last}: "
                "they were lost or refused (read result() for the whole text)",
            )
        if status is None:
            raise NoSuchJob(f"no job {cur.job_id!r} (never submitted, or its records expired)")
        if status == Outcome.FAILED:
            raise JobFailed(cur.job_id, reason or "unknown")
        if status == Outcome.CANCELED:
            return [Chunk(seq=cur.last + 1, finish_reason="canceled", attempt=cur.attempt)]
        text, ids = text or "", list(token_ids or ())
        return [
            Chunk(
                seq=cur.last + 1,
                text=text[len(cur.text) :],
                token_ids=ids[cur.num_tokens :],
                finish_reason=finish_reason or "stop",
                usage=usage,
                attempt=cur.attempt,
            )
        ]

    def _restart(
        self,
        text: str,
        token_ids: Sequence[int] | None,
        finish_reason: str | None,
        usage: dict[str, int] | None,
    ) -> list[Chunk]:
        """A run of its own after the last one seen: a ``reset`` (if anything was shown),
        then the result's whole text as its last chunk."""
        cur = self.cur
        attempt = cur.attempt + 1
        seq = first_seq(attempt)
        out = [Chunk(seq, kind="reset", attempt=attempt)] if cur.shown else []
        last = Chunk(
            seq + 1,
            text=text,
            token_ids=list(token_ids or ()),
            finish_reason=finish_reason or "stop",
            usage=usage,
            attempt=attempt,
        )
        cur.shown, cur.text, cur.last, cur.attempt = True, text, last.seq, attempt
        return [*out, last]
