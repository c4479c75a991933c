"""The prompt cache: KV state of earlier prompts, reused by later jobs that start the same.

An eval sweep sends one few-shot prefix in front of thousands of questions, and a chat
resends its whole history every turn: both prefill the same tokens again and again. The
cache keeps the KV state of finished rows (prompt and completion) and of prefixes shared
by a burst of jobs under a byte budget, least recently used out first, and hands each
admitted row the state of its longest cached prefix; only the rest of its prompt is
prefilled.

What keeps it cheap (each of these cost the e2e benchmark a
large share of its speed on the H200 when it was missing):

- A lookup walks a radix tree of tokens once (a shared run of tokens is one list
  comparison); any entry below the point where the walk stops shares the whole walked
  prefix, so the first one found serves (mlx-lm's ``PromptTrie`` walks token by token
  and looks for the shortest such entry, which visits every branch below: tens of
  milliseconds per lookup for a sweep's hundreds of entries).
- A hit shorter than :data:`MIN_REUSE` tokens is a miss, decided before anything is
  copied: a prompt that shares two tokens with an entry gains nothing from it.
- A hit hands out slices of the entry's arrays, not a deep copy: MLX arrays are never
  written in place through a slice, and mlx-lm copies a row's cache into the batch
  (``BatchKVCache.merge``), so nothing ever writes to an entry.
- A stored row's arrays are evaluated when stored (``mx.async_eval``, off the host's
  critical path). Left lazy, each entry would keep the whole batch's KV buffer of its
  step alive, so memory would grow far past the budget it counts.
- A stored row is one array (every layer's keys and values, concatenated), one
  allocation where separate arrays cost two a layer: on the H200, copying 64 rows of a
  24-layer model took 29 ms as 3,072 arrays and 18 ms as 64.
- Finished rows reach the cache as views of the batch (:func:`row_cache`), their padding
  known on the host: mlx-lm's ``extract`` copies every layer and reads the padding from
  the device, waiting for the decode step in flight. Rows too short to keep are not
  even viewed, and rows that finish in the same step are copied out together.
- Rows join the batch in one copy per layer (one entry, one length: a broadcast) or one
  concatenation for all layers (several entries, or hits beside misses); mlx-lm's merge
  writes each row of each layer on its own.

A cache type without ``merge`` (``QuantizedKVCache``) cannot join a batch with history:
such a model never hits and every row prefills in full, as it would without the cache.
Pinned to mlx-lm 0.32.2.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

log = logging.getLogger("mlxq.worker")

#: Entries kept at most, whatever their size.
MAX_ENTRIES = 1024
#: Fewest cached tokens worth a hit, and fewest tokens worth keeping (an entry shorter
#: than this could never serve a hit). On a GPU a prefill pass of a few dozen tokens a row
#: costs about what a pass of one does, so shorter hits save nothing there; they cost the
#: copy into the batch (on the H200, 64 rows each finding their own 44-token entry took
#: the first token of a burst from 125 to 298 ms).
MIN_REUSE = 128
#: A prefix shared by jobs of one burst is prefilled once, alone, when the cache lacks at
#: least this many of its tokens: shorter, and no row could use it as a hit.
MIN_SHARED_PREFIX = MIN_REUSE
#: Fewest finished rows of one batch copied out together: below it, a copy a row is fewer
#: operations.
MIN_GROUP = 3
#: Without a device memory size (the CPU): a fixed budget.
CPU_DEFAULT_BYTES = 1 << 30
#: Of the device memory left beside the model, the share the cache may hold by default.
DEVICE_SHARE = 0.25
#: A default budget smaller than this is no cache (the model leaves too little room).
MIN_DEFAULT_BYTES = 64 << 20


def default_budget() -> int:
    """Bytes the cache may hold when the worker is not told: a quarter of what the
    device's recommended working set (Metal, CUDA) leaves beside what MLX holds now (the
    loaded model), else 1 GiB; 0 (no cache) when that is under 64 MiB."""
    try:
        info = mx.device_info()
    except Exception:  # an MLX build without it: the CPU default
        return CPU_DEFAULT_BYTES
    if mx.default_device() == mx.cpu:
        return CPU_DEFAULT_BYTES
    return budget_beside(info, mx.get_active_memory())


def budget_beside(info: dict[str, Any], used: int) -> int:
    """:func:`default_budget` for a device described by ``info`` (``mx.device_info()``)
    with ``used`` bytes held: a quarter of its memory left, 0 when under 64 MiB, and the
    CPU default when ``info`` gives no size."""
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        size = info.get(key)
        if isinstance(size, int) and size > 0:
            budget = int((size - used) * DEVICE_SHARE)
            return budget if budget >= MIN_DEFAULT_BYTES else 0
    return CPU_DEFAULT_BYTES


class _Entry:
    """One cached state: hashed by identity, so the LRU never hashes its tokens. Either
    ``block``, every layer's keys then values in one array (``[2 * layers, heads, tokens,
    dim]``), or ``cache``, the layers' caches as they are (types that cannot be packed)."""

    __slots__ = ("block", "cache", "nbytes", "tokens")

    def __init__(
        self, tokens: list[int], nbytes: int, block: mx.array | None, cache: list[Any]
    ) -> None:
        self.tokens, self.nbytes, self.block, self.cache = tokens, nbytes, block, cache


