"""Rows leaving a batch: the worker's filter of every layer's KV cache keeps what mlx-lm's
``BatchKVCache.filter`` keeps, whether the kept rows are one run or not, and copies them
out of the old arrays."""

from __future__ import annotations

import copy
import gc

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from mlxq.worker.kv_pack import filter_rows, schedule_caches  # noqa: E402

ROWS, HEADS, DIM, WIDTH = 6, 2, 8, 20


def _batch(padding: list[int]) -> list[BatchKVCache]:
    """Two layers of a batch whose rows are left-padded by ``padding``."""
    caches = []
    for layer in range(2):
        c = BatchKVCache(padding)
        keys = mx.random.normal((ROWS, HEADS, WIDTH, DIM), key=mx.random.key(layer))
        c.update_and_fetch(keys, keys * 2)
        caches.append(c)
    mx.eval([a for c in caches for a in (c.keys, c.values, c.offset, c.left_padding)])
    return caches


def _rows(c: BatchKVCache) -> list[tuple[list[float], list[float], int]]:
    """Each row's tokens (keys and values past its padding) and offset."""
    pad = c.left_padding.tolist()
    offset = c.offset.tolist()
    return [
        (
            c.keys[i, :, pad[i] : c._idx].tolist(),
            c.values[i, :, pad[i] : c._idx].tolist(),
            offset[i],
        )
        for i in range(len(pad))
    ]


@pytest.mark.parametrize(
    "keep",
    [
        [0, 1, 2, 3, 4],  # the newest row left (a chat job's end in a sweep's batch)
        [2, 3, 4, 5],  # the oldest rows left
        [1, 2, 3, 4],  # the longest row (row 0) and the newest left: padding cut
        [0, 1, 3, 4, 5],  # one in the middle: a gather
        [5, 3, 1],  # scattered, out of order
        [4],
    ],
)
@pytest.mark.parametrize("scheduled", [False, True])
def test_filter_rows_keeps_what_mlx_lm_keeps(keep, scheduled):
    padding = [0, 3, 5, 2, 7, 9]
    ours, theirs = _batch(padding), _batch(padding)
    held = [WIDTH - padding[i] for i in keep]
    filter_rows(ours, keep, held)
    if scheduled:  # the worker queues the copies apart from the next step
        schedule_caches(ours)
    for c in theirs:
        c.filter(mx.array(keep))
    for a, b in zip(ours, theirs, strict=True):
        assert a._idx == b._idx
        assert a.left_padding.tolist() == b.left_padding.tolist()
        assert _rows(a) == _rows(b)
        assert a.keys.shape[0] == len(keep)


def test_schedule_caches_passes_over_what_holds_no_arrays_of_its_own():
    class Slotted:
        __slots__ = ("keys",)

        def __init__(self) -> None:
            self.keys = mx.zeros((2, 2))

    class Listed:  # as mlx-lm's ArraysCache: its arrays in a list
        def __init__(self) -> None:
            self.cache = [mx.ones((2,)), None]

    schedule_caches([Slotted(), Listed()])  # nothing to queue: no error
    schedule_caches([])


def test_a_filtered_batch_decodes_on_as_mlx_lms():
    """The next token written into a filtered cache lands as it lands in mlx-lm's."""
    padding = [0, 3, 5, 2, 7, 9]
    ours, theirs = _batch(padding), _batch(padding)
    keep = [0, 1, 2, 3, 4]
    filter_rows(ours, keep, [WIDTH - padding[i] for i in keep])
    for c in theirs:
        c.filter(mx.array(keep))
    step = mx.random.normal((len(keep), HEADS, 1, DIM), key=mx.random.key(7))
    before = copy.deepcopy(_rows(ours[0]))
    for a, b in zip(ours, theirs, strict=True):
        a.update_and_fetch(step, step)
        b.update_and_fetch(step, step)
        assert _rows(a) == _rows(b)
    assert [r[0] for r in _rows(ours[0])] != [r[0] for r in before]


@pytest.mark.parametrize(
    "keep",
    [
        list(range(7)),  # the newest row left: one run
        list(range(1, 8)),  # the longest row left: one run, its padding cut off
        [0, 1, 2, 4, 5, 6, 7],  # one in the middle: a gather
    ],
)
def test_a_filtered_cache_owns_its_memory(keep):
    """The kept rows are copied out, not left as views holding the old arrays alive: the
    next decode step writes into each layer's arrays in place only where they own their
    memory (else it copies the whole cache inside that step), and the old arrays' memory
    goes back as the filter's copies land."""
    gc.collect()
    padding = [0, 8, 9, 10, 11, 12, 13, 14]
    caches = []
    for layer in range(2):
        c = BatchKVCache(padding)
        keys = mx.random.normal((8, 2, 200, 64), key=mx.random.key(layer))
        c.update_and_fetch(keys, keys * 2)  # into arrays of 256 positions, their own
        caches.append(c)
    mx.eval([a for c in caches for a in (c.keys, c.values, c.offset, c.left_padding)])
    del keys
    gc.collect()
    kv = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    before = mx.get_active_memory()
    filter_rows(caches, keep, [200 - padding[i] for i in keep])
    schedule_caches(caches)
    mx.eval([a for c in caches for a in (c.keys, c.values)])
    gc.collect()
    kept = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    assert kept <= kv * 7 // 8
    # At least the rows (and padding) let go went back; a view would give back nothing.
    assert before - mx.get_active_memory() >= (kv - kept) * 0.9
