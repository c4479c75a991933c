"""Top log-probs for a whole batch in one op equal a plain numpy reference, row by row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.batching.logprobs import (
    LogprobRows,
    TokenLogprob,
    step_logprobs,
    to_host,
    top_logprobs,
)


def _logprobs(rows: int, vocab: int, seed: int, levels: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)) * 3
    if levels:  # few distinct values: many ties
        x = np.round(x * levels / 10) * 10 / levels
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def check_row(
    lp: np.ndarray, token: int, k: int, chosen: float, ids: list[int], vals: list[float]
) -> None:
    """One row against numpy: the chosen value, the k largest values, ids that hold them."""
    assert chosen == lp[token]
    assert vals == sorted(lp, reverse=True)[:k]  # the top k values, most likely first
    assert len(set(ids)) == k and [lp[i] for i in ids] == vals  # distinct ids holding them


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 64),
    k=st.integers(0, 20),
    levels=st.sampled_from([0, 1, 4]),
    seed=st.integers(0, 2**16),
)
def test_matches_numpy(rows: int, vocab: int, k: int, levels: int, seed: int) -> None:
    k = min(k, vocab)
    lp = _logprobs(rows, vocab, seed, levels)
    tokens = np.random.default_rng(seed).integers(0, vocab, size=rows)
    chosen, ids, vals = top_logprobs(mx.array(lp), mx.array(tokens, dtype=mx.uint32), k)
    assert ids.shape == vals.shape == (rows, k) and chosen.shape == (rows,)
    assert chosen.dtype == vals.dtype == mx.float32 and ids.dtype == mx.int32
    for i in range(rows):
        check_row(lp[i], int(tokens[i]), k, chosen.tolist()[i], ids.tolist()[i], vals.tolist()[i])


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.sampled_from([2_560, 4_096, 10_240, 12_320, 20_480]),
    k=st.integers(1, 20),
    levels=st.sampled_from([0, 1, 4]),
    seed=st.integers(0, 2**16),
)
def test_chunked_search_matches_numpy(vocab: int, k: int, levels: int, seed: int) -> None:
    # Vocabularies that split into chunks of 32 to 128: the chunk-maxima path, ties included.
    lp = _logprobs(3, vocab, seed, levels)
    tokens = mx.array([0, vocab - 1, vocab // 2])
    chosen, ids, vals = top_logprobs(mx.array(lp), tokens, k)
    for i in range(3):
        check_row(
            lp[i], int(tokens[i].item()), k, chosen.tolist()[i], ids.tolist()[i], vals.tolist()[i]
        )


def test_whole_vocabulary_and_bfloat16() -> None:
    lp = _logprobs(3, 30, seed=1)
    tokens = mx.array([0, 29, 7])
    chosen, ids, vals = top_logprobs(mx.array(lp).astype(mx.bfloat16), tokens, 30)  # k = V: a sort
    as_bf16 = np.array(mx.array(lp).astype(mx.bfloat16).astype(mx.float32))
    for i in range(3):
        check_row(
            as_bf16[i],
            int(tokens[i].item()),
            30,
            chosen.tolist()[i],
            ids.tolist()[i],
            vals.tolist()[i],
        )


def test_big_vocabulary() -> None:
    lp = _logprobs(4, 151_936, seed=2)
    tokens = mx.array([5, 151_935, 0, 77_000])
    chosen, ids, vals = top_logprobs(mx.array(lp), tokens, 20)
    for i in range(4):
        check_row(
            lp[i], int(tokens[i].item()), 20, chosen.tolist()[i], ids.tolist()[i], vals.tolist()[i]
        )


def test_masked_tokens_read_minus_infinity() -> None:
    lp = np.full((1, 4), -np.inf, dtype=np.float32)
    lp[0, 2] = 0.0
    chosen, ids, vals = top_logprobs(mx.array(lp), mx.array([2]), 2)
    assert chosen.tolist() == [0.0] and ids.tolist()[0][0] == 2
    assert vals.tolist() == [[0.0, -np.inf]]


def test_only_the_rows_that_asked_and_each_its_own_k() -> None:
    lp = _logprobs(5, 40, seed=3)
    tokens = mx.array([1, 2, 3, 4, 5], dtype=mx.uint32)
    rows = LogprobRows.from_requests([None, 3, 0, None, 20])
    assert rows.any_requested and rows.k == 20 and rows.rows is not None
    step = step_logprobs(mx.array(lp), tokens, rows)
    assert step.top_ids.shape == (3, 20)  # rows 1, 2 and 4 only
    mx.eval(step.arrays())
    out = to_host(step, rows)
    assert out[0] is None and out[3] is None
    for i, k in [(1, 3), (2, 0), (4, 20)]:
        got = out[i]
        assert isinstance(got, TokenLogprob) and got.token == i + 1 and len(got.top) == k
        check_row(lp[i], i + 1, k, got.logprob, [t for t, _ in got.top], [v for _, v in got.top])


def test_every_row_asking_takes_no_gather() -> None:
    rows = LogprobRows.from_requests([1, 1])
    assert rows.rows is None and rows.k == 1
    out = to_host(step_logprobs(mx.array(_logprobs(2, 9, 4)), mx.array([0, 8]), rows), rows)
    assert [o.token for o in out if o] == [0, 8]


def test_nobody_asking() -> None:
    rows = LogprobRows.from_requests([None, None])
    assert not rows.any_requested and rows.k == 0


@pytest.mark.parametrize("bad", [21, -1, True, 1.5, "3"])
def test_bad_requests_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^requested\[1\]="):
        LogprobRows.from_requests([1, bad])  # type: ignore[list-item]


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="k=5"):
        top_logprobs(mx.zeros((1, 4)), mx.array([0]), 5)
    with pytest.raises(ValueError, match="want"):
        top_logprobs(mx.zeros((2, 4)), mx.array([0]), 1)
    with pytest.raises(ValueError, match="want"):
        step_logprobs(mx.zeros((3, 4)), mx.zeros((3,)), LogprobRows.from_requests([1, 1]))
