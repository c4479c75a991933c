"""The tiny checkpoint must load and run through the real mlx_lm stack."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

from mlxq.worker.tiny import IM_END, IM_START, build_tiny_model

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
TEXTS = [
    "Hello, world! The harbor at 10:42 was 3.5 degrees.",
    "  leading spaces, tabs\tand\nnewlines , odd spacing .",
    "naïve café 日本語 😀 Привет Γεια שלום",
    "unseen bytes: \x00\x7f \u200b 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)
    return out


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(model_dir))[:2]
    return model, tokenizer


def _read_all(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_writes_expected_files(model_dir: Path) -> None:
    assert {p.name for p in model_dir.iterdir()} == FILES
    config = json.loads((model_dir / "config.json").read_text("utf-8"))
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text("utf-8"))
    vocab = tokenizer["model"]["vocab"]
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == len(vocab) == 1024
    assert vocab[IM_END] == config["eos_token_id"]


def test_tokenizer_round_trips(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text


def test_multibyte_text_uses_merged_tokens(loaded: tuple[Any, Any]) -> None:
    # The corpus contains these, so BPE must have merged their UTF-8 bytes.
    _, tokenizer = loaded
    for word in ["café", "日本", "です", "Привет"]:
        assert len(tokenizer.encode(word)) < len(word.encode("utf-8"))


def test_streaming_detokenizer_round_trips(loaded: tuple[Any, Any]) -> None:
    # The worker streams text token by token; split multi-byte characters
    # must be held back until complete, not emitted as replacement chars.
    _, tokenizer = loaded
    # mlx_lm 0.32.2 streams a NUL byte as "Ā": _decode_bytes tests the byte
    # value for truth, and 0 is falsy. decode() is right; leave NUL out here.
    for text in (t.replace("\x00", "") for t in TEXTS):
        detok = tokenizer.detokenizer
        detok.reset()
        pieces = []
        for token in tokenizer.encode(text):
            detok.add_token(token)
            pieces.append(detok.last_segment)
        detok.finalize()
        pieces.append(detok.last_segment)
        # mlx_lm drops one leading space at stream start by design (a reply's
        # first token usually carries one); pinned so a change gets noticed.
        expected = text[1:] if text.startswith(" ") else text
        assert "".join(pieces) == expected


def test_special_tokens_and_eos(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_token == IM_END
    assert tokenizer.eos_token_id == eos
    assert tokenizer.eos_token_ids == {eos}
    # One id each: special tokens are never split into byte pieces.
    assert tokenizer.encode(f"{IM_START}{IM_END}") == [
        tokenizer.convert_tokens_to_ids(IM_START),
        eos,
    ]


def test_chat_template(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    bare = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert bare == f"{IM_START}user\nhi{IM_END}\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(ids) == text


def test_generate_runs_and_varies(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    outputs = []
    for prompt in ["The harbor", "Hello", "1 2 3", "café"]:
        ids = mx.array([tokenizer.encode(prompt)])
        tokens = []
        for _ in range(8):
            token = mx.argmax(model(ids)[0, -1]).item()
            assert isinstance(token, int)
            tokens.append(token)
            ids = mx.concatenate([ids, mx.array([[token]])], axis=1)
        outputs.append(tokens)
    # A degenerate init would repeat one token forever, whatever the prompt.
    assert len({t for tokens in outputs for t in tokens}) > 4
    text = mlx_lm.generate(model, tokenizer, prompt="The harbor", max_tokens=8)
    assert isinstance(text, str)
    assert text


def test_same_seed_gives_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _read_all(again) == _read_all(model_dir)


def test_different_seed_changes_only_weights(model_dir: Path, tmp_path: Path) -> None:
    other = _read_all(build_tiny_model(tmp_path / "other", seed=1))
    first = _read_all(model_dir)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }


def test_leaves_global_rng_alone(tmp_path: Path) -> None:
    mx.random.seed(7)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(7)
    build_tiny_model(tmp_path, seed=3)
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected)


def test_creates_missing_parents(tmp_path: Path) -> None:
    out = build_tiny_model(str(tmp_path / "a" / "b"), seed=2)
    assert out == tmp_path / "a" / "b"
    assert {p.name for p in out.iterdir()} == FILES


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_rejects_out_of_range_seed(tmp_path: Path, seed: int) -> None:
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tmp_path, seed=seed)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("seed", [1.0, "1", True])
def test_rejects_non_int_seed(tmp_path: Path, seed: Any) -> None:
    with pytest.raises(TypeError, match="seed"):
        build_tiny_model(tmp_path, seed=seed)


def test_rejects_file_as_out_dir(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        build_tiny_model(target)
