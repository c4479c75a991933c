"""The sweep: a bounded window of jobs in Redis, filled from the input as it is read.

One loop, one thread: fill the window (read lines, journal the new jobs' ids, submit them
with ``submit_many``, one round trip per queue), wait, then read the status of every job
in flight in one pipelined round trip and the results of those that ended in another,
and append their output lines. Results are written as they come, not in input order
(OpenAI's readers match by ``custom_id``). The wait adapts so a poll finds about a quarter
of the window ended: few round trips while jobs are slow, no empty window when they are
fast.

Crash safety, with :mod:`mlxq.producer.batch.files`: a job's id is journaled (fsync)
before it is submitted, and its output line written only after its result was read, so
a rerun with the same output skips what was answered, re-attaches to what was submitted
(queued, running or ended while nobody watched) and submits the rest; jobs canceled by an
interrupted run, or whose records are gone, are submitted again.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import redis

from mlxq.producer.batch import jobs, records
from mlxq.producer.batch.config import BatchConfig
from mlxq.producer.batch.files import Journal, LineFile
from mlxq.producer.batch.jobs import LIVE, Flight
from mlxq.producer.batch.lines import LineChecker, LineError, LineReader, LongLine, Request
from mlxq.producer.batch.progress import Tally
from mlxq.producer.batch.stop import Interrupted, StopFlag, retry
from mlxq.producer.client import Client
from mlxq.producer.connection import TRANSIENT, Outage, backoff
from mlxq.producer.errors import MlxqError
from mlxq.producer.job import cancel_job
from mlxq.producer.openai_api import completion_body
from mlxq.producer.result import Result, reason_of, value_of

log = logging.getLogger("mlxq.batch")
T = TypeVar("T")

MIN_POLL_S = 0.02
MAX_POLL_S = 0.25
#: Output lines are fsynced this often (and at the end): a kill of this process loses
#: nothing flushed; a crash of the machine at most this much, which the rerun restores
#: from the journal and Redis.
SYNC_S = 1.0
#: Times one line's job is submitted again when its records vanished before it ended.
MAX_TRIES = 3
#: Error lines buffered at most before they are written, while reading past bad lines.
ERROR_FLUSH = 1024


class Sweep:
    """One run over an input file; see the module docstring.

    Args:
        cfg: What to run.
        connection: Redis (made with ``retries=0``: a submit is never repeated blindly).
        out: The output file; ``err`` the errors file (the same object when none).
        journal: Loaded; ``inherited`` is what it held (``custom_id -> job id``).
        checker: Checks lines (knows what earlier runs answered).
        reported: Input lines an earlier run reported as unrunnable.
        tally: Counts, shown by ``on_progress``.
        stop: The stop flag (signals).
    """

    def __init__(
        self,
        cfg: BatchConfig,
        connection: redis.Redis,
        out: LineFile,
        err: LineFile,
        journal: Journal,
        inherited: dict[str, str],
        checker: LineChecker,
        reported: set[int],
        tally: Tally,
        stop: StopFlag,
        on_progress: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg, self.redis = cfg, connection
        self.out, self.err, self.journal = out, err, journal
        self.inherited, self.checker, self.reported = inherited, checker, reported
        self.tally, self.stop, self.on_progress = tally, stop, on_progress
        self.reader: LineReader | None = None
        self.lines: Iterator[tuple[int, bytes | LongLine]] = iter(())
        self.input_size: int | None = None
        self.exhausted = False
        #: Why the input ended short of what it held at the start (None: it did not).
        self.short: str | None = None
        self.flights: dict[str, Flight] = {}
        self.clients: dict[str, Client] = {}
        self.tools = jobs.ToolFormats(connection)
        self.outage = Outage(log, "sweep")
        self.poll_s = MAX_POLL_S
        self._rate = 0.0  # jobs ended per second, smoothed
        self._polled = time.monotonic()
        self._synced = time.monotonic()

    # -- the loop ----------------------------------------------------------------------

    def run(self, reader: LineReader, input_size: int | None = None) -> bool:
        """Run until every line read is answered or reported (True), or a stop (False).

        Args:
            reader: The input's lines.
            input_size: The input's size in bytes when the run started (None: a stream):
                an input that ends before it was truncated meanwhile (:attr:`short`).

        Raises:
            OSError: an output, errors or journal write failed (a full disk), naming the
                file; the jobs in flight are left running, journaled, for a rerun.
        """
        self.reader, self.lines, self.input_size = reader, iter(reader), input_size
        self.stop.install()
        try:
            while not self.stop.is_set():
                self._fill()
                if self.exhausted and not self.flights:
                    break
                if self.stop.wait(self.poll_s):
                    break
                self._collect()
                self._maybe_sync()
                self.on_progress()
        except Interrupted:
            pass
        finally:
            self.stop.restore()
        return not self.stop.is_set()

    def finish(self) -> None:
        """After a complete run: output durable, then the journal goes."""
        self.out.sync()
        self.err.sync()
        self.journal.remove()

    def interrupt(self) -> tuple[int, bool]:
        """After a stop: cancel what is in flight (unless ``detach``), write what ended.

        Returns:
            (jobs left in flight, whether they were canceled).
        """
        canceled = False
        if self.flights and not self.cfg.detach:
            try:
                for job_id in list(self.flights):
                    cancel_job(self.redis, job_id)
                canceled = True
            except TRANSIENT as e:
                log.warning("could not cancel the jobs in flight (%s): they stay queued", e)
        with contextlib.suppress(*TRANSIENT):
            self._collect(settle=True)
        self.out.sync()
        self.err.sync()
        self.journal.close()
        return len(self.flights), canceled

    def abandon(self) -> None:
        """After a failed write: keep what can be kept, quietly. The jobs in flight stay
        journaled (and running) for a rerun to collect."""
        for f in (self.out, self.err):
            with contextlib.suppress(OSError):
                f.sync()
        self.journal.close()

    # -- filling the window ------------------------------------------------------------

    def _fill(self) -> None:
        room = self.cfg.max_in_flight - len(self.flights)
        fresh: list[Request] = []
        attach: list[tuple[Request, str]] = []
        errors: list[dict[str, Any]] = []
        while len(fresh) + len(attach) < room and not self.exhausted:
            try:
                line, raw = next(self.lines)
            except StopIteration:
                self.exhausted = True
                self._at_end()
                break
            item = self.checker.check(line, raw)
            if isinstance(item, LineError):
                if item.line not in self.reported:
                    errors.append(records.line_error(item))
                    self.tally.invalid += 1
                if len(errors) >= ERROR_FLUSH:
                    self.err.write(errors)
                    errors = []
            elif item is not None:
                job_id = self.inherited.pop(item.custom_id, None)
                if job_id is None:
                    fresh.append(item)
                else:
                    attach.append((item, job_id))
        self.err.write(errors)
        if attach:
            fresh += self._attach(attach)
        if fresh:
            self._submit([Flight(r, uuid.uuid4().hex) for r in fresh])

    def _at_end(self) -> None:
        """The input ended: say whether it was whole, and settle the journaled jobs of an
        earlier run that no line of it named."""
        read = self.reader.offset if self.reader is not None else 0
        if self.input_size is not None and read < self.input_size:
            self.short = (
                f"the input ended at byte {read} of the {self.input_size} it held when this "
                "run started: it was truncated or replaced meanwhile, and the lines that "
                "followed were not read"
            )
            # The earlier run's jobs of those lines stay journaled, for a rerun with the
            # whole input to collect.
            return
        if self.inherited:
            self._cancel_strays()

    def _cancel_strays(self) -> None:
        """Journaled jobs whose ``custom_id`` this input has no runnable line for (an
        earlier run's input was another file): cancel those still queued or running, and
        say what became of them all, rather than drop them silently."""
        strays = list(self.inherited.items())
        self.inherited.clear()
        states = self._states([j for _, j in strays])
        live = [j for (_, j), s in zip(strays, states, strict=True) if s == LIVE]
        for job_id in live:
            self._retry(partial(cancel_job, self.redis, job_id))
        ended = sum(s is not None and s != LIVE for s in states)
        shown = ", ".join(repr(c) for c, _ in strays[:3]) + (", ..." if len(strays) > 3 else "")
        log.warning(
            "%s: the journal names %d job(s) an earlier run submitted for custom_ids this "
            "input has no runnable line for (%s): was that run's input another file? %d "
            "still queued or running: canceled; %d had ended: their answers are not written; "
            "%d never reached Redis or are gone",
            self.journal.path,
            len(strays),
            shown,
            len(live),
            ended,
            len(strays) - len(live) - ended,
        )

    def _attach(self, pairs: Sequence[tuple[Request, str]]) -> list[Request]:
        """Take over jobs an earlier run submitted; returns the lines to submit anew
        (never submitted, canceled by that run, or gone)."""
        states = self._states([j for _, j in pairs])
        again = []
        for (req, job_id), state in zip(pairs, states, strict=True):
            if state is None or state == "canceled":
                again.append(req)
            else:
                self.flights[job_id] = Flight(req, job_id, inherited=True)
        return again

    def _submit(self, flights: Sequence[Flight]) -> None:
        self.journal.record((f.request.custom_id, f.job_id) for f in flights)
        by_queue: dict[str, list[Flight]] = {}
        for f in flights:
            by_queue.setdefault(f.request.queue, []).append(f)
        for queue, group in by_queue.items():
            self._submit_to(self._client(queue), group)

    def _submit_to(self, client: Client, group: list[Flight]) -> None:
        """Submit ``group`` (journaled) to one queue; a job refused by submit's checks
        becomes an error line (the others still go)."""
        pending, failures = group, 0
        while pending:
            try:
                client.submit_many(
                    [f.request.req.submit for f in pending], job_ids=[f.job_id for f in pending]
                )
                break
            except TRANSIENT as e:
                # Sent or not? Each slice is one transaction: what exists went through.
                self.outage.failed(e)
                failures += 1
                if self.stop.wait(backoff().compute(failures)):
                    raise Interrupted from None
                there = self._states([f.job_id for f in pending])
                pending = [f for f, s in zip(pending, there, strict=True) if s is None]
            except ValueError as e:  # a check of submit's that parse_request does not make
                if len(pending) > 1:
                    for f in pending:  # find the one(s) at fault
                        self._submit_to(client, [f])
                else:
                    r = pending[0].request
                    error = LineError(r.line, r.custom_id, "invalid_request", str(e))
                    self.err.write([records.line_error(error)])
                    self.tally.invalid += 1
                handled = {f.job_id for f in pending}
                group = [f for f in group if f.job_id not in handled]
                break
        self.outage.ok()
        for f in group:
            self.flights[f.job_id] = f

    def _client(self, queue: str) -> Client:
        client = self.clients.get(queue)
        if client is None:
            client = self.clients[queue] = Client(connection=self.redis, queue=queue)
            try:
                served = self._retry(lambda: jobs.served(self.redis, queue))
            except redis.ResponseError as e:  # a roll of another type: only advice is lost
                log.warning(
                    "could not tell whether a live worker serves queue %r (%s): going on", queue, e
                )
                served = True
            if not served:
                log.warning("no live worker serves queue %r: its jobs wait until one does", queue)
        return client

    # -- collecting results ------------------------------------------------------------

    def _collect(self, settle: bool = False) -> None:
        """Write the output lines of the jobs that ended. ``settle``: after a stop, only
        those that finished or failed (the rest are the next run's)."""
        ids = list(self.flights)
        states = self._states(ids)
        ended = [(j, s) for j, s in zip(ids, states, strict=True) if s != LIVE]
        self._pace(len(ended))
        if settle:
            ended = [(j, s) for j, s in ended if s in ("finished", "failed")]
        if not ended:
            return
        need = [j for j, s in ended if s in ("finished", "failed")]
        fields = dict(zip(need, self._retry(lambda: jobs.results(self.redis, need)), strict=True))
        out, again, now = [], [], int(time.time())
        for job_id, state in ended:
            f = self.flights.pop(job_id)
            record = self._record(f, state, fields.get(job_id), now)
            if record is None:
                again.append(Flight(f.request, uuid.uuid4().hex, tries=f.tries + 1))
            else:
                out.append(record)
        self.out.write(out)
        self.tally.answered += len(out)
        if again:
            self._submit(again)

    def _record(
        self, f: Flight, state: str | None, fields: dict[bytes, bytes] | None, now: int
    ) -> dict[str, Any] | None:
        """The output line of an ended job, or None: submit the line again."""
        cid, job_id = f.request.custom_id, f.job_id
        retry = f.tries < MAX_TRIES
        if state == "finished":
            value = value_of(fields)
            if value is not None:
                if why := self._retry(lambda: self.tools.unread(f.request)):
                    return self._failed(cid, job_id, f"invalid job: {why}")
                try:
                    result = Result.from_value(value)
                    fmt = self.tools.of(f.request.queue)
                    body = completion_body(f.request.req, job_id, result, now, tool_format=fmt)
                except (MlxqError, KeyError, TypeError, ValueError) as e:
                    return self._failed(cid, job_id, f"unreadable result ({e})")
                self.tally.prompt_tokens += int(result.usage.get("prompt_tokens", 0))
                self.tally.completion_tokens += int(result.usage.get("completion_tokens", 0))
                return records.answer(cid, job_id, body)
            if f.inherited and retry:
                return None
            return self._failed(cid, job_id, "its result expired")
        if state == "failed":
            return self._failed(cid, job_id, reason_of(fields))
        if state == "canceled":
            # An earlier run's Ctrl-C canceled it: run it again; canceled by someone else
            # during this run: that is its answer.
            return None if f.inherited and retry else self._failed(cid, job_id, "canceled")
        if retry:  # its records are gone (expired, or a Redis that lost them)
            log.warning("job %s (custom_id %r) vanished from Redis: submitting again", job_id, cid)
            return None
        return self._failed(cid, job_id, "its records vanished from Redis")

    def _failed(self, cid: str, job_id: str, reason: str) -> dict[str, Any]:
        self.tally.failed += 1
        return records.failure(cid, job_id, reason)

    def _pace(self, ended: int) -> None:
        # Aim for a poll to find a quarter of what is in flight ended: a quarter of the window
        # while it is full, less in the sweep's tail, so the last answers are not read late.
        now = time.monotonic()
        dt, self._polled = max(now - self._polled, 1e-3), now
        self._rate = 0.7 * self._rate + 0.3 * (ended / dt)
        target = max(1, min(self.cfg.max_in_flight, len(self.flights)) // 4)
        wait = target / self._rate if self._rate > 0 else MAX_POLL_S
        self.poll_s = min(MAX_POLL_S, max(MIN_POLL_S, wait))

    def _maybe_sync(self) -> None:
        if time.monotonic() - self._synced >= SYNC_S:
            self.out.sync()
            self.err.sync()
            self._synced = time.monotonic()

    # -- Redis -------------------------------------------------------------------------

    def _states(self, ids: Sequence[str]) -> list[str | None]:
        return self._retry(lambda: jobs.states(self.redis, ids))

    def _retry(self, do: Callable[[], T]) -> T:
        return retry(do, self.outage, self.stop)
