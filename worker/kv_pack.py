"""The prompt cache's entries as arrays: finished rows packed into blocks, and sliced back.

A stored row is one array (every layer's keys and values, concatenated), one allocation
where separate arrays cost two a layer. Finished rows reach the cache as views of their
batch (:func:`row_cache`) and rows that finished in one step are copied out together
(:func:`packed_rows`); a hit is a slice of an entry's block (:func:`prefix_of`), never a
copy. Pinned to mlx-lm 0.32.2.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from mlxq.worker.kv_merge import Hit, RowKV
from mlxq.worker.prefix_tree import Entry

#: Fewest finished rows of one batch copied out together: below it, a copy a row is fewer
#: operations.
MIN_GROUP = 3


def state_arrays(cache: Any) -> list[mx.array]:
    """Every array a layer's cache holds (what is evaluated when it is stored)."""
    state = cache.state
    items = state if isinstance(state, (list, tuple)) else [state]
    out: list[mx.array] = []
    for s in items:
        if isinstance(s, mx.array):
            out.append(s)
        elif isinstance(s, (list, tuple)):
            out.extend(x for x in s if isinstance(x, mx.array))
    return out


def _plain(c: Any) -> bool:
    return type(c) in (KVCache, RowKV, RowView) and c.keys is not None and c.values is not None


def packed(cache: list[Any]) -> mx.array | None:
    """One row's plain KV caches copied into one array, ``[2 * layers, heads, tokens,
    dim]`` (layer i's keys at 2i, values at 2i + 1); None when the layers differ in
    shape or type. One allocation an entry instead of two a layer."""
    if not all(_plain(c) and c.keys.shape[0] == 1 for c in cache):
        return None
    parts = [
        a if a.shape[2] == c.offset else a[..., : c.offset, :]
        for c in cache
        for a in (c.keys, c.values)
    ]
    first = parts[0]
    if any(a.shape != first.shape or a.dtype != first.dtype for a in parts):
        return None
    return mx.concatenate(parts, axis=0)


class RowView(KVCache):  # type: ignore[misc]
    """A finished row's layer as a view of its batch's arrays: ``keys[row, :, start:end]``
    of ``batch_keys`` (and the same of ``batch_values``). Rows of one batch stored together
    are copied from these together."""

    def __init__(
        self, batch_keys: mx.array, batch_values: mx.array, row: int, start: int, end: int
    ) -> None:
        super().__init__()
        self.batch_keys, self.batch_values = batch_keys, batch_values
        self.row, self.start, self.end = row, start, end
        self.keys = batch_keys[row : row + 1, :, start:end]
        self.values = batch_values[row : row + 1, :, start:end]
        self.offset = end - start


def row_cache(cache: Any, idx: int, n: int) -> Any:
    """Row ``idx`` of a batch's cache, which holds ``n`` tokens of it, as a plain cache
    viewing the batch's arrays (no copy:
    :meth:`mlxq.worker.prompt_cache.PromptCache.store_many` copies what it keeps).
    mlx-lm's ``extract`` copies each layer and reads the row's padding from the device
    once a layer, waiting for the step in flight; the host knows it from ``n``. Other
    cache types: ``extract``."""
    if not _host_padded(cache, n, n):
        return cache.extract(idx)
    return RowView(cache.keys, cache.values, idx, cache._idx - n, cache._idx)


def _host_padded(cache: Any, fewest: int, most: int) -> bool:
    """Whether a layer's rows' left padding follows from the tokens each holds (a
    :class:`BatchKVCache` whose rows, each ending at its ``_idx``, hold ``fewest`` to
    ``most`` tokens)."""
    return (
        type(cache) is BatchKVCache and cache.keys is not None and 0 < fewest <= most <= cache._idx
    )


