"""A deterministic tiny random-weight Llama checkpoint for tests and demos.

The worker loads models with ``mlx_lm.load``, so tests need a real checkpoint
in the Hugging Face layout. Downloading one is slow and needs a network; this
builds one of under a megabyte offline in well under a second. Its output is
gibberish, but every code path (tokenizer, chat template, KV cache, sampling,
EOS handling, streaming detokenization of multi-byte text) is the real one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trainers put special tokens first, so their ids are 0, 1, 2 in this order.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB_SIZE = 1024
MAX_SEED = 2**63 - 1  # mx.random.key takes a uint64; stay clear of sign issues.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Small enough that a forward pass on CPU takes microseconds, but with more
# than one layer and grouped-query attention so those code paths run too.
MODEL_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# With the default 1/sqrt(fan_in) output scale the logits have std ~1 over
# 1024 tokens, which is nearly uniform; a larger gain gives peaked
# distributions, like a trained model's, so sampling settings visibly matter.
LM_HEAD_GAIN = 4.0


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on the packaged corpus.

    Training is deterministic (same merges and ids in every process), so the
    tokenizer does not depend on the seed and need not be shipped prebuilt.
    """
    corpus = resources.files("mlxq.worker").joinpath("data/corpus.txt").read_text("utf-8")
    tokenizer = Tokenizer(models.BPE())
    # Byte-level everything and no normalizer: any string encodes, and decode
    # gives back exactly the bytes that went in.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # An explicit post-processor stops transformers from installing its own.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def model_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``config.json`` contents for a model paired with ``tokenizer``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_DIMS,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "torch_dtype": "float32",
    }


@contextmanager
def _global_rng_restored() -> Iterator[None]:
    # mlx layers draw their default init from the global key, which cannot be
    # assigned back; but a key is the (high, low) halves of a uint64 seed, so
    # re-seeding with that value restores the caller's random stream exactly.
    key = cast("list[mx.array]", mx.random.state)[0]
    hi, lo = cast("list[int]", key.tolist())
    try:
        yield
    finally:
        mx.random.seed((hi << 32) | lo)


