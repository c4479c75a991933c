"""The vectorized sampler draws each row from mlx-lm's own distribution for its params.

Hand-made log-prob arrays, no model. The reference distribution comes from
mlx-lm's own filter functions, so "the same as make_sampler" is checked against
mlx-lm itself, not against a second copy of our logic.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxq.batching.sampler import RowParams, sample
from mlxq.producer.params import MAX_SEED
from mlxq.producer.params import SamplingParams as SP

MIXED = [
    SP(),
    SP(temperature=0.7, top_p=0.9),
    SP(temperature=1.0, top_k=5),
    SP(temperature=1.3, min_p=0.1),
    SP(temperature=0.8, top_p=0.5, top_k=3, min_p=0.05),
]
#: One-sided false-alarm rate per chi-square test; the seeds are fixed anyway.
ALPHA_Z = 3.719  # standard normal quantile for alpha = 1e-4


def _logprobs(rows: int, vocab: int, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)) * scale
    x = x - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def reference(row: np.ndarray, p: SP) -> np.ndarray:
    """The row's token distribution under mlx-lm's own filters (greedy: one-hot)."""
    if p.greedy:
        out = np.zeros(row.shape[-1])
        out[int(np.argmax(row))] = 1.0
        return out
    # mlx-lm compiles its filters with the params as constants: ~0.4 s to retrace
    # for every new top_p. Eager gives the same numbers.
    mx.disable_compile()
    try:
        return _filtered(mx.array(row)[None], p)
    finally:
        mx.enable_compile()


def _filtered(x: mx.array, p: SP) -> np.ndarray:
    if 0 < p.top_p < 1:
        x = apply_top_p(x, p.top_p)
    if p.min_p != 0:
        x = apply_min_p(x, p.min_p)
    if 0 < p.top_k < x.shape[-1]:  # mlx-lm refuses top_k >= V; it keeps everything
        x = apply_top_k(x, p.top_k)
    return np.array(mx.softmax(x * (1 / p.temperature), axis=-1)[0], dtype=np.float64)


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at ALPHA_Z (no scipy here);
    a little above the exact one for small df (df=1: 16.2 vs 15.1), so conservative."""
    c = 2 / (9 * df)
    return df * (1 - c + ALPHA_Z * math.sqrt(c)) ** 3


