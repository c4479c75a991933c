"""The processes the ops scripts start and stop: a private redis-server, workers, waits,
stops.

Imported by the scripts beside it (``python ops/bench_e2e.py`` puts ``ops/`` on the path).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from mlxq.producer import AsyncClient, AsyncJob
from mlxq.producer.connection import connect
from mlxq.producer.info import collect
from mlxq.producer.keys import RQ_JOB

#: This install's ``mlxq``: beside this python, else on PATH (an install whose scripts
#: live elsewhere, as the GPU machine's).
MLXQ = Path(sys.executable).with_name("mlxq")
if not MLXQ.exists():
    MLXQ = Path(shutil.which("mlxq") or MLXQ)


def version(pkg: str) -> str | None:
    """An installed package's version, or None."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def commit() -> str | None:
    """This checkout's short commit, or None (no git here)."""
    got = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    ).stdout.strip()
    return got or None


async def first_chunks_s(
    url: str, queue: str, kws: list[dict[str, Any]], wait_s: float = 3600.0
) -> list[float]:
    """Submit ``kws`` in one call, then seconds from the submit to each job's first
    streamed chunk (nan for a job that streamed none)."""
    ac = AsyncClient(url, queue)
    t0 = time.perf_counter()

    async def first(job: AsyncJob) -> float:
        dt = None
        async for _ in job.stream(timeout=wait_s):
            dt = dt if dt is not None else time.perf_counter() - t0
        return dt if dt is not None else float("nan")

    try:
        return list(await asyncio.gather(*map(first, await ac.submit_many(kws))))
    finally:
        await ac.aclose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, within: float
) -> None:
    """Poll ``ready`` until it holds; exit with the log's tail if ``proc`` ends first or
    ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            sys.exit(f"{what} did not start (exit {proc.poll()}):\n{tail}")
        time.sleep(0.05)


def start_redis(work: Path, extra: Sequence[str] = ()) -> tuple[str, subprocess.Popen[bytes]]:
    """A private redis-server on a free port, keeping nothing on disk; its URL and process."""
    exe = shutil.which("redis-server") or sys.exit("redis-server not found (or pass --redis-url)")
    port, log = free_port(), work / "redis.log"
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, *extra, "--dir", str(work)], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"redis://127.0.0.1:{port}/0"

    def up() -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.ConnectionError:
            return False

    wait_for("redis-server", up, proc, log, 30)
    return url, proc


def start_worker(
    model: str | Path,
    url: str,
    queue: str,
    log: Path,
    extra: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    started: list[subprocess.Popen[bytes]] | None = None,
    exe: str | None = None,
) -> tuple[str, subprocess.Popen[bytes]]:
    """``mlxq worker`` serving ``queue`` (with ``extra`` options), returned once ``mlxq
    info`` lists it: its name and process. The process joins ``started`` at once, so a
    caller's cleanup stops it even when it never comes up. ``exe``: another install's
    ``mlxq`` (default: this one's)."""
    if exe is None:
        exe = str(MLXQ)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    cmd = [exe, "worker", "--model", str(model), "--redis-url", url, "--queue", queue]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--name", name, *extra], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    if started is not None:
        started.append(proc)
    r = connect(url)  # redis:// or redis+sentinel://
    try:
        wait_for(
            "mlxq worker",
            lambda: any(w["name"] == name for w in collect(r)["workers"]),
            proc,
            log,
            600,
        )
    finally:
        r.close()
    return name, proc


def stop(proc: subprocess.Popen[bytes] | None, within: float = 60) -> None:
    """SIGTERM, then SIGKILL after ``within`` seconds."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(within)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rq_time(raw: bytes | None) -> float | None:
    """Unix seconds from an rq record's timestamp (UTC, ISO format), or None."""
    if not raw:
        return None
    return datetime.fromisoformat(raw.decode().replace("Z", "+00:00")).timestamp()


def records(
    url: str, ids: Sequence[str], fields: Sequence[str] = ("enqueued_at", "started_at")
) -> list[tuple[float | None, ...]]:
    """Each job's ``fields`` of its rq record (by default enqueued_at and started_at), as
    unix seconds."""
    r = redis.Redis.from_url(url)
    try:
        with r.pipeline(transaction=False) as p:
            for i in ids:
                p.hmget(f"{RQ_JOB}{i}", list(fields))
            return [tuple(rq_time(v) for v in got) for got in p.execute()]
    finally:
        r.close()
