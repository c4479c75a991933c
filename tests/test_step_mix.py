"""ops/bench_step_mix.py: a decode step's time by rows and sampled rows, and the sampler's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parent.parent / "ops"


def test_each_variant_and_the_sampler_alone_are_timed():
    argv = [sys.executable, str(OPS / "bench_step_mix.py"), "--shape", "tiny", "--steps", "2"]
    done = subprocess.run([*argv, "--rows", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("the sampler alone")))
    steps, alone = lines[1:at], lines[at + 1 :]
    assert len(steps) == 12 and len(alone) == 7, done.stdout
    for line in steps + alone:
        *_, ms = line.split()
        assert float(ms) > 0, line
    assert "V = 4096" in lines[at], lines[at]
    # --rows 4: the batch's rows before chat rows join, and one or two more with them.
    assert {int(line.split()[0]) for line in steps + alone} == {4, 5, 6}, done.stdout


def test_steps_in_sequence_time_every_variant_once_a_round():
    argv = [sys.executable, str(OPS / "bench_step_mix.py"), "--shape", "tiny", "--steps", "2"]
    done = subprocess.run(
        [*argv, "--pipelined", "--rounds", "2", "--rows", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("steps in sequence"), done.stdout
    rows = [line.split() for line in lines[1:]]
    assert len(rows) == 13, done.stdout
    # rows, sampled, head parts, the median, its lead over the plain 64 rows, two rounds
    assert all(len(r) == 7 and all(float(x) > 0 for x in r[-2:]) for r in rows), done.stdout
    # --rows 4: every variant's rows and the head's split move by 4 - 64.
    assert rows[0][:3] == ["4", "0", "0"] and float(rows[0][4]) == 0, rows[0]
    assert {int(r[0]) for r in rows} == {2, 3, 4, 5, 6, 12, 36, 68}, done.stdout
    assert {int(r[2]) for r in rows} == {0, 4}, done.stdout


def test_steps_in_sequence_of_the_variants_given_the_first_the_base():
    argv = [sys.executable, str(OPS / "bench_step_mix.py"), "--shape", "tiny", "--steps", "2"]
    argv += ["--pipelined", "--rounds", "2", "--variants", "2:0,3:1,4:1:2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "over 2 rows (median)" in lines[0], done.stdout
    rows = [line.split() for line in lines[1:]]
    assert [r[:3] for r in rows] == [["2", "0", "0"], ["3", "1", "0"], ["4", "1", "2"]]
    assert float(rows[0][4]) == 0 and len(rows[0][5:]) == 2, rows[0]
    bad = subprocess.run([*argv[:-1], "3:4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'3:4': want ROWS:SAMPLED[:HEAD_PARTS]" in bad.stderr


def test_the_sampler_alone_at_a_vocabulary_given():
    argv = [sys.executable, str(OPS / "bench_step_mix.py"), "--sampler-only", "--vocab", "64"]
    done = subprocess.run([*argv, "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("the sampler alone, V = 64:"), done.stdout
    kinds = [line.split()[2] for line in lines[1:]]
    assert kinds == ["seeded", "seeded", "seeded", "unseeded", "seeded", "top_p", "seeded"]


def test_bench_fused_times_each_way_and_finds_the_fused_logits_agree():
    """ops/bench_fused.py: a decode step alone and as one sequence, a new row's prefill
    alone, beside the step and fused with it; the fused logits checked against two passes."""
    argv = [sys.executable, str(OPS / "bench_fused.py"), "--shape", "tiny", "--rows", "4"]
    argv += ["--steps", "2", "--widths", "8,16"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=OPS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("4 rows holding 100: decode step alone"), done.stdout
    rows = lines[2:]
    assert [r.split()[0] for r in rows] == ["8", "16"], done.stdout
    for r in rows:
        assert r.endswith("argmax same"), r
        assert float(r.split("max diff ")[1].split(",")[0]) < 1e-4, r
