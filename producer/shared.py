"""Reads of the state every process shares, safe whatever one key there holds.

rq's sets of queues (``rq:queues``) and workers (``rq:workers``), each queue's list and
registries, each worker's rq record, mlxq's rolls of workers and their WIP lists: any
client with write access can put anything there (another tool, a typo in redis-cli, an
attacker). rq's own readers fail for all on one bad entry (``Queue.all`` and ``Worker.all``
raise on one member or field they cannot parse) and its counts clean registries up, i.e.
write. So the readers of shared state (``mlxq info``, the gateway, the dashboard's lists)
read it here, by hand:

- set members and record fields are parsed one by one; one that is not as rq writes it
  (not UTF-8, not ``rq:queue:<name>``, a ``birth`` that is no date) is skipped;
- per-queue and per-worker reads go in one pipeline each, errors returned, not raised, so
  a key of another type costs its own queue or worker, never the rest;
- what is skipped is told to ``warn`` (a :class:`~mlxq.producer.throttle.Throttle` in
  long-lived readers), one line per bad entry;
- nothing here writes.

Redis being away still raises (``redis.ConnectionError``): that is no entry to skip.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis

from mlxq.producer import keys

Warn = Callable[[str], None]

#: Longest queue or worker name read from a shared set (mlxq's queue names are at most
#: 128 characters): a longer member is garbage, skipped.
MAX_NAME_CHARS = 256
#: rq's registries of a queue, by the state whose jobs they hold.
REGISTRIES: Mapping[str, Callable[[str], str]] = {
    "started": keys.started_registry,
    "finished": keys.finished_registry,
    "failed": keys.failed_registry,
    "canceled": keys.canceled_registry,
}
#: The counts of a queue, in ``mlxq info``'s order.
COUNTS = ("queued", *REGISTRIES)
#: Registries scored by expiry time, whose expired entries rq drops when it counts them
#: (the reads here leave them, and do not count them).
_EXPIRING = frozenset({"finished", "failed"})
#: Most entries read from one worker's WIP list: a worker holds its rows and a buffer of
#: jobs ahead of them (a few hundred at most); a longer list is read this far.
MAX_HELD = 4096
#: rq's timestamps (``2026-12-02T17:33:01.123456Z``), and its older form without micros.
_RQ_TIMES = ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ")
_WORKER_FIELDS = ("state", "queues", "birth")
#: What a job id is (as :meth:`Client.submit_many` checks ``job_ids``; mlxq's own ids are
#: uuid4 hex): a registry entry whose id is not one is garbage, skipped.
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def shown(raw: Any, limit: int = 60) -> str:
    """A value read from Redis as a warning quotes it: its repr, cut to ``limit`` chars."""
    r = repr(raw)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} chars)"


def text(raw: Any) -> str | None:
    """A reply as text; None when it is missing or not UTF-8."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, bytes):
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return None
    return None


def epoch(raw: Any) -> float | None:
    """One of rq's UTC timestamps as Unix seconds; None when missing or not one."""
    t = text(raw)
    for fmt in _RQ_TIMES if t else ():
        try:
            return datetime.strptime(t, fmt).replace(tzinfo=timezone.utc).timestamp()  # type: ignore[arg-type]
        except ValueError:
            continue
    return None


def _name(raw: Any, prefix: str = "") -> str | None:
    """The name in ``raw`` (after ``prefix``), if it is one: UTF-8, 1 to
    :data:`MAX_NAME_CHARS` characters."""
    t = text(raw)
    if t is None or not t.startswith(prefix):
        return None
    name = t[len(prefix) :]
    return name if 0 < len(name) <= MAX_NAME_CHARS else None


def names_in(connection: redis.Redis, set_key: str, prefix: str, warn: Warn) -> list[str]:
    """The names in one of rq's sets of keys (``rq:queues``, ``rq:workers``), sorted.

    A set of another type reads as empty, a member that is not ``<prefix><name>`` is
    skipped; each told to ``warn``.
    """
    try:
        members = connection.smembers(set_key)
    except redis.ResponseError as e:
        warn(f"skipped {set_key}: {e}")
        return []
    names, bad = set(), []
    for m in members:
        name = _name(m, prefix)
        if name is None:
            bad.append(m)
        else:
            names.add(name)
    if bad:
        warn(
            f"skipped {len(bad)} member(s) of {set_key} that name no {prefix}<name> key "
            f"(one: {shown(min(bad))})"
        )
    return sorted(names)


