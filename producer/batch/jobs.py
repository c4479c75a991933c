"""The jobs of a sweep in Redis: one record per input line in flight, and the bulk reads
(one pipelined round trip for any number of jobs) the sweep polls them with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.batch.lines import Request
from mlxq.producer.listing import served as served  # the check `mlxq submit` makes too
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


def _replies(p: Any) -> list[Any]:
    """A pipeline's replies, where a key of another type (a rogue write) answers as its
    error, for the caller to read as "no such job"; any other error is raised (one that
    passes must not read as a vanished job, which would be submitted again)."""
    replies: list[Any] = p.execute(raise_on_error=False)
    for r in replies:
        if isinstance(r, Exception) and not str(r).startswith("WRONGTYPE"):
            raise r
    return replies


def _state(raw: Any) -> str | None:
    if isinstance(raw, Exception):  # its job key of another type: no job of this sweep's
        return None
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
        return [_state(raw) for raw in _replies(p)]


def results(connection: redis.Redis, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
    """Per job, the fields of its latest rq result entry (None when it has none)."""
    if not ids:
        return []
    with connection.pipeline(transaction=False) as p:
        for job_id in ids:
            p.xrevrange(keys.results_key(job_id), count=1)
        replies = _replies(p)
    # A results key of another type reads as no result (the line is answered as failed).
    return [None if isinstance(e, Exception) else latest_fields(e) for e in replies]
