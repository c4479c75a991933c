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

Then chat rows join a running batch of greedy rows, as they join a sweep's (:data:`BESIDE`):
there they are drawn apart from the batch's argmax, their first token from their prefill,
and each kind of row alone or two at once is a layout of its own, whatever the batch's
size. Unmet, each one cost a GPU's first batch to meet it a kernel build: on an H200 (0.5B
shape, a sweep of 64 rows) one decode turn took 3.6 s at the first chat job beside the
sweep and another 3.0 s at the first two at once, every row of the batch waiting.

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


_TEMPERATURE = SamplingParams(temperature=0.7)
_TEMPERATURE_SEEDED = SamplingParams(temperature=0.7, seed=11)
_TOP_P_SEEDED = SamplingParams(temperature=0.7, top_p=0.9, seed=12)
#: Chat rows joining a running batch of greedy rows, in turn: each kind alone, then two at
#: once (temperature only and with top_p, seeded and not, and a seeded row beside one
#: that is not).
BESIDE: tuple[tuple[SamplingParams, ...], ...] = (
    (_TEMPERATURE_SEEDED,),
    (_TEMPERATURE_SEEDED, _TEMPERATURE_SEEDED),
    (_TEMPERATURE,),
    (_TEMPERATURE, _TEMPERATURE),
    (_TEMPERATURE_SEEDED, _TEMPERATURE),
    (_TOP_P,),
    (_TOP_P, _TOP_P),
    (_TOP_P_SEEDED,),
    (_TOP_P_SEEDED, _TOP_P_SEEDED),
)
#: The greedy rows they join (at most; ``max_batch`` less two where that is fewer).
BESIDE_GREEDY = 4


def warm_up(engine: Any) -> float:
    """Run :data:`ROUNDS` through ``engine`` (idle: no job in it yet), then :data:`BESIDE`,
    then zero its counts and empty its prompt cache. Returns the seconds it took."""
    if engine.active:
        raise RuntimeError("warm_up: the engine has rows already")
    start = time.perf_counter()
    text = "The quick brown fox jumps over the lazy dog, and then it runs away. "
    for r, (kinds, ride) in enumerate(ROUNDS):
        jobs = [_job(engine, f"{r}-{i}", s, text * (1 + i % 2)) for i, s in enumerate(kinds)]
        _run(engine, jobs, ride)
    beside = _beside(engine, text)
    shapes = 0
    if engine.prefill_buckets:
        shapes = warm_shapes(engine, engine.encode(GenerationRequest(prompt=text * 8)))
    engine.counters.reset()
    if engine.prompt_cache is not None:
        engine.prompt_cache.clear()
    took = time.perf_counter() - start
    log.info(
        "warm-up: %d rows, %d prefill shapes in %.0f ms",
        sum(len(k) for k, _ in ROUNDS) + beside,
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


def _job(
    engine: Any, name: str, sampling: SamplingParams, prompt: str, tokens: int = TOKENS
) -> Job:
    req = GenerationRequest(prompt=prompt, max_tokens=tokens, sampling=sampling)
    job = Job(f"warm-up-{name}", req, engine.encode(req))
    job.start("warm-up")
    return job


def _beside(engine: Any, text: str) -> int:
    """Greedy rows started as a sweep's refill (they ride), then :data:`BESIDE`'s rows
    joining them as chat jobs do, one round after another while they decode. Returns the
    rows it ran (none where the batch has no room for two greedy rows and two more)."""
    greedy: int = min(BESIDE_GREEDY, engine.max_batch - 2)
    if greedy < 2:  # two sampled rows beside fewer are not drawn apart
        return 0
    steps = TOKENS + 1  # a chat row's first token from its prefill, then its steps
    long = len(BESIDE) * steps + 2
    engine.add([_job(engine, f"greedy-{i}", _GREEDY, text, long) for i in range(greedy)], ride=True)
    for r, kinds in enumerate(BESIDE):
        engine.add([_job(engine, f"beside-{r}-{i}", s, text) for i, s in enumerate(kinds)])
        for _ in range(steps):
            engine.step()
    while engine.active:
        engine.step()
    return greedy + sum(len(k) for k in BESIDE)


def _run(engine: Any, jobs: list[Job], ride: bool) -> None:
    engine.add(jobs, ride=ride)
    while engine.active:
        engine.step()