def holding(connection: redis.Redis, queues: list[str]) -> list[str]:
    """The queues of which some key exists (EXISTS answers whatever a key's type)."""
    with connection.pipeline(transaction=False) as p:
        for q in queues:
            p.exists(*(k for _, k in _count_keys(q)))
        held = p.execute(raise_on_error=False)
    return [q for q, n in zip(queues, held, strict=True) if isinstance(n, int) and n > 0]


def survey(connection: redis.Redis, queues: list[str], warn: Warn) -> tuple[list[str], list[str]]:
    """:func:`holding`'s queues, and the mlxq workers that serve or served any of them
    (their rolls, ``mlxq:workers:<queue>``: whose WIP lists may hold their jobs), sorted;
    in one pipeline. A roll of another type or a member that is no name is skipped, told
    to ``warn``."""
    with connection.pipeline(transaction=False) as p:
        for q in queues:
            p.exists(*(k for _, k in _count_keys(q)))
            p.smembers(keys.workers_key(q))
        replies = p.execute(raise_on_error=False)
    held: list[str] = []
    workers: set[str] = set()
    for q, n, members in zip(queues, replies[::2], replies[1::2], strict=True):
        if isinstance(n, int) and n > 0:
            held.append(q)
        if isinstance(members, Exception):
            warn(f"skipped {keys.workers_key(q)}: {members}")
            continue
        names = {m: _name(m) for m in members}
        if bad := [m for m, name in names.items() if name is None]:
            warn(
                f"skipped {len(bad)} member(s) of {keys.workers_key(q)} that are no worker "
                f"name (one: {shown(min(bad))})"
            )
        workers.update(name for name in names.values() if name is not None)
    return held, sorted(workers)


# -- jobs a worker claimed and has not started ---------------------------------------------
#
# A worker claims jobs ahead of its free rows (claim.lua): each moves from the queue's list
# into the worker's WIP list, its record still ``status: queued`` (with ``mlxq_owner``), until
# it starts. Such a job is in neither rq's queue list nor a registry: these reads find it.


def read_wips(p: redis.client.Pipeline, workers: list[str]) -> None:
    """Queue on ``p`` the reads :func:`held_ids` parses: each worker's WIP list, at most
    :data:`MAX_HELD` entries."""
    for w in workers:
        p.lrange(keys.wip_key(w), 0, MAX_HELD - 1)


def held_ids(workers: list[str], replies: Iterator[Any], warn: Warn) -> dict[str, str]:
    """The ids in the workers' WIP lists (the next ``len(workers)`` replies of
    :func:`read_wips`), each once, with the worker holding it: running and buffered alike
    (the job's own status tells them apart). A list of another type, or an entry that is
    no job id, is skipped, told to ``warn``."""
    out: dict[str, str] = {}
    for w in workers:
        ids = next(replies)
        if isinstance(ids, Exception):
            warn(f"skipped {keys.wip_key(w)}: {ids}")
            continue
        bad = []
        for raw in ids:
            job_id = text(raw)
            if job_id is not None and JOB_ID.fullmatch(job_id):
                out.setdefault(job_id, w)
            else:
                bad.append(raw)
        if bad:
            warn(
                f"skipped {len(bad)} entries of {keys.wip_key(w)} that are no job id "
                f"(one: {shown(min(bad))})"
            )
    return out


def buffered(
    connection: redis.Redis, queues: Collection[str], workers: list[str], warn: Warn
) -> dict[str, list[str]]:
    """The jobs of ``queues`` that ``workers`` claimed and have not started, by queue
    (each worker's in the order it claimed them); two pipelines, none without workers.

    A job counts where its record says ``status: queued`` and its ``origin`` (the queue it
    was claimed from) is one of ``queues``; a record of another type is skipped, told to
    ``warn``.
    """
    if not workers:
        return {}
    with connection.pipeline(transaction=False) as p:
        read_wips(p, workers)
        held = held_ids(workers, iter(p.execute(raise_on_error=False)), warn)
    if not held:
        return {}
    with connection.pipeline(transaction=False) as p:
        for job_id in held:
            p.hmget(keys.job_key(job_id), "status", "origin")
        rows = p.execute(raise_on_error=False)
    out: dict[str, list[str]] = {}
    for job_id, row in zip(held, rows, strict=True):
        if isinstance(row, Exception):
            warn(f"skipped job {job_id} ({keys.job_key(job_id)}): {row}")
            continue
        q = text(row[1])
        if text(row[0]) == "queued" and q is not None and q in queues:
            out.setdefault(q, []).append(job_id)
    return out