def init_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """Random float32 weights for ``config``, a pure function of ``seed``.

    Uses explicit PRNG keys instead of ``mx.random.seed`` so that building a
    model leaves the caller's global RNG as it was (the worker samples with
    it) and the result does not hinge on the order mlx_lm creates layers in.
    """
    # Instantiate the real model only for its parameter names and shapes, so
    # the checkpoint always matches what mlx_lm.load will build.
    args = ModelArgs(model_type="llama", vocab_size=config["vocab_size"], **MODEL_DIMS)
    with _global_rng_restored():
        flat = cast("list[tuple[str, mx.array]]", tree_flatten(Model(args).parameters()))
    shapes = {name: tuple(p.shape) for name, p in flat}
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights: dict[str, mx.array] = {}
    for name, key in zip(names, keys, strict=True):
        shape = shapes[name]
        if len(shape) == 1:  # RMSNorm scales: identity, as in a fresh model.
            weights[name] = mx.ones(shape, dtype=mx.float32)
            continue
        if name.endswith("embed_tokens.weight"):
            std = 1.0  # Unit scale like each layer's output, so the token isn't drowned out.
        elif name == "lm_head.weight":
            std = LM_HEAD_GAIN / math.sqrt(shape[1])
        else:  # Linear (out, in): keep activations at unit scale.
            std = 1.0 / math.sqrt(shape[1])
        weights[name] = mx.random.normal(shape, dtype=mx.float32, key=key) * std
    mx.eval(weights)
    return weights


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    # Bytes, not text mode, so files are identical on every platform.
    path.write_bytes((json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def write_checkpoint(
    out: Path,
    weights: dict[str, mx.array],
    tokenizer: Tokenizer,
    config: dict[str, Any],
    *,
    pretty: bool = True,
) -> None:
    """Write a checkpoint in the Hugging Face layout that ``mlx_lm.load`` reads, with this
    module's chat template: ``config.json``, ``generation_config.json``,
    ``model.safetensors``, ``tokenizer.json`` (indented when ``pretty``) and
    ``tokenizer_config.json``, into the existing directory ``out``."""
    # Sorted keys keep the safetensors header, and so the file, stable.
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {name: weights[name] for name in sorted(weights)},
        metadata={"format": "mlx"},
    )
    (out / "tokenizer.json").write_bytes(tokenizer.to_str(pretty=pretty).encode("utf-8"))
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": ENDOFTEXT,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "add_prefix_space": False,
            # Its "cleanup" deletes spaces before punctuation, which would
            # break exact round-trips.
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random-weight Llama checkpoint that ``mlx_lm.load`` accepts.

    Files written: ``config.json``, ``generation_config.json``,
    ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.
    Existing files of those names are overwritten; other files are left alone.
    The same seed always gives byte-identical files.

    Args:
        out_dir: Directory to write into; created (with parents) if missing.
        seed: Non-negative integer that determines the weights. The tokenizer
            is the same for every seed.

    Returns:
        The output directory as a ``Path``.

    Raises:
        TypeError: If ``seed`` is not an ``int``.
        ValueError: If ``seed`` is negative or does not fit in 63 bits, or if
            ``out_dir`` exists and is not a directory.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be between 0 and {MAX_SEED}, got {seed}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    config = model_config(tokenizer)
    write_checkpoint(out, init_weights(config, seed), tokenizer, config)
    return out


def build_tiny_model_with_tokenizer(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    seed: int = 0,
    eos_ids: list[int] | None = None,
) -> Path:
    """Write a tiny random-weight Llama checkpoint around a real model's tokenizer.

    The weights are random, but the tokenizer, its chat template, BOS handling and
    end-of-sequence ids are that model's, so what a worker does with text (prompt token
    counts, the text of a completion, stop strings, multi-byte characters) can be checked
    against the tokenizer itself without downloading any weights.

    Args:
        out_dir: Directory to write into; created (with parents) if missing.
        tokenizer_dir: Holds the model's ``tokenizer.json`` and ``tokenizer_config.json``
            (and its ``generation_config.json``, if there is one, for the EOS ids).
        seed: As for :func:`build_tiny_model`.
        eos_ids: The model's end-of-sequence ids (``generation_config.json``'s
            ``eos_token_id``); default: that file's, else the tokenizer's ``eos_token``.

    Returns:
        The output directory as a ``Path``.

    Raises:
        ValueError: A tokenizer file is missing or names no token the vocabulary has.
    """
    src = Path(tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (src / name).is_file():
            raise ValueError(f"tokenizer_dir: {src} has no {name}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok_config = json.loads((src / "tokenizer_config.json").read_text("utf-8"))

    def token_id(field: str) -> int | None:
        tok = tok_config.get(field)
        text = tok.get("content") if isinstance(tok, dict) else tok
        if text is None:
            return None
        i = tokenizer.token_to_id(text)
        if i is None:
            raise ValueError(f"tokenizer_config.json: {field}={text!r} is not in the vocabulary")
        return int(i)

    if eos_ids is None:
        gen = src / "generation_config.json"
        found = json.loads(gen.read_text("utf-8")).get("eos_token_id") if gen.is_file() else None
        eos_ids = [found] if isinstance(found, int) else found or []
        eos_ids = eos_ids or [i for i in [token_id("eos_token")] if i is not None]
    config = model_config(tokenizer)
    bos = token_id("bos_token")
    config.update(bos_token_id=bos, eos_token_id=list(eos_ids), pad_token_id=token_id("pad_token"))
    weights = init_weights(config, seed)
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {name: weights[name] for name in sorted(weights)},
        metadata={"format": "mlx"},
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": bos,
            "eos_token_id": list(eos_ids),
            "pad_token_id": config["pad_token_id"],
        },
    )
    return out
