"""A model's body and head apart (mlxq.worker.model_head), on the tiny model."""

from __future__ import annotations

from typing import Any

import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxq.worker.model_head import model_head  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_model):
    return mlx_lm.load(str(tiny_model))[0]


def test_the_heads_logits_at_each_rows_last_position_are_the_models(model):
    split = model_head(model)
    assert split is not None
    x = mx.array([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    want = model(x, cache=make_prompt_cache(model))
    got = split.last_logits(x, make_prompt_cache(model), [4, 2])
    assert got.shape == (2, want.shape[-1])
    assert mx.allclose(got[0], want[0, 4], atol=1e-5).item()
    assert mx.allclose(got[1], want[1, 2], atol=1e-5).item()


class _Capped:
    """The tiny model with a soft cap on its logits, as some models have after the head."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.model, self.layers = inner, inner.model, inner.layers
        self.lm_head = getattr(inner, "lm_head", None)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        return mx.tanh(self.inner(x, cache=cache) / 2) * 2


class _Whole:
    """A model that is one call: no body to run apart."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.layers = inner, inner.layers

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        return self.inner(x, cache=cache)


def test_a_model_that_is_not_its_body_and_head_is_not_split(model, caplog):
    caplog.set_level("INFO", logger="mlxq.worker.model_head")
    assert model_head(_Capped(model)) is None
    assert "does more than its body and head" in caplog.text
    assert model_head(_Whole(model)) is None
    assert "no body and head to split" in caplog.text
