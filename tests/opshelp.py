"""Helpers for the operations tests: the ``mlxq`` command as a process, a pseudo-terminal
read by a terminal emulator (pyte), waiting for a condition."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyte
from wcwidth import wcwidth

MLXQ = [sys.executable, "-m", "mlxq.producer.cli"]


def env_for(url: str | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", HF_HUB_OFFLINE="1", **extra)
    env.pop("MLXQ_REDIS_URL", None)
    if url is not None:
        env["MLXQ_REDIS_URL"] = url
    return env


def mlxq(
    *args: str, url: str | None = None, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``mlxq ARGS`` to its end, with ``url`` as ``$MLXQ_REDIS_URL``."""
    return subprocess.run(
        [*MLXQ, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_for(url),
    )


def mlxq_all(
    runs: list[list[str]], url: str | None = None, timeout: float = 120
) -> list[subprocess.CompletedProcess[str]]:
    """Run several ``mlxq`` commands at once (each start costs an interpreter's start)."""
    procs = [
        subprocess.Popen(
            [*MLXQ, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_for(url),
        )
        for args in runs
    ]
    out = []
    for args, p in zip(runs, procs, strict=True):
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess([*MLXQ, *args], p.returncode, stdout, stderr))
    return out


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if value := check():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Reader:
    """Collects what a file descriptor gives, from a thread (so the writer never blocks)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.data = fd, b""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                got = os.read(self.fd, 65536)
            except OSError:  # EIO: the terminal's other side closed
                return
            if not got:
                return
            self.data += got

    def join(self, timeout: float = 30) -> bytes:
        self._thread.join(timeout)
        return self.data


class Terminal:
    """A process on a pseudo-terminal of ``cols`` x ``rows``, its output fed to pyte."""

    def __init__(self, argv: list[str], env: dict[str, str], cols: int = 200, rows: int = 100):
        self.cols, self.rows = cols, rows
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
        )
        os.close(slave)
        self.master = master
        self.reader = Reader(master)

    def finish(self, timeout: float = 120) -> list[str]:
        """Wait for the process; the screen's rows, right-stripped, trailing blanks cut."""
        self.proc.wait(timeout)
        data = self.reader.join()
        os.close(self.master)
        screen = pyte.Screen(self.cols, self.rows)
        pyte.ByteStream(screen).feed(data)
        shown = [line.rstrip() for line in screen.display]
        while shown and not shown[-1]:
            shown.pop()
        return shown


def rows_of(text: str, cols: int) -> list[str]:
    """How a terminal ``cols`` wide lays ``text`` out from column 0 (right-stripped)."""
    out = []
    for line in text.split("\n"):
        row, width = "", 0
        for ch in line:
            w = max(0, wcwidth(ch))
            if width + w > cols:
                out.append(row)
                row, width = "", 0
            row, width = row + ch, width + w
        out.append(row)
    return [r.rstrip() for r in out]


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON log; fails on a line that is not a JSON object."""
    docs = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        assert isinstance(doc, dict), line
        docs.append(doc)
    return docs


def settled(read: Callable[[], Any], apart: float = 0.1) -> Any:
    """``read()`` once two reads ``apart`` s apart agree: a frozen worker's writes sent
    just before its SIGSTOP (a start, an end) land after it, so one read may be stale."""
    last = read()
    while True:
        time.sleep(apart)
        now = read()
        if now == last:
            return now
        last = now