class _Node:
    __slots__ = ("children", "entry", "label")

    def __init__(self, label: list[int]) -> None:
        self.label = label  # the tokens on the edge from the parent
        self.children: dict[int, _Node] = {}  # by the first token of their label
        self.entry: _Entry | None = None


def _matched(label: Sequence[int], tokens: Sequence[int], at: int) -> int:
    """How many of ``label``'s tokens ``tokens`` has from ``at`` on."""
    n = len(label)
    if tokens[at : at + n] == label:
        return n
    m = 0
    for x, y in zip(label, tokens[at : at + n], strict=False):
        if x != y:
            break
        m += 1
    return m


class _Trie:
    """Entries by their tokens, in a radix tree: an edge holds a run of tokens, so a
    sweep's shared 1,000-token prefix is one list comparison, not 1,000 steps. A node
    without an entry always has children (a removal prunes the branch it empties), so a
    walk down any child reaches an entry."""

    def __init__(self) -> None:
        self.root = _Node([])

    def add(self, entry: _Entry) -> tuple[_Entry | None, list[_Entry]]:
        """Put ``entry`` in; returns the entry it replaced (same tokens) and the entries
        whose tokens are a proper prefix of its, met on the way down."""
        tokens, node, d, above = entry.tokens, self.root, 0, []
        while d < len(tokens):
            if node.entry is not None:
                above.append(node.entry)
            child = node.children.get(tokens[d])
            if child is None:
                node.children[tokens[d]] = child = _Node(tokens[d:])
                node, d = child, len(tokens)
                break
            m = _matched(child.label, tokens, d)
            if m < len(child.label):  # split the edge where they part
                mid = _Node(child.label[:m])
                child.label = child.label[m:]
                mid.children[child.label[0]] = child
                node.children[tokens[d]] = child = mid
            node, d = child, d + m
        prev, node.entry = node.entry, entry
        return prev, above

    def remove(self, tokens: Sequence[int]) -> None:
        path, d = [self.root], 0
        while d < len(tokens):
            child = path[-1].children.get(tokens[d])
            if child is None or _matched(child.label, tokens, d) < len(child.label):
                return
            path.append(child)
            d += len(child.label)
        node = path.pop()
        if node is self.root:
            return
        node.entry = None
        if not node.children:
            del path[-1].children[node.label[0]]
            node = path[-1]
        if node is not self.root and node.entry is None and len(node.children) == 1:
            (only,) = node.children.values()  # fold the lone child into its parent
            node.label = node.label + only.label
            node.children, node.entry = only.children, only.entry

    def nearest(self, tokens: Sequence[int]) -> tuple[_Entry | None, int, _Entry | None, int]:
        """The longest entry that is a prefix of ``tokens`` (and its length), and an entry
        sharing more of ``tokens`` than that one (and how many it shares)."""
        node, d = self.root, 0
        prefix: _Entry | None = None
        prefix_len = 0
        while True:
            if node.entry is not None:
                prefix, prefix_len = node.entry, d
            if d == len(tokens):
                break
            child = node.children.get(tokens[d])
            if child is None:
                break
            m = _matched(child.label, tokens, d)
            node, d = child, d + m
            if m < len(child.label):
                break
        if d <= prefix_len:
            return prefix, prefix_len, None, 0
        while node.entry is None:  # any entry below shares the walked tokens
            node = next(iter(node.children.values()))
        return prefix, prefix_len, node.entry, d


