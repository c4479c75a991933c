"""ops/bench_step_mix.py: a decode step's time by rows and sampled rows, and the sampler's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parent.parent / "ops"


def test_each_variant_and_the_sampler_alone_are_timed():
    argv = [sys.executable, str(OPS / "bench_step_mix.py"), "--shape", "tiny", "--steps", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=OPS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("the sampler alone")))
    steps, alone = lines[1:at], lines[at + 1 :]
    assert len(steps) == 12 and len(alone) == 7, done.stdout
    for line in steps + alone:
        *_, ms = line.split()
        assert float(ms) > 0, line
    assert "V = 4096" in lines[at], lines[at]


def test_the_sampler_alone_at_a_vocabulary_given():
    argv = [sys.executable, str(OPS / "bench_step_mix.py"), "--sampler-only", "--vocab", "64"]
    done = subprocess.run([*argv, "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("the sampler alone, V = 64:"), done.stdout
    kinds = [line.split()[2] for line in lines[1:]]
    assert kinds == ["seeded", "seeded", "seeded", "unseeded", "seeded", "top_p", "seeded"]
