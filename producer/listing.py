"""Which jobs a queue holds, newest first, and one job's details: what the dashboard and
``mlxq jobs`` / ``mlxq status`` list.

Reads rq's own queue list and registries, and from each job's hash only its status and
timestamps (never its payload, which can be a megabyte of prompt), all in one pipeline.
Nothing here writes: registries are read without rq's cleanup pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Queue
from rq.job import Job as RqJob
from rq.utils import as_text

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.outcome import STATUS_OF_RQ
from mlxq.producer.result import latest_failure, latest_fields, reason_of

STATUSES = ("queued", "started", "finished", "failed", "canceled")
_FIELDS = ("status", "origin", "enqueued_at", "started_at", "ended_at")


def _epoch(raw: Any) -> float | None:
    """rq's UTC timestamps (``2026-12-02T17:33:01.123456Z``) as Unix seconds."""
    text = as_text(raw) if raw else ""
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            continue
    return None


def _ids(q: Queue, status: str, limit: int) -> list[str]:
    """The newest ``limit`` job ids of one state in ``q``."""
    if status == "queued":
        # Producers push on the right; the newest are at the end of the list.
        return q.get_job_ids(offset=max(0, q.count - limit), length=limit)
    registry = {
        "started": q.started_job_registry,
        "finished": q.finished_job_registry,
        "failed": q.failed_job_registry,
        "canceled": q.canceled_job_registry,
    }[status]
    # Scores are expiry times, so the highest are (near enough) the latest to arrive.
    return list(registry.get_job_ids(0, limit - 1, desc=True, cleanup=False))


def _queues(connection: redis.Redis, queue: str | None) -> list[Queue]:
    if queue is not None:
        return [Queue(queue, connection=connection, serializer=MsgpackSerializer)]
    return list(Queue.all(connection=connection, serializer=MsgpackSerializer))


def recent_jobs(
    connection: redis.Redis,
    queue: str | None = None,
    status: str | Sequence[str] | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """The latest jobs, newest activity first.

    Args:
        connection: Redis holding the queues.
        queue: One queue's jobs; None: every queue rq knows.
        status: Only jobs in this state (or these states), of :data:`STATUSES`.
        limit: Most jobs returned (and most read from each registry).

    Returns:
        ``[{"id", "queue", "status", "enqueued_at", "started_at", "ended_at", "age_s",
        "duration_s", "failure_reason"}]``; times are Unix seconds or None, ``age_s``
        counts from enqueue, ``duration_s`` from start to end (or to now while running);
        ``failure_reason`` is set for failed jobs (the last line of the worker's reason)
        and canceled ones (``"canceled"``), as ``mlxq status`` shows it.

    Raises:
        ValueError: ``status`` names no state, or ``limit`` is below 1.
    """
    wanted = (status,) if isinstance(status, str) else tuple(status or STATUSES)
    if bad := [s for s in wanted if s not in STATUSES]:
        raise ValueError(f"status={bad!r}: must be among {', '.join(STATUSES)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit={limit!r}: must be an integer >= 1")
    found: dict[str, str] = {}  # id -> queue
    for q in _queues(connection, queue):
        for s in wanted:
            found.update(dict.fromkeys(_ids(q, s, limit), q.name))
    with connection.pipeline(transaction=False) as p:
        for job_id in found:
            p.hmget(RqJob.key_for(job_id), _FIELDS)
        rows = p.execute()
    now = datetime.now(timezone.utc).timestamp()
    jobs = []
    for (job_id, q_name), row in zip(found.items(), rows, strict=True):
        raw_status, origin, *times = row
        state = STATUS_OF_RQ.get(as_text(raw_status) if raw_status else "", "")
        if state not in wanted:  # expired, or moved on since the registry was read
            continue
        enqueued, started, ended = (_epoch(t) for t in times)
        jobs.append(
            {
                "id": job_id,
                "queue": as_text(origin) if origin else q_name,
                "status": state,
                "enqueued_at": enqueued,
                "started_at": started,
                "ended_at": ended,
                "age_s": None if enqueued is None else max(0.0, now - enqueued),
                "duration_s": None if started is None else max(0.0, (ended or now) - started),
            }
        )
    jobs.sort(
        key=lambda j: j["ended_at"] or j["started_at"] or j["enqueued_at"] or 0.0, reverse=True
    )
    return _with_reasons(connection, jobs[:limit])


def _with_reasons(connection: redis.Redis, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``jobs`` with their ``failure_reason``: the failed ones' read in one round trip."""
    failed = [j for j in jobs if j["status"] == "failed"]
    with connection.pipeline(transaction=False) as p:
        for j in failed:
            p.xrevrange(keys.results_key(j["id"]), count=1)
        entries = p.execute(raise_on_error=False)
    for j, e in zip(failed, entries, strict=True):
        # A result log of another type (a rogue key) says nothing: that job's reason only.
        j["failure_reason"] = "unknown" if isinstance(e, Exception) else reason_of(latest_fields(e))
    for j in jobs:
        j.setdefault("failure_reason", "canceled" if j["status"] == "canceled" else None)
    return jobs


def served(connection: redis.Redis, queue: str) -> bool:
    """Whether a live worker (one holding its lease) serves ``queue``."""
    raw: Any = connection.smembers(keys.workers_key(queue))
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]
    with connection.pipeline(transaction=False) as p:
        for name in names:
            p.exists(keys.alive_key(name))
        return any(p.execute())


def job_queue(connection: redis.Redis, job_id: str) -> str | None:
    """The queue a job was submitted to, or None when no such job exists."""
    raw = connection.hget(RqJob.key_for(job_id), "origin")
    return as_text(raw) if raw else None


def job_details(connection: redis.Redis, job_id: str) -> dict[str, Any] | None:
    """What ``mlxq status`` shows of one job, or None when no such job exists.

    Returns:
        ``{"id", "queue", "status", "attempts", "worker", "enqueued_at", "started_at",
        "ended_at", "queue_wait_s", "run_s", "failure_reason"}``: times are Unix seconds
        or None; ``queue_wait_s`` runs from enqueue to the latest start (or to now while
        queued), ``run_s`` from that start to the end (or to now while running);
        ``worker`` is the one that ran it last (or holds it now), None if none did;
        ``failure_reason`` is set for failed and canceled jobs.
    """
    fields = (*_FIELDS, "mlxq_attempt", "worker_name", "mlxq_owner")
    raw_status, origin, *times, attempts, worker, owner = connection.hmget(
        RqJob.key_for(job_id), fields
    )
    if raw_status is None:
        return None
    state = STATUS_OF_RQ.get(as_text(raw_status), "queued")
    enqueued, started, ended = (_epoch(t) for t in times)
    now = datetime.now(timezone.utc).timestamp()
    wait_end = started if started is not None else (None if state != "queued" else now)
    reason = None
    if state == "failed":
        reason = latest_failure(connection, job_id)
    elif state == "canceled":
        reason = "canceled"
    return {
        "id": job_id,
        "queue": as_text(origin) if origin else None,
        "status": state,
        "attempts": int(attempts) if attempts and as_text(attempts).isdigit() else 0,
        "worker": as_text(by) if (by := owner or worker) else None,
        "enqueued_at": enqueued,
        "started_at": started,
        "ended_at": ended,
        "queue_wait_s": None if enqueued is None or wait_end is None else wait_end - enqueued,
        "run_s": None if started is None else max(0.0, (ended or now) - started),
        "failure_reason": reason,
    }
