"""A seeded row's Gumbel noise: a hash of (seed, position, token id), nothing else.

So a seeded job draws the same tokens alone or in any batch, paused and resumed or not,
and from one release to the next (``tests/test_sampler.py`` pins a few). Two 32-bit keys
a row come from its seed and position; each token's noise is murmur3's finalizer over
its id and the keys, mapped into (0, 1) and through -log(-log(u)).

The keys are made on the host where the positions are known there (the worker's):
three integer steps a seeded row and one small array, where the same on the device was
seven compiled kernels of a few values each and a gather, each a launch of the host's on
every decode step with a seeded row in it.
"""

from __future__ import annotations

import functools

import mlx.core as mx

_M1, _M2, _GOLD = (mx.array(c, dtype=mx.uint32) for c in (0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9))
_BELOW_ONE = mx.array(1.0 - 2.0**-24, dtype=mx.float32)  # the largest float32 under 1
_U32 = 0xFFFFFFFF

#: A row set's two keys, (R, 1) uint32 each.
Keys = tuple[mx.array, mx.array]


def _fmix32(h: mx.array) -> mx.array:
    # murmur3's finalizer: a bijection on uint32 in which every input bit
    # flips about half the output bits, so neighbouring counters look unrelated.
    h = (h ^ (h >> 16)) * _M1
    h = (h ^ (h >> 13)) * _M2
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    """:func:`_fmix32` on one host integer (uint32 arithmetic: products wrap mod 2**32)."""
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _U32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _U32
    return h ^ (h >> 16)


def first_key(seed: int) -> int:
    """A seeded row's first key: a function of its seed alone."""
    lo, hi = seed & _U32, seed >> 32
    return _fmix32_int(_fmix32_int((lo + 0x9E3779B9) & _U32) ^ hi)


def second_key(first: int, seed: int, position: int) -> int:
    """A seeded row's second key at ``position``, given its first."""
    return _fmix32_int(first ^ _fmix32_int((position * 0x9E3779B9 + (seed >> 32)) & _U32))


def second_keys(first: mx.array, seed_hi: mx.array, positions: mx.array) -> mx.array:
    """:func:`second_key` on the device: (R, 1) first keys and seeds' high 32 bits, R positions."""
    pos = positions.astype(mx.uint32).reshape(-1, 1)
    return _fmix32(first ^ _fmix32(pos * _GOLD + seed_hi))


@mx.compile
def hash_gumbel(tokens: mx.array, key1: mx.array, key2: mx.array) -> mx.array:
    """Gumbel noise for each token id of ``tokens`` under each row's keys."""
    # Compiled so the ~12 integer ops fuse into few passes: as fast as mx.random.gumbel.
    h = _fmix32(_fmix32(tokens ^ key1) + key2)
    # In (0, 1): the largest of the 2**24 values, (2**24 - 0.5) / 2**24, rounds to 1.0 in
    # float32, whose noise would be +inf and win the draw even for a token of probability
    # 0 (one a constraint masked out); it is held just below 1.
    u = mx.minimum(((h >> 8).astype(mx.float32) + 0.5) * (2.0**-24), _BELOW_ONE)
    return -mx.log(-mx.log(u))


@functools.cache
def token_ids(vocab: int) -> mx.array:
    """(1, vocab) token ids, uint32, made once: the whole-vocabulary hash reads them."""
    ids = mx.arange(vocab, dtype=mx.uint32).reshape(1, -1)
    mx.eval(ids)
    return ids
