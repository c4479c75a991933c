"""The decode loop: schedule -> run -> postprocess, on the one thread that does MLX.

Each turn takes what the other threads sent (start verdicts, committed ends, cancels, a
lost lease: :mod:`mlxq.worker.messages`), takes the jobs the prefetcher made ready
(waiting up to ``window_ms`` for company when idle), admits them into free rows, runs one
engine step, and hands each job's output to the writer: chunks when due, an end when the
job left the batch. It never waits on Redis; a row is free for the next job the moment
its job ends. The threads around it are started and stopped by
:class:`mlxq.worker.process.Worker`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping

from mlxq.batching.admission import AdmissionPolicy, admit
from mlxq.batching.window import Window
from mlxq.producer.codec import Chunk
from mlxq.producer.outcome import Outcome
from mlxq.worker import messages
from mlxq.worker.bridge import Bridge
from mlxq.worker.config import WorkerConfig
from mlxq.worker.engine import Engine
from mlxq.worker.held import Held
from mlxq.worker.jobs import Job, Status, apply_deltas
from mlxq.worker.logs import log_end, log_queued, log_started
from mlxq.worker.metrics import NoMetrics
from mlxq.worker.prefetch import Prefetcher, ttl_expired
from mlxq.worker.prompt_cache import MIN_REUSE
from mlxq.worker.routing import finished_as
from mlxq.worker.sink import Sink
from mlxq.worker.writes import ChunkWrite, End, ReleaseMode, StartWrite

log = logging.getLogger("mlxq.worker")

#: A job whose runs ended this many times because a worker died or its batch failed is
#: failed instead of started again: one poison job cannot take workers down forever.
MAX_ATTEMPTS = 3
#: How often deadlines (per-job timeout, ttl) are checked.
DEADLINE_CHECK_S = 0.1
#: After stopping, how long the writer may take to commit what is left.
SETTLE_S = 10.0


class DecodeLoop:
    """The decode thread's jobs and turns; :meth:`run` serves until :meth:`stop`.

    Args:
        config: What to serve and how.
        engine: The model's batch.
        bridge: The worker's Redis (for a rejoin after a lost lease).
        inbox: Where the other threads' messages come in.
        held: The jobs this worker holds: the loop adds and settles them.
        sink: The writer.
        prefetch: Where claimed jobs come from.
    """

    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        bridge: Bridge,
        inbox: messages.Inbox,
        held: Held,
        sink: Sink,
        prefetch: Prefetcher,
    ) -> None:
        self.config, self.engine, self.bridge, self.inbox = config, engine, bridge, inbox
        self.held, self.sink, self.prefetch = held, sink, prefetch
        self.policy = AdmissionPolicy(config.max_batch, config.max_wait_steps)
        self.window = Window(config.window_ms / 1000, config.max_batch)
        self.interval = config.stream_interval_ms / 1000
        self.ttl_refresh_s = config.stream_ttl / 4
        self.fresh: set[str] = set()  # admitted since the last good step: suspects if it fails
        self.steps = 0
        self.outcomes: Counter[Outcome] = Counter()
        self.metrics: NoMetrics = NoMetrics()
        self.suspended = False  # rq's suspend key is set: admit nothing new
        self._stop = threading.Event()
        self._hard = threading.Event()
        self._next_deadline_check = 0.0

    @property
    def stopping(self) -> bool:
        """Whether a stop came: nothing new is admitted."""
        return self._stop.is_set()

    def stop(self) -> None:
        """First call: stop admitting and drain. Second: requeue what is held, now."""
        if self._stop.is_set():
            log.warning("second stop signal: requeuing what is held and exiting now")
            self._hard.set()
            return
        self._stop.set()
        log.info(
            "stopping: in-flight jobs may finish within %.0f s, then are requeued "
            "(signal again to stop at once)",
            self.config.grace_s,
        )

    def run(self) -> None:
        """Turn until stopped, then drain."""
        while not self._stop.is_set():
            self._turn()
        self._drain()

    # -- one turn ----------------------------------------------------------------------

    def _turn(self) -> None:
        self._handle_inbox()
        self._take()
        self._check_deadlines()
        self._admit()
        if self.engine.active:
            self._step()
        self._ask_prefetch()

    def _ask_prefetch(self) -> None:
        buffered = len(self.held.jobs(Status.BUFFERED))
        # A whole batch in reserve: when every row ends at once (a sweep of equal jobs),
        # the next batch is ready to prefill in one pass.
        want = self.engine.free_slots + self.config.max_batch - buffered
        self.prefetch.want = 0 if self._stop.is_set() or self.suspended else max(0, want)

    def _take(self) -> None:
        if self.suspended:  # what the prefetcher still had in flight goes back
            self._hand_back("rq suspend")
            if not self.engine.active:
                self.prefetch.wait(0.05)
            return
        if self.engine.active or self.held.jobs(Status.BUFFERED):
            self._add(self.prefetch.take())
            return
        self._ask_prefetch()
        if not self.prefetch.wait(0.05):
            return
        # Idle, and a first job came: hold a window open so a burst shares one prefill.
        self.window.open(time.monotonic())
        while True:
            self._add(self.prefetch.take())
            now = time.monotonic()
            if (
                self.window.should_close(now, len(self.held.jobs(Status.BUFFERED)))
                or self._stop.is_set()
            ):
                break
            self.prefetch.wait(self.window.remaining(now))
        self.window.close()

    def _add(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.epoch != self.bridge.epoch:
                continue  # claimed under a lease this worker lost: not its own
            if self.held.runs(job.id):
                log.warning(
                    "job %s: a second queue entry for a job this worker holds; dropped", job.id
                )
                self.sink.release(ReleaseMode.DROP, [job.id])
                continue
            job.arrived_step = self.steps
            self.held.add(job)
            log_queued(self.config.queue, job)

    # -- schedule ----------------------------------------------------------------------

    def _admit(self) -> None:
        free = self.engine.free_slots
        buffered = self.held.jobs(Status.BUFFERED)
        if not buffered or free <= 0 or self._stop.is_set() or self.suspended:
            return
        running = Counter(j.key for j in self.held.jobs(Status.RUNNING))
        chosen = admit(buffered, running, min(free, self.config.max_batch), self.steps, self.policy)
        starts, resets, rows = [], [], []
        for job in chosen:
            if job.failed_attempts >= MAX_ATTEMPTS:
                self._fail_unstarted(
                    job,
                    f"gave up after {job.failed_attempts} attempts: its "
                    "worker died or its batch failed each time",
                )
                continue
            exec_id = uuid.uuid4().hex
            resets += [ChunkWrite(job.id, c, True) for c in job.start(exec_id)]
            starts.append(StartWrite(job.id, job.attempts_before, exec_id))
            rows.append(job)
        self.sink.starts(starts)
        self.sink.chunks(resets)
        try:
            self.engine.add(rows)
        except Exception as e:  # nothing of these reached MLX yet: theirs, not the batch's
            for job in rows:
                self._end(job, Outcome.FAILED, job.fail(f"engine error: {type(e).__name__}: {e}"))
            return
        self.fresh.update(j.id for j in rows)
        self.metrics.started(rows)
        for job in rows:
            log_started(self.config.queue, job)

    def _fail_unstarted(self, job: Job, reason: str) -> None:
        job.status = Status.ENDING
        job.note = reason
        self.sink.fail(job.id, job.attempts_before, reason)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + DEADLINE_CHECK_S
        for job in self.held.jobs():
            if job.status is Status.RUNNING and job.deadline is not None and now > job.deadline:
                job.timed_out = True
                self.engine.remove([job])
                self._end(
                    job,
                    Outcome.FAILED,
                    job.fail(f"timeout: ran longer than timeout={job.request.timeout:g} s"),
                )
            elif (
                job.status is Status.BUFFERED
                and (why := ttl_expired(job.request, job.enqueued_at)) is not None
            ):
                self._fail_unstarted(job, why)

    # -- run + postprocess -------------------------------------------------------------

    def _step(self) -> None:
        try:
            touched = apply_deltas(self.engine.step())
        except Exception as e:
            self._on_engine_error(e)
            return
        self.steps += 1
        self.fresh.clear()
        now = time.monotonic()
        self.metrics.step(now, touched)
        chunks: list[ChunkWrite] = []
        ends: list[tuple[Job, Chunk]] = []
        for job in touched:
            if job.status is not Status.RUNNING:
                continue
            if job.all_finished:
                owed, final = job.finish()
                chunks += [ChunkWrite(job.id, c, False) for c in owed]
                ends.append((job, final))
            else:
                due = job.chunks_due(now, self.interval)
                if due:
                    expire = self._refresh_ttl(job, now)
                    chunks += [ChunkWrite(job.id, c, expire) for c in due]
        self.sink.chunks(chunks)
        for job, final in ends:  # after their chunks, so each job's end comes last
            self._end(job, Outcome.FINISHED, final)

    def _refresh_ttl(self, job: Job, now: float) -> bool:
        # A log's TTL is refreshed with its first chunk and then whenever a quarter of it
        # has gone by, so it never expires while its job runs (its end refreshes it too).
        if now - job.ttl_refreshed_at < self.ttl_refresh_s:
            return False
        job.ttl_refreshed_at = now
        return True

    def _end(self, job: Job, outcome: Outcome, final: Chunk, reason: str = "") -> None:
        """Hand a job's end to the writer; its row is already free."""
        self.fresh.discard(job.id)
        if outcome is Outcome.FAILED and not reason:
            reason = final.error or "failed"
        job.note = reason
        self.sink.end(
            End(
                job.id,
                Outcome(outcome),
                job.execution_id,
                job.started_at,
                final,
                job.canceled_instead(final),
                job.result() if outcome is Outcome.FINISHED else None,
                reason,
                _route(self.config, self.engine, job) if outcome is Outcome.FINISHED else None,
            )
        )

    def _on_engine_error(self, e: Exception) -> None:
        """An MLX error leaves the batch state unusable. Jobs admitted since the last
        good step are the suspects and fail with the error; the others go back to the
        queue and start again (MAX_ATTEMPTS bounds that)."""
        reason = f"engine error: {type(e).__name__}: {e}"
        running = self.held.jobs(Status.RUNNING)
        suspects = [j for j in running if j.id in self.fresh]
        log.exception(
            "engine step failed; failing %d suspect job(s), requeuing %d",
            len(suspects),
            len(running) - len(suspects),
        )
        for job in suspects:
            self._end(job, Outcome.FAILED, job.fail(reason))
        requeued = [j for j in running if j.id not in self.fresh]
        self._release(requeued, ReleaseMode.REQUEUE, reason)
        self.engine.reset()
        self.fresh.clear()

    def _release(self, jobs: list[Job], mode: ReleaseMode, why: str) -> None:
        for job in jobs:
            job.status = Status.ENDING
            job.note = why
        self.engine.remove(jobs)
        self.sink.release(mode, [j.id for j in jobs])

    # -- what the other threads say ----------------------------------------------------

    def _handle_inbox(self) -> None:
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: messages.Message) -> None:
        match message:
            case messages.Started(verdicts):
                self._on_started(verdicts)
            case messages.Ended(outcomes) | messages.Settled(outcomes):
                for job_id, outcome in outcomes.items():
                    self._settle(job_id, outcome)
            case messages.CancelRequested(job_ids):
                self._on_cancel(job_ids)
            case messages.WriteFailed(job_id, why):
                self._on_write_failed(job_id, why)
            case messages.Reaped():
                self._abandon()
            case messages.Suspended(suspended):
                self._suspend(suspended)
            case _:
                messages.unhandled(message)

    def _on_started(self, verdicts: Mapping[str, str]) -> None:
        for job_id, verdict in verdicts.items():
            job = self.held.get(job_id)
            if verdict == "ok" or job is None:
                continue
            # Canceled meanwhile, or no longer this worker's: drop it; nothing of it was
            # written after its start, and the writer voids what is still queued.
            job.status, job.note = Status.ENDING, f"{verdict} at start"
            self.engine.remove([job])
            self.fresh.discard(job_id)
            self._settle(job_id, Outcome.CANCELED if verdict == "canceled" else Outcome.DROPPED)

    def _settle(self, job_id: str, outcome: Outcome) -> None:
        job = self.held.get(job_id)
        if job is None or job.status is not Status.ENDING:
            return  # gone already, or claimed afresh after its hand-back committed
        self.held.settle(job_id)
        self.outcomes[outcome] += 1
        self.metrics.settled(job, outcome)
        log_end(self.config.queue, job, outcome)

    def _suspend(self, suspended: bool) -> None:
        self.suspended = suspended
        if suspended:
            log.warning(
                "rq suspend is set: admitting nothing new until `rq resume`; %d running "
                "job(s) go on, waiting ones go back to the queue",
                len(self.held.jobs(Status.RUNNING)),
            )
            self._hand_back("rq suspend")
        else:
            log.info("rq resume: admitting jobs again")

    def _hand_back(self, why: str) -> None:
        """Give every job not running yet back to the queue's front, the prefetched ones
        too (a clean hand-back: no attempt is counted against them)."""
        self._add(self.prefetch.take())
        self._release(self.held.jobs(Status.BUFFERED), ReleaseMode.CLEAN, why)

    def _on_cancel(self, job_ids: tuple[str, ...]) -> None:
        for job_id in job_ids:
            job = self.held.get(job_id)
            if job is None or job.status is Status.ENDING:
                continue
            if job.status is Status.BUFFERED:  # the release script ends it canceled
                job.status = Status.ENDING
                self.sink.release(ReleaseMode.REQUEUE, [job_id])
            else:
                self.engine.remove([job])
                self._end(job, Outcome.CANCELED, job.cancel())

    def _on_write_failed(self, job_id: str, why: str) -> None:
        job = self.held.get(job_id)
        if job is not None and job.status is Status.RUNNING:
            self.engine.remove([job])
            self._end(job, Outcome.FAILED, job.fail(f"its replay log cannot be written: {why}"))

    def _abandon(self) -> None:
        """Declared dead by another worker, which requeued everything this one held:
        drop it all, then rejoin under a new lease."""
        log.error("dropping %d held jobs, now the queue's again", len(self.held))
        self.engine.reset()
        self.held.clear()
        self.fresh.clear()
        self.prefetch.take()
        try:
            self.bridge.rejoin()
        except Exception as e:  # Redis away: the next beat reports reaped again
            log.warning("rejoin failed (%s); will retry", e)

    # -- shutdown ----------------------------------------------------------------------

    def _drain(self) -> None:
        """After SIGTERM: admit nothing, let running jobs finish within the grace period,
        then requeue what remains at the queue's front (not counted as failed runs)."""
        self.prefetch.stop()
        self._hand_back("shutting down")
        deadline = time.monotonic() + self.config.grace_s
        while (
            self.held.jobs(Status.RUNNING)
            and time.monotonic() < deadline
            and not self._hard.is_set()
        ):
            self._handle_inbox()
            self._check_deadlines()
            if self.engine.active:
                self._step()
        why = "second stop signal" if self._hard.is_set() else "grace period over"
        self._release(self.held.jobs(Status.RUNNING), ReleaseMode.CLEAN, why)
        settle = time.monotonic() + SETTLE_S
        while len(self.held) and time.monotonic() < settle:
            self._handle_inbox()
            time.sleep(0.01)


def _route(config: WorkerConfig, engine: Engine, job: Job) -> str | None:
    """The key naming this worker as holding a finished chat job's conversation: its row
    (prompt and reply) was offered to the prompt cache."""
    if not config.routing or engine.prompt_cache is None:
        return None
    if len(job.prompt_ids) + job.generated < MIN_REUSE:
        return None
    return finished_as(config.queue, job.request, "".join(job.text))
