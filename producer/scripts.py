"""mlxq's Lua scripts: every multi-key change of a job's state, one atomic call each.

Scripts live with the code that calls them: the producer's (``submit``, ``cancel``,
``retry``, ``purge``) in ``lua/`` here, the worker's in :mod:`mlxq.worker`'s ``lua/``.
Each is sent as the key header (from :mod:`mlxq.producer.keys`), then the shared
``lib.lua`` (here), then its own body, so key names have one source. Each script has one
typed wrapper beside it that owns its KEYS and ARGV order and parses its reply into a
:class:`Call`; callers never build either list. Scripts run by SHA; after a Redis restart
(which empties the script cache) they are loaded again and the call retried: every mlxq
script is idempotent for that reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any, Generic, TypeVar, cast

import redis
from rq.utils import utcformat

from mlxq.producer import keys
from mlxq.producer.codec import NOTICE

Arg = str | bytes | int | float
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


def load(package: str, name: str) -> Script:
    """The script ``lua/<name>.lua`` of ``package``, with the key header and ``lib.lua``."""
    lib = resources.files("mlxq.producer").joinpath("lua", "lib.lua").read_text("utf-8")
    body = resources.files(package).joinpath("lua", f"{name}.lua").read_text("utf-8")
    source = keys.lua_header() + lib + body
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One script call, built by the script's wrapper: its KEYS, its ARGV, and how its
    reply reads."""

    script: Script
    keys: Sequence[str | bytes]
    args: Sequence[Arg]
    parse: Callable[[Any], T]


def call(client: redis.Redis, one: Call[T]) -> T:
    """Run one script by SHA, loading it first if Redis does not have it."""
    return cast(T, run(client, [one])[0])


def run(client: redis.Redis, calls: Sequence[Call[Any]]) -> list[Any]:
    """Run several scripts in one round trip, in order; their parsed replies in the same
    order (a parser that raises stops at that reply).

    Raises:
        redis.RedisError: a connection error, or a script that raised (a bug, not data).
    """
    return run_waited(client, calls, 0, 0)[0]


def run_waited(
    client: redis.Redis, calls: Sequence[Call[Any]], replicas: int, timeout_ms: int
) -> tuple[list[Any], int]:
    """:func:`run`, then ``WAIT replicas timeout_ms`` on the same connection (WAIT counts
    the replicas that have this connection's writes; inside a script it would not block):
    the parsed replies and the replicas that confirmed (0 when ``replicas`` is 0: no WAIT).
    """
    for attempt in (0, 1):
        with client.pipeline(transaction=False) as pipe:
            for c in calls:
                pipe.execute_command("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args)
            if replicas > 0:
                pipe.execute_command("WAIT", replicas, timeout_ms)
            replies = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            for script in {c.script.name: c.script for c in calls}.values():
                client.script_load(script.source)
            continue
        for r in replies:
            if isinstance(r, Exception):
                raise r
        reached = int(replies[-1]) if replicas > 0 else 0
        parsed = [c.parse(r) for c, r in zip(calls, replies, strict=False)]
        return parsed, reached
    raise AssertionError("unreachable")


# -- the producer's scripts ---------------------------------------------------------------

CANCEL = load("mlxq.producer", "cancel")
RETRY = load("mlxq.producer", "retry")
PURGE = load("mlxq.producer", "purge")
SUBMIT = load("mlxq.producer", "submit")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def cancel(job_id: str, now: datetime) -> Call[str]:
    """Cancel a job: ``nosuch``, ``ended``, ``canceled`` or ``requested``."""
    args: list[Arg] = [job_id, now.timestamp(), utcformat(now), keys.DEFAULT_FAILURE_TTL, NOTICE]
    return Call(CANCEL, [], args, _text)


def retry(job_id: str, now: datetime) -> Call[str]:
    """Requeue an ended job as a new attempt: ``requeued``, ``nosuch``, ``oom``,
    ``noqueue``, ``badqueue``, or its status when it is neither failed nor canceled."""
    return Call(RETRY, [keys.RQ_QUEUES], [job_id, utcformat(now), NOTICE], _text)


def _purged(reply: Any) -> tuple[int, str]:
    return int(reply[0]), _text(reply[1])


def purge(box: str, state: str, job_ids: Sequence[str]) -> Call[tuple[int, str]]:
    """Delete the jobs ``job_ids`` of ``box`` (a queue's list for ``queued``, else the
    state's registry) that are still in it and in that state: (how many, '') or (0, the
    type ``box`` holds instead of a list or zset)."""
    return Call(PURGE, [box], [state, NOTICE, *job_ids], _purged)


def _words(v: Any) -> list[str]:
    return [_text(x) for x in v]


def submit(
    queue_key: str,
    max_queued: int | None,
    records: Sequence[tuple[str, Mapping[str, Arg]]],
    check_too: Sequence[tuple[str, str]] = (),
) -> Call[list[str]]:
    """Enqueue jobs (each its id and rq's record fields) once every check passed, ids
    ``check_too`` (each with its request's :func:`digest`) included: ``ok``, or why
    nothing was written (``queue <type>``, ``full <queued>``, ``live <id> <status>``,
    ``taken <id> <type>``, ``oom``). A live job whose record holds the same request is
    no refusal: it is left as it is (a retried submit)."""
    args: list[Arg] = [-1 if max_queued is None else max_queued, len(check_too)]
    for job_id, sha in check_too:
        args += [job_id, sha]
    for job_id, fields in records:
        args += [job_id, digest(fields), len(fields)]
        for name, value in fields.items():
            args += [name, value]
    return Call(SUBMIT, [queue_key, keys.RQ_QUEUES], args, _words)


def digest(fields: Mapping[str, Arg]) -> str:
    """The SHA-1 (hex) of a job record's request (rq's ``data`` field), as Lua's
    ``redis.sha1hex`` gives it."""
    data = fields.get("data", b"")
    return hashlib.sha1(data if isinstance(data, bytes) else str(data).encode()).hexdigest()
