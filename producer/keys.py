"""Every Redis key and channel name mlxq uses, in one place.

rq owns its own keys (``rq:queue:<name>``, ``rq:job:<id>``, its registries);
these are the ones mlxq adds beside them, all under one prefix.
"""

from __future__ import annotations

PREFIX = "mlxq"

#: rq's function reference stored in every mlxq job. The worker never imports
#: or calls it: it only checks that a job it dequeued carries this name.
JOB_FUNC = "mlxq.worker.generate"


def stream_key(job_id: str) -> str:
    """The job's replay log: a Redis stream of chunks, entry id ``0-<seq>``."""
    return f"{PREFIX}:stream:{job_id}"


def channel(job_id: str) -> str:
    """The job's live pub/sub channel: the same chunks as the stream, as they are made."""
    return f"{PREFIX}:chan:{job_id}"


def worker_stats_key(worker_name: str) -> str:
    """A hash of the worker's counters and model, read by ``mlxq info``."""
    return f"{PREFIX}:worker:{worker_name}"


def cancel_channel(queue: str) -> str:
    """Where producers announce cancels of running jobs to that queue's workers."""
    return f"{PREFIX}:cancel:{queue}"


def cancel_set(queue: str) -> str:
    """Running jobs asked to cancel and not yet seen by a worker (the durable twin
    of :func:`cancel_channel`, for a worker that was reconnecting)."""
    return f"{PREFIX}:cancels:{queue}"


def wip_key(worker_name: str) -> str:
    """Every job a worker holds (buffered or running), moved there atomically from the
    queue; a dead worker's list is how its jobs are found and requeued."""
    return f"{PREFIX}:wip:{worker_name}"


def alive_key(worker_name: str) -> str:
    """Set with a short expiry by a live worker's heartbeat thread; value ``host:pid``."""
    return f"{PREFIX}:alive:{worker_name}"


def workers_key(queue: str) -> str:
    """Names of the mlxq workers serving ``queue``, dead or alive (the reaper's roll)."""
    return f"{PREFIX}:workers:{queue}"


def reap_lock(worker_name: str) -> str:
    """Held by the one worker that requeues a dead worker's jobs."""
    return f"{PREFIX}:reaping:{worker_name}"
