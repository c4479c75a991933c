"""A batch's tokens as one sequence through the model (mlxq.worker.fused_pass), on the
tiny model: the same logits as the model's own calls, and the same tokens from a worker's
engine that decodes so."""

from __future__ import annotations

import dataclasses

import pytest

mlx_lm = pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from kvcheck import decode_matches, left_padded_batch  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxq.producer.params import GenerationRequest, SamplingParams  # noqa: E402
from mlxq.worker.engine import Engine  # noqa: E402
from mlxq.worker.fused_pass import (  # noqa: E402
    COMPILED_ENV,
    HEAD_ROWS_ENV,
    fused_pass,
    head_in_parts,
    head_rows,
)
from mlxq.worker.jobs import Job, apply_deltas  # noqa: E402
from mlxq.worker.kv_pack import filter_rows  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model))


def test_decode_steps_as_one_sequence_give_the_models_logits(loaded):
    model = loaded[0]
    fused = fused_pass(model)
    assert fused is not None
    theirs, ours = decode_matches(model, fused, atol=1e-5)
    for a, b in zip(theirs, ours, strict=True):
        assert a._idx == b._idx and mx.array_equal(a.offset, b.offset).item()
        assert mx.allclose(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :], atol=1e-5).item()
    # One offsets array for every layer, the step's sum computed once; a leave keeps it one.
    assert all(c.offset is ours[0].offset for c in ours)
    filter_rows(ours, [0, 2], [6 + 4, 3 + 4])  # rows 0 and 2: their prompts and 4 steps
    for c in theirs:
        c.filter([0, 2])
    assert all(c.offset is ours[0].offset for c in ours)
    for a, b in zip(theirs, ours, strict=True):
        assert a._idx == b._idx and mx.array_equal(a.offset, b.offset).item()
        assert mx.array_equal(a.left_padding, b.left_padding).item()


def test_a_decode_steps_layers_compiled_give_the_logits_built_op_by_op(loaded, monkeypatch):
    """Each layer's work before and after attention as compiled functions (off by default,
    ``MLXQ_COMPILED_LAYERS=1`` turns them on): the very logits of the same layers built
    op by op, step after step and at a new count of rows."""
    model = loaded[0]
    default = fused_pass(model)
    assert default is not None and not default.compiled and "compiled" not in default.describe()
    monkeypatch.setenv(COMPILED_ENV, "1")
    fused = fused_pass(model)
    assert fused is not None and fused.compiled and "layers compiled" in fused.describe()
    plain = dataclasses.replace(fused, compiled=())
    for rows in (3, 2):  # a new count of rows: traced again
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]][:rows]
        ours, theirs = left_padded_batch(model, prompts), left_padded_batch(model, prompts)
        tokens = mx.array([3, 4, 5][:rows])
        for _ in range(3):
            got, want = fused.decode(tokens, ours), plain.decode(tokens, theirs)
            assert mx.array_equal(got, want).item()
            tokens = mx.argmax(want, axis=-1)


class CountingHead:
    """The model's head, counting its products and the rows of each."""

    def __init__(self, head):
        self.head, self.rows = head, []

    def __call__(self, h):
        self.rows.append(h.shape[1])
        return self.head(h)


@pytest.mark.parametrize(
    ("rows", "part", "products"),
    [(65, 64, [64, 1]), (70, 64, [64, 6]), (72, 64, [72]), (64, 64, [64]), (65, 0, [65]),
     (5, 64, [5]), (130, 64, [128, 2])],
)  # fmt: skip
def test_the_head_in_parts_gives_the_one_products_logits(loaded, rows, part, products):
    """Rows a few past a full part run apart (MLX's CUDA backend tiles its 4-bit products
    by 64 rows); anything else is one product. The logits are the same either way."""
    model = loaded[0]
    fused = fused_pass(model)
    assert fused is not None
    h = mx.random.normal((1, rows, model.args.hidden_size), key=mx.random.key(rows))
    counted = CountingHead(fused.head)
    got = head_in_parts(counted, h, part)
    assert counted.rows == products
    want = fused.head(h)[0]
    assert got.shape == want.shape == (rows, model.args.vocab_size)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_the_heads_parts_are_off_on_a_cpu_and_the_environment_may_say(monkeypatch, caplog):
    monkeypatch.delenv(HEAD_ROWS_ENV, raising=False)
    assert head_rows() == 0  # MLX on this machine's CPU: no tiles to fill
    monkeypatch.setenv(HEAD_ROWS_ENV, "64")
    assert head_rows() == 64
    monkeypatch.setenv(HEAD_ROWS_ENV, "lots")
    assert head_rows() == 0
    assert "MLXQ_HEAD_ROWS='lots': not a count of rows" in caplog.text