def assert_fits(counts: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit; bins expected under 5 draws are pooled."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "drew a token outside the support"
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    if len(obs) < 2:
        assert obs.sum() == n
        return
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_critical(len(obs) - 1), (stat, len(obs) - 1)


def draw_tiled(base: np.ndarray, params: list[SP], reps: int, **kw: int) -> np.ndarray:
    """One sample() call over ``reps`` copies of the batch; returns (reps, B) tokens."""
    x = mx.array(np.tile(base, (reps, 1)))
    rows = RowParams.from_params(params * reps, **kw)
    positions = mx.arange(len(params) * reps)
    return np.array(sample(x, rows, positions)).reshape(reps, len(params))


@pytest.mark.parametrize(
    ("vocab", "scale", "num_candidates"),
    [(32, 2.0, 1024), (1024, 3.0, 1024), (1024, 3.0, 0), (1024, 0.3, 1024)],
    ids=["small-vocab", "narrow-path", "full-sort", "flat-falls-back"],
)
def test_mixed_batch_matches_mlx_lm(vocab: int, scale: float, num_candidates: int) -> None:
    mx.random.seed(0)
    base = _logprobs(len(MIXED), vocab, scale, seed=vocab)
    tokens = draw_tiled(base, MIXED, reps=3000, num_candidates=num_candidates)
    for i, p in enumerate(MIXED):
        counts = np.bincount(tokens[:, i], minlength=vocab)
        assert_fits(counts, reference(base[i], p))


def test_greedy_rows_take_the_argmax() -> None:
    base = _logprobs(64, 500, 2.0, seed=1)
    params = [MIXED[i % len(MIXED)] for i in range(64)]
    tokens = np.array(sample(mx.array(base), RowParams.from_params(params), mx.arange(64)))
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert (tokens[greedy] == base[greedy].argmax(-1)).all()
    all_greedy = sample(mx.array(base), RowParams.from_params([SP()] * 64), mx.arange(64))
    assert (np.array(all_greedy) == base.argmax(-1)).all()


@pytest.mark.parametrize("num_candidates", [1024, 0], ids=["candidates", "full-sort"])
@pytest.mark.parametrize("sampled", [1, 3, 40], ids=["one-sampled", "few-sampled", "most-sampled"])
def test_a_mostly_greedy_batch_and_a_mostly_sampled_one_draw_alike(
    num_candidates: int, sampled: int
) -> None:
    # A sweep's greedy rows with a chat row or two, and the other way round: each greedy
    # row takes its argmax and each seeded row the draw it makes alone, whichever way the
    # batch is drawn.
    base = _logprobs(48, 2000, 1.5, seed=9)
    seeded = {i: SP(temperature=0.8, top_p=0.95 if i % 2 else 1.0, seed=i) for i in range(sampled)}
    params = [seeded.get(i, SP()) for i in range(48)]
    positions = mx.arange(48) + 5
    tokens = np.array(
        sample(mx.array(base), RowParams.from_params(params, num_candidates), positions)
    )
    for i, p in enumerate(params):
        if p.greedy:
            assert tokens[i] == base[i].argmax()
        else:
            alone = sample(
                mx.array(base[i : i + 1]), RowParams.from_params([p]), positions[i : i + 1]
            )
            assert tokens[i] == int(alone[0])


SEEDED = [
    SP(temperature=1.0, seed=7),
    SP(temperature=0.7, top_p=0.9, seed=2**40 + 3),
    SP(temperature=1.2, top_k=20, seed=0),
    SP(temperature=0.9, min_p=0.02, seed=12345),
]


@pytest.mark.parametrize("p", SEEDED, ids=["plain", "top_p", "top_k", "min_p"])
def test_seeded_row_ignores_its_batch(p: SP) -> None:
    mx.random.seed(1)
    vocab = 3000
    row = _logprobs(1, vocab, 1.5, seed=5)
    others = _logprobs(63, vocab, 1.5, seed=6)
    batch = [MIXED[i % len(MIXED)] for i in range(63)]
    batch[10] = SP(temperature=0.5, seed=99)
    for pos in (0, 1, 17, 4000):
        alone = sample(mx.array(row), RowParams.from_params([p]), mx.array([pos]))
        x = mx.array(np.concatenate([others[:30], row, others[30:]]))
        positions = mx.array([pos + 1 + i for i in range(30)] + [pos] + list(range(33)))
        mixed = sample(x, RowParams.from_params([*batch[:30], p, *batch[30:]]), positions)
        assert int(alone[0]) == int(mixed[30])


@pytest.mark.parametrize("num_candidates", [1024, 0], ids=["candidates", "full-sort"])
def test_seeded_keys_made_on_the_host_draw_what_the_device_keys_draw(num_candidates: int) -> None:
    # The worker hands positions over as host integers and its seeded rows' keys are made
    # there; given as an array, they are made on the device. The same draws either way, at
    # seeds and positions past 32 bits' worth of products, greedy rows beside them.
    x = mx.array(_logprobs(6, 3000, 1.5, seed=7))
    params = [
        SP(),
        SP(temperature=0.7, seed=MAX_SEED),
        SP(temperature=1.3, top_p=0.9, seed=2**32 + 3),
        SP(temperature=0.9),
        SP(temperature=0.5, top_k=40, seed=0),
        SP(temperature=1.0, min_p=0.05, seed=123456789),
    ]
    for rows in (params, params[1:3], [params[1]]):
        rp = RowParams.from_params(rows, num_candidates)
        n = len(rows)
        for pos in ([0] * n, [2**31 + 9] * n, [2**32 - 1 - i for i in range(n)]):
            seeded = [i for i, p in enumerate(rows) if p.seed is not None]
            host = np.array(sample(x[:n], rp, pos))[seeded]
            device = np.array(sample(x[:n], rp, mx.array(pos, dtype=mx.uint32)))[seeded]
            assert host.tolist() == device.tolist()


@pytest.mark.parametrize("num_candidates", [1024, 0], ids=["candidates", "full-sort"])
def test_seeded_draws_stay_those_of_earlier_releases(num_candidates: int) -> None:
    # A seeded job's tokens are a function of (seed, position, logits): the same from one
    # release to the next, however the keys are made (these came from 198a57c's sampler,
    # whose keys were made on the device).
    x = mx.array(_logprobs(4, 3000, 1.5, seed=11))
    params = [
        SP(temperature=0.7, seed=MAX_SEED),
        SP(temperature=1.3, top_p=0.9, seed=2**32 + 3),
        SP(temperature=0.5, top_k=40, seed=0),
        SP(temperature=1.0, min_p=0.05, seed=123456789),
    ]
    rows = RowParams.from_params(params, num_candidates)
    got = [np.array(sample(x, rows, [t] * 4)).tolist() for t in (0, 5, 2**32 - 1)]
    assert got == [[1475, 2660, 0, 1113], [117, 1472, 2639, 2903], [2066, 1260, 2639, 805]]


def test_seeds_and_positions_change_the_draw() -> None:
    row = mx.array(_logprobs(1, 1000, 0.5, seed=2))
    draws = {
        int(sample(row, RowParams.from_params([SP(temperature=1.0, seed=s)]), mx.array([t]))[0])
        for s in range(8)
        for t in range(8)
    }
    assert len(draws) > 40  # 64 draws from ~1000 near-uniform tokens


def test_seeded_draws_follow_the_distribution() -> None:
    # Many seeds, one position each: the counter-based noise must be as good as random.
    base = _logprobs(2, 64, 1.5, seed=3)
    params = [SP(temperature=0.8, top_p=0.95, seed=s) for s in range(4000)]
    x = mx.array(np.tile(base[:1], (4000, 1)))
    tokens = np.array(sample(x, RowParams.from_params(params), mx.full((4000,), 9)))
    assert_fits(np.bincount(tokens, minlength=64), reference(base[0], params[0]))


@pytest.mark.parametrize("num_candidates", [1024, 0], ids=["candidates", "full-sort"])
def test_unseeded_draws_call_after_call_follow_the_distribution(num_candidates: int) -> None:
    # One unseeded row among greedy ones, drawn call after call as a decode step draws it:
    # its noise is new each call (the full-sort path draws it inside a compiled function,
    # MLX's random state passed through), and a seed of MLX's random repeats the calls.
    base = _logprobs(3, 48, 1.5, seed=4)
    params = [SP(), SP(temperature=0.9, top_p=0.97), SP()]
    rows = RowParams.from_params(params, num_candidates)
    x, positions = mx.array(base), mx.zeros((3,), dtype=mx.int32)

    def calls(n: int) -> np.ndarray:
        return np.array([sample(x, rows, positions).tolist() for _ in range(n)])

    mx.random.seed(11)
    tokens = calls(1500)
    assert (tokens[:, [0, 2]] == np.argmax(base[[0, 2]], axis=-1)).all()
    assert_fits(np.bincount(tokens[:, 1], minlength=48), reference(base[1], params[1]))
    mx.random.seed(11)
    assert (calls(20) == tokens[:20]).all()


def test_rejects_empty_batch_and_wrong_shape() -> None:
    with pytest.raises(ValueError, match="params"):
        RowParams.from_params([])
    with pytest.raises(ValueError, match="logprobs shape"):
        sample(mx.zeros((3, 10)), RowParams.from_params(MIXED), mx.arange(3))


def test_half_precision_logprobs() -> None:
    # Quantized models hand over bfloat16 log-probs; cuts are taken in float32.
    base = _logprobs(len(MIXED), 2000, 3.0, seed=8)
    x = mx.array(np.tile(base, (200, 1))).astype(mx.bfloat16)
    tokens = np.array(sample(x, RowParams.from_params(MIXED * 200), mx.arange(1000)))
    tokens = tokens.reshape(200, len(MIXED))
    ranked = np.argsort(-np.array(x[: len(MIXED)].astype(mx.float32)), axis=-1)
    assert (tokens[:, 0] == int(mx.argmax(x[0]))).all()
    assert np.isin(tokens[:, 2], ranked[2, :5]).all()
    assert np.isin(tokens[:, 4], ranked[4, :3]).all()


def _params() -> st.SearchStrategy[SP]:
    return st.builds(
        SP,
        temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.0]),
        top_p=st.floats(0.01, 1.0),
        top_k=st.integers(0, 40),
        min_p=st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 1.0]),
        seed=st.none() | st.integers(0, 2**63 - 1),
    )


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    num_candidates=st.sampled_from([0, 1, 4, 1024]),
)
def test_tokens_stay_in_the_reference_support(
    data: st.DataObject, vocab: int, num_candidates: int
) -> None:
    params = data.draw(st.lists(_params(), min_size=1, max_size=6))
    # Distinct logits 0.05 apart: ties would make mlx-lm's own top_k choice arbitrary.
    ints = data.draw(
        st.lists(st.permutations(range(vocab)), min_size=len(params), max_size=len(params))
    )
    x = np.array(ints, dtype=np.float64) * data.draw(st.sampled_from([0.05, 0.5, 3.0]))
    x = (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)
    reps = 50
    tokens = draw_tiled(x, params, reps, num_candidates=num_candidates)
    for i, p in enumerate(params):
        support = reference(x[i], p) > 0
        assert support[tokens[:, i]].all(), (p, x[i], tokens[:, i])