def _count_keys(queue: str) -> list[tuple[str, str]]:
    """(state, key) of each key the counts of ``queue`` read."""
    return [("queued", keys.queue_key(queue)), *((s, k(queue)) for s, k in REGISTRIES.items())]


def _counts_of(queue: str, replies: Iterator[Any]) -> tuple[dict[str, int], list[str]]:
    """One queue's counts from its replies (as :func:`queue_counts` asked), and what was
    wrong with its keys."""
    counts, wrong = {}, []
    for state, key in _count_keys(queue):
        n = next(replies)
        if state in _EXPIRING:
            expired = next(replies)
            if isinstance(n, int) and isinstance(expired, int):
                n -= expired
        if isinstance(n, int):
            counts[state] = n
        else:
            wrong.append(f"{key}: {n}")
    return counts, wrong


def queue_counts(
    connection: redis.Redis, queues: Iterable[str], warn: Warn, keep: Collection[str] = ()
) -> dict[str, dict[str, int]]:
    """Each queue's jobs by state (:data:`COUNTS`, then ``buffered``), sorted by name.

    ``queued`` counts every job waiting to start: those in rq's queue list and those a
    worker claimed ahead of a free row (:func:`buffered`), which ``buffered`` counts
    apart (a part of ``queued``, not beside it).

    A few pipelines, whatever the number of queues (rq never forgets a queue name, so
    there may be thousands): the first finds the queues that hold anything and the
    workers that serve them, two more the jobs those workers hold, the last counts. A
    queue with no jobs is left out unless it is in ``keep`` (those a worker serves); a
    queue whose list or a registry has another type is left out, told to ``warn``.
    """
    names = sorted(set(queues))
    holds, workers = survey(connection, names, warn)
    held = buffered(connection, set(names), workers, warn)
    wanted = sorted(set(holds) | (set(keep) & set(names)) | set(held))
    now = time.time()
    with connection.pipeline(transaction=False) as p:
        for q in wanted:
            for state, key in _count_keys(q):
                if state == "queued":
                    p.llen(key)
                else:
                    p.zcard(key)
                if state in _EXPIRING:
                    p.zcount(key, 0, now)
        replies = iter(p.execute(raise_on_error=False))
    out = {}
    for q in wanted:
        counts, wrong = _counts_of(q, replies)
        if wrong:
            warn(f"skipped queue {shown(q)}: {'; '.join(wrong)}")
            continue
        counts["buffered"] = len(held.get(q, ()))
        counts["queued"] += counts["buffered"]
        if q in keep or any(counts.values()):
            out[q] = counts
    return out


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What rq's record of a worker says: its name, state, queues and start (Unix s)."""

    name: str
    state: str
    queues: tuple[str, ...]
    birth: float | None


def _record(name: str, fields: list[Any], warn: Warn) -> WorkerRecord:
    """A worker's record from its ``state``, ``queues`` and ``birth``; a field not as rq
    writes it is left out, told to ``warn``."""
    state, queues, birth = fields
    key = keys.rq_worker_key(name)
    listed = (text(queues) or "").split(",") if queues else []
    names = [q for q in map(_name, listed) if q is not None]
    if len(names) < len(listed) or (queues and text(queues) is None):
        warn(f"worker {shown(name)}: skipped queue names in {key} queues={shown(queues)}")
    born = epoch(birth)
    if birth and born is None:
        warn(f"worker {shown(name)}: {key} birth={shown(birth)} is no date: its uptime is unknown")
    return WorkerRecord(name, _name(state) or "?", tuple(names), born)


def worker_records(connection: redis.Redis, warn: Warn) -> list[WorkerRecord]:
    """Every worker rq lists, by name, in one pipeline.

    A record of another type is left out, told to ``warn``; a record that is gone (rq keeps
    a worker's name in its set a while after its record expired) is left out silently.
    """
    names = names_in(connection, keys.RQ_WORKERS, keys.RQ_WORKER, warn)
    with connection.pipeline(transaction=False) as p:
        for name in names:
            p.hmget(keys.rq_worker_key(name), _WORKER_FIELDS)
        replies = p.execute(raise_on_error=False)
    out = []
    for name, fields in zip(names, replies, strict=True):
        if isinstance(fields, Exception):
            warn(f"skipped worker {shown(name)}: {keys.rq_worker_key(name)}: {fields}")
        elif any(f is not None for f in fields):
            out.append(_record(name, fields, warn))
    return out


def queue_names(connection: redis.Redis, warn: Warn) -> list[str]:
    """Every queue rq knows (``rq:queues``), sorted."""
    return names_in(connection, keys.RQ_QUEUES, keys.RQ_QUEUE, warn)
