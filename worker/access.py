"""What the worker needs of its Redis user, checked before it starts.

Under an ACL user that lacks a command, a key or a channel the worker uses, a worker would
register, claim jobs and then fail every one (or log a traceback every beat). So before
it registers it sends every command it uses (its own, rq's, and those its Lua scripts
call: Redis checks each ``redis.call`` against the same ACL), each on a key of the kind it
is sent on, and the channels it publishes and listens on, queued in a ``MULTI`` that is
then discarded: Redis checks a command's permissions when it queues it, and runs nothing
of a discarded transaction. No key is read or written, whatever the user may do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from mlxq.producer import keys
from mlxq.worker import scripts as lua

log = logging.getLogger("mlxq.worker")

#: A job id no job has: the keys named after it stand for every job's.
PROBE_ID = "mlxq-access-probe"

#: The arguments after the key that make each command well formed (never run).
_ARGS: dict[str, tuple[str, ...]] = {
    "DEL": (),
    "EXISTS": (),
    "TYPE": (),
    "EXPIRE": ("1",),
    "PEXPIRE": ("1",),
    "PERSIST": (),
    "GET": (),
    "SET": ("v",),
    "MGET": (),
    "HSET": ("f", "v"),
    "HGET": ("f",),
    "HMGET": ("f",),
    "HDEL": ("f",),
    "HEXISTS": ("f",),
    "HINCRBY": ("f", "1"),
    "HSTRLEN": ("f",),
    "HGETALL": (),
    "LPUSH": ("x",),
    "RPUSH": ("x",),
    "LREM": ("0", "x"),
    "LPOS": ("x",),
    "LLEN": (),
    "LRANGE": ("0", "0"),
    "SADD": ("x",),
    "SREM": ("x",),
    "SMEMBERS": (),
    "SISMEMBER": ("x",),
    "ZADD": ("0", "x"),
    "ZREM": ("x",),
    "ZSCORE": ("x",),
    "ZCARD": (),
    "ZRANGE": ("0", "0"),
    "ZRANGEBYSCORE": ("0", "0"),
    "ZREMRANGEBYSCORE": ("0", "0"),
    "XADD": ("*", "f", "v"),
    "XRANGE": ("-", "+"),
    "XREVRANGE": ("+", "-"),
    "XLEN": (),
    "XDEL": ("0-1",),
    "XSETID": ("0-1",),
}

_HASH = "HSET HGET HMGET HDEL HEXISTS HINCRBY HSTRLEN HGETALL EXISTS TYPE EXPIRE PERSIST DEL"
_STREAM = "XADD XRANGE XREVRANGE XLEN XDEL XSETID EXISTS TYPE EXPIRE PERSIST DEL"
_LIST = "LPUSH RPUSH LREM LPOS LLEN LRANGE EXISTS TYPE DEL"
_ZSET = "ZADD ZREM ZSCORE ZCARD ZRANGE ZRANGEBYSCORE ZREMRANGEBYSCORE EXISTS TYPE EXPIRE DEL"
_SET = "SADD SREM SMEMBERS SISMEMBER EXISTS TYPE DEL"
_STRING = "SET GET MGET EXISTS TYPE EXPIRE PEXPIRE DEL"


@dataclass(frozen=True, slots=True)
class Probe:
    """One command as the worker sends it: its name (as ACL rules name it), its words,
    and the keys and channels among them."""

    name: str
    args: tuple[str, ...]
    keys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()
    #: The worker serves without it, less well: what it then lacks, said at start, not
    #: refused ("": it cannot serve without it).
    optional: str = ""


def _on(key: str, commands: str) -> list[Probe]:
    return [Probe(c, (c, key, *_ARGS[c]), keys=(key,)) for c in commands.split()]


#: What a worker lacks without the client commands that wake an idle worker.
NO_WAKE = (
    "a worker handing this one a chat turn cannot wake it while it waits idle, so the turn "
    "starts when its wait ends"
)
#: What a worker lacks without ``INFO``: it tells a new master by its ``run_id``.
NO_INFO = (
    "it cannot tell when a failover gives it another master, so it does not resync the "
    "jobs it holds with the new one"
)


def probes(worker: str, queues: Sequence[str], wait_replicas: int = 0) -> list[Probe]:
    """Every command the worker ``worker`` serving ``queues`` sends, on its keys (``WAIT``
    where its ends wait for replicas)."""
    job = PROBE_ID
    wip = keys.wip_key(worker)
    found = [
        *_on(keys.job_key(job), _HASH),
        *_on(keys.execution_key(job, "x"), _HASH),
        *_on(keys.results_key(job), _STREAM),
        *_on(keys.stream_key(job), _STREAM),
        *_on(keys.executions_key(job), _ZSET),
        *_on(keys.alive_key(worker), _STRING),
        *_on(keys.reaped_key(worker), _STRING),
        *_on(keys.blocker_key(worker), _STRING),
        *_on(wip, _LIST),
        *_on(keys.worker_stats_key(worker), _HASH),
        *_on(keys.handed_key(worker), _ZSET),
        *_on(keys.rq_worker_key(worker), _HASH),
        *_on(keys.rq_worker_executions(worker), _ZSET),
        *_on(keys.RQ_WORKERS, _SET),
        *_on(keys.RQ_QUEUES, _SET),
        *_on(keys.RQ_SUSPENDED, "EXISTS"),
    ]
    for q in queues:
        queue = keys.queue_key(q)
        found += _on(queue, _LIST)
        found += _on(keys.workers_key(q), _SET)
        found += _on(WORKERS_BY_QUEUE_KEY % q, _SET)
        found += _on(keys.route_key(q, "x"), _STRING)
        for registry in (
            keys.started_registry(q),
            keys.finished_registry(q),
            keys.failed_registry(q),
            keys.canceled_registry(q),
        ):
            found += _on(registry, _ZSET)
        found += [
            Probe("BLMOVE", ("BLMOVE", queue, wip, "0", "LEFT", "RIGHT"), keys=(queue, wip)),
            Probe("LMOVE", ("LMOVE", queue, wip, "LEFT", "RIGHT"), keys=(queue, wip)),
        ]
    chunks, cancels = keys.channel(job), keys.cancel_channel(worker)
    alive = keys.alive_key(worker)
    sha = lua.SCRIPTS["beat"].sha
    return [
        *found,
        Probe("PUBLISH", ("PUBLISH", chunks, "x"), channels=(chunks,)),
        Probe("PUBLISH", ("PUBLISH", cancels, "x"), channels=(cancels,)),
        Probe("SUBSCRIBE", ("SUBSCRIBE", cancels), channels=(cancels,)),
        Probe("EVALSHA", ("EVALSHA", sha, "1", alive), keys=(alive,)),
        Probe("SCRIPT|LOAD", ("SCRIPT", "LOAD", "return 1")),
        # A worker handing a chat turn wakes an idle one with these; without them the
        # idle one finds the turn when its blocking wait ends (a second or so later).
        Probe("CLIENT|ID", ("CLIENT", "ID"), optional=NO_WAKE),
        Probe("CLIENT|UNBLOCK", ("CLIENT", "UNBLOCK", "0"), optional=NO_WAKE),
        Probe("INFO", ("INFO", "server"), optional=NO_INFO),
        Probe("PING", ("PING",)),
        *([Probe("WAIT", ("WAIT", "0", "0"))] if wait_replicas > 0 else []),
    ]


@dataclass
class Lacking:
    """What the user may not do, each named once, in the order found."""

    commands: dict[str, None]
    keys: dict[str, None]
    channels: dict[str, None]
    other: dict[str, None]
    #: Commands the worker can do without, each with what it then lacks (see
    #: ``Probe.optional``): not in ``bool()``.
    optional: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.commands or self.keys or self.channels or self.other)

    def add(self, probe: Probe, error: redis.ResponseError) -> None:
        text = str(error)
        if probe.optional:
            self.optional[probe.name.replace("|", " ")] = probe.optional
            return
        if isinstance(error, redis.exceptions.NoPermissionError) or text.startswith("NOPERM"):
            if "keys" in text:
                self.keys.update(dict.fromkeys(probe.keys))
            elif "channels" in text:
                self.channels.update(dict.fromkeys(probe.channels))
            else:
                self.commands[probe.name.replace("|", " ")] = None
        else:  # a command this Redis does not know (older than 6.2), say
            self.other[f"{probe.name.replace('|', ' ')} ({text})"] = None

    def text(self, user: str) -> str:
        parts = []
        for what, names in (
            ("commands", self.commands),
            ("keys", self.keys),
            ("channels", self.channels),
        ):
            if names:
                parts.append(f"{what} {_listed(names)}")
        if self.other:
            parts.append(f"refused {_listed(self.other)}")
        return (
            f"Redis user {user!r} may not do what the worker needs: {'; '.join(parts)}. "
            f"Grant them (e.g. ACL SETUSER {user} ~rq:* ~mlxq:* &mlxq:* +@all; see "
            "ops/redis.conf) or use another user"
        )


def _listed(names: dict[str, None], most: int = 6) -> str:
    shown = list(names)[:most]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


def user_of(connection: redis.Redis) -> str:
    """The ACL user a client logs in as (``default`` when its URL names none)."""
    kw: dict[str, Any] = connection.connection_pool.connection_kwargs
    return str(kw.get("username") or "default")


def lacking(
    connection: redis.Redis, worker: str, queues: Sequence[str], wait_replicas: int = 0
) -> Lacking:
    """What of :func:`probes` the user may not do; nothing is run.

    Raises:
        redis.RedisError: Redis cannot be reached, or refuses ``MULTI`` itself (then
            nothing is sent after it: it would run).
    """
    found = Lacking({}, {}, {}, {})
    checks = probes(worker, queues, wait_replicas)
    pool = connection.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command("MULTI")
        try:
            conn.read_response()
        except redis.ResponseError as e:  # rq's pipelines need it too; nothing else is sent
            found.add(Probe("MULTI", ("MULTI",)), e)
            return found
        conn.send_packed_command(conn.pack_commands([p.args for p in checks]))
        for p in checks:
            try:
                conn.read_response()  # QUEUED, or why not
            except redis.ResponseError as e:
                found.add(p, e)
        conn.send_command("DISCARD")
        conn.read_response()
    except BaseException:
        conn.disconnect()  # mid-transaction: never handed to anyone else
        raise
    finally:
        pool.release(conn)
    return found
