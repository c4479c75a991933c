"""mlxq's Lua scripts: every multi-key change of a job's state, registered once.

Each script in ``lua/`` is sent as the key header (from :mod:`mlxq.producer.keys`), then
``lib.lua``, then its own body, so key names have one source. Scripts run by SHA; after a
Redis restart (which empties the script cache) they are loaded again and the call retried:
every mlxq script is idempotent for that reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from mlxq.producer import keys

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
    "cancel",
    "hand",
    "giveback",
    "leave",
    "route",
)

Arg = str | bytes | int | float


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


def _load(name: str) -> Script:
    folder = resources.files("mlxq.producer").joinpath("lua")
    source = (
        keys.lua_header()
        + folder.joinpath("lib.lua").read_text("utf-8")
        + folder.joinpath(f"{name}.lua").read_text("utf-8")
    )
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


SCRIPTS: dict[str, Script] = {n: _load(n) for n in NAMES}


def call(client: redis.Redis, name: str, keys_: Sequence[str | bytes], args: Sequence[Arg]) -> Any:
    """Run one script by SHA, loading it first if Redis does not have it."""
    return run(client, [(name, keys_, args)])[0]


def run(
    client: redis.Redis, calls: Sequence[tuple[str, Sequence[str | bytes], Sequence[Arg]]]
) -> list[Any]:
    """Run several scripts in one round trip, in order; their replies in the same order.

    Raises:
        redis.RedisError: a connection error, or a script that raised (a bug, not data).
    """
    for attempt in (0, 1):
        with client.pipeline(transaction=False) as pipe:
            for name, k, a in calls:
                pipe.execute_command("EVALSHA", SCRIPTS[name].sha, len(k), *k, *a)
            replies = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            for name in {n for n, _, _ in calls}:
                client.script_load(SCRIPTS[name].source)
            continue
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return list(replies)
    raise AssertionError("unreachable")
