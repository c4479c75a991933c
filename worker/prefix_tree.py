"""The prompt cache's index: its entries by their tokens, in a radix tree.

A lookup walks the tree once (a shared run of tokens is one list comparison); any entry
below the point where the walk stops shares the whole walked prefix, so the first one
found serves. mlx-lm's ``PromptTrie`` walks token by token and looks for the shortest
such entry, which visits every branch below: tens of milliseconds per lookup for a
sweep's hundreds of entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx


class Entry:
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
        self.entry: Entry | None = None


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


class Trie:
    """Entries by their tokens, in a radix tree: an edge holds a run of tokens, so a
    sweep's shared 1,000-token prefix is one list comparison, not 1,000 steps. A node
    without an entry always has children (a removal prunes the branch it empties), so a
    walk down any child reaches an entry."""

    def __init__(self) -> None:
        self.root = _Node([])

    def add(self, entry: Entry) -> tuple[Entry | None, list[Entry]]:
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

    def nearest(self, tokens: Sequence[int]) -> tuple[Entry | None, int, Entry | None, int]:
        """The longest entry that is a prefix of ``tokens`` (and its length), and an entry
        sharing more of ``tokens`` than that one (and how many it shares)."""
        node, d = self.root, 0
        prefix: Entry | None = None
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
