"""What a prefill attention call costs the first time MLX meets its shapes, and after.

MLX's CUDA backend runs prefill attention through cuDNN and builds a cuDNN plan for every
new set of shapes (query and key lengths, strides, mask); a chat turn of a new length
meets new shapes. This times one ``mx.fast.scaled_dot_product_attention`` call of a chat
turn's shape (61 queries against 3,000-4,300 cached keys, Qwen2.5-0.5B's heads, bf16) for
eight key lengths never seen before, then the same eight again.

    python ops/bench_attention_shapes.py
    MLX_CUDA_USE_CUDNN_SDPA=0 python ops/bench_attention_shapes.py   # cuDNN's path off

On the H200 (mlx 0.32.4) the first sight cost 42-67 ms with cuDNN (three of eight over
0.9 s with a mask), 0.2-0.4 ms again; with MLX_CUDA_USE_CUDNN_SDPA=0, 0.2-4.9 ms and
0.2-0.4 ms (docs/benchmarks.md). On Metal and the CPU there is no plan to build.
"""

from __future__ import annotations

import os
import time

import mlx.core as mx

HEADS, KV_HEADS, DIM = 14, 2, 64


def one_call_ms(tq: int, tk: int, buffer: int, masked: bool) -> float:
    """One attention call of these shapes; keys are a slice of a longer buffer, as a KV
    cache's are."""
    q = mx.random.normal((1, HEADS, tq, DIM)).astype(mx.bfloat16)
    kb = mx.random.normal((1, KV_HEADS, buffer, DIM)).astype(mx.bfloat16)
    vb = mx.random.normal((1, KV_HEADS, buffer, DIM)).astype(mx.bfloat16)
    k, v = kb[..., :tk, :], vb[..., :tk, :]
    mask = mx.ones((1, 1, tq, tk), dtype=mx.bool_) if masked else None
    mx.eval(q, k, v, *([mask] if mask is not None else []))
    t = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask=mask))
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    cudnn = os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1")
    print(f"device {mx.default_device()}, MLX_CUDA_USE_CUDNN_SDPA={cudnn}")
    for masked in (True, False):
        one_call_ms(61, 1000, 1024, masked)  # kernels compiled, before timing
        first, again = [], []
        for i in range(8):
            tk = 3000 + 161 * i  # a chat turn's growth
            buffer = (tk // 256 + 2) * 256
            first.append(one_call_ms(61, tk, buffer, masked))
            again.append(one_call_ms(61, tk, buffer, masked))
        print(
            f"mask={'array' if masked else 'none'}: first sight ms "
            + " ".join(f"{x:.1f}" for x in first)
            + " | again "
            + " ".join(f"{x:.1f}" for x in again)
        )


if __name__ == "__main__":
    main()
