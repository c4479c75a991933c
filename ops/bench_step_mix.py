"""What a sampled row, more rows or a longer row cost a greedy batch's decode step.

The sweep beside chat jobs (ops/bench_priority.py) runs its decode steps slower than the
sweep alone: its batch holds a row or two more, sampled (seeded, temperature 0.7) where the
sweep's rows are greedy. This times one step (model pass, log-softmax, one sampler call)
outside the worker on the same shapes, each variant alone and synchronized per step, then
the sampler call alone on random log-probs of the model's vocabulary.

A synchronized step holds the host's work for the step and the device's in one figure.
``--pipelined`` times steps as the worker runs them instead: each step queued before the
one before it is read, so the figure is the device's or the host's, whichever is longer,
by rows (64 to 128) and sampled rows.

    python ops/bench_step_mix.py                 # 0.5B shape (bf16, 4-bit)
    python ops/bench_step_mix.py --pipelined     # steps in sequence, as the worker's
    python ops/bench_step_mix.py --shape tiny    # a CPU's quick look
    python ops/bench_step_mix.py --sampler-only --vocab 64 --sampler-steps 2000
                                                 # the sampler's dispatch alone (a CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from bench_kv_rows import Batch, build

from mlxq.batching.sampler import RowParams, sample
from mlxq.producer.params import SamplingParams
from mlxq.worker.fused_pass import fused_pass
from mlxq.worker.random_model import SHAPES

#: Calls each variant makes before its timed ones (kernels built, buffers allocated).
WARM = 5


def mix(rows: int, sampled: int, kind: str) -> RowParams:
    """Greedy rows, then ``sampled`` rows of ``kind`` (seeded, unseeded or top_p, seeded)
    at temperature 0.7, as a sweep's batch holds chat rows."""
    top_p, seeded = (0.9 if kind == "top_p" else 1.0), kind != "unseeded"
    params = [SamplingParams(temperature=0.0)] * (rows - sampled) + [
        SamplingParams(temperature=0.7, top_p=top_p, seed=k if seeded else None)
        for k in range(sampled)
    ]
    return RowParams.from_params(params, 0)


