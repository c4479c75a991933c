"""Which calls the one-kernel decode attention (mlxq.worker.decode_attention) takes, and
that it stays off where MLX has no CUDA. The kernel itself runs only on CUDA:
``ops/bench_decode_attention.py`` checks it against MLX's own there, and the fused pass
checks it again at load before using it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from mlxq.worker import decode_attention as da
from mlxq.worker.fused_pass import fused_pass


def _call(rows=3, heads=4, kv=2, dims=64, n=9, dtype=mx.bfloat16):
    q = mx.zeros((rows, heads, 1, dims), dtype)
    k = mx.zeros((rows, kv, 256, dims), dtype)[..., :n, :]
    mask = create_causal_mask(1, offset=n - 1, left_padding=mx.array([0, 2, 5][:rows]))
    return q, k, k, mask


def test_one_query_token_a_row_with_a_padding_mask_is_taken():
    q, k, v, mask = _call()
    assert mask.dtype == mx.bool_ and mask.shape == (3, 1, 1, 9)
    assert da.usable(q, k, v, mask)
    assert da.usable(*_call(dims=128, heads=8, kv=8, dtype=mx.float16))


@pytest.mark.parametrize(
    "why",
    ["prompt", "float32", "dims", "no mask", "additive mask", "quantized cache", "heads"],
)
def test_other_calls_keep_mlxs_own(why):
    q, k, v, mask = _call()
    if why == "prompt":
        q = mx.zeros((3, 4, 2, 64), mx.bfloat16)
    elif why == "float32":
        q, k, v, mask = _call(dtype=mx.float32)
    elif why == "dims":
        q, k, v, mask = _call(dims=80)
    elif why == "no mask":
        mask = None
    elif why == "additive mask":
        mask = mx.where(mask, 0.0, -mx.inf).astype(mx.bfloat16)
    elif why == "quantized cache":
        k = v = (k, k, k)
    elif why == "heads":
        q, k, v, mask = _call(heads=3, kv=2)
    assert not da.usable(q, k, v, mask)


def test_off_without_cuda_even_when_asked(monkeypatch, tiny_model):
    import mlx_lm

    monkeypatch.setenv(da.ENV, "1")
    assert not da.enabled()  # this machine's MLX runs on its CPU
    fused = fused_pass(mlx_lm.load(str(tiny_model))[0])
    assert fused is not None and not fused.one_kernel_attention
