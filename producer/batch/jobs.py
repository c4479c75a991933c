"""The jobs of a sweep in Redis: one record per input line in flight, and the bulk reads
(one pipelined round trip for any number of jobs) the sweep polls them with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.batch.lines import Request
from mlxq.producer.outcome import TERMINAL, job_status
from mlxq.producer.result import latest_fields

LIVE = "live"


@dataclass(slots=True)
class Flight:
    """One job in Redis for one input line.

    Attributes:
        request: The line.
        job_id: Its job.
        inherited: Submitted by an earlier run (re-attached from the journal).
        tries: Jobs submitted for the line so far.
    """

    request: Request
    job_id: str
    inherited: bool = False
    tries: int = 1


def _state(raw: Any) -> str | None:
    status = job_status(raw)
    return status if status is None or status in TERMINAL else LIVE


def states(connection: redis.Redis, ids: Sequence[str]) -> list[str | None]:
    """Per job: ``finished``, ``failed``, ``canceled``, ``live`` (queued or running), or
    None (no such job: never submitted, or its records are gone)."""
    if not ids:
        return []
    with connection.pipeline(transaction=False) as p:
        for job_id in ids:
            p.hget(keys.job_key(job_id), "status")
        return [_state(raw) for raw in p.execute()]


def results(connection: redis.Redis, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
    """Per job, the fields of its latest rq result entry (None when it has none)."""
    if not ids:
        return []
    with connection.pipeline(transaction=False) as p:
        for job_id in ids:
            p.xrevrange(keys.results_key(job_id), count=1)
        return [latest_fields(entries) for entries in p.execute()]


def served(connection: redis.Redis, queue: str) -> bool:
    """Whether a live worker (one holding its lease) serves ``queue``."""
    raw: Any = connection.smembers(keys.workers_key(queue))
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]
    with connection.pipeline(transaction=False) as p:
        for name in names:
            p.type(keys.alive_key(name))
        return any(keys.lease_held(t) for t in p.execute())
