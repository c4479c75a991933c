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
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.utils import now
from rq.worker import SimpleWorker

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest

log = logging.getLogger("mlxq.worker")


@dataclass(slots=True)
class Running:
    """A job this worker has started: its rq objects and its stream position."""

    job: Job
    execution: Execution
    request: GenerationRequest
    seq: int = 0
    attempt: int = 1
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

    Args:
        connection: Redis connection.
        queue: Queue name.
        name: Worker name, unique (rq refuses a name whose dead twin's key lives).
    """

    def __init__(self, connection: redis.Redis, queue: str, name: str) -> None:
        self.redis = connection
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
        """Move one job id to rq's intermediate list and fetch it; None if none came.

        A job whose hash rq cannot even restore is failed here by id.
        """
        try:
            # rq annotates int, but hands the timeout to BLMOVE, which takes fractions.
            got = Queue.dequeue_any([self.queue], timeout,  # type: ignore[arg-type]
                                    connection=self.redis, serializer=MsgpackSerializer)
        except DequeueTimeout:
            return None
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:
            job_id = getattr(e, "job_id", None)
            if job_id is None:
                raise
            self._fail_unreadable(job_id, f"unreadable job record: {type(e).__name__}: {e}")
            return None
        return got[0] if got else None

    def start(self, job: Job, request: GenerationRequest) -> Running:
        """Mark a job started (StartedJobRegistry, status, out of the intermediate list)."""
        execution = self.worker.prepare_execution(job)
        self.worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
        return Running(job, execution, request)

    def succeed(self, r: Running, result: dict[str, Any]) -> None:
        r.job._result = result
        r.job.ended_at = now()
        self.worker.handle_job_success(r.job, self.queue, self.queue.started_job_registry,
                                       r.execution)

    def fail(self, r: Running, reason: str) -> None:
        r.job.ended_at = now()
        self.worker.handle_job_failure(r.job, self.queue, exc_string=reason,
                                       execution=r.execution)

    def fail_unstarted(self, job: Job, reason: str) -> None:
        """Fail a job still in the intermediate list (it never reached the batch)."""
        log.warning("job %s failed before start: %s", job.id, reason)
        with self.redis.pipeline() as p:
            p.lrem(self.queue.intermediate_queue_key, 1, job.id)
            job.ended_at = now()
            job.set_status(JobStatus.FAILED, pipeline=p)
            job._handle_failure(reason, pipeline=p, worker_name=self.worker.name)
            p.execute()

    def drop_unstarted(self, job_id: str) -> None:
        """Forget a job still in the intermediate list (it was canceled there)."""
        self.redis.lrem(self.queue.intermediate_queue_key, 1, job_id)

    def requeue_unstarted(self, job_id: str) -> None:
        """Give a job from the intermediate list back to the queue's front."""
        with self.redis.pipeline() as p:
            p.lrem(self.queue.intermediate_queue_key, 1, job_id)
            self.queue.push_job_id(job_id, pipeline=p, at_front=True)
            p.execute()

    def requeue(self, r: Running) -> None:
        """Put a started job back at the queue's front, as if never started."""
        with self.redis.pipeline() as p:
            self.worker.cleanup_execution(r.job, pipeline=p, execution=r.execution)
            r.job.set_status(JobStatus.QUEUED, pipeline=p)
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
        self.redis.srem(keys.cancel_set(self.queue.name), r.job.id)

    def is_canceled(self, job: Job) -> bool:
        try:
            return job.get_status(refresh=True) in (JobStatus.CANCELED, JobStatus.STOPPED)
        except NoSuchJobError:
            return True

    def _fail_unreadable(self, job_id: str, reason: str) -> None:
        log.warning("job %s failed: %s", job_id, reason)
        job_key = f"{Job.redis_job_namespace_prefix}{job_id}"
        with self.redis.pipeline() as p:
            p.lrem(self.queue.intermediate_queue_key, 1, job_id)
            p.hset(job_key, mapping={"status": JobStatus.FAILED.value, "exc_info": reason})
            p.expire(job_key, 7 * 24 * 3600)
            p.execute()
        registry = FailedJobRegistry(self.queue.name, connection=self.redis,
                                     serializer=MsgpackSerializer)
        self.redis.zadd(registry.key, {job_id: now().timestamp() + 7 * 24 * 3600})
