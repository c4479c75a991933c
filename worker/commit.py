"""The writer's round trip: one flush of typed writes, committed in one pipelined call.

Each kind of write is one script, many jobs per call, with its typed wrapper here (as
:mod:`mlxq.worker.scripts` has for the others), run in the order the writes must land
(:class:`~mlxq.worker.writes.Flush`). Each script's reply is a part of the flush's
:class:`~mlxq.worker.writes.FlushReply`; a reply saying the lease is not this worker's
raises :class:`~mlxq.worker.errors.LeaseLost`, one saying Redis refused it for memory
:class:`redis.exceptions.OutOfMemoryError`.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Sequence
from functools import partial
from typing import Any

import redis

from mlxq.producer import keys, scripts
from mlxq.producer.codec import NOTICE, MsgpackSerializer, encode_chunk
from mlxq.producer.connection import WAIT_TIMEOUT_S
from mlxq.producer.outcome import Outcome, outcome_of
from mlxq.producer.scripts import Arg, Call
from mlxq.worker.bridge import STARTED_TTL, Bridge
from mlxq.worker.errors import LeaseLost, ReplicasBehind
from mlxq.worker.routing import ROUTE_TTL
from mlxq.worker.scripts import Now, WorkerKeys, script_call, text
from mlxq.worker.writes import (
    ChunkWrite,
    End,
    FailWrite,
    Flush,
    FlushReply,
    ReleaseMode,
    StartWrite,
)

#: How long one WAIT for replicas after a flush of ends may take.
WAIT_MS = int(WAIT_TIMEOUT_S * 1000)


def commit(bridge: Bridge, f: Flush) -> FlushReply:
    """Write one flush in one round trip.

    Raises:
        LeaseLost: the lease is not this worker's (nothing was written).
        ReplicasBehind: fewer replicas than ``--wait-replicas`` confirmed the ends (they
            are written; the caller sends the same flush again).
        redis.exceptions.OutOfMemoryError: Redis refused it (nothing was written past
            the point it reports; the caller retries the same flush, idempotently).
    """
    k, token, now, ttl = bridge.k, bridge.token, Now.read(), bridge.config.stream_ttl
    calls: list[Call[FlushReply]] = []
    if f.chunks:
        calls.append(chunks(k, token, ttl, f.chunks))
    if routes := [e.route for e in f.ends if e.route and e.outcome == Outcome.FINISHED]:
        # Before the ends: a client that sees a turn end and sends the next finds it.
        calls.append(route(k, token, ROUTE_TTL, routes))
    if f.ends:
        calls.append(end(k, token, now, ttl, f.ends))
    if f.fails:
        calls.append(fail(k, token, now, ttl, f.fails))
    calls += [release(k, token, now, r.mode, r.job_ids) for r in f.releases]
    if f.starts:
        calls.append(start(k, token, now, STARTED_TTL, f.starts))
    # An end counts once its replicas have it: WAIT on the same connection, after the
    # scripts (inside one it would not block), one per flush however many jobs end.
    asked = bridge.config.wait_replicas if (f.ends or f.fails) else 0
    parts, reached = scripts.run_waited(bridge.redis, calls, asked, WAIT_MS)
    if reached < asked:
        raise ReplicasBehind(asked, reached)
    out = FlushReply()
    for part in parts:
        out.add(part)
    return out


def _written(name: str, k: WorkerKeys, reply: Any) -> None:
    if reply and reply[0] == b"lease":
        raise LeaseLost(k.worker)
    if reply and reply[0] == b"oom":
        raise redis.exceptions.OutOfMemoryError(f"{name}: refused (out of memory)")


def _shared(e: Any) -> bool:
    """Whether a reply's entry is the one of the keys a script's jobs share."""
    return not e[0] and len(e) > 2 and e[1] == b"keys"


def _jobs(reply: list[Any]) -> list[Any]:
    """A script's entries of jobs (the one of the keys its jobs share left out)."""
    return [e for e in reply if not _shared(e)]


def _healed(reply: list[Any], at: int, verdicts: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(id, what) for each entry of a script's reply that says it replaced a key (of a job
    whose verdict is one of ``verdicts``: any, when none are given); ('', what) for the
    keys its jobs share."""
    jobs = [e for e in _jobs(reply) if not verdicts or text(e[1]) in verdicts]
    out = [(text(e[0]), text(e[at])) for e in jobs if len(e) > at and e[at]]
    return out + [("", text(e[2])) for e in reply if _shared(e)]


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
    return script_call("chunks", [k.alive], args, partial(_chunks_written, k))


def _routed(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("route", k, reply)
    return FlushReply()


def route(k: WorkerKeys, token: str, ttl: int, route_keys: Sequence[str]) -> Call[FlushReply]:
    """Name this worker under conversations it finished, for ``ttl`` seconds."""
    return script_call("route", [k.alive], [token, k.worker, ttl, *route_keys], partial(_routed, k))


def _ended(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("end", k, reply)
    out = FlushReply(healed=_healed(reply, 3))
    for e in _jobs(reply):
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
    return script_call("end", keys_, args, partial(_ended, k))


_FAILED = {"failed": Outcome.FAILED, "canceled": Outcome.CANCELED}


def _failed(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("fail", k, reply)
    out = FlushReply(healed=_healed(reply, 2))
    out.settled.update({text(e[0]): _FAILED.get(text(e[1]), Outcome.DROPPED) for e in _jobs(reply)})
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
    return script_call("fail", [k.alive, k.wip, k.failed, k.canceled], args, partial(_failed, k))


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
    return script_call(
        "release",
        [k.alive, k.wip, k.queue, k.started, k.execs, k.canceled],
        [*args, mode.value, *ids],
        partial(_released, k, ids),
    )


def _started(k: WorkerKeys, reply: Any) -> FlushReply:
    _written("start", k, reply)
    return FlushReply(
        started={text(e[0]): text(e[1]) for e in _jobs(reply)},
        healed=_healed(reply, 2, ("ok",)),  # a refused start's third field is why
    )


def start(
    k: WorkerKeys, token: str, now: Now, ttl: int, starts: Sequence[StartWrite]
) -> Call[FlushReply]:
    """Start claimed jobs: rq's STARTED state, an execution each, StartedJobRegistry."""
    args: list[Arg] = [token, k.worker, now.ts, now.text, ttl, keys.DEFAULT_FAILURE_TTL, NOTICE]
    for s in starts:
        args += [s.job_id, s.attempts_before, s.execution_id]
    keys_ = [k.alive, k.started, k.rq_worker, k.execs, k.wip, k.canceled]
    return script_call("start", keys_, args, partial(_started, k))
