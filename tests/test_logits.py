"""The vectorized processors give every row what mlx-lm's own processors give it.

The reference is mlx-lm itself: each row gets ``make_logits_processors(...)``
and a ``TokenBuffer`` fed exactly as ``GenerationBatch._step`` feeds it (the
prompt minus its last token, then each step's input token), and runs on its
own (1, V) slice. The vectorized result must be bit-identical, in float32,
bfloat16 and float16, while rows join and leave.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import make_logits_processors

from mlxq.batching.history import TokenHistory
from mlxq.batching.logits import LogitsRows, apply
from mlxq.producer.logits_params import LogitsParams as LP

DTYPES = [mx.float32, mx.bfloat16, mx.float16]
EOS = (2,)


class Reference:
    """One row on mlx-lm's per-row path (plus min_tokens, which mlx-lm lacks)."""

    def __init__(self, prompt: Sequence[int], params: LP | None) -> None:
        p = params or LP()
        self.params, self.generated = p, 0
        self.buffer = TokenBuffer([int(t) for t in prompt[:-1]])
        self.input = int(prompt[-1])
        self.procs = make_logits_processors(
            logit_bias=dict(p.logit_bias) if p.logit_bias else None,
            repetition_penalty=p.repetition_penalty,
            repetition_context_size=p.repetition_context_size,
            presence_penalty=p.presence_penalty,
            presence_context_size=p.presence_context_size,
            frequency_penalty=p.frequency_penalty,
            frequency_context_size=p.frequency_context_size,
        )

    def process(self, row: mx.array) -> mx.array:
        if self.procs:  # as GenerationBatch._step: only rows with processors keep a context
            context = self.buffer.update_and_fetch(mx.array([self.input]))
            for proc in self.procs:
                row = proc(context, row)
        if self.generated < self.params.min_tokens:
            stops = list(self.params.stop_token_ids) + list(EOS)
            out = np.array(row.astype(mx.float32))
            out[0, stops] = -math.inf
            row = mx.array(out).astype(row.dtype)
        return row

    def advance(self, token: int) -> None:
        self.input, self.generated = token, self.generated + 1


class Batch:
    """A batch on both paths, rows joining and leaving as mlx-lm's batch does."""

    def __init__(self, vocab: int, dtype: mx.Dtype, seed: int) -> None:
        self.vocab, self.dtype = vocab, dtype
        self.rng = np.random.default_rng(seed)
        self.refs: list[Reference] = []
        self.params: list[LP | None] = []
        self.history = TokenHistory.empty()
        self.rows = LogitsRows.from_params([], vocab, EOS)

    def join(self, prompts: Sequence[Sequence[int]], params: Sequence[LP | None]) -> None:
        sizes = [p.context_size if p else 0 for p in params]
        new = TokenHistory.from_prompts(prompts, sizes, vocab_size=self.vocab)
        self.history = self.history.extend(new)
        self.refs += [Reference(t, p) for t, p in zip(prompts, params, strict=True)]
        self.params += list(params)
        self.rows = LogitsRows.from_params(self.params, self.vocab, EOS)

    def keep(self, keep: Sequence[int]) -> None:
        self.history = self.history.select(keep)
        self.refs = [self.refs[i] for i in keep]
        self.params = [self.params[i] for i in keep]
        self.rows = LogitsRows.from_params(self.params, self.vocab, EOS)

    def step(self, scale: float = 3.0, token_range: int = 8) -> None:
        b = len(self.refs)
        logits = mx.array(self.rng.normal(size=(b, self.vocab)) * scale).astype(self.dtype)
        want = mx.concatenate([r.process(logits[i : i + 1]) for i, r in enumerate(self.refs)])
        got = apply(logits, self.history, self.rows)
        assert got.dtype == logits.dtype
        if not mx.array_equal(got, want).item():
            diff = np.argwhere(
                np.array(got.astype(mx.float32)) != np.array(want.astype(mx.float32))
            )
            raise AssertionError(f"rows/tokens that differ: {diff.tolist()}")
        # Tokens from a small range, so windows hold repeats.
        tokens = self.rng.integers(0, min(token_range, self.vocab), size=b)
        self.history = self.history.append(mx.array(tokens, dtype=mx.uint32))
        for r, t in zip(self.refs, tokens.tolist(), strict=True):
            r.advance(t)


