"""How a held job leaves the decode loop: every end and hand-back it hands the writer.

A running job ends (finished, failed, canceled) with its final chunk; a job not running
yet fails before its start or goes back to the queue; a batch whose step failed fails
its suspects and requeues the rest. Each frees its row at once and hands the writer one
write; the job stays held, as ``ENDING``, until the writer says the write committed (the
loop then settles it: :meth:`mlxq.worker.loop.DecodeLoop._settle`).
"""

from __future__ import annotations

import logging
import time

from mlxq.producer.codec import Chunk
from mlxq.producer.outcome import Outcome
from mlxq.worker.config import WorkerConfig
from mlxq.worker.engine import Engine
from mlxq.worker.held import Held
from mlxq.worker.jobs import Job, Status
from mlxq.worker.prefetch import ttl_expired
from mlxq.worker.prompt_cache import MIN_REUSE
from mlxq.worker.routing import finished_as
from mlxq.worker.sink import Sink
from mlxq.worker.writes import End, ReleaseMode

log = logging.getLogger("mlxq.worker")

#: How often deadlines (per-job timeout, ttl) are checked.
DEADLINE_CHECK_S = 0.1


class Endings:
    """The decode thread's ways of letting a job go.

    Args:
        config: What the worker serves.
        engine: The model's batch (a job's row is freed here).
        held: The jobs this worker holds.
        sink: The writer.
    """

    def __init__(self, config: WorkerConfig, engine: Engine, held: Held, sink: Sink) -> None:
        self.config, self.engine, self.held, self.sink = config, engine, held, sink
        self.fresh: set[str] = set()  # admitted since the last good step: suspects if it fails
        self._next_deadline_check = 0.0

    def end(self, job: Job, outcome: Outcome, final: Chunk, reason: str = "") -> None:
        """Hand a job's end to the writer; its row is already free."""
        self.fresh.discard(job.id)
        if outcome is Outcome.FAILED and not reason:
            reason = final.error or "failed"
        job.note = reason
        self.sink.end(
            End(
                job.id,
                outcome,
                job.execution_id,
                job.started_at,
                final,
                job.canceled_instead(final),
                job.result() if outcome is Outcome.FINISHED else None,
                reason,
                _route(self.config, self.engine, job) if outcome is Outcome.FINISHED else None,
            )
        )

    def end_running(self, job: Job, outcome: Outcome, final: Chunk) -> None:
        """Take a running job's rows out of the batch now, then end it (cancel, timeout,
        a log it cannot write)."""
        self.engine.remove([job])
        self.end(job, outcome, final)

    def release(self, jobs: list[Job], mode: ReleaseMode, why: str) -> None:
        """Free these jobs' rows and hand them back to the queue (``mode`` says how)."""
        for job in jobs:
            job.status = Status.ENDING
            job.note = why
        self.engine.remove(jobs)
        self.sink.release(mode, [j.id for j in jobs])

    def fail_unstarted(self, job: Job, reason: str) -> None:
        """Fail a job that never started (nothing of it was written)."""
        job.status = Status.ENDING
        job.note = reason
        self.sink.fail(job.id, job.attempts_before, reason)

    def check_deadlines(self) -> None:
        """Fail running jobs past their timeout and waiting ones past their ttl (at most
        every :data:`DEADLINE_CHECK_S`)."""
        now = time.monotonic()
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + DEADLINE_CHECK_S
        for job in self.held.jobs():
            started = job.status in (Status.RUNNING, Status.PAUSED)  # paused: wall time counts
            if started and job.deadline is not None and now > job.deadline:
                job.timed_out = True
                reason = f"timeout: ran longer than timeout={job.request.timeout:g} s"
                self.end_running(job, Outcome.FAILED, job.fail(reason))
            elif (
                job.status is Status.BUFFERED
                and (why := ttl_expired(job.request, job.enqueued_at)) is not None
            ):
                self.fail_unstarted(job, why)

    def refused_at_start(self, job: Job, verdict: str) -> Outcome:
        """Drop a job whose start script refused it; returns the outcome it settles as."""
        # Canceled meanwhile, or no longer this worker's: nothing of it was written after
        # its start, and the writer voids what is still queued.
        job.status, job.note = Status.ENDING, f"{verdict} at start"
        self.engine.remove([job])
        self.fresh.discard(job.id)
        return Outcome.CANCELED if verdict == "canceled" else Outcome.DROPPED

    def cancel(self, job_ids: tuple[str, ...]) -> None:
        """End these jobs canceled: a running one here, a waiting one by the writer."""
        for job_id in job_ids:
            job = self.held.get(job_id)
            if job is None or job.status is Status.ENDING:
                continue
            if job.status is Status.BUFFERED:  # the release script ends it canceled
                job.status = Status.ENDING
                self.sink.release(ReleaseMode.REQUEUE, [job_id])
            else:
                self.end_running(job, Outcome.CANCELED, job.cancel())

    def write_failed(self, job_id: str, why: str) -> None:
        """Fail a running job whose replay log cannot be written."""
        job = self.held.get(job_id)
        if job is not None and job.status in (Status.RUNNING, Status.PAUSED):
            final = job.fail(f"its replay log cannot be written: {why}")
            self.end_running(job, Outcome.FAILED, final)

    def engine_error(self, e: Exception) -> None:
        """An MLX error leaves the batch state unusable. Jobs admitted since the last
        good step are the suspects and fail with the error; the others go back to the
        queue and start again (MAX_ATTEMPTS bounds that), paused ones too (their KV went
        with the batch)."""
        reason = f"engine error: {type(e).__name__}: {e}"
        running = self.held.started()
        suspects = [j for j in running if j.id in self.fresh]
        log.exception(
            "engine step failed; failing %d suspect job(s), requeuing %d",
            len(suspects),
            len(running) - len(suspects),
        )
        for job in suspects:
            self.end(job, Outcome.FAILED, job.fail(reason))
        requeued = [j for j in running if j.id not in self.fresh]
        self.release(requeued, ReleaseMode.REQUEUE, reason)
        self.engine.reset()
        self.fresh.clear()


def _route(config: WorkerConfig, engine: Engine, job: Job) -> str | None:
    """The key naming this worker as holding a finished chat job's conversation: its row
    (prompt and reply) was offered to the prompt cache."""
    if not config.routing or engine.prompt_cache is None:
        return None
    if len(job.prompt_ids) + job.generated < MIN_REUSE:
        return None
    return finished_as(job.queue or config.queue, job.request, "".join(job.text))
