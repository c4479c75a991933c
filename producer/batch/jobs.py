"""The jobs of a sweep in Redis: one record per input line in flight, and the bulk reads
(one pipelined round trip for any number of jobs) the sweep polls them with."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.batch.lines import Request
from mlxq.producer.listing import served as served  # the check `mlxq submit` makes too
from mlxq.producer.openai_api.tool_calls import AUTO, auto_needs_format
from mlxq.producer.outcome import TERMINAL, job_status
from mlxq.producer.result import latest_fields

LIVE = "live"
log = logging.getLogger("mlxq.batch")


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


class ToolFormats:
    """The tool-call format of each queue's model (what ``tool_choice="auto"`` answers
    are read in), read from its live workers' stats once per run, when first needed."""

    def __init__(self, connection: redis.Redis) -> None:
        self.redis = connection
        self._known: dict[str, str] = {}

    def of(self, queue: str) -> str:
        """The format every live worker of ``queue`` published; "" when they name none
        or differ."""
        if queue not in self._known:
            from mlxq.producer.info import collect  # as `mlxq info` and the gateway read

            formats = {
                str(w.get("tool_format") or "")
                for w in collect(self.redis, log.warning)["workers"]
                if w.get("alive", True) and queue in str(w.get("queue", "")).split(",")
            }
            self._known[queue] = formats.pop() if len(formats) == 1 else ""
        return self._known[queue]

    def unread(self, request: Request) -> str | None:
        """Why the calls of ``request``'s answer cannot be read (``auto`` on a model of
        no format mlxq reads), or None."""
        if request.req.tool_calls != AUTO:
            return None
        return auto_needs_format(self.of(request.queue))
