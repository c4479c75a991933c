"""The worker's Lua scripts (``lua/``): their keys, and one typed wrapper each.

A wrapper takes named arguments and returns a :class:`~mlxq.producer.scripts.Call`: the
script's KEYS and ARGV in the order the script reads them (its header comment lists them),
and the parser of its reply. Nothing else builds either list. Calls run one at a time
(:func:`~mlxq.producer.scripts.call`) or several in one round trip
(:func:`~mlxq.producer.scripts.run`). Here: the lease, roll and claim scripts; the
writer's (``chunks``, ``route``, ``end``, ``fail``, ``release``, ``start``) are beside the
one call that runs them, in :mod:`mlxq.worker.commit`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

from rq.utils import utcformat

from mlxq.producer import keys
from mlxq.producer.codec import MAX_JOB_DATA_BYTES, NOTICE
from mlxq.producer.scripts import Arg, Call, Script, load
from mlxq.worker.errors import LeaseLost
from mlxq.worker.logs import THROTTLE

log = logging.getLogger("mlxq.worker")

NAMES = (
    "claim",
    "start",
    "chunks",
    "end",
    "fail",
    "release",
    "reap",
    "beat",
    "rejoin",
    "refresh",
    "hand",
    "giveback",
    "leave",
    "route",
    "resync",
)
SCRIPTS: dict[str, Script] = {n: load("mlxq.worker", n) for n in NAMES}


def text(v: Any) -> str:
    """A reply's bytes as text (never raises)."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


@dataclass(frozen=True, slots=True)
class Now:
    """One moment, as rq writes it: a timestamp and its text."""

    ts: float
    text: str

    @classmethod
    def read(cls) -> Now:
        dt = datetime.now(timezone.utc)
        return cls(dt.timestamp(), utcformat(dt))


@dataclass(frozen=True, slots=True)
class WorkerKeys:
    """The keys of one worker that its scripts touch: its own, and its first queue's
    (each job's scripts write its own queue's registries; these are for a job whose record
    names none); ``rolls`` are the rolls of every queue it serves."""

    worker: str
    queue_name: str
    queue: str
    wip: str
    alive: str
    roll: str
    started: str
    rq_worker: str
    execs: str
    finished: str
    failed: str
    canceled: str
    handed: str
    blocker: str
    stats: str
    reaped: str
    rolls: tuple[str, ...] = ()

    @property
    def other_rolls(self) -> list[str]:
        return [r for r in self.rolls if r != self.roll]

    @classmethod
    def of(cls, queue: str, worker: str, queues: Sequence[str] = ()) -> WorkerKeys:
        """The keys of ``worker`` serving ``queue`` first, then the rest of ``queues``."""
        return cls(
            rolls=tuple(keys.workers_key(q) for q in dict.fromkeys([queue, *queues])),
            worker=worker,
            queue_name=queue,
            queue=keys.queue_key(queue),
            wip=keys.wip_key(worker),
            alive=keys.alive_key(worker),
            roll=keys.workers_key(queue),
            started=keys.started_registry(queue),
            rq_worker=keys.rq_worker_key(worker),
            execs=keys.rq_worker_executions(worker),
            finished=keys.finished_registry(queue),
            failed=keys.failed_registry(queue),
            canceled=keys.canceled_registry(queue),
            handed=keys.handed_key(worker),
            blocker=keys.blocker_key(worker),
            stats=keys.worker_stats_key(worker),
            reaped=keys.reaped_key(worker),
        )


def script_call(
    name: str, keys_: list[str], args: list[Arg], parse: Callable[[Any], Any]
) -> Call[Any]:
    """A call of the worker's script ``name``."""
    return Call(SCRIPTS[name], keys_, args, parse)


# -- lease and roll (the heartbeat) -------------------------------------------------------


def beat(k: WorkerKeys, token: str, lease_ms: int) -> Call[tuple[str, str]]:
    """Keep the lease and stay on the rolls: (``ok`` | ``renewed`` | ``reaped``, what was
    replaced: '' for nothing)."""
    return script_call(
        "beat",
        [k.alive, k.roll, k.reaped, *k.other_rolls],
        [token, k.worker, lease_ms],
        lambda r: (text(r[0]), text(r[1])),
    )


def giveback(k: WorkerKeys, token: str, cutoff_ms: int) -> Call[int]:
    """Jobs handed here before ``cutoff_ms`` and not claimed go back: how many."""
    return script_call("giveback", [k.alive, k.handed, k.wip, k.queue], [token, cutoff_ms], int)


def leave(k: WorkerKeys, token: str, settled: bool) -> Call[tuple[str, int]]:
    """Leave for good: (``left`` | ``stays``, how many handed jobs went back)."""
    return script_call(
        "leave",
        [k.alive, k.roll, k.stats, k.handed, k.wip, k.queue, *k.other_rolls],
        [token, k.worker, "1" if settled else ""],
        lambda r: (text(r[0]), int(r[1])),
    )


def _reap_keys(k: WorkerKeys) -> list[str]:
    return [k.alive, k.wip, k.queue, k.roll, k.started, k.execs, k.reaped, k.canceled]


