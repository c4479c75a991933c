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
