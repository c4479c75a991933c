"""A batch's tokens as one sequence through the model (mlxq.worker.fused_pass), on the
tiny model: the same logits as the model's own calls, and the same tokens from a worker's
engine that decodes so."""

from __future__ import annotations

import dataclasses

import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from mlxq.producer.params import GenerationRequest, SamplingParams  # noqa: E402
from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.fused_pass import fused_pass  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def _batch(model, prompts: list[list[int]]) -> list[BatchKVCache]:
    """A batch's caches after a left-padded prefill of ``prompts``."""
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    caches = [BatchKVCache(pads) for _ in model.layers]
    model(mx.array([[0] * n + p for n, p in zip(pads, prompts, strict=True)]), cache=caches)
    return caches


def test_decode_steps_as_one_sequence_give_the_models_logits(loaded):
    model = loaded[0]
    fused = fused_pass(model)
    assert fused is not None
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    theirs, ours = _batch(model, prompts), _batch(model, prompts)
    tokens = mx.array([3, 4, 5])
    for _ in range(4):
        want = model(tokens[:, None], cache=theirs)[:, -1, :]
        got = fused.decode(tokens, ours)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-5).item()
        tokens = mx.argmax(want, axis=-1)
    for a, b in zip(theirs, ours, strict=True):
        assert a._idx == b._idx and mx.array_equal(a.offset, b.offset).item()
        assert mx.allclose(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :], atol=1e-5).item()


def test_a_new_rows_prompt_shares_the_decode_steps_pass(loaded):
    model = loaded[0]
    fused = fused_pass(model)
    assert fused is not None
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    theirs, ours = _batch(model, prompts), _batch(model, prompts)
    tokens, prompt = mx.array([3, 4]), [20, 21, 22, 23, 24]
    want = model(tokens[:, None], cache=theirs)[:, -1, :]
    new_theirs, new_ours = make_prompt_cache(model), make_prompt_cache(model)
    want_new = model(mx.array([prompt]), cache=new_theirs)[:, -1, :]
    got, got_new = fused(tokens, ours, prompt, new_ours)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert mx.allclose(got_new, want_new, atol=1e-5).item()
    assert new_ours[0].offset == new_theirs[0].offset == len(prompt)


def test_a_model_with_sliding_window_layers_keeps_its_own_call(caplog):
    """A layer that attends to a window needs a mask of its own: not the common layout."""
    caplog.set_level("INFO", logger="mlxq.worker.fused_pass")
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    assert fused_pass(model) is None
    assert "not the common layout" in caplog.text


class _Scaled:
    """The tiny model with its hidden states scaled on the way in, as some models do: its
    own call is not the common layout's, though its parts are all there."""

    def __init__(self, inner) -> None:
        self.inner, self.model, self.layers = inner, inner.model, inner.layers

    def __call__(self, x, cache=None):
        h = self.model.embed_tokens(x) * 2.0
        return self.inner(x, cache=cache, input_embeddings=h)


def test_a_model_whose_call_differs_keeps_its_own_call(loaded, caplog):
    caplog.set_level("INFO", logger="mlxq.worker.fused_pass")
    assert fused_pass(_Scaled(loaded[0])) is None
    assert "differs from its own calls" in caplog.text


def test_an_engine_decoding_as_one_sequence_emits_the_same_tokens(loaded):
    """Greedy and seeded rows of several lengths, joining a busy batch and leaving it: the
    same tokens and log-probs as mlx-lm's call of a token a row."""
    model, tok = loaded
    prompts = ["Hi", "The harbour at dawn", " ".join(["gulls over the quay"] * 5)]
    reqs = {
        f"g{i}": GenerationRequest(prompt=p, max_tokens=8 + 3 * i) for i, p in enumerate(prompts)
    }
    reqs |= {
        f"s{i}": GenerationRequest(
            prompt=p, max_tokens=12, sampling=SamplingParams(temperature=0.9, seed=i)
        )
        for i, p in enumerate(prompts)
    }
    reqs = {n: dataclasses.replace(r, logprobs=True) for n, r in reqs.items()}

    def run(one_sequence: bool) -> dict[str, tuple[list[int], list[float]]]:
        engine = Engine(model, tok, max_batch=8, one_sequence=one_sequence)
        assert (engine.fused is not None) is one_sequence
        jobs = {}
        for n, r in reqs.items():
            jobs[n] = Job(n, r, engine.encode(r))
            jobs[n].start("exec")
        names = list(jobs)
        engine.add([jobs[n] for n in names[:3]])
        for _ in range(3):
            apply_deltas(engine.step())
        engine.add([jobs[n] for n in names[3:]])
        while engine.active:
            apply_deltas(engine.step())
        assert engine.counters.decode_steps > 10
        return {
            n: (j.token_ids, [e["logprob"] for e in j.choices[0].logprobs]) for n, j in jobs.items()
        }

    ours, theirs = run(True), run(False)
    assert {n: t for n, (t, _) in ours.items()} == {n: t for n, (t, _) in theirs.items()}
    for n, (_, lps) in ours.items():
        assert lps == pytest.approx(theirs[n][1], abs=1e-4), n