def rejoin(
    k: WorkerKeys, token: str, now: Now, lease_ms: int, starting: str | None = None
) -> Call[int]:
    """Start over under a new token: how many entries went back to the queue. Starting
    (``starting``: the lease value found, '' for none): -1, and nothing done, when the
    lease holds another value by now."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, keys.DEFAULT_FAILURE_TTL, NOTICE]
    args.append(lease_ms)
    if starting is not None:
        args.append(starting)
    return script_call("rejoin", [*_reap_keys(k), *k.other_rolls], args, int)


def _reaped(out: Any) -> list[str] | None:
    return [text(i) for i in out[1:]] if text(out[0]) == "reaped" else None


def reap(dead: WorkerKeys, seen: str | None, now: Now, marker_ttl: int) -> Call[list[str] | None]:
    """Requeue a dead worker's jobs, each to its own queue, and take it off ``dead``'s
    rolls: their ids, or None when it turned out alive."""
    args: list[Arg] = [dead.worker, seen or "", now.ts, now.text, keys.DEFAULT_FAILURE_TTL]
    keys_ = [*_reap_keys(dead), *dead.other_rolls]
    return script_call("reap", keys_, [*args, NOTICE, marker_ttl], _reaped)


def refresh(
    k: WorkerKeys, token: str, now: Now, ttl: int, running: Sequence[tuple[str, str]]
) -> Call[None]:
    """Keep rq's records of running jobs (id, execution id) from expiring."""
    args: list[Arg] = [token, now.ts, now.text, ttl]
    for job_id, execution_id in running:
        args += [job_id, execution_id]
    return script_call("refresh", [k.alive, k.started, k.rq_worker], args, lambda _: None)


# -- moving jobs (the prefetcher) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claimed:
    """What the claim script read of one job it moved into this worker's WIP list.

    ``verdict`` is ``"ok"`` (``data`` holds rq's stored job data) or why it was not:
    ``dup``, ``mine`` (this worker's own started job), ``missing``, ``canceled``, ``nodata``,
    ``toolarge``, ``bad``, ``oom``.
    """

    id: bytes
    verdict: str
    data: bytes = b""
    attempts: int = 0
    clean: int = 0
    enqueued_at: str = ""
    detail: str = ""
    handed: bool = False  # another worker handed it here (it is never handed on)
    queue: str = ""  # the queue it came from (rq's ``origin``)


def _claimed(k: WorkerKeys, out: Any) -> list[Claimed]:
    if out and out[0] == b"lease":
        raise LeaseLost(k.worker)
    claimed = []
    for e in out:
        verdict = text(e[1])
        if not e[0] and verdict in _KEY_NEWS:  # news of a key, not of a job
            _key_news(k, verdict, text(e[2]))
            continue
        if verdict == "ok":
            handed, queue = e[6] == b"1", text(e[7]) if len(e) > 7 else k.queue_name
            claimed.append(
                Claimed(
                    e[0],
                    verdict,
                    e[2],
                    int(e[3]),
                    int(e[4]),
                    text(e[5]),
                    handed=handed,
                    queue=queue,
                )
            )
        else:
            claimed.append(Claimed(e[0], verdict, detail=" ".join(text(x) for x in e[2:])))
    return claimed


#: What a claim may say of a key rather than of a job (its entry's id is empty; an empty
#: id popped from a queue is a job entry, dropped as no id).
_KEY_NEWS = frozenset({"wip", "queue", "keys"})


def _key_news(k: WorkerKeys, what: str, detail: str) -> None:
    if what == "wip":
        THROTTLE.warning(
            k.wip,
            "this worker's WIP list %s was a %s: replaced by an empty list (the jobs "
            "it listed are not requeued should this worker die)",
            k.wip,
            detail,
        )
    elif what == "queue":
        THROTTLE.warning(
            k.queue,
            "queue %s is a %s, not a list (a rogue write): no job can be taken from it "
            "until it is deleted (it holds none); looking again now and then",
            k.queue,
            detail,
        )
    else:
        THROTTLE.warning(detail, "replaced keys of the wrong type: %s", detail)


def claim(
    k: WorkerKeys, token: str, now: Now, n: int, moved: Sequence[bytes]
) -> Call[list[Claimed]]:
    """Claim up to ``n`` more jobs from the queue, plus ``moved`` (already in the WIP
    list); the reply raises :class:`LeaseLost` when the lease is not this worker's."""
    return script_call(
        "claim",
        [k.queue, k.wip, k.alive, k.canceled, k.handed],
        [
            token,
            k.worker,
            now.ts,
            now.text,
            n,
            MAX_JOB_DATA_BYTES,
            keys.DEFAULT_FAILURE_TTL,
            NOTICE,
            *moved,
        ],
        partial(_claimed, k),
    )


def hand(
    k: WorkerKeys, token: str, job_id: str, to: WorkerKeys, now_ms: int, ttl_ms: int, most: int
) -> Call[str]:
    """Hand a claimed, unstarted job to worker ``to`` should it hold at most ``most``
    rows; ``ok`` or why not."""
    return script_call(
        "hand",
        [k.alive, k.wip, to.alive, to.wip, to.handed, to.stats, k.roll],
        [token, k.worker, job_id, to.worker, now_ms, ttl_ms, most],
        text,
    )


# -- after a failover (the heartbeat) -----------------------------------------------------


def _resynced(reply: Any) -> tuple[list[str], list[str]]:
    if reply and reply[0] == b"lease":
        raise LeaseLost("resync")
    return [text(v) for v in reply[0]], [text(i) for i in reply[1]]


def resync(
    k: WorkerKeys, token: str, now: Now, runs: Sequence[tuple[str, str, int]]
) -> Call[tuple[list[str], list[str]]]:
    """Make a new master agree with the runs held (id, execution id, attempt): a verdict
    per run (``ok``, ``reclaimed``, ``lost``) and the strays' ids (started here, not
    held: their end was lost). See ``resync.lua``."""
    args: list[Arg] = [token, k.worker, now.text]
    for job_id, execution, attempt in runs:
        args += [job_id, execution, attempt]
    return script_call("resync", [k.alive, k.wip, k.queue], args, _resynced)
