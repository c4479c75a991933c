"""The worker: schedule -> run -> postprocess, on the one thread that does MLX.

Each turn takes what the other threads sent (start verdicts, committed ends, cancels, a
lost lease), takes the jobs the prefetcher made ready (waiting up to ``window_ms`` for
company when idle), admits them into free rows, runs one engine step, and hands each
job's output to the writer: chunks when due, an end when the job left the batch. It never
waits on Redis; a row is free for the next job the moment its job ends.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections import Counter
from typing import Any

from mlxq.batching.admission import AdmissionPolicy, admit
from mlxq.batching.window import Window
from mlxq.producer.codec import Chunk
from mlxq.producer.outcome import Outcome
from mlxq.producer.params import MAX_PROMPT_CHARS
from mlxq.worker.bridge import Bridge
from mlxq.worker.cancels import CancelListener
from mlxq.worker.config import WorkerConfig
from mlxq.worker.engine import Engine
from mlxq.worker.jobs import Job, Status
from mlxq.worker.liveness import Liveness
from mlxq.worker.logs import job_event
from mlxq.worker.messages import Ended, Settled, Started, WriteFailed
from mlxq.worker.metrics import Metrics, NoMetrics, TokenRate
from mlxq.worker.prefetch import MAX_CHARS_PER_TOKEN, Prefetcher, ttl_expired
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


def _max_prompt_chars(engine: Engine) -> int:
    if not engine.max_context:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, engine.max_context * MAX_CHARS_PER_TOKEN)


class Worker:
    """Runs until SIGTERM/SIGINT (or :meth:`stop`); see :class:`WorkerConfig`.

    Args:
        config: What to serve and how.
        engine: A ready engine (tests inject one); by default ``config.model`` is loaded.
    """

    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.name = config.worker_name
        self.engine = engine or Engine.for_worker(config)
        self.bridge = Bridge(config)
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.jobs: dict[str, Job] = {}  # every job past the prefetcher, until settled
        self.sink = Sink(self.bridge, self.inbox, on_lease_lost=self._poke)
        self.prefetch = Prefetcher(
            self.bridge,
            self.sink,
            self.engine.encode,
            max_tokens_cap=config.max_tokens_cap,
            max_prompt_chars=_max_prompt_chars(self.engine),
            holds=self.holds,
            runs=self.runs,
            load=self.load,
            routing=config.routing,
        )
        self.liveness = Liveness(
            self.bridge,
            self.inbox,
            self.stats,
            self._held,
            on_renewed=self.sink.refresh_ttls,
            on_suspend=self._on_suspend,
        )
        self.cancels = CancelListener(self.bridge, self.inbox, self.holds)
        self.policy = AdmissionPolicy(config.max_batch, config.max_wait_steps)
        self.window = Window(config.window_ms / 1000, config.max_batch)
        self.interval = config.stream_interval_ms / 1000
        self.ttl_refresh_s = config.stream_ttl / 4
        self.fresh: set[str] = set()  # admitted since the last good step: suspects if it fails
        self.steps = 0
        self.outcomes: Counter[str] = Counter()
        self.born = time.time()
        self.rate = TokenRate()
        self.metrics: NoMetrics = NoMetrics()
        self.suspended = False  # rq's suspend key is set: admit nothing new
        self._stop = threading.Event()
        self._hard = threading.Event()
        self._next_deadline_check = 0.0

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
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

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        self.bridge.register()
        if self.config.metrics_port is not None:
            metrics = Metrics(self.stats)
            port = metrics.serve(self.config.metrics_port, self.config.metrics_host)
            self.metrics = metrics
            log.info("metrics at http://%s:%d/metrics", self.config.metrics_host, port)
        for t in (self.sink, self.liveness, self.cancels, self.prefetch):
            t.start()
        log.info(
            "worker %s serving queue %r with %s (max_batch=%d, window=%.0f ms)",
            self.name,
            self.config.queue,
            self.config.model,
            self.config.max_batch,
            self.config.window_ms,
        )
        try:
            while not self._stop.is_set():
                self._turn()
            self._drain()
        finally:
            self._shutdown()
        return 0

    def _shutdown(self) -> None:
        self.prefetch.stop()
        self.cancels.stop()
        settled = self.sink.close(SETTLE_S)
        self.liveness.stop()
        self.metrics.close()
        try:
            # Jobs handed here and not claimed go back to the queue; the roll is left only
            # with nothing held, else a live worker requeues what this one holds at once.
            self.bridge.unregister(settled)
        except Exception as e:  # Redis is gone: the reaper covers for us
            log.warning("on exit: %s", e)
        log.info("worker %s stopped", self.name)

    def holds(self, job_id: str) -> bool:
        """Whether this worker holds a job in any state, its end not yet committed."""
        return job_id in self.jobs or self.prefetch.holds(job_id)

    def runs(self, job_id: str) -> bool:
        """Whether a job is buffered or running here (a second claim of it is a rogue
        duplicate; a job whose hand-back is committing may be claimed again)."""
        job = self.jobs.get(job_id)
        return (job is not None and job.status is not Status.ENDING) or self.prefetch.holds(job_id)

    def load(self) -> int:
        """Rows this worker holds, running or buffered (safe from any thread)."""
        return sum(self._rows())

    def _rows(self) -> tuple[int, int]:
        """Jobs running and jobs buffered (safe from any thread)."""
        statuses = [j.status for j in list(self.jobs.values())]
        return statuses.count(Status.RUNNING), statuses.count(Status.BUFFERED)

    def _poke(self) -> None:
        self.liveness.poke()

    # -- one turn ----------------------------------------------------------------------

    def _turn(self) -> None:
        self._handle_inbox()
        self._take()
        self._check_deadlines()
        self._admit()
        if self.engine.active:
            self._step()
        self._ask_prefetch()

    def _running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.status is Status.RUNNING]

    def _buffered(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.status is Status.BUFFERED]

    def _ask_prefetch(self) -> None:
        buffered = sum(j.status is Status.BUFFERED for j in self.jobs.values())
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
        if self.engine.active or self._buffered():
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
            if self.window.should_close(now, len(self._buffered())) or self._stop.is_set():
                break
            self.prefetch.wait(self.window.remaining(now))
        self.window.close()

    def _add(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.epoch != self.bridge.epoch:
                continue  # claimed under a lease this worker lost: not its own
            if self.runs(job.id):
                log.warning(
                    "job %s: a second queue entry for a job this worker holds; dropped", job.id
                )
                self.sink.release(ReleaseMode.DROP, [job.id])
                continue
            job.arrived_step = self.steps
            self.jobs[job.id] = job
            waited = None if job.enqueued_at is None else max(0.0, time.time() - job.enqueued_at)
            job_event(
                log,
                "queued_wait",
                job.id,
                self.config.queue,
                job.attempts_before + 1,
                queue_wait_s=waited,
            )

    # -- schedule ----------------------------------------------------------------------

    def _admit(self) -> None:
        free = self.engine.free_slots
        buffered = self._buffered()
        if not buffered or free <= 0 or self._stop.is_set() or self.suspended:
            return
        running = Counter(j.key for j in self._running())
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
            resets += [
                ChunkWrite(job.id, c, True) for c in job.start(exec_id, self.engine.new_detokenizer)
            ]
            starts.append(StartWrite(job.id, job.attempts_before, exec_id))
            rows.append(job)
        self.sink.starts(starts)
        self.sink.chunks(resets)
        try:
            self.engine.add(rows)
        except Exception as e:  # nothing of these reached MLX yet: theirs, not the batch's
            for job in rows:
                self._end(job, "failed", job.fail(f"engine error: {type(e).__name__}: {e}"))
            return
        self.fresh.update(j.id for j in rows)
        self.metrics.started(rows)
        for job in rows:
            job_event(
                log,
                "started",
                job.id,
                self.config.queue,
                job.attempt,
                prompt_tokens=len(job.prompt_ids),
                queue_wait_s=(
                    None if job.enqueued_at is None else max(0.0, job.started_at - job.enqueued_at)
                ),
                buffered_s=job.started_mono - job.claimed_at,
            )

    def _fail_unstarted(self, job: Job, reason: str) -> None:
        job.status = Status.ENDING
        job.note = reason
        self.sink.fail(job.id, job.attempts_before, reason)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + DEADLINE_CHECK_S
        for job in list(self.jobs.values()):
            if job.status is Status.RUNNING and job.deadline is not None and now > job.deadline:
                job.timed_out = True
                self.engine.remove([job])
                self._end(
                    job,
                    "failed",
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
            touched = self.engine.step()
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
            self._end(job, "finished", final)

    def _refresh_ttl(self, job: Job, now: float) -> bool:
        # A log's TTL is refreshed with its first chunk and then whenever a quarter of it
        # has gone by, so it never expires while its job runs (its end refreshes it too).
        if now - job.ttl_refreshed_at < self.ttl_refresh_s:
            return False
        job.ttl_refreshed_at = now
        return True

    def _end(self, job: Job, outcome: str, final: Chunk, reason: str = "") -> None:
        """Hand a job's end to the writer; its row is already free."""
        self.fresh.discard(job.id)
        if outcome == "failed" and not reason:
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
                job.result() if outcome == "finished" else None,
                reason,
                self._route(job) if outcome == "finished" else None,
            )
        )

    def _route(self, job: Job) -> str | None:
        """The key naming this worker as holding a finished chat job's conversation: its
        row (prompt and reply) was offered to the prompt cache."""
        if not self.config.routing or self.engine.prompt_cache is None:
            return None
        if len(job.prompt_ids) + job.generated < MIN_REUSE:
            return None
        return finished_as(self.config.queue, job.request, "".join(job.text))

    def _on_engine_error(self, e: Exception) -> None:
        """An MLX error leaves the batch state unusable. Jobs admitted since the last
        good step are the suspects and fail with the error; the others go back to the
        queue and start again (MAX_ATTEMPTS bounds that)."""
        reason = f"engine error: {type(e).__name__}: {e}"
        running = self._running()
        suspects = [j for j in running if j.id in self.fresh]
        log.exception(
            "engine step failed; failing %d suspect job(s), requeuing %d",
            len(suspects),
            len(running) - len(suspects),
        )
        for job in suspects:
            self._end(job, "failed", job.fail(reason))
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
            match message:
                case Started(verdicts=verdicts):
                    self._on_started(dict(verdicts))
                case Ended(outcomes=outcomes) | Settled(outcomes=outcomes):
                    for job_id, outcome in outcomes.items():
                        self._settle(job_id, outcome)
                case WriteFailed(job_id=job_id, why=why):
                    self._on_write_failed(job_id, why)
                case ("cancel", job_ids):
                    self._on_cancel(job_ids)
                case ("reaped", _):
                    self._abandon()
                case ("suspend", suspended):
                    self._suspend(suspended)

    def _on_started(self, verdicts: dict[str, str]) -> None:
        for job_id, verdict in verdicts.items():
            job = self.jobs.get(job_id)
            if verdict == "ok" or job is None:
                continue
            # Canceled meanwhile, or no longer this worker's: drop it; nothing of it was
            # written after its start, and the writer voids what is still queued.
            job.status, job.note = Status.ENDING, f"{verdict} at start"
            self.engine.remove([job])
            self.fresh.discard(job_id)
            self._settle(job_id, "canceled" if verdict == "canceled" else "dropped")

    def _settle(self, job_id: str, outcome: str) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.status is not Status.ENDING:
            return  # gone already, or claimed afresh after its hand-back committed
        del self.jobs[job_id]
        self.outcomes[outcome] += 1
        self.metrics.settled(job, outcome)
        self._log_end(job, outcome)

    def _log_end(self, job: Job, outcome: str) -> None:
        now = time.monotonic()
        started = bool(job.started_mono)
        event = "timed_out" if outcome == "failed" and job.timed_out else outcome
        level = logging.INFO if outcome in ("finished", "canceled", "requeued") else logging.WARNING
        job_event(
            log,
            event,
            job.id,
            self.config.queue,
            job.attempt or job.attempts_before + 1,
            level,
            tokens=job.generated if started else None,
            prompt_tokens=len(job.prompt_ids),
            finish_reason=job.finish_reason if outcome == "finished" else None,
            ttft_s=None if job.first_token_at is None else job.first_token_at - job.started_mono,
            run_s=now - job.started_mono if started else None,
            e2e_s=None if job.enqueued_at is None else max(0.0, time.time() - job.enqueued_at),
            reason=(job.note or None) if outcome != "finished" else None,
        )

    def _on_suspend(self, suspended: bool) -> None:
        """rq's suspend key came or went (the liveness thread calls this)."""
        self.prefetch.pause(suspended)
        self.inbox.put(("suspend", suspended))

    def _suspend(self, suspended: bool) -> None:
        self.suspended = suspended
        if suspended:
            log.warning(
                "rq suspend is set: admitting nothing new until `rq resume`; %d running "
                "job(s) go on, waiting ones go back to the queue",
                len(self._running()),
            )
            self._hand_back("rq suspend")
        else:
            log.info("rq resume: admitting jobs again")

    def _hand_back(self, why: str) -> None:
        """Give every job not running yet back to the queue's front, the prefetched ones
        too (a clean hand-back: no attempt is counted against them)."""
        self._add(self.prefetch.take())
        self._release(self._buffered(), ReleaseMode.CLEAN, why)

    def _on_cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job.status is Status.ENDING:
                continue
            if job.status is Status.BUFFERED:  # the release script ends it canceled
                job.status = Status.ENDING
                self.sink.release(ReleaseMode.REQUEUE, [job_id])
            else:
                self.engine.remove([job])
                self._end(job, "canceled", job.cancel())

    def _on_write_failed(self, job_id: str, why: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None and job.status is Status.RUNNING:
            self.engine.remove([job])
            self._end(job, "failed", job.fail(f"its replay log cannot be written: {why}"))

    def _abandon(self) -> None:
        """Declared dead by another worker, which requeued everything this one held:
        drop it all, then rejoin under a new lease."""
        log.error("dropping %d held jobs, now the queue's again", len(self.jobs))
        self.engine.reset()
        self.jobs.clear()
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
        while self._running() and time.monotonic() < deadline and not self._hard.is_set():
            self._handle_inbox()
            self._check_deadlines()
            if self.engine.active:
                self._step()
        why = "second stop signal" if self._hard.is_set() else "grace period over"
        self._release(self._running(), ReleaseMode.CLEAN, why)
        settle = time.monotonic() + SETTLE_S
        while self.jobs and time.monotonic() < settle:
            self._handle_inbox()
            time.sleep(0.01)

    # -- reporting ---------------------------------------------------------------------

    def _held(self) -> tuple[list[str], list[tuple[str, str]]]:
        jobs = list(self.jobs.values())
        held = [j.id for j in jobs if j.status is not Status.ENDING]
        running = [(j.id, j.execution_id) for j in jobs if j.status is Status.RUNNING]
        return held, running

    def stats(self) -> tuple[str, dict[str, Any]]:
        c = self.engine.counters
        running, buffered = self._rows()
        # Stopping or suspended: no free rows, so no chat turn is handed here.
        closed = self.suspended or self._stop.is_set()
        room = 0 if closed else max(0, self.config.max_batch - running - buffered)
        state = "busy" if running else "suspended" if self.suspended else "idle"
        return state, {
            "name": self.name,
            "queue": self.config.queue,
            "model": self.config.model,
            "max_batch": self.config.max_batch,
            "window_ms": self.config.window_ms,
            "decode_steps": c.decode_steps,
            "vectorized_steps": c.vectorized_steps,
            "sampler_calls": c.sampler_calls,
            "tokens_generated": c.tokens_generated,
            "prompt_tokens": c.prompt_tokens,
            "prompt_tokens_prefilled": c.prompt_tokens_prefilled,
            "prompt_cache_queries": c.prompt_cache_queries,
            "prompt_cache_hits": c.prompt_cache_hits,
            "prompt_tokens_cached": c.prompt_tokens_cached,
            "prompt_cache_bytes": self.engine.prompt_cache_bytes,
            "jobs_finished": self.outcomes["finished"],
            "jobs_failed": self.outcomes["failed"] + self.prefetch.failed,
            "jobs_canceled": self.outcomes["canceled"],
            "jobs_requeued": self.outcomes["requeued"],
            "tok_s_1m": round(self.rate.sample(c.tokens_generated), 2),
            "suspended": self.suspended,
            "updated_at": time.time(),
            "running": running,
            "buffered": buffered,
            "room": room,
            "load": running + buffered,
            "jobs_handed_out": self.prefetch.handed,
            "jobs_handed_in": self.prefetch.handed_in,
            "pid": os.getpid(),
            "cancels_ignored": self.cancels.ignored,
            "started_at": self.born,
            "batch_sizes": {str(k): v for k, v in sorted(c.batch_sizes.items())},
        }
