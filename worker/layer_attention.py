"""One part's attention in a decoder layer, as the fused pass runs it
(:mod:`mlxq.worker.fused_pass`): its projections as heads at their rotary positions, the
cache's update, and attention over what the cache holds."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from mlxq.worker import decode_attention


def attend(
    attn: Any,
    q: mx.array,
    k: mx.array | None,
    v: mx.array,
    b: int,
    n: int,
    cache: Any,
    mask: Any,
    one_kernel: bool = False,
) -> mx.array:
    """One part's attention, as the model's own attention module runs it on (b, n) tokens
    after its projections (with ``one_kernel``, a decode step's as one kernel where it
    can: :mod:`~mlxq.worker.decode_attention`); returned as (1, b * n, heads x dims).
    With ``k`` None, ``q`` holds the queries and the keys as one part (joined projections
    with nothing between them and the rotary embedding): one embedding for both."""
    q, k, v = heads(attn, q, k, v, b, n, cache.offset)
    o = attend_heads(attn, q, k, v, cache, mask, one_kernel)
    return o.transpose(0, 2, 1, 3).reshape(1, b * n, -1)


def heads(
    attn: Any, q: mx.array, k: mx.array | None, v: mx.array, b: int, n: int, offset: Any
) -> tuple[mx.array, mx.array, mx.array]:
    """A part's projections as heads, (b, heads, n, dims), its queries and keys at their
    rotary positions from ``offset`` (the cache's; ``k`` None: see :func:`attend`)."""
    v = v.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if k is None:
        qk = q.reshape(b, n, attn.n_heads + attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        qk = attn.rope(qk, offset=offset)
        return qk[:, : attn.n_heads], qk[:, attn.n_heads :], v
    q = q.reshape(b, n, attn.n_heads, -1)
    k = k.reshape(b, n, attn.n_kv_heads, -1)
    if (q_norm := getattr(attn, "q_norm", None)) is not None:
        q = q_norm(q)
    if (k_norm := getattr(attn, "k_norm", None)) is not None:
        k = k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def attend_heads(
    attn: Any, q: mx.array, k: mx.array, v: mx.array, cache: Any, mask: Any, one_kernel: bool
) -> mx.array:
    """Heads' attention over ``cache`` once ``k`` and ``v`` are in it: (b, heads, n, dims)."""
    k, v = cache.update_and_fetch(k, v)
    if one_kernel and decode_attention.usable(q, k, v, mask):
        return decode_attention.decode_attention(q, k, v, mask, attn.scale)
    return scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