MIXED = [
    LP(
        repetition_penalty=1.3,
        repetition_context_size=5,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        frequency_context_size=7,
        logit_bias={3: 2.0, 7: -1.5, 0: 100.0},
    ),
    None,
    LP(frequency_penalty=-0.4, logit_bias={0: 5.0}),
    LP(repetition_penalty=0.8, presence_penalty=-1.0, presence_context_size=3),
    LP(),
    LP(repetition_penalty=1.1, repetition_context_size=40),
    LP(logit_bias={49: -100.0, 1: 0.5}, min_tokens=3, stop_token_ids=(5, 6)),
]


def _prompts(rng: np.random.Generator, lengths: Sequence[int], hi: int = 10) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, hi, size=n)] for n in lengths]


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_matches_mlx_lm_row_by_row(dtype: mx.Dtype) -> None:
    batch = Batch(vocab=50, dtype=dtype, seed=0)
    # Prompts shorter and longer than the context sizes; one of a single token.
    batch.join(_prompts(batch.rng, [12, 3, 1, 30, 4, 60, 2]), MIXED)
    for _ in range(25):
        batch.step()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_leaving_and_joining_keep_their_own_history(dtype: mx.Dtype) -> None:
    batch = Batch(vocab=50, dtype=dtype, seed=1)
    batch.join(_prompts(batch.rng, [9, 25, 4]), MIXED[:3])
    for _ in range(4):
        batch.step()
    batch.keep([2, 0])  # reordered, as a filter after removals can leave them
    batch.step()
    # Wider contexts join: the kept rows' narrower windows are padded, not mixed up.
    batch.join(_prompts(batch.rng, [50, 7]), [MIXED[5], MIXED[3]])
    for _ in range(5):
        batch.step()
    batch.keep([3])
    batch.join(_prompts(batch.rng, [6]), [MIXED[6]])
    for _ in range(6):
        batch.step()
    batch.keep([])
    assert batch.history.batch_size == 0


def test_a_batch_that_asks_nothing_is_untouched() -> None:
    params = [None, LP(), LP(repetition_penalty=1.0, presence_penalty=0.0), LP(min_tokens=4)]
    rows = LogitsRows.from_params(params, 16)  # min_tokens with no stop and no EOS ids
    assert not rows.any_active and rows.width == 0
    history = TokenHistory.from_prompts([[1, 2]] * 4, [0] * 4, vocab_size=16)
    logits = mx.zeros((4, 16))
    assert apply(logits, history, rows) is logits


def test_min_tokens_masks_stop_and_eos_until_reached() -> None:
    rows = LogitsRows.from_params(
        [LP(min_tokens=2, stop_token_ids=(7,)), LP(), LP(min_tokens=1)], 10, eos_token_ids={2, 3}
    )
    history = TokenHistory.from_prompts([[1], [1], [1]], [0, 0, 0], vocab_size=10)
    logits = mx.zeros((3, 10))
    masked = []
    for _ in range(3):
        out = np.array(apply(logits, history, rows))
        masked.append([sorted(np.flatnonzero(np.isinf(r)).tolist()) for r in out])
        history = history.append(mx.zeros((3,), dtype=mx.uint32))
    assert masked == [[[2, 3, 7], [], [2, 3]], [[2, 3, 7], [], []], [[], [], []]]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_big_window_and_big_bias_table(dtype: mx.Dtype) -> None:
    # 300 bias entries x a 400-token window: past the pairwise lookup, so the
    # repetition penalty reads the biased logits another way; same numbers.
    rng = np.random.default_rng(3)
    bias = {
        int(t): float(v)
        for t, v in zip(rng.choice(500, 300, replace=False), rng.uniform(-5, 5, 300), strict=True)
    }
    batch = Batch(vocab=500, dtype=dtype, seed=3)
    params = [LP(repetition_penalty=1.2, repetition_context_size=400, logit_bias=bias), None]
    batch.join(_prompts(rng, [600, 10], hi=500), params)
    for _ in range(3):
        batch.step(token_range=500)


def test_keys_wider_than_int32() -> None:
    # (V + 1) * W past 2**31: the window sort falls back to int64 keys.
    batch = Batch(vocab=600_000, dtype=mx.float32, seed=4)
    params = [LP(repetition_penalty=1.5, repetition_context_size=4096, presence_penalty=1.0)]
    batch.join(_prompts(batch.rng, [5000], hi=600_000), params)
    batch.step(token_range=600_000)


