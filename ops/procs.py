"""The processes the ops scripts start and stop: a private redis-server, waits, stops.

Imported by the scripts beside it (``python ops/bench_e2e.py`` puts ``ops/`` on the path).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis


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


def stop(proc: subprocess.Popen[bytes] | None, within: float = 60) -> None:
    """SIGTERM, then SIGKILL after ``within`` seconds."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(within)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
