"""``/health`` watched while an attack on the gateway runs: a process of its own polls it
(so the test's own work, building a 16 MB body, never delays a poll), and the test asserts
every answer (never a duration); the durations are printed as figures (``-s``)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

#: Polls ``URL/health`` every 20 ms from when it says "ready" until its stdin closes, then
#: once more; prints a JSON list of [seconds, status, body].
_POLLER = """
import json, select, sys, time, urllib.error, urllib.request
url, polls = sys.argv[1], []
def poll():
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=60) as res:
            status, body = res.status, json.loads(res.read())
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()[:200].decode(errors="replace")
    except OSError as e:
        status, body = 0, repr(e)
    polls.append([time.perf_counter() - t0, status, body])
print("ready", flush=True)
while True:  # at least one poll as the attack starts, then every 20 ms until it ends
    poll()
    if select.select([sys.stdin], [], [], 0.02)[0]:
        break
poll()
print(json.dumps(polls), flush=True)
"""


class HealthWatch:
    """``with HealthWatch(url, "attack") as hw: <attack>`` then ``hw.check()``.

    Polls ``GET /health`` from entry to exit, and once more after the attack.
    :meth:`check` asserts that each poll was answered ``200 {"status": "ok", "redis":
    "ok", ...}`` and prints how long the answers took.
    """

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.polls: list[tuple[float, int, Any]] = []  # (seconds, status, body or error)
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> HealthWatch:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _POLLER, f"{self.url}/health"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None and self._proc.stdout.readline() == "ready\n"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate(timeout=120)  # closes its stdin: the poller's end
        self.polls = [tuple(p) for p in json.loads(out)]  # type: ignore[misc]

    def check(self, live_workers: int | None = None) -> dict[str, float]:
        """Assert every poll was answered ok (with ``live_workers`` at least this many,
        when given); print and return the figures (ms)."""
        assert len(self.polls) >= 2, "/health was never polled during the attack"
        for _, status, body in self.polls:
            assert status == 200, (self.name, status, body)
            assert body["status"] == "ok" and body["redis"] == "ok", (self.name, body)
            if live_workers is not None:
                assert (body["live_workers"] or 0) >= live_workers, (self.name, body)
        ms = sorted(1000 * t for t, _, _ in self.polls)
        figures = {
            "polls": len(ms),
            "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
            "max_ms": round(ms[-1], 1),
        }
        print(f"\n/health during {self.name}: {figures}")
        return figures
