"""ops/bench_client_floor.py: the burst's first chunks from a server that answers at once,
through the official openai client and raw HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

OPS = Path(__file__).resolve().parent.parent / "ops"


def test_every_way_times_each_request_of_each_round(tmp_path):
    out = tmp_path / "floor.json"
    argv = [sys.executable, str(OPS / "bench_client_floor.py"), "--burst", "4", "--rounds", "2"]
    done = subprocess.run(
        [*argv, "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=OPS
    )
    assert done.returncode == 0, done.stderr
    for way in ("openai", "openai-warm", "http"):
        assert any(line.startswith(way + " ") for line in done.stdout.splitlines()), done.stdout
    got = json.loads(out.read_text())
    assert got["burst"] == 4
    for way, rounds in got["seconds"].items():
        assert len(rounds) == 2, way
        assert all(len(r) == 4 and all(0 < s < 60 for s in r) for r in rounds), way


def test_a_way_it_does_not_know_is_named():
    argv = [sys.executable, str(OPS / "bench_client_floor.py"), "--ways", "openai,grpc"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=OPS)
    assert done.returncode == 2
    assert "--ways: grpc is not one of openai,openai-warm,http" in done.stderr