penalties = st.one_of(st.just(0.0), st.floats(-2, 2, allow_nan=False))
params_st = st.one_of(
    st.none(),
    st.builds(
        LP,
        repetition_penalty=st.one_of(st.none(), st.just(1.0), st.floats(0.05, 5)),
        repetition_context_size=st.integers(1, 12),
        presence_penalty=penalties,
        presence_context_size=st.integers(1, 12),
        frequency_penalty=penalties,
        frequency_context_size=st.integers(1, 12),
        logit_bias=st.one_of(
            st.none(), st.dictionaries(st.integers(0, 15), st.floats(-100, 100), max_size=5)
        ),
        min_tokens=st.integers(0, 3),
        stop_token_ids=st.lists(st.integers(0, 15), max_size=3).map(tuple),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    params=st.lists(params_st, min_size=1, max_size=5),
    lengths=st.lists(st.integers(1, 20), min_size=5, max_size=5),
    steps=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_any_mix_matches_mlx_lm(
    params: list[LP | None], lengths: list[int], steps: int, dtype: mx.Dtype, seed: int
) -> None:
    batch = Batch(vocab=16, dtype=dtype, seed=seed)
    batch.join(_prompts(batch.rng, lengths[: len(params)], hi=16), params)
    for i in range(steps):
        batch.step(token_range=16)
        if i == 1 and len(params) > 1:
            batch.keep(list(range(len(params)))[::-2])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"presence_context_size": 4097}, "presence_context_size"),
        ({"frequency_context_size": 2.0}, "frequency_context_size"),
        ({"logit_bias": {1: 101}}, "logit_bias[1]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias key"),
        ({"logit_bias": {"5": 1.0, 5: 2.0}}, "logit_bias key"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
    ],
)
def test_bad_params_name_the_field_and_value(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field.replace('[', '.').replace(']', '.')}="):
        LP(**kwargs)  # type: ignore[arg-type]


def test_params_normalize() -> None:
    p = LP(logit_bias={"7": 1, 3: -0.0}, stop_token_ids=[4, 5], presence_penalty=None)  # type: ignore[arg-type]
    assert dict(p.logit_bias or {}) == {3: 0.0, 7: 1.0} and p.stop_token_ids == (4, 5)
    assert p.presence_penalty == 0.0 and p.context_size == 0 and p.active
    assert LP(logit_bias={}).logit_bias is None and not LP(logit_bias={}).active
    assert LP(frequency_penalty=0.1, frequency_context_size=64).context_size == 64
    assert hash(LP(logit_bias={1: 1.0})) == hash(LP(logit_bias={1: 1.0}))


def test_token_ids_past_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match=r"params\[1\]\.logit_bias"):
        LogitsRows.from_params([None, LP(logit_bias={16: 1.0})], 16)
    with pytest.raises(ValueError, match=r"params\[0\]\.stop_token_ids"):
        LogitsRows.from_params([LP(min_tokens=1)], 16, eos_token_ids=[16])
    with pytest.raises(ValueError, match=r"prompts\[1\] token 16"):
        TokenHistory.from_prompts([[1], [16]], [4, 4], vocab_size=16)


def test_apply_refuses_mismatched_shapes() -> None:
    rows = LogitsRows.from_params([LP(presence_penalty=1.0, presence_context_size=8)], 16)
    narrow = TokenHistory.from_prompts([[1, 2]], [4], vocab_size=16)
    with pytest.raises(ValueError, match="history width 4"):
        apply(mx.zeros((1, 16)), narrow, rows)
    with pytest.raises(ValueError, match="want"):
        apply(mx.zeros((1, 17)), narrow.fit(8), rows)


def test_history_window() -> None:
    h = TokenHistory.from_prompts([[1, 2, 3, 4], [5], []], [3, 2, 0], vocab_size=10)
    assert h.tokens.tolist() == [[2, 3, 4], [-1, -1, 5], [-1, -1, -1]]
    h = h.append(mx.array([7, 8, 9]))
    assert h.tokens.tolist() == [[3, 4, 7], [-1, 5, 8], [-1, -1, 9]]
    assert h.generated.tolist() == [1, 1, 1]
    assert h.fit(2).tokens.tolist() == [[4, 7], [5, 8], [-1, 9]]
    assert h.fit(4).tokens.tolist()[1] == [-1, -1, 5, 8]
    other = TokenHistory.from_prompts([[6, 6, 6, 6, 6]], [5], vocab_size=10)
    both = h.select([1]).extend(other)
    assert both.tokens.tolist() == [[-1, -1, -1, 5, 8], [6, 6, 6, 6, 6]]
    assert both.generated.tolist() == [1, 0]
    none = TokenHistory.from_prompts([[1]], [0], vocab_size=10).append(mx.array([3]))
    assert none.width == 0 and none.generated.tolist() == [1]
    with pytest.raises(ValueError, match="rows="):
        h.select([3])