class PromptCache:
    """KV caches by token prefix, under ``max_bytes``.

    Args:
        model: The mlx-lm model whose caches are kept.
        max_bytes: Most bytes of KV state held (> 0).
        max_kv_size: The engine's rotating cache size (None: full context).
        prefill_step_size: Tokens per forward pass when a shared prefix is prefilled.
    """

    def __init__(
        self,
        model: Any,
        max_bytes: int,
        *,
        max_kv_size: int | None = None,
        prefill_step_size: int = 2048,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r}: must be >= 1")
        self.model, self.max_bytes = model, max_bytes
        self.max_kv_size, self.prefill_step_size = max_kv_size, prefill_step_size
        self.mergeable = all(hasattr(c, "merge") for c in make_prompt_cache(model, max_kv_size))
        if not self.mergeable:
            log.warning(
                "prompt cache: this model's KV cache cannot join a batch with history; "
                "every prompt is prefilled in full"
            )
        self.clear()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        self._trie = _Trie()
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._nbytes = 0

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """The cache of ``tokens``' longest cached prefix, and how many tokens it holds;
        always at least one token short of ``tokens`` (mlx-lm refuses an empty rest) and
        at least :data:`MIN_REUSE` long. ``(None, 0)``: a miss."""
        if not self.mergeable or len(tokens) <= MIN_REUSE:
            return None, 0
        prefix, prefix_len, longer, shared = self._trie.nearest(tokens)
        last = len(tokens) - 1
        for entry, n in ((longer, min(shared, last)), (prefix, min(prefix_len, last))):
            if entry is None or n < MIN_REUSE:
                continue
            cache = _first(entry, n)
            if cache is not None:
                self._lru.move_to_end(entry)
                return cache, n
        return None, 0

    def store(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep ``cache``, the KV state of exactly ``tokens`` (see :meth:`store_many`)."""
        self.store_many([(tokens, cache)])

    def store_many(self, rows: Sequence[tuple[Sequence[int], list[Any]]]) -> None:
        """Keep each row's cache, the KV state of exactly its tokens. A row shorter than
        :data:`MIN_REUSE` or larger than the whole budget is dropped (it would only push
        everything else out, then itself); entries it extends are dropped for it when it
        can be trimmed back to them. Rows that finished together in one batch are copied
        together (:func:`_packed_rows`)."""
        if not self.mergeable:
            return
        rows = [(t, c) for t, c in rows if len(t) >= MIN_REUSE and c]
        blocks = _packed_rows([c for _, c in rows])
        arrays: list[mx.array] = []
        entries = []
        for (tokens, cache), block in zip(rows, blocks, strict=True):
            if block is None:
                cache = [_compact(c) for c in cache]
                kept = [a for c in cache for a in _arrays(c)]
                nbytes = sum(c.nbytes for c in cache)
            else:
                cache, kept, nbytes = [], [block], block.nbytes
            if nbytes <= self.max_bytes:
                arrays += kept
                entries.append(_Entry(list(tokens), nbytes, block, cache))
        if arrays:
            mx.async_eval(arrays)
        for entry in entries:
            self._add(entry)

    def _add(self, entry: _Entry) -> None:
        prev, covered = self._trie.add(entry)
        if prev is not None:
            self._drop_counted(prev)
        self._lru[entry] = None
        self._nbytes += entry.nbytes
        if entry.block is not None or can_trim_prompt_cache(entry.cache):
            for e in covered:
                self._evict(e)
        while len(self._lru) > MAX_ENTRIES or self._nbytes > self.max_bytes:
            self._evict(next(iter(self._lru)))

    def _drop_counted(self, entry: _Entry) -> None:
        self._lru.pop(entry, None)
        self._nbytes -= entry.nbytes

    def _evict(self, entry: _Entry) -> None:
        self._trie.remove(entry.tokens)
        self._drop_counted(entry)

    def prefill_shared(self, prompts: Sequence[Sequence[int]]) -> int:
        """Prefill, once each, the prefixes that several of ``prompts`` share and the cache
        lacks, and keep them; returns the tokens computed."""
        if not self.mergeable or len(prompts) < 2:
            return 0
        computed = 0
        for prefix in shared_prefixes(prompts, MIN_SHARED_PREFIX):
            cache, held = self.fetch([*prefix, -1])  # the prefix, whole if it is cached
            if len(prefix) - held < MIN_SHARED_PREFIX:
                continue
            if cache is None:
                cache = make_prompt_cache(self.model, self.max_kv_size)
            rest = list(prefix[held:])
            for i in range(0, len(rest), self.prefill_step_size):
                chunk = mx.array([rest[i : i + self.prefill_step_size]])
                self.model(chunk, cache=cache)
                mx.eval([c.state for c in cache])
            computed += len(rest)
            self.store(prefix, cache)
        return computed


def _arrays(cache: Any) -> list[mx.array]:
    state = cache.state
    items = state if isinstance(state, (list, tuple)) else [state]
    out: list[mx.array] = []
    for s in items:
        if isinstance(s, mx.array):
            out.append(s)
        elif isinstance(s, (list, tuple)):
            out.extend(x for x in s if isinstance(x, mx.array))
    return out


class _Hit:
    """One row's cached prefix, shared by its layers: the entry and how many of its tokens.
    The first layer's merge leaves every layer's merged state here for the others."""

    __slots__ = ("entry", "merged", "n")

    def __init__(self, entry: _Entry, n: int) -> None:
        self.entry, self.n = entry, n
        self.merged: tuple[tuple[int, ...], mx.array, list[int], int] | None = None


class _RowKV(KVCache):  # type: ignore[misc]
    """One layer of a row's cached prefix: the first ``offset`` tokens of an entry's arrays.

    mlx-lm's ``BatchKVCache.merge`` writes each row of each layer separately: 64 copies
    a layer, 3,072 for a batch of 64 on a 24-layer model, most of a cached batch's prefill
    time on the H200. Here rows that start from one entry at one length (a sweep's batch
    on its shared prefix) join with one broadcast copy a layer; rows from several packed
    entries (chats) with one padded copy an entry and one concatenation for all layers,
    taken by the first layer's merge and viewed by the others. Any other mix merges as
    mlx-lm does."""

    def __init__(self, keys: mx.array, values: mx.array, hit: _Hit, layer: int) -> None:
        super().__init__()
        self.keys, self.values, self.offset = keys, values, hit.n  # hit.n tokens each
        self.hit, self.layer = hit, layer

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        rows = [c for c in caches if type(c) is _RowKV]
        if not rows or not all(type(c) is _RowKV or _empty(c) for c in caches):
            return BatchKVCache.merge(caches)
        first = rows[0]
        if len(rows) == len(caches) and all(
            c.hit.entry is first.hit.entry and c.offset == first.offset for c in caches
        ):
            return _broadcast(first, len(caches))
        if all(c.hit.entry.block is not None for c in rows):
            return _from_blocks([c.hit if type(c) is _RowKV else None for c in caches], first)
        return BatchKVCache.merge(caches)


def _empty(c: Any) -> bool:
    """A row with nothing cached (a miss beside hits): all padding in a merged batch."""
    return type(c) is KVCache and c.keys is None


def _room(n: int) -> int:
    """A batch cache's length for ``n`` cached tokens with room for the rest of the prompts,
    as mlx-lm's own prefill would leave: without it their first forward pass allocates
    and copies every layer again."""
    return (n // BatchKVCache.step + 2) * BatchKVCache.step


def _broadcast(row: _RowKV, b: int) -> Any:
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


def _from_blocks(hits: list[_Hit | None], row: _RowKV) -> Any:
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


def _plain(c: Any) -> bool:
    return type(c) in (KVCache, _RowKV, _RowView) and c.keys is not None and c.values is not None


def _packed(cache: list[Any]) -> mx.array | None:
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


class _RowView(KVCache):  # type: ignore[misc]
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
    viewing the batch's arrays (no copy: :meth:`PromptCache.store_many` copies what it
    keeps). mlx-lm's ``extract`` copies each layer and reads the row's padding from the
    device once a layer, waiting for the step in flight; the host knows it from ``n``.
    Other cache types: ``extract``."""
    if type(cache) is not BatchKVCache or cache.keys is None or not 0 < n <= cache._idx:
        return cache.extract(idx)
    return _RowView(cache.keys, cache.values, idx, cache._idx - n, cache._idx)


def _packed_rows(caches: Sequence[list[Any]]) -> list[mx.array | None]:
    """Each row's caches packed as :func:`_packed` packs them (None: they cannot be);
    rows that finished together in one batch (views of the same arrays), together."""
    out: list[mx.array | None] = [None] * len(caches)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, cache in enumerate(caches):
        if all(type(c) is _RowView for c in cache):
            groups.setdefault((id(cache[0].batch_keys), cache[0].end), []).append(i)
        else:
            out[i] = _packed(cache)
    for members in groups.values():
        rows = [caches[i] for i in members]
        blocks = _packed_together(rows) if len(rows) >= MIN_GROUP else None
        for i, block in zip(members, blocks or [_packed(c) for c in rows], strict=True):
            out[i] = block
    return out


def _packed_together(rows: list[list[_RowView]]) -> list[mx.array | None] | None:
    """Rows of one batch, each packed as :func:`_packed` packs it: each layer's keys and
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


def _compact(c: Any) -> Any:
    """A plain KV cache of exactly what ``c`` holds (a prefilled one has room for 256
    more; a row's cached prefix would keep a reference to the entry it came from)."""
    if not _plain(c) or (type(c) is KVCache and c.keys.shape[2] == c.offset):  # type: ignore[union-attr]
        return c
    out: Any = KVCache()
    out.keys = mx.contiguous(c.keys[..., : c.offset, :])
    out.values = mx.contiguous(c.values[..., : c.offset, :])
    out.offset = c.offset
    return out


def _first(entry: _Entry, n: int) -> list[Any] | None:
    """A cache of the first ``n`` tokens of ``entry``, for a row of its own (None: this
    cache type cannot be cut back to ``n``). Plain KV caches are sliced, others copied."""
    hit = _Hit(entry, n)
    if entry.block is not None:
        b = entry.block
        return [
            _RowKV(b[2 * i : 2 * i + 1, :, :n], b[2 * i + 1 : 2 * i + 2, :, :n], hit, i)
            for i in range(b.shape[0] // 2)
        ]
    if all(_plain(c) for c in entry.cache):
        return [
            _RowKV(c.keys[..., :n, :], c.values[..., :n, :], hit, i)
            for i, c in enumerate(entry.cache)
        ]
    excess = len(entry.tokens) - n
    if excess and not can_trim_prompt_cache(entry.cache):
        return None
    cache = copy.deepcopy(entry.cache)
    if excess:
        trim_prompt_cache(cache, excess)
    return cache


def shared_prefixes(prompts: Sequence[Sequence[int]], min_len: int) -> list[list[int]]:
    """The prefixes, at least ``min_len`` tokens, that two or more prompts share: prompts
    sorted, neighbours sharing ``min_len`` tokens grouped, each group's common prefix cut
    one token short of its shortest prompt (so every row keeps a token to prefill)."""
    ordered = sorted({tuple(p) for p in prompts})
    counts: dict[tuple[int, ...], int] = {}
    for p in prompts:
        counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    out: list[list[int]] = []
    group: list[tuple[int, ...]] = []
    common = 0

    def close() -> None:
        many = len(group) > 1 or (bool(group) and counts[group[0]] > 1)
        if many:
            n = min(common, *(len(p) - 1 for p in group))
            if n >= min_len:
                out.append(list(group[0][:n]))

    for p in ordered:
        if group:
            n = _matched(group[-1], p, 0)
            if n >= min_len:
                group.append(p)
                common = min(common, n)
                continue
            close()
        group, common = [p], len(p)
    if group:
        close()
    return out
