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
- Finished rows reach the cache as views of the batch
  (:func:`~mlxq.worker.kv_pack.row_cache`), their padding known on the host: mlx-lm's
  ``extract`` copies every layer and reads the padding from the device, waiting for the
  decode step in flight. Rows too short to keep are not even viewed, and rows that
  finish in the same step are copied out together.
- Rows join the batch in one copy per layer (one entry, one length: a broadcast) or one
  concatenation for all layers (several entries, or hits beside misses); mlx-lm's merge
  writes each row of each layer on its own.

The index is a radix tree (:mod:`mlxq.worker.prefix_tree`); entries are packed and sliced
in :mod:`mlxq.worker.kv_pack`, and hits join a batch in :mod:`mlxq.worker.kv_merge`. Here:
the budget, the least-recently-used order, and the shared prefixes' prefill.

A cache type without ``merge`` (``QuantizedKVCache``) cannot join a batch with history:
such a model never hits and every row prefills in full, as it would without the cache.
Pinned to mlx-lm 0.32.2.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from mlxq.worker.kv_pack import compact, packed_rows, prefix_of, state_arrays
from mlxq.worker.prefix_tree import Entry, Trie, shared_prefixes

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
        self._trie = Trie()
        self._lru: OrderedDict[Entry, None] = OrderedDict()
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
            cache = prefix_of(entry, n)
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
        together (:func:`packed_rows`)."""
        if not self.mergeable:
            return
        rows = [(t, c) for t, c in rows if len(t) >= MIN_REUSE and c]
        blocks = packed_rows([c for _, c in rows])
        arrays: list[mx.array] = []
        entries = []
        for (tokens, cache), block in zip(rows, blocks, strict=True):
            if block is None:
                cache = [compact(c) for c in cache]
                kept = [a for c in cache for a in state_arrays(c)]
                nbytes = sum(c.nbytes for c in cache)
            else:
                cache, kept, nbytes = [], [block], block.nbytes
            if nbytes <= self.max_bytes:
                arrays += kept
                entries.append(Entry(list(tokens), nbytes, block, cache))
        if arrays:
            mx.async_eval(arrays)
        for entry in entries:
            self._add(entry)

    def _add(self, entry: Entry) -> None:
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

    def _drop_counted(self, entry: Entry) -> None:
        self._lru.pop(entry, None)
        self._nbytes -= entry.nbytes

    def _evict(self, entry: Entry) -> None:
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
