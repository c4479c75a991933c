"""What one row leaving or joining a full batch costs the decode steps around it.

A sweep's batch of 64 rows with one chat row coming and going: each chat job's end filters
every layer's KV cache down to the rows that stay (a gather of the whole batch) and each
start extends it (a pad and a concatenation of the whole batch). On the H100 (0.5B shape,
10,000-job sweep beside chat jobs, ``ops/stage_trace.py`` of the worker's passes) the
decode step after a row left took 20.6 ms at p50 against 14.6 for the others, and after a
row joined 19.6-20.4. This times the same operations on the same shapes outside the worker:
steady decode steps, then a row leaving (``filter_rows``, as the worker filters) and joining
(mlx-lm's ``BatchKVCache.extend``), each timed alone (synchronized) and with the decode
step that follows it, as the worker runs them (lazily, in one evaluation). A leave is
timed three ways: the worker's (``filter_rows``: kept rows in one run are a slice, others
a gather), a gather always (the worker's before), and, as a candidate, a concatenation of
the runs of kept rows (contiguous copies, no gather), to see which of MLX's kernels the
cost is in. (Most of the worker's 6 ms was elsewhere: the step after a change waited for
its own evaluation, since fixed; docs/benchmarks.md. What is left is these copies.)

    python ops/bench_kv_rows.py                  # 0.5B shape (bf16, 4-bit), batch 64
    python ops/bench_kv_rows.py --shape tiny     # a CPU's quick look

The model is built in memory with random weights (no checkpoint, no tokenizer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from mlxq.worker import kv_pack
from mlxq.worker.random_model import COMMON, GROUP_SIZE, SHAPES

#: MLX's CUDA graph settings, printed where set.
GRAPH_SETTINGS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE")


def build(shape: str, bits: int) -> Any:
    args = llama.ModelArgs.from_dict(
        {"model_type": "llama", **SHAPES[shape], **COMMON, "hidden_act": "silu"}
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16 if shape != "tiny" else mx.float32)
    if bits:
        nn.quantize(model, group_size=GROUP_SIZE, bits=bits)
    mx.eval(model.parameters())
    return model


class Batch:
    """A decode batch: its caches, next inputs and the tokens each row holds."""

    def __init__(self, model: Any, rows: int, prompt: int) -> None:
        self.model = model
        self.caches = [BatchKVCache([0] * rows) for _ in model.layers]
        tokens = mx.random.randint(0, 1000, (rows, prompt))
        self.next = mx.argmax(model(tokens, cache=self.caches)[:, -1, :], axis=-1)
        mx.eval(self.next, *self.arrays())
        self.held = [prompt] * rows

    def arrays(self) -> list[mx.array]:
        return [a for c in self.caches for a in (c.keys, c.values, c.offset, c.left_padding)]

    def step(self) -> None:
        """One decode step, left lazy."""
        logits = self.model(self.next[:, None], cache=self.caches)[:, -1, :]
        self.next = mx.argmax(logits, axis=-1)
        self.held = [n + 1 for n in self.held]

    def leave(self, row: int, how: str) -> None:
        keep = [i for i in range(len(self.held)) if i != row]
        held = [self.held[i] for i in keep]
        if how == "runs":
            filter_runs(self.caches, keep, held)
        elif how == "gather":
            one_run, kv_pack._one_run = kv_pack._one_run, lambda keep: None
            try:
                kv_pack.filter_rows(self.caches, keep, held)
            finally:
                kv_pack._one_run = one_run
        else:
            kv_pack.filter_rows(self.caches, keep, held)
        self.next = self.next[mx.array(keep)]
        self.held = held

    def join(self, other: Batch) -> None:
        for c, o in zip(self.caches, other.caches, strict=True):
            c.extend(o)
        self.next = mx.concatenate([self.next, other.next])
        self.held += other.held


def _runs(keep: list[int]) -> list[tuple[int, int]]:
    """``keep`` (ascending) as [start, end) runs of consecutive rows."""
    out: list[tuple[int, int]] = []
    for i in keep:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def filter_runs(caches: list[Any], keep: list[int], held: list[int]) -> None:
    """``filter_rows``' result by slicing the runs of kept rows and concatenating them."""
    runs = _runs(keep)
    index = mx.array(keep)
    most = max(held)
    for c in caches:
        cut = max(c._idx - most, 0)
        c.keys, c.values = (
            mx.concatenate([a[s:e, :, cut:] for s, e in runs]) for a in (c.keys, c.values)
        )
        c.offset, c.left_padding = c.offset[index], c.left_padding[index] - cut
        c._idx -= cut


def timed(fn: Callable[[], None], batch: Batch) -> float:
    start = time.perf_counter()
    fn()
    mx.eval(batch.next, *batch.arrays())
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=48)
    ap.add_argument("--leave", choices=["newest", "middle"], default="newest")
    args = ap.parse_args()

    model = build(args.shape, args.bits)
    batch = Batch(model, args.batch, args.prompt)
    for _ in range(8):  # kernels built before timing
        timed(batch.step, batch)
    out: dict[str, list[float]] = {}

    def note(name: str, ms: float) -> None:
        out.setdefault(name, []).append(ms)

    def then_step(change: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            change()
            batch.step()

        return both

    for cycle in range(args.cycles):
        for _ in range(3):
            note("decode step, steady", timed(batch.step, batch))
        # The newest row (a chat job's, last in the batch) or one in the middle.
        row = len(batch.held) - 1 if args.leave == "newest" else len(batch.held) // 2
        how = ("worker", "gather", "runs")[cycle // 2 % 3]
        leave = partial(batch.leave, row, how)
        if cycle % 2:  # alone, then the step after it
            note(f"leave alone ({how}, evaluated)", timed(leave, batch))
            note(f"decode step after a leave ({how})", timed(batch.step, batch))
        else:  # as the worker runs them: one evaluation for both
            note(f"leave ({how}) + decode step, one eval", timed(then_step(leave), batch))
        for _ in range(3):
            note("decode step, steady", timed(batch.step, batch))
        one = Batch(model, 1, args.prompt // 2)  # a chat job's prefill, evaluated
        join = partial(batch.join, one)
        if cycle % 2:
            note("join alone (extend, evaluated)", timed(join, batch))
            note("decode step after a join", timed(batch.step, batch))
        else:
            note("join + decode step, one evaluation", timed(then_step(join), batch))
    # MLX's CUDA backend runs ops as CUDA graphs of a few nodes each, cached by their
    # topology: these settings decide how many and how often a changed step misses.
    tuned = " ".join(f"{k}={os.environ[k]}" for k in GRAPH_SETTINGS if k in os.environ)
    print(
        f"{mx.default_device()}, shape {args.shape}, {args.bits}-bit, batch {args.batch}, "
        f"prompt {args.prompt}, {args.cycles} cycles, {args.leave} row leaves"
        f"{', ' + tuned if tuned else ''}; ms, p50 (min, max)"
    )
    for name, ms in out.items():
        print(
            f"  {name:<38} {statistics.median(ms):8.2f}"
            f"  ({min(ms):.2f}, {max(ms):.2f})  n={len(ms)}"
        )


if __name__ == "__main__":
    main()
