"""How cached prefixes join a batch: one copy a layer, where mlx-lm's merge makes one a row.

:func:`mlxq.worker.kv_pack.prefix_of` hands each hit row its layers as :class:`RowKV`;
mlx-lm merges a batch's rows through the first row's type, so :meth:`RowKV.merge` decides
how the batch's caches are built. Pinned to mlx-lm 0.32.2.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.worker.prefix_tree import Entry


class Hit:
    """One row's cached prefix, shared by its layers: the entry and how many of its tokens.
    The first layer's merge leaves every layer's merged state here for the others."""

    __slots__ = ("entry", "merged", "n")

    def __init__(self, entry: Entry, n: int) -> None:
        self.entry, self.n = entry, n
        self.merged: tuple[tuple[int, ...], mx.array, list[int], int] | None = None


class RowKV(KVCache):  # type: ignore[misc]
    """One layer of a row's cached prefix: the first ``offset`` tokens of an entry's arrays.

    mlx-lm's ``BatchKVCache.merge`` writes each row of each layer separately: 64 copies
    a layer, 3,072 for a batch of 64 on a 24-layer model, most of a cached batch's prefill
    time on the H200. Here rows that start from one entry at one length (a sweep's batch
    on its shared prefix) join with one broadcast copy a layer; rows from several packed
    entries (chats) with one padded copy an entry and one concatenation for all layers,
    taken by the first layer's merge and viewed by the others. Any other mix merges as
    mlx-lm does."""

    def __init__(self, keys: mx.array, values: mx.array, hit: Hit, layer: int) -> None:
        super().__init__()
        self.keys, self.values, self.offset = keys, values, hit.n  # hit.n tokens each
        self.hit, self.layer = hit, layer

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        rows = [c for c in caches if type(c) is RowKV]
        if not rows or not all(type(c) is RowKV or _empty(c) for c in caches):
            return BatchKVCache.merge(caches)
        first = rows[0]
        if len(rows) == len(caches) and all(
            c.hit.entry is first.hit.entry and c.offset == first.offset for c in caches
        ):
            return _broadcast(first, len(caches))
        if all(c.hit.entry.block is not None for c in rows):
            return _from_blocks([c.hit if type(c) is RowKV else None for c in caches], first)
        return BatchKVCache.merge(caches)


def _empty(c: Any) -> bool:
    """A row with nothing cached (a miss beside hits): all padding in a merged batch."""
    return type(c) is KVCache and c.keys is None


def _room(n: int) -> int:
    """A batch cache's length for ``n`` cached tokens with room for the rest of the prompts,
    as mlx-lm's own prefill would leave: without it their first forward pass allocates
    and copies every layer again."""
    return (n // BatchKVCache.step + 2) * BatchKVCache.step


def _broadcast(row: RowKV, b: int) -> Any:
    n = row.offset
    out: Any = BatchKVCache([0] * b)
    for name in ("keys", "values"):
        a = getattr(row, name)
        buf = mx.zeros((b, a.shape[1], _room(n), a.shape[3]), a.dtype)
        buf[..., :n, :] = mx.broadcast_to(a, (b, *a.shape[1:]))
        setattr(out, name, buf)
    out.offset += n
    out._idx = n
    return out


def _from_blocks(hits: list[Hit | None], row: RowKV) -> Any:
    """Layer ``row.layer`` of the batch of these rows (None: a row with nothing cached)."""
    key = tuple(0 if h is None else id(h) for h in hits)
    memo = row.hit.merged
    if memo is None or memo[0] != key:
        m = max(h.n for h in hits if h is not None)
        size = _room(m)
        like = cast(mx.array, row.hit.entry.block)  # every packed entry's layout
        padded: dict[tuple[int, int], mx.array] = {}
        parts = []
        for h in hits:
            at = (0, 0) if h is None else (id(h.entry), h.n)
            part = padded.get(at)
            if part is None:
                if h is None:
                    part = mx.zeros((*like.shape[:2], size, like.shape[3]), like.dtype)
                else:
                    block = cast(mx.array, h.entry.block)[:, :, : h.n]
                    part = mx.pad(block, [(0, 0), (0, 0), (m - h.n, size - m), (0, 0)])
                padded[at] = part
            parts.append(part)
        memo = (key, mx.stack(parts, axis=1), [m - (h.n if h else 0) for h in hits], m)
        row.hit.merged = memo
    _, merged, padding, m = memo
    out: Any = BatchKVCache(padding)
    out.keys, out.values = merged[2 * row.layer], merged[2 * row.layer + 1]
    out.offset += m
    out._idx = m
    if 2 * row.layer + 2 == merged.shape[0]:
        row.hit.merged = None  # the last layer: the batch's caches hold what they need
    return out
