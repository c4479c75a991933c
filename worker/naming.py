"""A worker's name: whether it is free to take, and taking it.

A name is held by a lease (``mlxq:alive:<name>``, ``host:pid:nonce``) and by rq's worker
registration. A dead predecessor of the same name (a worker killed, a start that failed)
never blocks a new one for long; a live one, or a process that may still run, always does.
"""

from __future__ import annotations

import os
import socket

import redis

from mlxq.producer import scripts
from mlxq.producer.errors import SetupError
from mlxq.worker import rq_compat
from mlxq.worker import scripts as lua
from mlxq.worker.scripts import Now, WorkerKeys, text

#: Lease length; a worker not heard from for this long may be reaped.
LEASE_MS = 5000


def process_gone(value: str) -> bool:
    """True when a lease value ``host:pid:nonce`` names a process of this host that no
    longer exists."""
    host, _, rest = value.partition(":")
    return host == socket.gethostname() and _pid_gone(rest.partition(":")[0])


def _pid_gone(pid: str) -> bool:
    """True when ``pid`` (text) names no process of this host."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def lease_value(r: redis.Redis, k: WorkerKeys) -> str | None:
    """A worker's lease as Redis holds it; None when none, or of another type."""
    try:
        v = r.get(k.alive)
    except redis.ResponseError as e:
        if not rq_compat.wrong_type(e):
            raise
        return None
    return None if v is None else text(v)


def check_name(r: redis.Redis, name: str, k: WorkerKeys, rq_key: str) -> tuple[str, bool]:
    """Whether ``name`` is free to take: the lease value found ('' for none) and whether
    rq holds a stale registration of the name (at ``rq_key``, to replace).

    Raises:
        SetupError: a live worker holds the lease, or a process that may still run holds
            rq's registration of the name.
    """
    held = lease_value(r, k)
    if held is not None and not process_gone(held):
        raise SetupError(
            f"worker name {name!r} is taken: a live worker holds its lease "
            f"({k.alive} = {held!r}); stop it or choose another --name (the lease "
            f"of a worker that died lapses within {LEASE_MS // 1000} s)"
        )
    kind = text(r.type(rq_key))
    if kind == "none":
        return held or "", False
    death, host, pid = (
        [text(v) if v is not None else "" for v in r.hmget(rq_key, "death", "hostname", "pid")]
        if kind == "hash"
        else ["", "", ""]
    )
    if death or not host or not pid.isdigit():
        return held or "", not death  # ended, or no registration rq could have made
    if host == socket.gethostname() and (pid == str(os.getpid()) or _pid_gone(pid)):
        return held or "", True
    where = "this host" if host == socket.gethostname() else f"host {host!r}"
    ttl = r.ttl(rq_key)
    raise SetupError(
        f"worker name {name!r} is taken: process {pid} of {where} registered it "
        f"in rq ({rq_key}) and may still run (stopped or frozen); stop it or choose another "
        f"--name" + (f" (that registration expires in {ttl} s)" if ttl > 0 else "")
    )


def take_name(r: redis.Redis, name: str, k: WorkerKeys, token: str, seen: str) -> int:
    """Take the lease under ``token``; what a dead predecessor of this name held goes back
    to the queue first. Returns how many WIP entries went back.

    Raises:
        SetupError: another worker took the lease meanwhile.
    """
    back: int = scripts.call(r, lua.rejoin(k, token, Now.read(), LEASE_MS, starting=seen))
    if back < 0:
        raise SetupError(
            f"worker name {name!r} is taken: another worker took its lease "
            f"({k.alive}) while this one started; choose another --name"
        )
    return back
