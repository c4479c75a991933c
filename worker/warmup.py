"""A worker's rows of each common kind, run once before its first job.

Why. MLX builds a kernel the first time it meets a fused op in a new layout (the CPU
backend compiles C++ with the system compiler, Metal and CUDA their own source), and MLX's
CUDA backend builds a cuDNN attention plan for each new prefill shape. Met mid-batch, each
build stalls every row of the batch: on this machine's CPU a sweep's batch beside chat
jobs once took 2.4 s for one decode step, the first with two sampled rows in it (three
sampler kernels built for that layout; one sampled row had built the others). Here the
batch meets those layouts before any job does: greedy rows beside sampled ones, seeded and
unseeded, one sampled row and several, rows with a first-token pass of their own and rows
that ride. Then every count goes back to zero and the prompt cache is emptied, so ``mlxq
info`` counts jobs only. Greedy and seeded rows' tokens are the same with and without it;
unseeded rows draw from MLX's global generator, which it has moved on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

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
        engine.add(jobs, ride=ride)
        while engine.active:
            engine.step()
    engine.counters.reset()
    if engine.prompt_cache is not None:
        engine.prompt_cache.clear()
    took = time.perf_counter() - start
    log.info("warm-up: %d rows in %.0f ms", sum(len(k) for k, _ in ROUNDS), took * 1000)
    return took
