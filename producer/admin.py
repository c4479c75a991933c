"""Retry ended jobs and purge a queue's jobs: ``mlxq retry`` and ``mlxq purge``.

rq's own ``rq requeue`` and ``rq empty`` do not know the fields mlxq keeps in a job's
record (which worker owns it, its runs, a pending cancel) nor its replay log: the README
says what they do to mlxq jobs. These do the same work the mlxq way, each change one
atomic script call (``lua/retry.lua``, ``lua/purge.lua``) against the workers' claims and
ends, many calls to one round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Queue

from mlxq.producer import keys, scripts
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.errors import MlxqError

#: The states ``retry`` takes a job out of.
RETRYABLE = ("failed", "canceled")
#: The states ``purge`` deletes jobs in: every one but ``started`` (a running job is
#: canceled, not purged).
PURGEABLE = ("queued", "failed", "finished", "canceled")
#: Jobs per script call (and per round trip): short enough that Redis serves others
#: between two calls.
SLICE = 500

#: What a retry's verdicts other than a status mean, said after the job's id.
RETRY_ERRORS = {
    "oom": "not requeued: Redis is out of memory (maxmemory) and refused the write",
    "noqueue": "not requeued: its record names no queue (a rogue write)",
    "badqueue": "not requeued: its queue's key holds another type than a list (a rogue write)",
}

_REGISTRY = {
    "failed": keys.failed_registry,
    "finished": keys.finished_registry,
    "canceled": keys.canceled_registry,
}


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def box(queue: str, state: str) -> str:
    """Where jobs of ``queue`` in ``state`` are listed: its list, or the state's registry."""
    return keys.queue_key(queue) if state == "queued" else _REGISTRY[state](queue)


def queue_names(connection: redis.Redis, queue: str | None) -> list[str]:
    """``[queue]``, or (None) every queue rq knows, by name."""
    if queue is not None:
        return [queue]
    return sorted(q.name for q in Queue.all(connection=connection, serializer=MsgpackSerializer))


def listed(connection: redis.Redis, queue: str, state: str) -> list[str]:
    """The ids of ``queue``'s jobs in ``state``, oldest first (the queue's head first).

    Raises:
        MlxqError: the key that lists them holds another type (a rogue write).
    """
    key = box(queue, state)
    kind = _text(connection.type(key))
    want = "list" if state == "queued" else "zset"
    if kind == "none":
        return []
    if kind != want:
        raise MlxqError(
            f"{key} holds a {kind}, not rq's {want} of {state} jobs (a rogue write): "
            f"nothing there can be listed; delete it (redis-cli DEL {key})"
        )
    raw = connection.lrange(key, 0, -1) if want == "list" else connection.zrange(key, 0, -1)
    return [_text(i) for i in raw]


def retry(connection: redis.Redis, job_ids: Sequence[str]) -> list[str]:
    """Requeue each job that failed or was canceled, as a new attempt of its request.

    Returns:
        One verdict per id, in order: ``requeued``; ``nosuch``; its status when that is
        no failed or canceled one; ``oom`` (Redis refused the write); ``noqueue`` (its
        record names no queue) or ``badqueue`` (its queue's key holds another type).
    """
    out: list[str] = []
    now = datetime.now(timezone.utc)
    for i in range(0, len(job_ids), SLICE):
        calls = [scripts.retry(job_id, now) for job_id in job_ids[i : i + SLICE]]
        out += scripts.run(connection, calls)
    return out


def purge(connection: redis.Redis, queue: str, state: str, job_ids: Iterable[str]) -> int:
    """Delete those of ``job_ids`` that are still listed in ``queue`` in ``state`` (as
    :func:`listed` gave them), with their results and replay logs; how many were.

    Raises:
        MlxqError: the key that lists them holds another type (a rogue write).
    """
    ids, n = list(job_ids), 0
    key = box(queue, state)
    for i in range(0, len(ids), SLICE):
        done, kind = scripts.call(connection, scripts.purge(key, state, ids[i : i + SLICE]))
        if kind:
            raise MlxqError(f"{key} holds a {kind} (a rogue write): nothing purged from it")
        n += done
    return n
