"""Which jobs a queue holds, newest first, and one job's details: what the dashboard and
``mlxq jobs`` / ``mlxq status`` list.

Reads rq's own queue list and registries, and from each job's hash only its status and
timestamps (never its payload, which can be a megabyte of prompt), all in one pipeline.
Nothing here writes: registries are read without rq's cleanup pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import redis
from rq.job import Job as RqJob
from rq.utils import as_text

from mlxq.producer import keys, shared
from mlxq.producer.outcome import STATUS_OF_RQ
from mlxq.producer.result import latest_failure, latest_fields, reason_of
from mlxq.producer.shared import Warn

log = logging.getLogger("mlxq.producer")

STATUSES = ("queued", "started", "finished", "failed", "canceled")
_FIELDS = ("status", "origin", "enqueued_at", "started_at", "ended_at")


def _newest_ids(
    connection: redis.Redis, queues: list[str], wanted: Sequence[str], limit: int, warn: Warn
) -> dict[str, str | None]:
    """The newest ``limit`` job ids of each wanted state in each queue, with their queue:
    one pipeline for all (errors returned: a key of another type costs only its own
    list, told to ``warn``), over only the queues that hold anything. Asked for queued
    jobs, it adds those the queues' workers claimed and have not started (in their WIP
    lists, no longer in the queue's), with None for their queue: their record says which
    (:func:`recent_jobs` keeps those of ``queues``)."""
    holds, workers = shared.survey(connection, queues, warn)
    reads = [(q, s) for q in holds for s in wanted]
    if "queued" not in wanted:
        workers = []
    with connection.pipeline(transaction=False) as p:
        for q, s in reads:
            if s == "queued":
                # Producers push on the right; the newest are at the end of the list.
                p.lrange(keys.queue_key(q), -limit, -1)
            else:
                # Scores are expiry times, so the highest are (near enough) the latest.
                p.zrange(shared.REGISTRIES[s](q), 0, limit - 1, desc=True)
        shared.read_wips(p, workers)
        replies = iter(p.execute(raise_on_error=False))
    found: dict[str, str | None] = {}
    for q, s in reads:
        ids = next(replies)
        if isinstance(ids, Exception):
            warn(f"skipped the {s} jobs of queue {shared.shown(q)}: {ids}")
            continue
        for raw in ids:
            # The started registry holds "<job id>:<execution id>".
            job_id = (shared.text(raw) or "").split(":")[0]
            if shared.JOB_ID.fullmatch(job_id):
                found[job_id] = q
    for job_id in shared.held_ids(workers, replies, warn):
        found.setdefault(job_id, None)
    return found


def _queues(connection: redis.Redis, queue: str | None, warn: Warn) -> list[str]:
    return [queue] if queue is not None else shared.queue_names(connection, warn)


def recent_jobs(
    connection: redis.Redis,
    queue: str | None = None,
    status: str | Sequence[str] | None = None,
    limit: int = 50,
    warn: Warn = log.warning,
) -> list[dict[str, Any]]:
    """The latest jobs, newest activity first.

    Queued jobs are all that wait to start: in the queue's list, or claimed by a worker
    ahead of a free row (buffered: in its WIP list, as ``mlxq status`` says, queued).

    Args:
        connection: Redis holding the queues.
        queue: One queue's jobs; None: every queue rq knows.
        status: Only jobs in this state (or these states), of :data:`STATUSES`.
        limit: Most jobs returned (and most read from each registry).
        warn: Told of each list or registry skipped as unreadable, and of job records of
            another type.

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
    queues = _queues(connection, queue, warn)
    found = _newest_ids(connection, queues, wanted, limit, warn)
    listed = set(queues)
    with connection.pipeline(transaction=False) as p:
        for job_id in found:
            p.hmget(keys.job_key(job_id), _FIELDS)
        rows = p.execute(raise_on_error=False)
    now = datetime.now(timezone.utc).timestamp()
    jobs = []
    for (job_id, q_name), row in zip(found.items(), rows, strict=True):
        if isinstance(row, Exception):
            warn(f"skipped job {job_id} ({keys.job_key(job_id)}): {row}")
            continue
        raw_status, origin, *times = row
        state = STATUS_OF_RQ.get(shared.text(raw_status) or "", "")
        if state not in wanted:  # expired, or moved on since the registry was read
            continue
        if q_name is None:  # held by a worker (running or buffered): its origin says whose
            q_name = shared.text(origin)
            if q_name not in listed:
                continue
        enqueued, started, ended = (shared.epoch(t) for t in times)
        jobs.append(
            {
                "id": job_id,
                "queue": shared.text(origin) or q_name,
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
    for j in jobs:
        j.setdefault("failure_reason", "canceled" if j["status"] == "canceled" else None)
    if not failed:
        return jobs
    with connection.pipeline(transaction=False) as p:
        for j in failed:
            p.xrevrange(keys.results_key(j["id"]), count=1)
        entries = p.execute(raise_on_error=False)
    for j, e in zip(failed, entries, strict=True):
        # A result log of another type (a rogue key) says nothing: that job's reason only.
        j["failure_reason"] = "unknown" if isinstance(e, Exception) else reason_of(latest_fields(e))
    return jobs


def served(connection: redis.Redis, queue: str) -> bool:
    """Whether a live worker (one holding its lease) serves ``queue``.

    Raises:
        redis.ResponseError: the queue's roll is of another type (callers only lose advice).
    """
    raw: Any = connection.smembers(keys.workers_key(queue))
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]
    with connection.pipeline(transaction=False) as p:
        for name in names:
            p.type(keys.alive_key(name))
        return any(keys.lease_held(t) for t in p.execute(raise_on_error=False))


def job_queue(connection: redis.Redis, job_id: str) -> str | None:
    """The queue a job was submitted to, or None when no such job exists."""
    try:
        raw = connection.hget(keys.job_key(job_id), "origin")
    except redis.ResponseError:  # a record of another type is no job's
        return None
    return shared.text(raw) or None


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
    enqueued, started, ended = (shared.epoch(t) for t in times)
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


def failure_reasons(
    connection: redis.Redis, job_ids: Sequence[str], warn: Warn = log.warning
) -> dict[str, str]:
    """Why each of these failed jobs failed (the last line of its latest failure, read
    with a size limit), in one pipeline; a result log of another type reads as unreadable,
    told to ``warn``."""
    with connection.pipeline(transaction=False) as p:
        for job_id in job_ids:
            p.xrevrange(keys.results_key(job_id), count=1)
        replies = p.execute(raise_on_error=False)
    out = {}
    for job_id, entries in zip(job_ids, replies, strict=True):
        if isinstance(entries, Exception):
            warn(f"job {job_id}: its result log {keys.results_key(job_id)}: {entries}")
            out[job_id] = "unknown (its failure record is unreadable)"
        else:
            out[job_id] = reason_of(latest_fields(entries))
    return out
