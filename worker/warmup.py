"""A worker's rows of each common kind, run once before its first job.

Why. MLX builds a kernel the first time it meets a fused op in a new layout (the CPU
backend compiles C++ with the system compiler, Metal and CUDA their own source), and MLX's
CUDA backend builds a cuDNN attention plan for each new prefill shape. Met mid-batch, each
build stalls every row of the batch: on this machine's CPU a sweep's batch beside chat
jobs once took 2.4 s for one decode step, the first with two sampled rows in it (three
sampler kernels built for that layout; one sampled row had built the others). Here the
batch meets those layouts before any job does: greedy rows beside sampled ones, seeded and
unseeded, one sampled row and several, rows whose prefill gives their first token and rows
that ride. Then every count goes back to zero and the prompt cache is emptied, so ``mlxq
info`` counts jobs only. Greedy and seeded rows' tokens are the same with and without it;
unseeded rows draw from MLX's global generator, which it has moved on.

Where prefills are padded to bucketed shapes (``--prefill-buckets``, on with MLX on CUDA),
it also runs a prefill pass of each shape a job is likely to meet: one row at every
bucketed width up to :data:`ONE_ROW_WIDTH` tokens (a chat job's prompt) and a full batch
of rows up to :data:`FULL_BATCH_WIDTH` (a sweep's refill). On an H100 a pass of a shape new
to the worker took 79-131 ms of the decode thread, against 14-16 ms for a one-row pass
of a shape it had met (0.5B shape, `ops/h200.sh TRACE=1`), and every row of the batch
waited for it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mlxq.batching.prefill import prefill_shape
from mlxq.producer.params import GenerationRequest, SamplingParams
from mlxq.worker.jobs import Job

log = logging.getLogger(__name__)

#: Tokens each warm-up row makes: a first token and decode steps after it.
TOKENS = 4

_GREEDY = SamplingParams()
_SEEDED = SamplingParams(temperature=0.8, seed=7)
_TOP_P = SamplingParams(temperature=0.8, top_p=0.9)
#: Rounds of rows, each started together, and whether they ride (their first token in the
#: batch's next decode step). Several sampled rows, then one, as the sampler's kernels
#: take one layout for a single sampled row and another for more.
ROUNDS: tuple[tuple[tuple[SamplingParams, ...], bool], ...] = (
    ((_GREEDY, _GREEDY, _SEEDED, _SEEDED, _TOP_P, _TOP_P), False),
    ((_GREEDY, _SEEDED), True),
    ((_TOP_P,), False),
)


def warm_up(engine: Any) -> float:
    """Run :data:`ROUNDS` through ``engine`` (idle: no job in it yet), then zero its counts
    and empty its prompt cache. Returns the seconds it took."""
    if engine.active:
        raise RuntimeError("warm_up: the engine has rows already")
    start = time.perf_counter()
    text = "The quick brown fox jumps over the lazy dog, and then it runs away. "
    for r, (kinds, ride) in enumerate(ROUNDS):
        jobs = []
        for i, sampling in enumerate(kinds):
            req = GenerationRequest(prompt=text * (1 + i % 2), max_tokens=TOKENS, sampling=sampling)
            job = Job(f"warm-up-{r}-{i}", req, engine.encode(req))
            job.start("warm-up")
            jobs.append(job)
        _run(engine, jobs, ride)
    shapes = 0
    if engine.prefill_buckets:
        shapes = warm_shapes(engine, engine.encode(GenerationRequest(prompt=text * 8)))
    engine.counters.reset()
    if engine.prompt_cache is not None:
        engine.prompt_cache.clear()
    took = time.perf_counter() - start
    log.info(
        "warm-up: %d rows, %d prefill shapes in %.0f ms",
        sum(len(k) for k, _ in ROUNDS),
        shapes,
        took * 1000,
    )
    return took


#: Bucketed widths a warm-up prefills one row at, up to this many tokens.
ONE_ROW_WIDTH = 512
#: Bucketed widths it prefills a full batch of rows at, up to this many tokens.
FULL_BATCH_WIDTH = 128


def warm_shapes(engine: Any, ids: list[int]) -> int:
    """Prefill one row at each bucketed width up to :data:`ONE_ROW_WIDTH` and a full batch
    at each up to :data:`FULL_BATCH_WIDTH` (none past the model's context), each shape once
    unless met before, with prompts cut from ``ids`` (a tokenized text). Returns the shapes
    it ran."""
    context = engine.max_context or ONE_ROW_WIDTH + 2  # None: the model names none
    cap = min(ONE_ROW_WIDTH, context - 2)
    shapes: dict[tuple[int, int], None] = {}  # in order, each once
    for rows, most in ((1, cap), (engine.max_batch, min(FULL_BATCH_WIDTH, cap))):
        for n in range(1, most + 1):
            shapes[prefill_shape(rows, n, engine.max_batch, engine.prefill_step_size)] = None
    ran = 0
    for rows, width in shapes:
        if (rows, width, width) in engine.counters.seen or width > cap:
            continue
        if engine.prompt_cache is not None:
            engine.prompt_cache.clear()  # so no row finds an earlier one's prefix
        # A full batch rides as a sweep's refill does: its pass holds all but a prompt's
        # last token, so its prompts are one token longer than the width. One row does
        # not ride, as a chat job's: its pass feeds the last token too, where it may.
        ride = rows > 1
        fed = not ride and engine.head is not None
        jobs = []
        for r in range(rows):
            # Each row its own first two tokens, so no two share a prefix.
            head = [ids[r % len(ids)], ids[(r // len(ids)) % len(ids)]]
            row = head + ids * (1 + width // len(ids))
            req = GenerationRequest(prompt="warm-up", max_tokens=1)
            job = Job(f"warm-up-{rows}x{width}-{r}", req, row[: width + (not fed)])
            job.start("warm-up")
            jobs.append(job)
        _run(engine, jobs, ride=ride)
        ran += 1
    return ran


def _run(engine: Any, jobs: list[Job], ride: bool) -> None:
    engine.add(jobs, ride=ride)
    while engine.active:
        engine.step()