def median_ms(call: Callable[[int], list[mx.array]], steps: int) -> float:
    """The median time of ``call(i)`` and the evaluation of what it returns, synchronized,
    over ``steps`` calls after :data:`WARM` untimed ones."""
    times = []
    for i in range(steps + WARM):
        start = time.perf_counter()
        mx.eval(*call(i))
        if i >= WARM:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(model: Any, rows: int, sampled: int, prompt: int, steps: int, seeded: bool) -> float:
    """One decode step: the model's pass, log-softmax and the sampler call."""
    batch = Batch(model, rows, prompt)
    rp = mix(rows, sampled, "seeded" if seeded else "unseeded")

    def step(i: int) -> list[mx.array]:
        logits = model(batch.next[:, None], cache=batch.caches)[:, -1, :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        batch.next = sample(lp, rp, [prompt + i] * rows)
        return [batch.next, *batch.arrays()]

    return median_ms(step, steps)


def run_pipelined(
    model: Any, rows: int, sampled: int, head_rows: int, prompt: int, steps: int
) -> float:
    """Decode steps in sequence (seeded sampled rows), the rows' tokens as one sequence
    where the worker runs them so (:mod:`mlxq.worker.fused_pass`): step i+1 is queued
    before step i's tokens are read, as the worker's decode steps run. The median of each
    step's wall time, after :data:`WARM` untimed steps."""
    batch = Batch(model, rows, prompt)
    rp = mix(rows, sampled, "seeded")
    fused = fused_pass(model)  # the worker's pass: the rows' tokens as one sequence
    if fused is not None:
        fused = dataclasses.replace(fused, head_rows=head_rows)

    def step(i: int) -> mx.array:
        if fused is not None:
            logits = fused.decode(batch.next, batch.caches)
        else:
            logits = model(batch.next[:, None], cache=batch.caches)[:, -1, :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        batch.next = sample(lp, rp, [prompt + i] * rows)
        mx.async_eval(batch.next)
        return batch.next

    pending = step(0)
    times = []
    for i in range(1, steps + WARM + 1):
        start = time.perf_counter()
        queued = step(i)
        pending.tolist()
        pending = queued
        if i > WARM:
            times.append((time.perf_counter() - start) * 1e3)
    pending.tolist()
    return statistics.median(times)


#: (rows, sampled rows, the head's rows in parts: mlxq.worker.fused_pass.HEAD_ROWS) for
#: steps in sequence: a 65th row with the head in one product and in parts, a sampled row
#: inside 64 and beside it, wider batches. Run in rounds (``--rounds``), every variant
#: once a round: a card's pace drifts over one process (an H100: the plain 64 rows from
#: 5.39 to 6.62 ms over one pass of the list), rounds put each variant on every stretch.
PIPELINED = [
    (64, 0, 0), (65, 0, 0), (65, 0, 64), (65, 1, 0), (65, 1, 64), (64, 1, 0), (62, 0, 0),
    (63, 1, 0), (66, 2, 0), (66, 2, 64), (72, 0, 0), (96, 0, 0), (128, 0, 0),
]  # fmt: skip


def pipelined(
    model: Any,
    steps: int,
    rounds: int,
    base_rows: int = 64,
    only: list[tuple[int, int, int]] | None = None,
) -> None:
    """:data:`PIPELINED`'s variants (or ``only``'s, the first the base), every one once a
    round; each variant's median over the rounds, its figure each round, and its
    difference from the base's in the same round (the median of those). :data:`PIPELINED`'s
    rows and head splits move with ``base_rows`` (``--rows``), as the whole steps' do."""
    shift = base_rows - 64
    variants = only or [(r + shift, s, p + shift if p else 0) for r, s, p in PIPELINED]
    got: dict[tuple[int, int, int], list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            got[v].append(run_pipelined(model, *v, prompt=40, steps=steps))
    base = got[variants[0]]
    print(
        "steps in sequence: rows sampled head-parts  ms/step (median of rounds)  "
        f"over {variants[0][0]} rows (median)  each round"
    )
    for (rows, sampled, parts), ms in got.items():
        over = statistics.median(m - b for m, b in zip(ms, base, strict=True))
        each = " ".join(f"{m:.2f}" for m in ms)
        mid = statistics.median(ms)
        print(f"{rows:4d} {sampled:7d} {parts:10d}  {mid:7.2f}  {over:+7.2f}  {each}")


def sampler_only(rows: int, sampled: int, kind: str, vocab: int, steps: int) -> float:
    """The sampler call alone, on random log-probs."""
    rp = mix(rows, sampled, kind)
    x = mx.random.normal((rows, vocab)).astype(mx.bfloat16)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    mx.eval(lp)
    return median_ms(lambda i: [sample(lp, rp, [i] * rows)], steps)


#: (rows, sampled rows, seeded, prompt) for whole steps; the plain 64-row step comes
#: back between the others, so drift over the run shows beside their differences.
WHOLE = [
    (64, 0, False, 40),
    (64, 0, False, 40),
    (65, 0, False, 40),
    (66, 0, False, 40),
    (65, 1, True, 40),
    (65, 1, False, 40),
    (66, 2, True, 40),
    (64, 1, True, 40),
    (64, 0, False, 120),
    (65, 1, True, 120),
    (64, 0, False, 40),
    (65, 1, True, 40),
]
#: (rows, sampled, kind) for the sampler alone.
ALONE = [
    (64, 0, "seeded"),
    (65, 0, "seeded"),
    (65, 1, "seeded"),
    (65, 1, "unseeded"),
    (66, 2, "seeded"),
    (66, 2, "top_p"),
    (64, 0, "seeded"),
]


def variants_arg(text: str) -> list[tuple[int, int, int]]:
    """``--variants``: ``ROWS:SAMPLED[:HEAD_PARTS]`` joined by commas."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            rows, sampled, head = (int(x) for x in [*parts, "0"][:3])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: want ROWS:SAMPLED[:HEAD_PARTS]") from None
        if len(parts) not in (2, 3) or rows < 1 or not 0 <= sampled <= rows or head < 0:
            raise argparse.ArgumentTypeError(f"{item!r}: want ROWS:SAMPLED[:HEAD_PARTS]")
        out.append((rows, sampled, head))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--rows", type=int, default=64, help="the batch's rows before chat rows join (64)"
    )
    ap.add_argument(
        "--sampler-only",
        action="store_true",
        help="time the sampler alone (no model): on a CPU a small --vocab shows its dispatch",
    )
    ap.add_argument(
        "--pipelined",
        action="store_true",
        help="whole steps in sequence, each queued before the last is read (as the worker)",
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="--pipelined: every variant once a round (3)"
    )
    ap.add_argument(
        "--variants",
        type=variants_arg,
        help="--pipelined: only these, ROWS:SAMPLED[:HEAD_PARTS] joined by commas, the first "
        "the base (e.g. 62:0,63:1,64:0,64:1: a chat row's step inside 64, many --rounds)",
    )
    ap.add_argument("--vocab", type=int, help="the sampler's vocabulary (default: the model's)")
    ap.add_argument("--sampler-steps", type=int, help="calls timed a variant (default: --steps)")
    args = ap.parse_args()
    if args.sampler_only:
        vocab = args.vocab or SHAPES[args.shape]["vocab_size"]
        alone(vocab, args.sampler_steps or args.steps, args.rows)
        return
    model = build(args.shape, args.bits)
    if args.pipelined:
        pipelined(model, args.steps, args.rounds, args.rows, args.variants)
        return
    print("rows sampled seeded prompt  ms/step (median)")
    for rows, sampled, seeded, prompt in WHOLE:
        rows += args.rows - 64
        ms = run(model, rows, sampled, prompt, args.steps, seeded)
        print(f"{rows:4d} {sampled:7d} {seeded!s:6} {prompt:6d}  {ms:7.2f}")
    alone(args.vocab or model.args.vocab_size, args.sampler_steps or args.steps, args.rows)


def alone(vocab: int, steps: int, base: int) -> None:
    print(f"the sampler alone, V = {vocab}: rows sampled kind  ms (median)")
    for rows, sampled, kind in ALONE:
        rows += base - 64
        ms = sampler_only(rows, sampled, kind, vocab, steps)
        print(f"{rows:4d} {sampled:7d} {kind:8}  {ms:7.3f}")


if __name__ == "__main__":
    main()
