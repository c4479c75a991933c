"""A decode step's attention as one kernel a layer against MLX's own, on CUDA.

MLX's CUDA backend runs attention for one query token with a mask array (mlx-lm's
left-padded batch cache) as a graph of operations; ``mlxq.worker.decode_attention`` runs
it as one kernel. This checks the two agree on left-padded rows of several shapes (keys a
slice of a larger cache buffer, as mlx-lm's cache hands them over), then times 24 layers'
attention a step both ways, steps launched back to back as the worker's are.

    MLXQ_DECODE_ATTENTION=1 python ops/bench_decode_attention.py     # a CUDA machine
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from mlxq.worker import decode_attention as da


def case(rows: int, heads: int, kv_heads: int, dims: int, n: int, seed: int) -> tuple:
    rng = random.Random(seed)
    mx.random.seed(seed)
    cap = (n + 255) // 256 * 256
    q = mx.random.normal((rows, heads, 1, dims)).astype(mx.bfloat16)
    kb = mx.random.normal((rows, kv_heads, cap, dims)).astype(mx.bfloat16)
    vb = mx.random.normal((rows, kv_heads, cap, dims)).astype(mx.bfloat16)
    pads = mx.array([rng.randrange(n) for _ in range(rows)])
    mask = create_causal_mask(1, offset=n - 1, left_padding=pads)
    k, v = kb[..., :n, :], vb[..., :n, :]
    mx.eval(q, k, v, mask)
    return q, k, v, mask


def check() -> bool:
    ok = True
    for rows, heads, kv, dims, n in [
        (1, 14, 2, 64, 1),
        (5, 14, 2, 64, 17),
        (64, 14, 2, 64, 300),
        (65, 14, 2, 64, 2000),
        (3, 16, 16, 128, 257),
        (64, 32, 8, 128, 700),
        (2, 8, 1, 64, 4097),
    ]:
        q, k, v, mask = case(rows, heads, kv, dims, n, rows * n)
        assert da.usable(q, k, v, mask), (q.shape, k.shape, mask.shape)
        scale = dims**-0.5
        want = mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale, mask=mask
        )
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        got = da.decode_attention(q, k, v, mask, scale)
        err = mx.abs(got.astype(mx.float32) - want).max().item()
        ref_err = mx.abs(ref.astype(mx.float32) - want).max().item()
        good = err <= max(2 * ref_err, 1e-2)
        ok &= good
        print(
            f"rows {rows:3d} heads {heads}/{kv} dims {dims} keys {n:5d}: max err {err:.4f} "
            f"(MLX's own in bf16: {ref_err:.4f}) {'ok' if good else 'DIFFERS'}"
        )
    return ok


def timed(n: int, steps: int, layers: int, one_kernel: bool) -> float:
    q, k, v, mask = case(64, 14, 2, 64, n, 7)
    scale = 64**-0.5
    ts = []
    last = None
    for _ in range(steps):
        t0 = time.perf_counter()
        x = q
        for _ in range(layers):
            if one_kernel:
                x = da.decode_attention(x, k, v, mask, scale)
            else:
                x = mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask)
        mx.async_eval(x)
        if last is not None:
            mx.eval(last)
        last = x
        ts.append((time.perf_counter() - t0) * 1e3)
    mx.eval(last)
    return statistics.median(ts[steps // 5 :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    if not da.enabled():
        print("not on CUDA, or MLXQ_DECODE_ATTENTION=1 not set: nothing to compare")
        return 0
    ok = check()
    print(f"{args.layers} layers' attention a step, 64 rows, 14/2 heads of 64, ms a step at p50")
    print("  keys   MLX's own   one kernel")
    for n in (64, 256, 1024, 4096):
        own = timed(n, args.steps, args.layers, False)
        one = timed(n, args.steps, args.layers, True)
        print(f"  {n:5d}  {own:9.3f}  {one:10.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
