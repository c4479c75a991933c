"""Reads of the state every process shares, safe whatever one key there holds.

rq's sets of queues (``rq:queues``) and workers (``rq:workers``), each queue's list and
registries, each worker's rq record: any client with write access can put anything there
(another tool, a typo in redis-cli, an attacker). rq's own readers fail for all on one bad
entry (``Queue.all`` and ``Worker.all`` raise on one member or field they cannot parse)
and its counts clean registries up, i.e. write. So the readers of shared state (``mlxq
info``, the gateway, the dashboard's lists) read it here, by hand:

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


def _count_keys(queue: str) -> list[tuple[str, str]]:
    """(state, key) of each key the counts of ``queue`` read."""
    return [("queued", keys.queue_key(queue)), *((s, k(queue)) for s, k in REGISTRIES.items())]


def holding(connection: redis.Redis, queues: list[str]) -> list[str]:
    """The queues of which some key exists (EXISTS answers whatever a key's type)."""
    with connection.pipeline(transaction=False) as p:
        for q in queues:
            p.exists(*(k for _, k in _count_keys(q)))
        held = p.execute(raise_on_error=False)
    return [q for q, n in zip(queues, held, strict=True) if isinstance(n, int) and n > 0]


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
    """Each queue's jobs by state (:data:`COUNTS`), sorted by name.

    Two pipelines, whatever the number of queues (rq never forgets a queue name, so there
    may be thousands): the first finds the queues that hold anything, the second counts
    those. A queue with no jobs is left out unless it is in ``keep`` (those a worker
    serves); a queue whose list or a registry has another type is left out, told to
    ``warn``.
    """
    names = sorted(set(queues))
    wanted = sorted(set(holding(connection, names)) | (set(keep) & set(names)))
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
        elif q in keep or any(counts.values()):
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
