"""ops/bench_engine_steps.py: the worker's engine steps by phase, and ``--after``'s steps
right after a row joined or left, one by one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parent.parent / "ops"


def test_after_times_each_step_after_a_join_and_a_leave(tmp_path):
    trace = tmp_path / "trace.jsonl"
    argv = [sys.executable, str(OPS / "bench_engine_steps.py"), "--rows", "4", "--steps", "3"]
    done = subprocess.run(
        [*argv, "--rounds", "2", "--settle", "3", "--after"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MLXQ_TRACE_STAGES": str(trace)},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index("steps after a row joined or left, ms at the median of rounds, by place")
    after = {" ".join(x.split()[:2]): x.split()[2:] for x in lines[at + 1 : at + 5]}
    # greedy has no row to join; chat and wider each join one, which leaves again.
    assert set(after) == {"chat join", "chat leave", "wider join", "wider leave"}, done.stdout
    for places in after.values():
        assert len(places) == 3 and all(float(ms) > 0 for ms in places), done.stdout
    # The trace's parts of the first two steps after each change and the last one.
    parts = {
        " ".join(x.split()[:-4])
        for x in lines[
            lines.index(next(x for x in lines if x.startswith("decode step parts"))) + 2 :
        ]
    }
    assert {"chat join #1", "chat join #2", "chat join #3", "wider leave #1"} <= parts, parts
    assert {"greedy", "chat", "wider"} <= parts, parts
