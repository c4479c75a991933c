"""The writer's round trip: one flush of typed writes, committed in one pipelined call.

Each kind of write is one script call (:mod:`mlxq.worker.scripts`), many jobs per call,
in the order the writes must land (:class:`~mlxq.worker.writes.Flush`); their replies come
back as one :class:`~mlxq.worker.writes.FlushReply`.
"""

from __future__ import annotations

from mlxq.producer import scripts
from mlxq.producer.outcome import Outcome
from mlxq.producer.scripts import Call
from mlxq.worker import scripts as lua
from mlxq.worker.bridge import STARTED_TTL, Bridge
from mlxq.worker.routing import ROUTE_TTL
from mlxq.worker.scripts import Now
from mlxq.worker.writes import Flush, FlushReply


def commit(bridge: Bridge, f: Flush) -> FlushReply:
    """Write one flush in one round trip.

    Raises:
        LeaseLost: the lease is not this worker's (nothing was written).
        redis.exceptions.OutOfMemoryError: Redis refused it (nothing was written past
            the point it reports; the caller retries the same flush, idempotently).
    """
    k, token, now, ttl = bridge.k, bridge.token, Now.read(), bridge.config.stream_ttl
    calls: list[Call[FlushReply]] = []
    if f.chunks:
        calls.append(lua.chunks(k, token, ttl, f.chunks))
    if routes := [e.route for e in f.ends if e.route and e.outcome == Outcome.FINISHED]:
        # Before the ends: a client that sees a turn end and sends the next finds it.
        calls.append(lua.route(k, token, ROUTE_TTL, routes))
    if f.ends:
        calls.append(lua.end(k, token, now, ttl, f.ends))
    if f.fails:
        calls.append(lua.fail(k, token, now, ttl, f.fails))
    calls += [lua.release(k, token, now, r.mode, r.job_ids) for r in f.releases]
    if f.starts:
        calls.append(lua.start(k, token, now, STARTED_TTL, f.starts))
    out = FlushReply()
    for part in scripts.run(bridge.redis, calls):
        out.add(part)
    return out
