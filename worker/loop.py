"""The decode loop: schedule -> run -> postprocess, on the one thread that does MLX.

Each turn takes what the other threads sent (start verdicts, committed ends, cancels, a
lost lease: :mod:`mlxq.worker.messages`), takes the jobs the prefetcher made ready
(:mod:`mlxq.worker.intake`), admits them into free rows as :mod:`mlxq.worker.schedule`
chooses (levels, weights, pauses), runs one engine step, and hands
each job's output to the writer: chunks when due, an end when the job left the batch
(:mod:`mlxq.worker.endings`). It never waits on Redis; a row is free for the next job the
moment its job ends. The threads around it are started and stopped by
:class:`mlxq.worker.process.Worker`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping

from mlxq.producer.codec import Chunk
from mlxq.producer.outcome import Outcome
from mlxq.worker import messages
from mlxq.worker.bridge import Bridge
from mlxq.worker.config import WorkerConfig
from mlxq.worker.endings import Endings
from mlxq.worker.engine import Engine
from mlxq.worker.held import Held
from mlxq.worker.intake import Intake
from mlxq.worker.jobs import Job, Status, apply_deltas
from mlxq.worker.logs import log_end, log_started
from mlxq.worker.metrics import NoMetrics
from mlxq.worker.prefetch import Prefetcher
from mlxq.worker.schedule import Scheduler
from mlxq.worker.sink import Sink
from mlxq.worker.writes import ChunkWrite, ReleaseMode, StartWrite

log = logging.getLogger("mlxq.worker")

#: A job whose runs ended this many times because a worker died or its batch failed is
#: failed instead of started again: one poison job cannot take workers down forever.
MAX_ATTEMPTS = 3
#: After stopping, how long the writer may take to commit what is left.
SETTLE_S = 10.0


#: A job whose run started and has not ended.
STARTED = (Status.RUNNING, Status.PAUSED)


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
        self.interval = config.stream_interval_ms / 1000
        self.ttl_refresh_s = config.stream_ttl / 4
        self.slow_turn_s = config.slow_turn_ms / 1000 or math.inf
        self.steps = 0
        self.outcomes: Counter[Outcome] = Counter()
        self.metrics: NoMetrics = NoMetrics()
        self.suspended = False  # rq's suspend key is set: admit nothing new
        self.tokens_by_queue: Counter[str] = Counter(dict.fromkeys(config.levels.queues, 0))
        self._stop = threading.Event()
        self._hard = threading.Event()
        self.ends = Endings(config, engine, held, sink)
        self.schedule = Scheduler(config, engine, held, self.ends)
        self.intake = Intake(config, engine, bridge, held, sink, prefetch, self.ends, self._stop)

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

    def _turn(self) -> None:
        stages = self.engine.counters.stages
        start, before = time.perf_counter(), dict(stages.ms)
        self._turn_stages()
        if (took := time.perf_counter() - start) >= self.slow_turn_s:
            self._slow_turn(took, stages.since(before))

    def _slow_turn(self, took: float, stages: Mapping[str, float]) -> None:
        """Say where a turn every row waited for went, by stage (a stage that waits on the
        device holds whatever the device did: a kernel compiled the first time its shapes
        came, a stalled card; a garbage collection logs its own line)."""
        log.warning(
            "a decode turn took %.0f ms (step %d, %d rows): %s",
            1000 * took,
            self.steps,
            self.engine.active,
            ", ".join(f"{k} {v:.0f} ms" for k, v in list(stages.items())[:4]) or "no stage",
        )

    def _turn_stages(self) -> None:
        on = self.engine.counters.stages.on
        with on("inbox"):
            self._handle_inbox()
        with on("intake"):  # with an idle worker's wait for a job
            self.intake.take(self.steps, self.suspended)
        with on("schedule"):
            self.ends.check_deadlines()
            self._admit()
        if self.engine.active:
            with on("post"):  # what the engine's stages leave: chunks, ends, metrics
                self._step()
        with on("intake"):
            self.intake.want(self._stop.is_set() or self.suspended)

    # -- schedule ----------------------------------------------------------------------

    def _admit(self) -> None:
        """Fill free rows: paused jobs resume and waiting ones start, as the scheduler
        chooses (stopping or suspended: only paused jobs, which started already)."""
        resume, chosen = self.schedule.choose(self.steps, self._stop.is_set() or self.suspended)
        if resume:
            self._resume(resume)
        if chosen:
            self._start(chosen)

    def _resume(self, jobs: list[Job]) -> None:
        try:
            self.engine.resume(jobs)
        except Exception as e:  # its rows never went back: the job fails, not the batch
            for job in jobs:
                self.ends.end(
                    job, Outcome.FAILED, job.fail(f"engine error: {type(e).__name__}: {e}")
                )
            return
        for job in jobs:
            job.status = Status.RUNNING
        self.ends.fresh.update(j.id for j in jobs)

    def _start(self, chosen: list[Job]) -> None:
        starts, resets, rows = [], [], []
        for job in chosen:
            if job.failed_attempts >= MAX_ATTEMPTS:
                self.ends.fail_unstarted(
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
        # The first level's jobs take their first token in a pass of their own, as soon as
        # their prefill ends; lower levels' (a sweep's) in the batch's next decode step,
        # which spares the batch that pass. One level: every job is the first level's.
        first = [j for j in rows if self.schedule.level(j) == 0]
        later = [j for j in rows if self.schedule.level(j) > 0]
        for group, ride in ((first, False), (later, True)):
            if group:
                self._add(group, ride)

    def _add(self, rows: list[Job], ride: bool) -> None:
        try:
            self.engine.add(rows, ride=ride)
        except Exception as e:  # nothing of these reached MLX yet: theirs, not the batch's
            for job in rows:
                self.ends.end(
                    job, Outcome.FAILED, job.fail(f"engine error: {type(e).__name__}: {e}")
                )
            return
        self.ends.fresh.update(j.id for j in rows)
        self.metrics.started(rows)
        for job in rows:
            log_started(job.queue, job)

    # -- run + postprocess -------------------------------------------------------------

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
            touched = apply_deltas(deltas)
        except Exception as e:
            self.ends.engine_error(e)
            return
        self.tokens_by_queue.update(d.job.queue for d in deltas)  # every job's is served
        self.steps += 1
        self.ends.fresh.clear()
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
            self.ends.end(job, Outcome.FINISHED, final)

    def _refresh_ttl(self, job: Job, now: float) -> bool:
        # A log's TTL is refreshed with its first chunk and then whenever a quarter of it
        # has gone by, so it never expires while its job runs (its end refreshes it too).
        if now - job.ttl_refreshed_at < self.ttl_refresh_s:
            return False
        job.ttl_refreshed_at = now
        return True

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
                self.ends.cancel(job_ids)
            case messages.WriteFailed(job_id, why):
                self.ends.write_failed(job_id, why)
            case messages.Reaped():
                self._abandon()
            case messages.Suspended(suspended):
                self._suspend(suspended)
            case messages.MasterChanged(kept, lost):
                self._after_failover(kept, lost)
            case _:
                messages.unhandled(message)

    def _after_failover(
        self, kept: tuple[tuple[str, str, int], ...], lost: tuple[tuple[str, str], ...]
    ) -> None:
        """Restream the runs kept under their new attempt; drop those lost."""
        for job_id, execution, attempt in kept:
            job = self.held.get(job_id)
            if job and job.execution_id == execution and job.status in STARTED:
                self.sink.chunks([ChunkWrite(job.id, c, True) for c in job.rebase(attempt)])
        for job_id, execution in lost:  # a paused one's end is refused in its turn
            job = self.held.get(job_id)
            if job and job.execution_id == execution and job.status is Status.RUNNING:
                self._settle(job_id, self.ends.refused_at_start(job, "lost in a failover"))

    def _on_started(self, verdicts: Mapping[str, str]) -> None:
        for job_id, verdict in verdicts.items():
            job = self.held.get(job_id)
            if verdict == "ok" or job is None:
                continue
            self._settle(job_id, self.ends.refused_at_start(job, verdict))

    def _settle(self, job_id: str, outcome: Outcome) -> None:
        job = self.held.get(job_id)
        if job is None or job.status is not Status.ENDING:
            return  # gone already, or claimed afresh after its hand-back committed
        self.held.settle(job_id)
        self.schedule.left(job)
        self.outcomes[outcome] += 1
        self.metrics.settled(job, outcome)
        log_end(job.queue, job, outcome)

    def _suspend(self, suspended: bool) -> None:
        self.suspended = suspended
        if suspended:
            log.warning(
                "rq suspend is set: admitting nothing new until `rq resume`; %d running "
                "job(s) go on, waiting ones go back to the queue",
                len(self.held.jobs(Status.RUNNING)),
            )
            self.intake.hand_back("rq suspend", self.steps)
        else:
            log.info("rq resume: admitting jobs again")

    def _abandon(self) -> None:
        """Declared dead by another worker, which requeued everything this one held:
        drop it all, then rejoin under a new lease."""
        log.error("dropping %d held jobs, now the queue's again", len(self.held))
        self.engine.reset()
        self.held.clear()
        self.ends.fresh.clear()
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
        self.intake.hand_back("shutting down", self.steps)
        deadline = time.monotonic() + self.config.grace_s
        while self.held.started() and time.monotonic() < deadline and not self._hard.is_set():
            self._handle_inbox()
            self.ends.check_deadlines()
            self._admit()  # stopping: paused jobs resume as rows free, nothing new starts
            if self.engine.active:
                self._step()
        why = "second stop signal" if self._hard.is_set() else "grace period over"
        self.ends.release(self.held.started(), ReleaseMode.CLEAN, why)
        settle = time.monotonic() + SETTLE_S
        while len(self.held) and time.monotonic() < settle:
            self._handle_inbox()
            time.sleep(0.01)
