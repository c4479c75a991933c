"""The worker's warm-up: rows of each common kind once, before any job, and no trace of
them after (counts, prompt cache), nor in any greedy or seeded job's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxq.producer.params import GenerationRequest, SamplingParams

mlx_lm = pytest.importorskip("mlx_lm")

from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402
from mlxq.worker.warmup import ROUNDS, warm_up  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _tokens(engine: Engine) -> dict[str, list[int]]:
    reqs = {
        "greedy": GenerationRequest(prompt="one two three", max_tokens=12),
        "seeded": GenerationRequest(
            prompt="four five", max_tokens=12, sampling=SamplingParams(temperature=0.9, seed=3)
        ),
        "top_p": GenerationRequest(
            prompt="six", max_tokens=12, sampling=SamplingParams(temperature=0.7, top_p=0.8, seed=4)
        ),
    }
    jobs = {}
    for name, req in reqs.items():
        jobs[name] = Job(name, req, engine.encode(req))
        jobs[name].start("exec")
    engine.add(list(jobs.values()))
    while engine.active:
        apply_deltas(engine.step())
    return {name: job.token_ids for name, job in jobs.items()}


def test_warm_up_runs_every_round_then_leaves_no_count_and_no_cached_prompt(loaded):
    engine = Engine(*loaded, max_batch=8, prompt_cache_bytes=1 << 24)
    took = warm_up(engine)
    assert took > 0 and engine.active == 0
    c = engine.counters
    assert (c.decode_steps, c.tokens_generated, c.prompt_tokens, c.first_token_passes) == (0,) * 4
    assert not c.prefill_shapes and not c.batch_sizes and not c.stages.ms
    assert c.seen  # what it built stays known: a job's pass of those shapes is not new
    assert engine.prompt_cache is not None and engine.prompt_cache.nbytes == 0
    with pytest.raises(RuntimeError):  # only before the first job
        engine.add([Job("x", GenerationRequest(prompt="x", max_tokens=2), [1, 2])])
        warm_up(engine)


def test_warm_up_runs_its_rows_through_the_batch(loaded, monkeypatch):
    """Every round's rows decoded (counted before the counts are zeroed)."""
    engine = Engine(*loaded, max_batch=8)
    seen = {}
    real = engine.counters.reset

    def keep() -> None:
        seen.update(steps=engine.counters.decode_steps, tokens=engine.counters.tokens_generated)
        real()

    monkeypatch.setattr(engine.counters, "reset", keep)
    warm_up(engine)
    rows = sum(len(kinds) for kinds, _ in ROUNDS)
    assert seen["tokens"] >= rows and seen["steps"] >= len(ROUNDS)


def test_greedy_and_seeded_tokens_are_those_of_a_worker_without_it(loaded):
    warmed = Engine(*loaded, max_batch=8)
    warm_up(warmed)
    assert _tokens(warmed) == _tokens(Engine(*loaded, max_batch=8))


def test_a_worker_whose_warm_up_fails_starts_clean_and_serves(tiny_model, monkeypatch, caplog):
    from mlxq.worker import warmup
    from mlxq.worker.config import WorkerConfig

    def half_way(engine: Engine) -> float:  # rows in the batch, then an error
        engine.add(
            [
                Job(
                    "w",
                    GenerationRequest(prompt="x y", max_tokens=3),
                    engine.encode(GenerationRequest(prompt="x y", max_tokens=3)),
                )
            ]
        )
        engine.step()
        raise RuntimeError("no kernel for this model")

    monkeypatch.setattr(warmup, "warm_up", half_way)
    engine = Engine.for_worker(WorkerConfig(str(tiny_model), prompt_cache_bytes=0))
    assert "warm-up skipped: RuntimeError: no kernel for this model" in caplog.text
    assert engine.active == 0 and engine.counters.decode_steps == 0
    assert len(_tokens(engine)["greedy"]) == 12


