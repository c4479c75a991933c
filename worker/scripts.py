"""The worker's Lua scripts (``lua/``), one typed wrapper each.

A wrapper takes named arguments and returns a :class:`~mlxq.producer.scripts.Call`: the
script's KEYS and ARGV in the order the script reads them (its header comment lists them),
and the parser of its reply. Nothing else builds either list. Calls run one at a time
(:func:`~mlxq.producer.scripts.call`) or several in one round trip
(:func:`~mlxq.producer.scripts.run`).

The writer's scripts (``chunks``, ``route``, ``end``, ``fail``, ``release``, ``start``) each
reply with a part of the flush's :class:`~mlxq.worker.writes.FlushReply`; a reply saying
the lease is not this worker's raises :class:`~mlxq.worker.errors.LeaseLost`, one saying
Redis refused it for memory :class:`redis.exceptions.OutOfMemoryError`.
"""

from __future__ import annotations

import base64
import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

import redis
from rq.utils import utcformat

from mlxq.producer import keys
from mlxq.producer.codec import MAX_JOB_DATA_BYTES, NOTICE, MsgpackSerializer, encode_chunk
from mlxq.producer.outcome import Outcome, outcome_of
from mlxq.producer.scripts import Arg, Call, Script, load
from mlxq.worker.errors import LeaseLost
from mlxq.worker.writes import ChunkWrite, End, FailWrite, FlushReply, ReleaseMode, StartWrite

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
    """The keys of one worker on one queue that its scripts touch."""

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

    @classmethod
    def of(cls, queue: str, worker: str) -> WorkerKeys:
        return cls(
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


def _call(name: str, keys_: list[str], args: list[Arg], parse: Callable[[Any], Any]) -> Call[Any]:
    return Call(SCRIPTS[name], keys_, args, parse)


# -- lease and roll (the heartbeat) -------------------------------------------------------


def beat(k: WorkerKeys, token: str, lease_ms: int) -> Call[str]:
    """Keep the lease: ``ok``, ``renewed`` or ``reaped``."""
    return _call("beat", [k.alive, k.roll, k.reaped], [token, k.worker, lease_ms], text)


def giveback(k: WorkerKeys, token: str, cutoff_ms: int) -> Call[int]:
    """Jobs handed here before ``cutoff_ms`` and not claimed go back: how many."""
    return _call("giveback", [k.alive, k.handed, k.wip, k.queue], [token, cutoff_ms], int)


def leave(k: WorkerKeys, token: str, settled: bool) -> Call[tuple[str, int]]:
    """Leave for good: (``left`` | ``stays``, how many handed jobs went back)."""
    return _call(
        "leave",
        [k.alive, k.roll, k.stats, k.handed, k.wip, k.queue],
        [token, k.worker, "1" if settled else ""],
        lambda r: (text(r[0]), int(r[1])),
    )


def _reap_keys(k: WorkerKeys) -> list[str]:
    return [k.alive, k.wip, k.queue, k.roll, k.started, k.execs, k.reaped, k.canceled]


def rejoin(k: WorkerKeys, token: str, now: Now, lease_ms: int) -> Call[int]:
    """Start over under a new token: how many entries went back to the queue."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, keys.DEFAULT_FAILURE_TTL, NOTICE]
    return _call("rejoin", _reap_keys(k), [*args, lease_ms], int)


def _reaped(out: Any) -> list[str] | None:
    return [text(i) for i in out[1:]] if text(out[0]) == "reaped" else None


def reap(dead: WorkerKeys, seen: str | None, now: Now, marker_ttl: int) -> Call[list[str] | None]:
    """Requeue a dead worker's jobs: their ids, or None when it turned out alive."""
    args: list[Arg] = [dead.worker, seen or "", now.ts, now.text, keys.DEFAULT_FAILURE_TTL]
    return _call("reap", _reap_keys(dead), [*args, NOTICE, marker_ttl], _reaped)


def refresh(
    k: WorkerKeys, token: str, now: Now, ttl: int, running: Sequence[tuple[str, str]]
) -> Call[None]:
    """Keep rq's records of running jobs (id, execution id) from expiring."""
    args: list[Arg] = [token, now.ts, now.text, ttl]
    for job_id, execution_id in running:
        args += [job_id, execution_id]
    return _call("refresh", [k.alive, k.started, k.rq_worker], args, lambda _: None)


# -- moving jobs (the prefetcher) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claimed:
    """What the claim script read of one job it moved into this worker's WIP list.

    ``verdict`` is ``"ok"`` (``data`` holds rq's stored job data) or why it was not:
    ``dup``, ``missing``, ``canceled``, ``nodata``, ``toolarge``, ``bad``, ``oom``.
    """

    id: bytes
    verdict: str
    data: bytes = b""
    attempts: int = 0
    clean: int = 0
    enqueued_at: str = ""
    detail: str = ""
    handed: bool = False  # another worker handed it here (it is never handed on)


def _claimed(k: WorkerKeys, out: Any) -> list[Claimed]:
    if out and out[0] == b"lease":
        raise LeaseLost(k.worker)
    claimed = []
    for e in out:
        verdict = text(e[1])
        if verdict == "wip":
            log.warning(
                "this worker's WIP list %s was a %s: replaced by an empty list (the jobs "
                "it listed are not requeued should this worker die)",
                k.wip,
                text(e[2]),
            )
            continue
        if verdict == "ok":
            handed = e[6] == b"1"
            claimed.append(
                Claimed(e[0], verdict, e[2], int(e[3]), int(e[4]), text(e[5]), handed=handed)
            )
        else:
            claimed.append(Claimed(e[0], verdict, detail=" ".join(text(x) for x in e[2:])))
    return claimed


def claim(
    k: WorkerKeys, token: str, now: Now, n: int, moved: Sequence[bytes]
) -> Call[list[Claimed]]:
    """Claim up to ``n`` more jobs from the queue, plus ``moved`` (already in the WIP
    list); the reply raises :class:`LeaseLost` when the lease is not this worker's."""
    return _call(
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
    return _call(
        "hand",
        [k.alive, k.wip, to.alive, to.wip, to.handed, to.stats, k.roll],
        [token, k.worker, job_id, to.worker, now_ms, ttl_ms, most],
        text,
    )


# -- writing (the writer thread) -----------------------------------------------------------


def _written(name: str, k: WorkerKeys, reply: Any) -> None:
    if reply and reply[0] == b"lease":
        raise LeaseLost(k.worker)
    if reply and reply[0] == b"oom":
        raise redis.exceptions.OutOfMemoryError(f"{name}: refused (out of memory)")


def _healed(reply: list[Any], at: int) -> list[tuple[str, str]]:
    """(id, what) for each entry of a script's reply that says it replaced a key."""
    return [(text(e[0]), text(e[at])) for e in reply if len(e) > at and e[at]]


def _zlib_text(reason: str) -> bytes:
    return zlib.compress(reason.encode("utf-8", "replace"))


def _chunks_written(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("chunks", k, reply)
    p = reply[1]
    return FlushReply(write_problems=[(text(p[i]), text(p[i + 1])) for i in range(0, len(p), 2)])


def chunks(
    k: WorkerKeys, token: str, stream_ttl: int, writes: Sequence[ChunkWrite]
) -> Call[FlushReply]:
    """Append chunks to their jobs' replay logs and publish them."""
    args: list[Arg] = [token, stream_ttl]
    for w in writes:
        args += [w.job_id, w.chunk.seq, encode_chunk(w.chunk), 1 if w.refresh_ttl else 0]
    return _call("chunks", [k.alive], args, partial(_chunks_written, k))


def _routed(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("route", k, reply)
    return FlushReply()


def route(k: WorkerKeys, token: str, ttl: int, route_keys: Sequence[str]) -> Call[FlushReply]:
    """Name this worker under conversations it finished, for ``ttl`` seconds."""
    return _call("route", [k.alive], [token, k.worker, ttl, *route_keys], partial(_routed, k))


def _ended(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("end", k, reply)
    out = FlushReply(healed=_healed(reply, 3))
    for e in reply:
        out.ended[text(e[0])] = outcome_of(text(e[1]))
        if len(e) > 2 and text(e[2]) not in ("ok", "dup"):
            out.write_problems.append((text(e[0]), text(e[2])))
    return out


def _end_args(e: End) -> list[Arg]:
    if e.outcome == Outcome.FINISHED:
        value = base64.b64encode(MsgpackSerializer.dumps(e.result)).decode()
        exc_info = b""
    else:
        exc_info = _zlib_text(e.reason)
        value = base64.b64encode(exc_info).decode()
    return [
        e.job_id,
        str(e.outcome),
        e.execution_id,
        value,
        exc_info,
        e.started_at,
        e.final.seq,
        encode_chunk(e.final),
        encode_chunk(e.canceled),
    ]


def end(
    k: WorkerKeys, token: str, now: Now, stream_ttl: int, ends: Sequence[End]
) -> Call[FlushReply]:
    """Commit the ends of running jobs."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, stream_ttl, keys.DEFAULT_RESULT_TTL]
    args += [keys.DEFAULT_FAILURE_TTL, keys.MAX_RECORD_TTL]
    for e in ends:
        args += _end_args(e)
    keys_ = [k.alive, k.started, k.rq_worker, k.execs, k.wip, k.finished, k.failed, k.canceled]
    return _call("end", keys_, args, partial(_ended, k))


_FAILED = {"failed": Outcome.FAILED, "canceled": Outcome.CANCELED}


def _failed(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("fail", k, reply)
    out = FlushReply(healed=_healed(reply, 2))
    out.settled.update({text(e[0]): _FAILED.get(text(e[1]), Outcome.DROPPED) for e in reply})
    return out


def fail(
    k: WorkerKeys, token: str, now: Now, stream_ttl: int, fails: Sequence[FailWrite]
) -> Call[FlushReply]:
    """Fail claimed jobs that never started, each with its error chunk."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, stream_ttl]
    args += [keys.DEFAULT_FAILURE_TTL, keys.MAX_RECORD_TTL, NOTICE]
    for f in fails:
        exc = _zlib_text(f.reason)
        args += [f.job_id, base64.b64encode(exc).decode(), exc, f.chunk.seq, encode_chunk(f.chunk)]
    return _call("fail", [k.alive, k.wip, k.failed, k.canceled], args, partial(_failed, k))


_RELEASED = {"requeued": Outcome.REQUEUED, "canceled": Outcome.CANCELED}


def _released(k: WorkerKeys, ids: Sequence[str | bytes], reply: Any) -> FlushReply:
    _written("release", k, reply)
    return FlushReply(
        settled={
            text(job_id): _RELEASED.get(text(what), Outcome.DROPPED)
            for job_id, what in zip(ids, reply, strict=True)
        }
    )


def release(
    k: WorkerKeys, token: str, now: Now, mode: ReleaseMode, ids: Sequence[str | bytes]
) -> Call[FlushReply]:
    """Give held jobs back to the queue's front, or drop their WIP entries."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, keys.DEFAULT_FAILURE_TTL, NOTICE]
    return _call(
        "release",
        [k.alive, k.wip, k.queue, k.started, k.execs, k.canceled],
        [*args, mode.value, *ids],
        partial(_released, k, ids),
    )


def _started(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("start", k, reply)
    return FlushReply(started={text(e[0]): text(e[1]) for e in reply}, healed=_healed(reply, 2))


def start(
    k: WorkerKeys, token: str, now: Now, ttl: int, starts: Sequence[StartWrite]
) -> Call[FlushReply]:
    """Start claimed jobs: rq's STARTED state, an execution each, StartedJobRegistry."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, ttl, keys.DEFAULT_FAILURE_TTL, NOTICE]
    for s in starts:
        args += [s.job_id, s.attempts_before, s.execution_id]
    keys_ = [k.alive, k.started, k.rq_worker, k.execs, k.wip, k.canceled]
    return _call("start", keys_, args, partial(_started, k))
