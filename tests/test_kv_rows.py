"""Rows leaving a batch: the worker's filter of every layer's KV cache keeps what mlx-lm's
``BatchKVCache.filter`` keeps, whether the kept rows are one run (a slice) or not (a
gather)."""

from __future__ import annotations

import copy

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from mlxq.worker.kv_pack import _one_run, filter_rows, schedule_caches  # noqa: E402

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


def test_one_run_is_only_consecutive_rows():
    assert _one_run([0, 1, 2]) == (0, 3)
    assert _one_run([3, 4]) == (3, 5)
    assert _one_run([0, 2]) is None
    assert _one_run([2, 1]) is None
    assert _one_run([]) is None


def test_a_sliced_batch_decodes_on_as_a_gathered_one():
    """The next token written into a filtered cache (a slice of the old arrays, then an
    update in place or a copy) lands as it lands in mlx-lm's."""
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