def row_copy(cache: Any, idx: int, n: int) -> Any:
    """Row ``idx`` of a batch's layer, which holds ``n`` tokens of it, copied out as a plain
    cache (a paused row's KV, kept while the batch goes on). As mlx-lm's ``extract``, but
    the row's padding comes from ``n``: no read from the device, which would wait for the
    step in flight once a layer."""
    if not _host_padded(cache, n, n):
        return cache.extract(idx)
    out = KVCache()
    start = cache._idx - n
    out.keys = mx.contiguous(cache.keys[idx : idx + 1, :, start : cache._idx])
    out.values = mx.contiguous(cache.values[idx : idx + 1, :, start : cache._idx])
    out.offset = n
    return out


def filter_rows(caches: list[Any], keep: list[int], held: Sequence[int]) -> None:
    """Keep rows ``keep`` of every layer (mlx-lm's ``BatchKVCache.filter``), row
    ``keep[i]`` holding ``held[i]`` tokens. The padding every kept row has on its left is
    cut off as mlx-lm cuts it, but known from ``held`` (the longest row's tokens end at
    ``_idx``), where mlx-lm reads it from the device once a layer, each read waiting for
    the step in flight: a batch whose rows end one by one paid that at every end. Kept rows
    in one run are sliced, not gathered (:func:`_one_run`)."""
    index = mx.array(keep)
    fewest, most = min(held, default=0), max(held, default=0)  # once, not a layer each
    run = _one_run(keep)
    # Layers that share their offsets (fused_pass.share_offsets) or their paddings
    # (kv_slots) keep sharing one gather; each original is held here, so no id is reused
    # while the loop runs.
    shared: dict[int, tuple[mx.array, mx.array]] = {}

    def gathered(a: mx.array) -> mx.array:
        if id(a) not in shared:
            shared[id(a)] = (a, a[index])
        return shared[id(a)][1]

    padded = []
    for c in caches:
        if not _host_padded(c, fewest, most):
            c.filter(keep)
            continue
        if run is None:
            c.keys, c.values = c.keys[index], c.values[index]
        else:
            c.keys, c.values = c.keys[run[0] : run[1]], c.values[run[0] : run[1]]
        c.offset, c.left_padding = gathered(c.offset), gathered(c.left_padding)
        padded.append(c)
    cut_to(padded, most)


def cut_to(caches: list[Any], most: int) -> None:
    """Cut each layer's columns before its last ``most`` (no row reaches them; a batch
    cache's rows end at its ``_idx``), and their padding with them. Layers that share a
    padding array keep sharing one."""
    shifted: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}
    for c in caches:
        cut = c._idx - most
        if cut <= 0:
            continue
        c.keys, c.values = c.keys[..., cut:, :], c.values[..., cut:, :]
        c._idx -= cut
        key = (id(c.left_padding), cut)
        if key not in shifted:
            shifted[key] = (c.left_padding, c.left_padding - cut)
        c.left_padding = shifted[key][1]


def schedule_caches(caches: list[Any]) -> None:
    """Queue a join's or a leave's copies of every layer's cache as an evaluation of their
    own, as a decode step's inputs are
    (:meth:`mlxq.worker.decode_batch.BoundGenerationBatch._batched_step`). Left lazy, they
    ran inside the next decode step's evaluation, an op sequence no steady step has. In
    the worker on an H100, with the 66-row layout, the steps after a row change took
    7.9-8.9 ms at the mean this way against 9.5-11.0 left lazy; the joins and leaves
    themselves grew by less, and the sweep's share beside chat jobs read 0.855-0.876
    against 0.840-0.849 (docs/benchmarks.md)."""
    arrays = [
        a for c in caches for a in getattr(c, "__dict__", {}).values() if isinstance(a, mx.array)
    ]
    if arrays:
        mx.async_eval(*arrays)


