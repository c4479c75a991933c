"""A decode step's attention over left-padded rows as one CUDA kernel a layer.

Why. mlx-lm's batch cache left-pads its rows, so a decode step's attention carries a mask
array (each row's padding). MLX's CUDA backend has no fused kernel for one query token
with a mask array (mlx 0.32: cuDNN's decode path and the vector kernel both refuse it),
and falls back to its graph of operations: a scale, two matrix products, a select and a
softmax, with their reshapes, in every layer. On an H100 a decode step is the host's
(docs/benchmarks.md: ~1,160 graph nodes a step for the 0.5B shape, ~500 of them
launches, and the device done before the host asks), so those five launches a layer are
about a fifth of a step's. This is the same attention in one launch a layer.

What. One warp a (row, query head): each lane walks every 32nd position of the row's
keys that its mask lets through, keeping a running max, sum and weighted sum of values
(float32), and the warp merges its lanes' sums at the end; the row's output is their
quotient, in the inputs' dtype. The keys and values are read in place (a slice of the
cache's buffer, by its strides), grouped query heads share their key-value head.

Where. :func:`usable` says whether a call can take it (CUDA, one query token, a boolean
mask of one row a batch row, head sizes MLX's own kernels take, half precision);
the fused pass runs MLX's own otherwise. It is off unless ``MLXQ_DECODE_ATTENTION=1``:
on an H100 (docs/benchmarks.md) it agreed with a float32 attention more closely than
MLX's own, and saved 0.7 ms a 24-layer step at 64 keys a row, but lost from 256 keys on
(each lane reads a key an element at a time), and the 0.5B-shaped bfloat16 model's logits
through it differed from those through MLX's bfloat16 fallback by more than the load
check allows. ``ops/bench_decode_attention.py`` checks and times the two on CUDA. Where
on, the fused pass's check at load (``fused_pass._agrees``) compares a decode step
through it with the model's own calls, and keeps MLX's own where they differ or the
kernel does not build.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from mlxq.worker.env import env_switch

ENV = "MLXQ_DECODE_ATTENTION"
#: Lanes a (row, head): one warp.
_LANES = 32
_HEAD_DIMS = (64, 128)

_SOURCE = """
    const int bh = blockIdx.x;
    const int heads = q_shape[1];
    const int b = bh / heads;
    const int h = bh % heads;
    const int lane = threadIdx.x;
    const int kvh = h / (heads / keys_shape[1]);
    const int n = keys_shape[2];
    const float sc = scale[0];
    const T* qp = q + b * q_strides[0] + h * q_strides[1];
    float qv[D];
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qv[d] = static_cast<float>(qp[d * q_strides[3]]) * sc;
        acc[d] = 0.f;
    }
    const T* k0 = keys + b * keys_strides[0] + kvh * keys_strides[1];
    const T* v0 = values + b * values_strides[0] + kvh * values_strides[1];
    const bool* mp = mask + b * mask_strides[0];
    const auto ks = keys_strides[3];
    const auto vs = values_strides[3];
    const float none = __int_as_float(0xff800000);  // minus infinity: no key seen yet
    float m = none;
    float l = 0.f;
    for (int t = lane; t < n; t += 32) {
        if (!mp[t * mask_strides[3]]) {
            continue;
        }
        const T* kp = k0 + t * keys_strides[2];
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) {
            s += qv[d] * static_cast<float>(kp[d * ks]);
        }
        const float mn = fmaxf(m, s);
        const float c = __expf(m - mn);
        const float p = __expf(s - mn);
        l = l * c + p;
        const T* vp = v0 + t * values_strides[2];
#pragma unroll
        for (int d = 0; d < D; ++d) {
            acc[d] = acc[d] * c + p * static_cast<float>(vp[d * vs]);
        }
        m = mn;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffff, m, off);
        const float l2 = __shfl_xor_sync(0xffffffff, l, off);
        const float mn = fmaxf(m, m2);
        const float c1 = (m == none) ? 0.f : __expf(m - mn);
        const float c2 = (m2 == none) ? 0.f : __expf(m2 - mn);
        l = l * c1 + l2 * c2;
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const float a2 = __shfl_xor_sync(0xffffffff, acc[d], off);
            acc[d] = acc[d] * c1 + a2 * c2;
        }
        m = mn;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* op = out + static_cast<size_t>(bh) * D;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        if ((d & 31) == lane) {
            op[d] = static_cast<T>(acc[d] * inv);
        }
    }
"""


def enabled() -> bool:
    """Whether the kernel may be used: MLX on CUDA, and turned on by :data:`ENV`."""
    from mlxq.worker.mlx_settings import on_cuda

    return env_switch(ENV, False) and on_cuda()


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxq_decode_attention",
        input_names=["q", "keys", "values", "mask", "scale"],
        output_names=["out"],
        source=_SOURCE,
        ensure_row_contiguous=False,
    )


@cache
def _scale(value: float) -> mx.array:
    return mx.array([value], mx.float32)


def usable(q: mx.array, k: mx.array, v: mx.array, mask: Any) -> bool:
    """Whether :func:`decode_attention` computes this call: one query token a row, a
    boolean mask of shape (rows, 1, 1, keys), keys and values of the query's head size
    and dtype (float16 or bfloat16), query heads a multiple of key-value heads."""
    if not (isinstance(k, mx.array) and isinstance(v, mx.array)):  # a quantized cache's
        return False
    if q.ndim != 4 or q.shape[2] != 1 or k.ndim != 4 or v.shape != k.shape:
        return False
    rows, heads, _, dims = q.shape
    return (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.shape == (rows, 1, 1, k.shape[2])
        and k.shape[0] == rows
        and k.shape[3] == dims
        and dims in _HEAD_DIMS
        and heads % k.shape[1] == 0
        and q.dtype in (mx.float16, mx.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
    )


def decode_attention(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float
) -> mx.array:
    """softmax(q k^T * scale, where ``mask``) v for one query token a row: (rows, heads, 1,
    dims), in ``q``'s dtype. Only where :func:`usable` holds, on CUDA."""
    rows, heads, _, dims = q.shape
    out: list[mx.array] = _kernel()(
        inputs=[q, k, v, mask, _scale(float(scale))],
        template=[("T", q.dtype), ("D", dims)],
        grid=(_LANES * rows * heads, 1, 1),
        threadgroup=(_LANES, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out[0]
