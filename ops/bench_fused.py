"""A decode step and a chat row's prefill: two passes against one (mlxq.worker.fused_pass).

Beside a sweep each chat job's prefill is a pass of its own, about a decode step's cost on
a GPU at the 0.5B shape. This times, outside the worker and synchronized per call: the
batch's decode step alone, the new row's prefill alone (its head on the last position, as
the worker runs it), the two as two passes evaluated together (what the worker does now),
and the two as one fused pass; for prompts of several widths. It checks that the fused
logits agree with the two passes' first.

    python ops/bench_fused.py                  # 0.5B shape, 4-bit, 64 rows
    python ops/bench_fused.py --shape tiny --rows 16 --steps 10   # a CPU's quick look
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).parent))
from bench_kv_rows import Batch, build
from bench_step_mix import median_ms

from mlxq.worker.fused_pass import fused_pass
from mlxq.worker.model_head import model_head


def batch(model: Any, rows: int, held: int) -> Batch:
    mx.random.seed(0)  # the same rows for every variant
    return Batch(model, rows, held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--held", type=int, default=100, help="tokens each batch row holds")
    ap.add_argument("--widths", default="16,32,64,128", help="the new row's prompt lengths")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    model = build(args.shape, args.bits)
    fused, head = fused_pass(model), model_head(model)
    if fused is None or head is None:
        sys.exit("this model has no fused pass or no head apart")
    widths = [int(w) for w in args.widths.split(",")]

    b = batch(model, args.rows, args.held)

    def decode(i: int) -> list[mx.array]:
        logits = model(b.next[:, None], cache=b.caches)[:, -1, :]
        b.next = mx.argmax(logits, axis=-1)
        return [b.next, *b.arrays()]

    alone = median_ms(decode, args.steps)
    f = batch(model, args.rows, args.held)

    def flat(i: int) -> list[mx.array]:
        f.next = mx.argmax(fused.decode(f.next, f.caches), axis=-1)
        return [f.next, *f.arrays()]

    flat_ms = median_ms(flat, args.steps)
    again = median_ms(decode, args.steps)
    print(
        f"{args.rows} rows holding {args.held}: decode step alone {alone:.2f} ms, as one "
        f"sequence {flat_ms:.2f} ms, alone again {again:.2f} ms (medians)"
    )
    print("width  prefill alone  two passes  fused  saved (of the prefill)  agree")
    for w in widths:
        p, t, f = one_width(model, fused, head, args.rows, args.held, w, args.steps)
        prompt = mx.random.randint(0, 1000, (w,)).tolist()
        agree = _agree(model, fused, head, args.rows, args.held, prompt)
        saved = (t - f) / p if p else 0.0
        print(f"{w:5d}  {p:13.2f}  {t:10.2f}  {f:5.2f}  {t - f:6.2f} ms ({saved:.0%})  {agree}")


def one_width(
    model: Any, fused: Any, head: Any, rows: int, held: int, w: int, steps: int
) -> tuple[float, float, float]:
    """ms a call at the median: a new row's prefill of ``w`` tokens alone, beside the
    batch's decode step as two passes, and fused with it."""
    prompt = mx.random.randint(0, 1000, (w,)).tolist()
    two_b, one_b = batch(model, rows, held), batch(model, rows, held)

    def prefill(i: int) -> list[mx.array]:
        return [head.last_logits(mx.array([prompt]), make_prompt_cache(model), [w - 1])]

    def two(i: int) -> list[mx.array]:
        first = head.last_logits(mx.array([prompt]), make_prompt_cache(model), [w - 1])
        logits = model(two_b.next[:, None], cache=two_b.caches)[:, -1, :]
        two_b.next = mx.argmax(logits, axis=-1)
        return [first, two_b.next, *two_b.arrays()]

    def one(i: int) -> list[mx.array]:
        logits, first = fused(one_b.next, one_b.caches, prompt, make_prompt_cache(model))
        one_b.next = mx.argmax(logits, axis=-1)
        return [first, one_b.next, *one_b.arrays()]

    return median_ms(prefill, steps), median_ms(two, steps), median_ms(one, steps)


def _agree(model: Any, fused: Any, head: Any, rows: int, held: int, prompt: list[int]) -> str:
    """The largest difference between the fused logits and two passes', and whether each
    row's argmax is the same."""
    a, b = batch(model, rows, held), batch(model, rows, held)
    want = model(a.next[:, None], cache=a.caches)[:, -1, :]
    want_new = head.last_logits(mx.array([prompt]), make_prompt_cache(model), [len(prompt) - 1])
    got, got_new = fused(b.next, b.caches, prompt, make_prompt_cache(model))
    diff = max(
        mx.abs(want.astype(mx.float32) - got.astype(mx.float32)).max().item(),
        mx.abs(want_new.astype(mx.float32) - got_new.astype(mx.float32)).max().item(),
    )
    same = bool((mx.argmax(want, -1) == mx.argmax(got, -1)).all().item()) and bool(
        (mx.argmax(want_new, -1) == mx.argmax(got_new, -1)).all().item()
    )
    return f"max diff {diff:.3g}, argmax {'same' if same else 'DIFFERS'}"


if __name__ == "__main__":
    main()