def _one_run(keep: list[int]) -> tuple[int, int] | None:
    """``keep`` as one [start, end) run of consecutive rows, or None. Rows kept in one run
    (the newest row left, as a chat job's end in a sweep's batch, or the oldest rows) are a
    slice of the batch's arrays, no copy at the leave; others a gather of every row kept,
    a copy of the batch's KV each time a row ends (``ops/bench_kv_rows.py`` times both
    ways). The next step's write into a slice copies it whole (MLX writes in place only
    into an array that owns its memory), yet on an H100 that cost 0.9-1.9 ms less a
    leave than a take of the kept rows at the leave (docs/benchmarks.md)."""
    if keep and keep == list(range(keep[0], keep[0] + len(keep))):
        return keep[0], keep[0] + len(keep)
    return None


def packed_rows(caches: Sequence[list[Any]]) -> list[mx.array | None]:
    """Each row's caches packed as :func:`packed` packs them (None: they cannot be);
    rows that finished together in one batch (views of the same arrays), together."""
    out: list[mx.array | None] = [None] * len(caches)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, cache in enumerate(caches):
        if all(type(c) is RowView for c in cache):
            groups.setdefault((id(cache[0].batch_keys), cache[0].end), []).append(i)
        else:
            out[i] = packed(cache)
    for members in groups.values():
        rows = [caches[i] for i in members]
        blocks = _packed_together(rows) if len(rows) >= MIN_GROUP else None
        for i, block in zip(members, blocks or [packed(c) for c in rows], strict=True):
            out[i] = block
    return out


def _packed_together(rows: list[list[RowView]]) -> list[mx.array | None] | None:
    """Rows of one batch, each packed as :func:`packed` packs it: each layer's keys and
    values of all of them gathered once, stacked once, then each row's block copied out.
    Row by row, a 24-layer model's row costs 48 copies, a batch of 64 rows 3,072;
    together, 96 and one a row. Each block is its own array, so evicting one entry frees
    its memory. None: the layers differ in shape or type."""
    sources = [a for c in rows[0] for a in (c.batch_keys, c.batch_values)]
    like = sources[0]
    if any(a.shape[1:] != like.shape[1:] or a.dtype != like.dtype for a in sources):
        return None
    lo, end = min(c[0].start for c in rows), rows[0][0].end
    order = [c[0].row for c in rows]
    if order == list(range(like.shape[0])):  # the whole batch, in order: no gather
        parts = [a[:, :, lo:end] for a in sources]
    else:
        take = mx.array(order)
        parts = [mx.take(a[:, :, lo:end], take, axis=0) for a in sources]
    stacked = mx.stack(parts)
    return [mx.contiguous(stacked[:, g, :, c[0].start - lo :]) for g, c in enumerate(rows)]


def compact(c: Any) -> Any:
    """A plain KV cache of exactly what ``c`` holds (a prefilled one has room for 256
    more; a row's cached prefix would keep a reference to the entry it came from)."""
    if not _plain(c) or (type(c) is KVCache and c.keys.shape[2] == c.offset):  # type: ignore[union-attr]
        return c
    out: Any = KVCache()
    out.keys = mx.contiguous(c.keys[..., : c.offset, :])
    out.values = mx.contiguous(c.values[..., : c.offset, :])
    out.offset = c.offset
    return out


def prefix_of(entry: Entry, n: int) -> list[Any] | None:
    """A cache of the first ``n`` tokens of ``entry``, for a row of its own (None: this
    cache type cannot be cut back to ``n``). Plain KV caches are sliced, others copied."""
    hit = Hit(entry, n)
    if entry.block is not None:
        b = entry.block
        return [
            RowKV(b[2 * i : 2 * i + 1, :, :n], b[2 * i + 1 : 2 * i + 2, :, :n], hit, i)
            for i in range(b.shape[0] // 2)
        ]
    if all(_plain(c) for c in entry.cache):
        return [
            RowKV(c.keys[..., :n, :], c.values[..., :n, :], hit, i)
            for i, c in enumerate(entry.cache)
        ]
    excess = len(entry.tokens) - n
    if excess and not can_trim_prompt_cache(entry.cache):
        return None
    cache = copy.deepcopy(entry.cache)
    if excess:
        trim_prompt_cache(cache, excess)
    return cache