def test_a_decode_step_of_65_rows_with_the_head_in_parts_gives_the_same_logits(loaded):
    model = loaded[0]
    fused = fused_pass(model)
    assert fused is not None
    parted = dataclasses.replace(fused, head_rows=64)
    prompts = [[5 + i % 7, 6, 7 + i % 3] for i in range(65)]
    theirs, ours = left_padded_batch(model, prompts), left_padded_batch(model, prompts)
    tokens = mx.arange(65) % 50
    want = fused.decode(tokens, theirs)
    got = parted.decode(tokens, ours)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_new_rows_prompt_shares_the_decode_steps_pass(loaded):
    model = loaded[0]
    fused = fused_pass(model)
    assert fused is not None
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    theirs, ours = left_padded_batch(model, prompts), left_padded_batch(model, prompts)
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


@pytest.mark.parametrize("buckets", [False, True], ids=["unpadded", "bucketed"])
def test_a_row_prefilled_in_the_batchs_decode_pass_decodes_as_in_a_pass_of_its_own(loaded, buckets):
    """A chat row that starts alone beside a busy batch runs its prompt in the batch's
    decode pass: no pass of its own, its first token out of that very call, and the same
    tokens and log-probs as a prefill of its own gives (greedy, seeded, one token only, a
    stop string, a prompt cache keeping what ends; a prompt padded to a bucketed width)."""
    model, tok = loaded
    chats = {
        "greedy": GenerationRequest(prompt="A chat turn arrives", max_tokens=9),
        "seeded": GenerationRequest(
            prompt="The harbour at dawn, gulls over the quay",
            max_tokens=7,
            sampling=SamplingParams(temperature=0.9, seed=3),
        ),
        "one": GenerationRequest(prompt="Just one token", max_tokens=1),
        "stop": GenerationRequest(prompt="Stop early", max_tokens=12, stop=["e"]),
    }
    chats = {n: dataclasses.replace(r, logprobs=True) for n, r in chats.items()}

    def run(one_sequence: bool) -> tuple[dict, int, int]:
        engine = Engine(
            model,
            tok,
            max_batch=8,
            prompt_cache_bytes=1 << 24,
            prefill_buckets=buckets,
            one_sequence=one_sequence,
            fused_prefill=True,
        )
        busy = []
        for i in range(3):
            r = GenerationRequest(prompt=f"Busy row {i}", max_tokens=60)
            busy.append(Job(f"b{i}", r, engine.encode(r)))
            busy[-1].start("exec")
        engine.add(busy)
        apply_deltas(engine.step())
        jobs, at_once = {}, 0
        for n, r in chats.items():
            jobs[n] = Job(n, r, engine.encode(r))
            jobs[n].start("exec")
            engine.add([jobs[n]])
            apply_deltas(engine.step())
            at_once += bool(jobs[n].token_ids)
            for _ in range(2):
                apply_deltas(engine.step())
        while engine.active:
            apply_deltas(engine.step())
        out = {
            n: (
                j.token_ids,
                [e["logprob"] for e in j.choices[0].logprobs or []],
                j.choices[0].finish_reason,
            )
            for n, j in {**jobs, **{j.id: j for j in busy}}.items()
        }
        return out, engine.counters.fused_prefills, at_once

    ours, fused, at_once = run(True)
    theirs, none, at_once_theirs = run(False)
    assert fused == len(chats) and none == 0
    assert at_once == at_once_theirs == len(chats)
    assert len(ours["one"][0]) == 1 and ours["one"][2] == "length"
    for n, (tokens, lps, finish) in ours.items():
        assert tokens == theirs[n][0] and finish == theirs[n][2], n
        assert lps == pytest.approx(theirs[n][1], abs=1e-4), n


def test_a_resumed_row_and_a_chat_row_starting_together_decode_as_in_passes_of_their_own(
    loaded,
):
    """A paused row put back (it rides: its next input is its last token) and a chat row
    added in the same call, then another chat row while the resumed one rides: every row's
    tokens are those of the engine without the fused pass."""
    model, tok = loaded

    def run(one_sequence: bool) -> tuple[dict[str, list[int]], int]:
        engine = Engine(model, tok, max_batch=8, one_sequence=one_sequence, fused_prefill=True)
        jobs = {}

        def add(name: str, prompt: str, n: int, **sp) -> None:
            r = GenerationRequest(prompt=prompt, max_tokens=n, sampling=SamplingParams(**sp))
            jobs[name] = Job(name, r, engine.encode(r))
            jobs[name].start("exec")
            engine.add([jobs[name]])

        for i in range(3):
            add(f"b{i}", f"Busy row {i} of the sweep", 30)
        for _ in range(3):
            apply_deltas(engine.step())
        assert engine.pause([jobs["b0"]]) == 1
        apply_deltas(engine.step())
        engine.resume([jobs["b0"]])
        add("c0", "A chat turn arrives", 6, temperature=0.8, seed=1)
        apply_deltas(engine.step())
        add("c1", "Another chat turn", 6)
        while engine.active:
            apply_deltas(engine.step())
        return {n: j.token_ids for n, j in jobs.items()}, engine.counters.fused_prefills

    ours, fused = run(True)
    theirs, _ = run(False)
    assert fused >= 1
    assert ours == theirs
