"""The prompt cache: KV state of earlier prompts, reused by later jobs that start the same.

An eval sweep sends one few-shot prefix in front of thousands of questions, and a chat
resends its whole history every turn: both prefill the same tokens again and again. The
cache keeps the KV state of finished rows (prompt and completion) and of prefixes shared
by a burst of jobs, in mlx-lm's :class:`~mlx_lm.models.cache.LRUPromptCache` (a token
trie, least recently used out first) under a byte budget, and hands each admitted row the
state of its longest cached prefix; only the rest of its prompt is prefilled.

mlx-lm copies a row's cache into the batch (``BatchKVCache.merge``), so an entry is
never shared with a running row. A cache type without ``merge`` (``QuantizedKVCache``)
cannot join a batch with history: such a model never hits and every row prefills in
full, as it would without the cache. Pinned to mlx-lm 0.32.2.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

log = logging.getLogger("mlxq.worker")

#: Entries kept at most, whatever their size: each insert and eviction walks the LRU order.
MAX_ENTRIES = 512
#: A prefix shared by jobs of one burst is prefilled once, alone, when it is at least this
#: long; shorter ones cost less than the extra forward pass saves.
MIN_SHARED_PREFIX = 32
#: Without a device memory size (the CPU): a fixed budget.
CPU_DEFAULT_BYTES = 1 << 30
#: Of the device's recommended working set, the share the cache may hold by default.
DEVICE_SHARE = 0.25
#: The trie is keyed by model too; one engine serves one model.
_MODEL_KEY = "model"


def default_budget() -> int:
    """Bytes the cache may hold when the worker is not told: a quarter of the device's
    recommended working set (Metal, CUDA), else 1 GiB."""
    try:
        info = mx.device_info()
    except Exception:  # an MLX build without it: the CPU default
        return CPU_DEFAULT_BYTES
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        size = info.get(key)
        if isinstance(size, int) and size > 0:
            return int(size * DEVICE_SHARE)
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
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max_bytes)

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=self.max_bytes)

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """A copy of the cache of ``tokens``' longest cached prefix, and how many tokens it
        holds; always at least one token short of ``tokens`` (a cache covering the whole
        prompt is trimmed by one, as mlx-lm refuses an empty rest). ``(None, 0)``: a miss."""
        if not self.mergeable or len(tokens) < 2:
            return None, 0
        ids = list(tokens)
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, ids)
        if cache is None:
            return None, 0
        if not rest:
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = ids[-1:]
        held = len(ids) - len(rest)
        return (cache, held) if held > 0 else (None, 0)

    def store(self, tokens: Sequence[int], cache: list[Any], *, kind: str = "assistant") -> None:
        """Keep ``cache``, the KV state of exactly ``tokens``; one larger than the whole
        budget is dropped (it would only push everything else out, then itself)."""
        if not self.mergeable or not tokens or not cache:
            return
        if sum(c.nbytes for c in cache) > self.max_bytes:
            return
        self._lru.insert_cache(_MODEL_KEY, list(tokens), cache, cache_type=kind)

    def prefill_shared(self, prompts: Sequence[Sequence[int]]) -> int:
        """Prefill, once each, the prefixes that several of ``prompts`` share and the cache
        lacks, and keep them; returns the tokens computed."""
        if not self.mergeable:
            return 0
        computed = 0
        for prefix in shared_prefixes(prompts, MIN_SHARED_PREFIX):
            cache, held = self.fetch([*prefix, 0])  # the prefix, whole if it is cached
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
            self.store(prefix, cache, kind="system")
        return computed


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
            n = _common(group[-1], p)
            if n >= min_len:
                group.append(p)
                common = min(common, n)
                continue
            close()
        group, common = [p], len(p)
    if group:
        close()
    return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
