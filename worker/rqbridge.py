"""rq's bookkeeping for a worker that holds many jobs at once.

rq's own worker runs one job at a time; mlxq's keeps a whole batch. Each job
still walks rq's states through rq's public worker methods (prepare, success,
failure), so ``rq info``, rq's registries and ``Job.get_status()`` stay true.
What rq has no call for (fail a job it could not even decode, requeue a started
job, cancel a running one) is done here with rq's own key helpers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, clean_registries
from rq.utils import as_text, now
from rq.worker import SimpleWorker

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest

log = logging.getLogger("mlxq.worker")

#: How long the record of a job that could not even be read is kept.
UNREADABLE_TTL = 7 * 24 * 3600
#: The longest a failed or canceled job's record is kept, whatever a (rogue) producer
#: asked: rq's own default is a year, and a canceled job gets no expiry at all.
MAX_FAILURE_TTL = 7 * 24 * 3600


def _failure_ttl(job: Job) -> int:
    ttl = job.failure_ttl
    return MAX_FAILURE_TTL if ttl is None or ttl <= 0 else min(int(ttl), MAX_FAILURE_TTL)


@dataclass(slots=True)
class Running:
    """A job this worker has started: its rq objects and its stream position."""

    job: Job
    execution: Execution
    request: GenerationRequest
    seq: int = 0
    attempt: int = 1
    deadline: float | None = None  # time.monotonic() past which it fails (its timeout)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def decode_job(job: Job, max_tokens_cap: int) -> GenerationRequest:
    """Check what a dequeued job carries; never trusts (or unpickles) it.

    Raises:
        PayloadError: naming what is wrong.
    """
    try:
        func, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as e:  # rq wraps msgpack's error in DeserializationError
        raise PayloadError(f"job data: not mlxq msgpack ({type(e).__name__})") from None
    if func != keys.JOB_FUNC:
        raise PayloadError(f"func={func!r}: not an mlxq job (want {keys.JOB_FUNC!r})")
    if kwargs or not isinstance(args, (list, tuple)) or len(args) != 1:
        raise PayloadError("job args: want exactly one payload map")
    return GenerationRequest.from_payload(args[0], max_tokens_cap=max_tokens_cap)


class RqBridge:
    """One queue's rq bookkeeping for one mlxq worker.

    Jobs move atomically from rq's queue list into this worker's own WIP list
    (``mlxq:wip:<name>``), not rq's shared intermediate list, and leave it only
    when their end is committed: the WIP list is always exactly what the worker
    holds, so a dead worker's jobs are found and requeued from it.

    Args:
        connection: Redis connection.
        queue: Queue name.
        name: Worker name, unique (rq refuses a name whose dead twin's key lives).
    """

    def __init__(self, connection: redis.Redis, queue: str, name: str) -> None:
        self.redis = connection
        self.name = name
        self.wip = keys.wip_key(name)
        self.queue = Queue(queue, connection=connection, serializer=MsgpackSerializer)
        self.worker = SimpleWorker([self.queue], connection=connection, name=name,
                                   serializer=MsgpackSerializer)

    def register(self) -> None:
        self.worker.register_birth()
        self.worker.set_state("idle")

    def unregister(self) -> None:
        self.worker.register_death()

    def heartbeat(self, running: list[Running]) -> None:
        self.worker.heartbeat()
        for r in running:
            self.worker.maintain_heartbeats(r.job, r.execution)

    def set_state(self, state: str) -> None:
        if self.worker.get_state() != state:
            self.worker.set_state(state)

    def dequeue(self, timeout: float | None) -> Job | None:
        """Move one job id from the queue to this worker's WIP list and fetch it.

        Args:
            timeout: Seconds to block; None does not block.

        Returns:
            The job, or None when none came (or it could not be read: it is failed).
        """
        if timeout is None:
            raw = self.redis.lmove(self.queue.key, self.wip, "LEFT", "RIGHT")
        else:
            # redis-py annotates an int; BLMOVE takes fractions of a second (Redis >= 6).
            raw = self.redis.blmove(self.queue.key, self.wip, timeout,  # type: ignore[arg-type]
                                    "LEFT", "RIGHT")
        if raw is None:
            return None
        job_id = as_text(raw)
        try:
            return Job.fetch(job_id, connection=self.redis, serializer=MsgpackSerializer)
        except NoSuchJobError:  # deleted while queued
            self.redis.lrem(self.wip, 1, job_id)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:
            self._fail_unreadable(job_id, f"unreadable job record: {type(e).__name__}: {e}")
        return None

    def start(self, job: Job, request: GenerationRequest) -> Running:
        """Mark a job started (StartedJobRegistry, status STARTED)."""
        execution = self.worker.prepare_execution(job)
        self.worker.prepare_job_execution(job)
        return Running(job, execution, request)

    def succeed(self, r: Running, result: dict[str, Any]) -> None:
        r.job._result = result
        r.job.ended_at = now()
        self.worker.handle_job_success(r.job, self.queue, self.queue.started_job_registry,
                                       r.execution)
        self.redis.lrem(self.wip, 1, r.job.id)

    def fail(self, r: Running, reason: str) -> None:
        r.job.ended_at = now()
        r.job.failure_ttl = _failure_ttl(r.job)
        self.worker.handle_job_failure(r.job, self.queue, exc_string=reason,
                                       execution=r.execution)
        self.redis.lrem(self.wip, 1, r.job.id)

    def fail_unstarted(self, job: Job, reason: str) -> None:
        """Fail a job that never reached the batch."""
        log.warning("job %s failed before start: %s", job.id, reason)
        with self.redis.pipeline() as p:
            job.ended_at = now()
            job.failure_ttl = _failure_ttl(job)
            job.set_status(JobStatus.FAILED, pipeline=p)
            job._handle_failure(reason, pipeline=p, worker_name=self.name)
            p.lrem(self.wip, 1, job.id)
            p.execute()

    def drop_unstarted(self, job_id: str) -> None:
        """Forget a buffered job (it was canceled while buffered)."""
        self.redis.lrem(self.wip, 1, job_id)

    def requeue_unstarted(self, job_id: str) -> None:
        """Give a buffered job back to the queue's front."""
        with self.redis.pipeline() as p:
            p.lrem(self.wip, 1, job_id)
            self.queue.push_job_id(job_id, pipeline=p, at_front=True)
            p.execute()

    def requeue(self, r: Running) -> None:
        """Put a started job back at the queue's front, as if never started."""
        with self.redis.pipeline() as p:
            self.worker.cleanup_execution(r.job, pipeline=p, execution=r.execution)
            r.job.set_status(JobStatus.QUEUED, pipeline=p)
            p.lrem(self.wip, 1, r.job.id)
            self.queue.push_job_id(r.job.id, pipeline=p, at_front=True)
            p.execute()

    def cancel(self, r: Running) -> None:
        """Record a running job as canceled (CanceledJobRegistry), its execution ended."""
        with self.redis.pipeline() as p:
            self.worker.cleanup_execution(r.job, pipeline=p, execution=r.execution)
            p.execute()
        try:
            r.job.cancel()
        except Exception as e:  # already canceled by the producer's call
            log.debug("cancel of %s: %s", r.job.id, e)
        with self.redis.pipeline() as p:
            p.expire(r.job.key, _failure_ttl(r.job))  # rq gives canceled jobs no expiry
            p.srem(keys.cancel_set(self.queue.name), r.job.id)
            p.lrem(self.wip, 1, r.job.id)
            p.execute()

    def forget_executions(self, job: Job) -> None:
        """Delete executions a start left behind when Redis failed halfway through it."""
        forget_executions(self.redis, job)

    def reconcile(self, held: set[str]) -> list[Job]:
        """After a Redis error: the WIP list is the truth of what this worker holds.

        A move whose reply was lost put a job in the list that the worker never saw;
        those still queued are returned to be buffered, ended ones are dropped, and a
        started one this worker does not run is requeued.
        """
        found = []
        for raw in self.redis.lrange(self.wip, 0, -1):
            job_id = as_text(raw)
            if job_id in held:
                continue
            try:
                job = Job.fetch(job_id, connection=self.redis, serializer=MsgpackSerializer)
            except NoSuchJobError:
                self.redis.lrem(self.wip, 1, job_id)
                continue
            status = job.get_status(refresh=False)
            if status in (JobStatus.QUEUED, JobStatus.CREATED):
                found.append(job)
            elif status == JobStatus.STARTED:
                self.forget_executions(job)
                with self.redis.pipeline() as p:
                    job.set_status(JobStatus.QUEUED, pipeline=p)
                    p.lrem(self.wip, 1, job_id)
                    self.queue.push_job_id(job_id, pipeline=p, at_front=True)
                    p.execute()
            else:
                self.redis.lrem(self.wip, 1, job_id)
        return found

    def sweep(self) -> None:
        """Expire what rq leaves to maintenance (run by no rq worker here): its registries'
        stale entries, and canceled entries whose job record has expired."""
        clean_registries(self.queue)
        canceled = self.queue.canceled_job_registry
        ids = canceled.get_job_ids(cleanup=False)
        with self.redis.pipeline() as p:
            for job_id in ids:
                p.exists(f"{Job.redis_job_namespace_prefix}{job_id}")
            alive = p.execute()
        gone = [j for j, ok in zip(ids, alive, strict=True) if not ok]
        if gone:
            self.redis.zrem(canceled.key, *gone)

    def _fail_unreadable(self, job_id: str, reason: str) -> None:
        log.warning("job %s failed: %s", job_id, reason)
        job_key = f"{Job.redis_job_namespace_prefix}{job_id}"
        registry = FailedJobRegistry(self.queue.name, connection=self.redis,
                                     serializer=MsgpackSerializer)
        with self.redis.pipeline() as p:
            p.hset(job_key, mapping={"status": JobStatus.FAILED.value, "exc_info": reason})
            p.expire(job_key, UNREADABLE_TTL)
            p.zadd(registry.key, {job_id: now().timestamp() + UNREADABLE_TTL})
            p.lrem(self.wip, 1, job_id)
            p.execute()


def requeue_orphans(connection: redis.Redis, queue: Queue, dead: str) -> list[str]:
    """Requeue, at the queue's front in their order, the jobs a dead worker held.

    Jobs that had ended (the worker died between committing and tidying up) are
    only dropped from its WIP list. The caller holds the dead worker's reap lock.

    Returns:
        The ids requeued.
    """
    wip = keys.wip_key(dead)
    requeued = []
    for raw in reversed(connection.lrange(wip, 0, -1)):
        job_id = as_text(raw)
        try:
            job = Job.fetch(job_id, connection=connection, serializer=MsgpackSerializer)
            status = job.get_status(refresh=False)
        except NoSuchJobError:
            connection.lrem(wip, 1, job_id)
            continue
        if status in (JobStatus.QUEUED, JobStatus.STARTED, JobStatus.CREATED):
            forget_executions(connection, job)
        with connection.pipeline() as p:
            p.lrem(wip, 1, job_id)
            if status in (JobStatus.QUEUED, JobStatus.STARTED, JobStatus.CREATED):
                job.set_status(JobStatus.QUEUED, pipeline=p)
                queue.push_job_id(job_id, pipeline=p, at_front=True)
                requeued.append(job_id)
            p.execute()
    dead_rq = SimpleWorker([queue], connection=connection, name=dead,
                           serializer=MsgpackSerializer)
    if connection.exists(dead_rq.key):
        dead_rq.register_death()
    return requeued[::-1]


def forget_executions(connection: redis.Redis, job: Job) -> None:
    """Delete a job's executions by id: out of StartedJobRegistry and its own registry.

    By id, not through rq's ``job.get_executions()``, which raises when an execution's
    hash has already expired (or was lost with a Redis restart) while its id lingers.
    """
    ids = job.execution_registry.get_execution_ids()
    if not ids:
        return
    with connection.pipeline() as p:
        for execution_id in ids:
            Execution(execution_id, job.id, connection).delete(job=job, pipeline=p)
        p.execute()
