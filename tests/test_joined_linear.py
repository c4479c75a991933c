"""Projections of one input as one quantized product (mlxq.worker.joined_linear) in the
worker's decode pass (mlxq.worker.fused_pass), on tiny random models quantized to 4 bits:
each part the very product it was, the pass's logits those of the model's own calls, and
an engine's tokens those of mlx-lm's call of a token a row."""

from __future__ import annotations

import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from kvcheck import decode_matches  # noqa: E402
from mlx_lm.models import llama, qwen2  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxq.producer.params import GenerationRequest, SamplingParams  # noqa: E402
from mlxq.worker import joined_linear  # noqa: E402
from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.fused_pass import fused_pass  # noqa: E402
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402

DIMS = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 1024,
}


def _qwen2(quantize: bool = True) -> qwen2.Model:
    """Qwen2's layout: its query, key and value projections have biases."""
    mx.random.seed(3)
    model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **DIMS))
    for layer in model.layers:  # random biases, so a part's bias is seen in its logits
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            p.bias = mx.random.normal(p.bias.shape) * 0.5
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _llama() -> llama.Model:
    mx.random.seed(4)
    model = llama.Model(llama.ModelArgs(model_type="llama", **DIMS))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_each_part_of_a_joined_product_is_its_own_product_and_the_modules_keep_views():
    model = _qwen2()
    attn = model.layers[0].self_attn
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    before = [p(x) for p in parts]
    joined = joined_linear.join(parts)
    assert joined is not None and joined.widths == (64, 32, 32)
    for want, got, p in zip(before, joined(x), parts, strict=True):
        assert mx.array_equal(want, got).item()
        assert mx.array_equal(want, p(x)).item()  # the module's own call, through its view
    assert mx.array_equal(attn.k_proj.weight, joined.weight[64:96]).item()


def test_projections_of_other_quantizations_or_none_are_not_joined():
    model = _qwen2(quantize=False)
    attn = model.layers[0].self_attn
    assert joined_linear.join([attn.q_proj, attn.k_proj, attn.v_proj]) is None
    q = nn.QuantizedLinear(64, 64, group_size=32, bits=4)
    k = nn.QuantizedLinear(64, 32, group_size=64, bits=4)
    assert joined_linear.join([q, k]) is None
    attn = _qwen2().layers[0].self_attn  # a bias on some parts only: left apart
    del attn.k_proj["bias"]
    assert joined_linear.join_attention(attn) is None


@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_a_decode_pass_with_joined_projections_gives_the_models_logits(make):
    """Three left-padded rows decoding four tokens, then a new row's prompt in the same
    pass: the logits of the model's own calls."""
    model = make()
    fused = fused_pass(model)
    assert fused is not None
    assert len(fused.gate_up) == 2 and all(fused.gate_up)
    assert len(fused.qkv) == 2 and all(fused.qkv)
    # Qwen2's biased parts come out as three; Llama's bare queries and keys as one part,
    # for one rotary embedding over both.
    want = (64, 32, 32) if make is _qwen2 else (96, 32)
    assert all(j.widths == want for j in fused.qkv)
    theirs, ours = decode_matches(model, fused, atol=1e-4)
    tokens, prompt = mx.array([3, 4, 5]), [20, 21, 22, 23, 24]
    new_theirs, new_ours = make_prompt_cache(model), make_prompt_cache(model)
    want_rows = model(tokens[:, None], cache=theirs)[:, -1, :]
    want_new = model(mx.array([prompt]), cache=new_theirs)[:, -1, :]
    got_rows, got_new = fused(tokens, ours, prompt, new_ours)
    assert mx.allclose(got_rows, want_rows, atol=1e-4).item()
    assert mx.allclose(got_new, want_new, atol=1e-4).item()


def test_the_environment_keeps_projections_apart(monkeypatch):
    monkeypatch.setenv(joined_linear.ENV, "0")
    fused = fused_pass(_qwen2())
    assert fused is not None and fused.qkv == () and fused.gate_up == ()


def test_joins_that_fail_leave_the_pass_unjoined(monkeypatch, caplog):
    """A model whose projections cannot be joined (here: the join raises) keeps the fused
    pass, unjoined, and says why; the worker does not fail to start."""

    def refuse(mlp):
        raise ValueError("no join here")

    monkeypatch.setattr(joined_linear, "join_mlp", refuse)
    fused = fused_pass(_qwen2())
    assert fused is not None and fused.qkv == () and fused.gate_up == ()
    assert "joined projections: ValueError: no join here; not used" in caplog.text


class _GeluMLP(qwen2.MLP):
    def __call__(self, x):
        return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))


def test_an_mlp_that_is_not_swiglu_keeps_its_own_call():
    model = _llama()
    for layer in model.layers:
        mlp = _GeluMLP(64, 128)
        nn.quantize(mlp, group_size=32, bits=4)
        layer.mlp = mlp
    mx.eval(model.parameters())
    fused = fused_pass(model)
    assert fused is not None and fused.gate_up == ()


@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_an_engine_with_joined_projections_emits_mlx_lms_tokens(tiny_model, make):
    """The tiny model's tokenizer over quantized Qwen2- and Llama-shaped models: greedy
    and seeded rows joining a busy batch and leaving it, the same tokens as mlx-lm's own
    call."""
    _, tok = mlx_lm.load(str(tiny_model))
    model = make()
    reqs = {
        "g0": GenerationRequest(prompt="Hi", max_tokens=9),
        "g1": GenerationRequest(prompt="The harbour at dawn", max_tokens=14),
        "s0": GenerationRequest(
            prompt="gulls over the quay",
            max_tokens=12,
            sampling=SamplingParams(temperature=0.9, seed=5),
        ),
    }

    def run(one_sequence: bool) -> dict[str, list[int]]:
        engine = Engine(model, tok, max_batch=8, one_sequence=one_sequence)
        assert (engine.fused is not None and bool(engine.fused.qkv)) is one_sequence
        jobs = {n: Job(n, r, engine.encode(r)) for n, r in reqs.items()}
        for j in jobs.values():
            j.start("exec")
        engine.add([jobs["g0"]])
        apply_deltas(engine.step())
        engine.add([jobs["g1"], jobs["s0"]])
        while engine.active:
            apply_deltas(engine.step())
        return {n: j.token_ids for n, j in jobs.items()}

    assert run(True) == run(False)
