"""Every exception the producer side raises on purpose, in one place.

Two kinds live elsewhere, with the layer that raises them: the worker's own (a lost
lease) in :mod:`mlxq.worker.errors`, and the gateway's HTTP answers
(:class:`~mlxq.producer.gateway.errors.APIError`, which needs Starlette) in
:mod:`mlxq.producer.gateway.errors`. The modules that raised the ones below before
they moved here re-export them, so ``from mlxq.producer.client import QueueFull`` works.
"""

from __future__ import annotations


class MlxqError(Exception):
    """Base class of mlxq's own errors."""


class SetupError(MlxqError):
    """A command cannot start: Redis cannot be reached, a model cannot be loaded. The
    message says what failed, where, and what to do."""


class PayloadError(MlxqError, ValueError):
    """A job payload is malformed: wrong type, bad value, undecodable bytes.

    Raised by the producer before anything reaches Redis, and by the worker on
    what it reads back (a rogue producer can write Redis directly).
    """


class JobFailed(MlxqError):
    """The job ended failed (or canceled, when a result was asked for).

    Attributes:
        job_id: The job's id.
        reason: Why it failed, as the worker recorded it.
    """

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id} failed: {reason}")
        self.job_id = job_id
        self.reason = reason


class StreamGap(JobFailed):
    """The job ended, but its log lacks chunks this listener never saw (lost to a Redis
    without persistence, or refused): the text would be wrong, so it is not given."""


class JobTimeout(MlxqError, TimeoutError):
    """Waiting on a job (stream or result) took longer than the caller allowed."""


class NoSuchJob(MlxqError, LookupError):
    """No job with that id exists (never did, or its records expired)."""


class InvalidRequest(PayloadError):
    """An OpenAI-style request body is malformed; ``param`` names the field.

    Attributes:
        param: The body field at fault (``"messages[0].content"``, ``"max_tokens"``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(MlxqError):
    """The queue holds ``max_queued`` jobs already; try later."""


class QueueBroken(MlxqError):
    """The queue's Redis key holds another type than a list (a rogue write): nothing can be
    queued there until it is deleted (it holds no job). The message names the key."""


class JobIdInUse(MlxqError, ValueError):
    """A job id given to ``submit``/``submit_many`` is a live job's (queued or running), or
    its key holds something that is no job record. The message names the id."""


class NotReplicated(MlxqError):
    """A submit wrote its jobs on the primary, but ``WAIT`` saw fewer replicas confirm
    them than ``wait_replicas`` asked within the timeout: the jobs may still run, and may
    be lost if the primary fails before its replicas catch up.

    Submitting again with the same ids is safe: a job still live with the same request is
    not queued twice (``client.submit_many(jobs, job_ids=e.job_ids)``).

    Attributes:
        asked: The replicas asked for.
        reached: The replicas that confirmed.
        job_ids: Every id of the call, in order (those after the unconfirmed slice were
            not sent).
    """

    def __init__(self, asked: int, reached: int, timeout_s: float, job_ids: list[str]) -> None:
        what = f"job {job_ids[0]}" if len(job_ids) == 1 else f"{len(job_ids)} jobs"
        super().__init__(
            f"{what}: only {reached} of {asked} replicas confirmed the submit within "
            f"{timeout_s:g} s (wait_replicas={asked}): it may still run, but a failover now "
            "could lose it; submitting again with the same job ids is safe"
        )
        self.asked, self.reached, self.job_ids = asked, reached, job_ids


class BatchLocked(MlxqError):
    """Another ``mlxq run-batch`` run is writing the same output file."""


class Interrupted(Exception):
    """A stop was asked for while a sweep's Redis call was being retried.

    Not an :class:`MlxqError`: the sweep catches it to end cleanly; it never reaches a user.
    """
