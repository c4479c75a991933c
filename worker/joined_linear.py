"""Projections of one input as one quantized product (vLLM's merged linears, for MLX).

Why. On MLX's CUDA backend a decode step is the host's: each kernel launched costs the
host about as much as the device takes to run it (docs/benchmarks.md). A layer of the
common decoder layout runs its query, key and value projections as three products of the
same input, and its MLP's gate and up projections as two; joined, they are one product
each. The rows of a 4-bit weight are quantized independently (groups run along the
input), so the joined weight is the parts' rows one after the other, exactly, and each
part of the product is the part's own product.

What it saves. The gate and up projections: one launch a layer (the MLP's activation
reads the two halves in place). The query, key and value projections: two launches a
layer. Where each part has a bias of its own, it is added as the part is split off (the
add writes each part out whole, as the rotary embedding wants it); where queries and keys
are normalized before the rotary embedding (Qwen3's ``q_norm`` and ``k_norm``), the norms
write them out whole. Otherwise (Llama, Mistral) queries and keys stay one part, and the
fused pass runs one rotary embedding over both: MLX's CUDA ``RoPE`` copies a strided
input out first, once for the two instead of once each.

Memory. The joined arrays are the only copy: the model's own projections keep views of
their rows (its own calls, the prefill's, are unchanged).

``MLXQ_JOINED_PROJECTIONS=0`` keeps every projection apart, to compare on one machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.env import env_switch

ENV = "MLXQ_JOINED_PROJECTIONS"


def enabled() -> bool:
    return env_switch(ENV, True)


@dataclass(frozen=True, slots=True)
class Joined:
    """Quantized projections of one input as one product; called, each part's output
    (plus its bias, where it has one)."""

    weight: mx.array
    scales: mx.array
    quant_biases: mx.array | None
    group_size: int
    bits: int
    mode: str
    widths: tuple[int, ...]
    biases: tuple[mx.array | None, ...]

    def __call__(self, x: mx.array) -> list[mx.array]:
        y = mx.quantized_matmul(
            x,
            self.weight,
            scales=self.scales,
            biases=self.quant_biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        out, start = [], 0
        for width, bias in zip(self.widths, self.biases, strict=True):
            part = y[..., start : start + width]
            out.append(part if bias is None else part + bias)
            start += width
        return out


def _key(m: Any) -> tuple[Any, ...] | None:
    if type(m) is not nn.QuantizedLinear:  # type: ignore[attr-defined]
        return None
    return (
        m.group_size,
        m.bits,
        getattr(m, "mode", "affine"),
        m.weight.shape[1],
        m.weight.dtype,
        "biases" in m,
        "bias" in m,
    )


def join(modules: Sequence[Any]) -> Joined | None:
    """``modules`` (quantized linear layers of one input size and quantization) as one
    :class:`Joined`, the modules left holding views of its rows; None where they differ
    in kind, quantization or input size."""
    keys = [_key(m) for m in modules]
    if len(modules) < 2 or keys[0] is None or any(k != keys[0] for k in keys):
        return None
    first = modules[0]
    weight = mx.concatenate([m.weight for m in modules])
    scales = mx.concatenate([m.scales for m in modules])
    quant = mx.concatenate([m.biases for m in modules]) if "biases" in first else None
    mx.eval(weight, scales, *([quant] if quant is not None else []))
    widths, start = [], 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight, m.scales = weight[start : start + n], scales[start : start + n]
        if quant is not None:
            m.biases = quant[start : start + n]
        mx.eval(m.parameters())
        widths.append(n)
        start += n
    return Joined(
        weight,
        scales,
        quant,
        first.group_size,
        first.bits,
        getattr(first, "mode", "affine"),
        tuple(widths),
        tuple(m.bias if "bias" in m else None for m in modules),
    )


def join_attention(attn: Any) -> Joined | None:
    """The query, key and value projections of ``attn`` joined: three parts where each
    has a bias or queries and keys are normalized first, else two, queries and keys as
    one (see the module's doc); None where they differ, or only some have a bias or a norm."""
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
        return None
    normed = [getattr(attn, n, None) is not None for n in ("q_norm", "k_norm")]
    if any(normed) != all(normed):
        return None
    joined = join([attn.q_proj, attn.k_proj, attn.v_proj])  # None for a bias on some only
    if joined is None or joined.biases[0] is not None or all(normed):
        return joined
    q, k, v = joined.widths
    return replace(joined, widths=(q + k, v), biases=(None, None))


def join_mlp(mlp: Any) -> Joined | None:
    """The gate and up projections of ``mlp`` joined (its call is checked against the
    joined one by the caller)."""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    if any(p is None for p in parts) or getattr(mlp, "down_proj", None) is None:
        return None
    return join(parts)