def test_with_buckets_it_prefills_the_shapes_jobs_meet_before_the_first_one(loaded):
    """Prefills padded to bucketed shapes (on with MLX on CUDA, where each new shape costs
    a plan): one row at every bucketed width up to 512 tokens, a full batch up to 128, so a
    chat prompt or a sweep's refill of those sizes meets no shape new to the worker."""
    engine = Engine(*loaded, max_batch=4, prefill_buckets=True, prompt_cache_bytes=1 << 24)
    warm_up(engine)
    seen = set(engine.counters.seen)
    short = {16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128}
    assert {(1, w, w) for w in short | {160, 192, 224, 256, 320, 384, 448, 512}} <= seen
    assert {(4, w, w) for w in short} <= seen
    assert not engine.counters.prefill_shapes and engine.prompt_cache.nbytes == 0
    chat = GenerationRequest(prompt="A question about harbours and tides " * 6, max_tokens=2)
    sweep = [GenerationRequest(prompt=f"Item {i}: " + "word " * 30, max_tokens=2) for i in range(4)]
    for reqs in ([chat], sweep):
        jobs = [Job(f"j{i}", r, engine.encode(r)) for i, r in enumerate(reqs)]
        for j in jobs:
            j.start("exec")
        engine.add(jobs)
        while engine.active:
            apply_deltas(engine.step())
    assert engine.counters.prefill_shapes and engine.counters.prefill_shapes <= seen
    # Without buckets a prompt's exact length is its shape: none is built ahead.
    plain = Engine(*loaded, max_batch=4)
    warm_up(plain)
    assert (1, 512, 512) not in plain.counters.seen


def test_with_buckets_greedy_and_seeded_tokens_are_those_of_a_worker_without_it(loaded):
    warmed = Engine(*loaded, max_batch=8, prefill_buckets=True)
    warm_up(warmed)
    assert _tokens(warmed) == _tokens(Engine(*loaded, max_batch=8, prefill_buckets=True))


#: Run in a process of its own whose MLX builds its kernels into an empty directory
#: (``$TMPDIR/mlx/<version>/cpu``), so what it builds can be listed.
BESIDE_SCRIPT = """
import glob, json, os, sys
import mlx_lm
from mlxq.producer.params import GenerationRequest, SamplingParams
from mlxq.worker.engine import Engine
from mlxq.worker.jobs import Job, apply_deltas
from mlxq.worker.warmup import warm_up

def built():
    return {os.path.basename(f) for f in glob.glob(os.environ["TMPDIR"] + "/mlx/*/cpu/*")}

model, tokenizer = mlx_lm.load(sys.argv[1])
engine = Engine(model, tokenizer, max_batch=12)
warm_up(engine)
n = 0

def jobs(params, tokens=6):
    global n
    out = []
    for p in params:
        n += 1
        req = GenerationRequest(prompt=f"row {n} of a sweep", max_tokens=tokens, sampling=p)
        job = Job(f"j{n}", req, engine.encode(req))
        job.start("exec")
        out.append(job)
    return out

engine.add(jobs([SamplingParams()] * 9, 60), ride=True)  # a sweep's refill
for _ in range(2):
    apply_deltas(engine.step())
t, s = SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=5)
p = SamplingParams(temperature=0.7, top_p=0.9, seed=6)
for name, params in (("seeded", [s]), ("two seeded", [s, s]), ("plain", [t]),
                     ("two plain", [t, t]), ("seeded and plain", [s, t]), ("top_p", [p])):
    before = built()
    engine.add(jobs(params))  # chat jobs: no ride, their first token from their prefill
    for _ in range(7):
        apply_deltas(engine.step())
    print(json.dumps([name, len(built() - before)]))
# A fused kernel no one built before: the listing sees what MLX builds.
before = built()
import mlx.core as mx
mx.eval(mx.compile(lambda a: mx.sin(a) * mx.cos(a) + a * 0.25)(mx.arange(8.0)))
print(json.dumps(["a new kernel", len(built() - before)]))
"""


def test_chat_rows_joining_a_sweeps_batch_build_no_kernel_after_the_warm_up(tiny_model, tmp_path):
    """A chat row beside a sweep's greedy rows is drawn apart from their argmax, its first
    token from its prefill: a layout of MLX's fused kernels of its own, built the first
    time it is met (on a GPU seconds, every row of the batch waiting). The warm-up meets
    each kind, alone and two at once (a kernel it never met shows in the listing)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "beside.py"
    script.write_text(BESIDE_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_model)],
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    built = dict(json.loads(line) for line in out.stdout.splitlines() if line.startswith("["))
    assert built.pop("a new kernel") > 0
    assert built == dict.fromkeys(
        ("seeded", "two seeded", "plain", "two plain", "seeded and plain", "top_p"), 0
    )
