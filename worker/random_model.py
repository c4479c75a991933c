"""Random-weight checkpoints of real model sizes, for benchmarks with no download.

A benchmark that should say how mlxq behaves on a 0.5B model needs a model of
that size: its forward pass sets how long a decode step takes, its
151,936-token vocabulary how much the sampler and the detokenizer cost. The
weights themselves do not matter, so these are random (Qwen2.5's dims in a
Llama layout, 4-bit) with the final norm scaled so that next-token logits are
as peaked as a trained model's. The tokenizer is the tiny model's BPE plus
added tokens ``<x0>``, ``<x1>``, ... up to the vocabulary size, so every id the
model can sample decodes to text. ``mlx_lm.load`` and ``mlxq worker --model``
read the result like any checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.nn.layers.quantized import quantize
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from tokenizers import AddedToken, Tokenizer

from mlxq.worker.tiny import (
    ENDOFTEXT,
    IM_END,
    MAX_SEED,
    _global_rng_restored,
    train_tokenizer,
    write_checkpoint,
)

# Fast on a CPU: a forward pass of a few milliseconds, yet quantized like the others and
# with a vocabulary past the tokenizer's, so padding is exercised.
_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=4096,
)

#: Model dims per shape: 0.5b and 1.5b are Qwen2.5's (without its qkv bias).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": _TINY,
    # The tiny widths with the 0.5B shape's 24 layers: a decode pass's host work (its ops
    # and launches) at a real model's count, its compute still a CPU's.
    "deep": {**_TINY, "num_hidden_layers": 24},
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151_936,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=151_936,
    ),
}
COMMON: dict[str, Any] = {
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}
BITS = (2, 3, 4, 5, 6, 8)
DTYPES = ("float32", "bfloat16", "float16")
GROUP_SIZE = 64
# As in Hugging Face initializers (initializer_range): with tied embeddings a unit
# scale would make the input token dominate the final hidden state, so the model
# would predict "repeat the last token" with probability ~1.
EMBED_STD = 0.02
PAD_TOKEN = "<x{}>"
# The logit std is measured on this many random prompts of this length.
PROBE_SHAPE = (8, 16)


def padded_tokenizer(vocab_size: int) -> Tokenizer:
    """The tiny model's BPE tokenizer plus ``<x0>``, ``<x1>``, ... up to ``vocab_size`` ids.

    Raises:
        ValueError: ``vocab_size`` is smaller than the BPE vocabulary.
    """
    tok = train_tokenizer()
    have = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < have:
        raise ValueError(f"vocab_size={vocab_size}: must be at least {have}")
    # Not special and not normalized: they decode to their own text, as any word does.
    tok.add_tokens(
        [
            AddedToken(PAD_TOKEN.format(i), special=False, normalized=False)
            for i in range(vocab_size - have)
        ]
    )
    return tok


def model_config(shape: str, tokenizer: Tokenizer, bits: int | None, dtype: str) -> dict[str, Any]:
    """The ``config.json`` contents for ``shape``; ``quantization`` as mlx-lm writes it."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **SHAPES[shape],
        **COMMON,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "torch_dtype": dtype,
    }
    if bits is not None:
        quant = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        # mlx-lm reads "quantization"; Hugging Face tools look for "quantization_config".
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)
    return config


def random_model(
    config: dict[str, Any], seed: int, logit_std: float, eos_reachable: bool = True
) -> Model:
    """The model ``config`` describes with random weights, a pure function of ``seed``.

    Draws every tensor from its own key split from ``seed`` (the caller's global
    RNG is left as it was), quantizes if ``config`` says so, then scales the
    final norm so next-token logits on random prompts have std ``logit_std``.
    """
    dtype = getattr(mx, config["torch_dtype"])
    with _global_rng_restored():
        # Its own init stays lazy and is never evaluated: load_weights replaces it.
        model = Model(ModelArgs.from_dict(config))
    shapes = {
        name: tuple(p.shape)
        for name, p in cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    }
    names = sorted(shapes)
    weight_key, probe_key = mx.random.split(mx.random.key(seed))
    keys = mx.random.split(weight_key, len(names))
    weights = []
    for name, key in zip(names, keys, strict=True):
        shape = shapes[name]
        if len(shape) == 1:  # RMSNorm scales: identity, as in a fresh model.
            weights.append((name, mx.ones(shape, dtype=dtype)))
            continue
        # Linear (out, in) keeps activations at unit scale.
        std = EMBED_STD if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(shape[1])
        w = mx.random.normal(shape, dtype=dtype, key=key) * std
        if name.endswith("embed_tokens.weight") and not eos_reachable:
            # A zero row gives end-of-sequence a logit of exactly 0, far below every
            # nucleus (logits have std logit_std): jobs then run to max_tokens.
            w[config["eos_token_id"]] = 0
        weights.append((name, w))
    model.load_weights(weights)
    if "quantization" in config:
        q = config["quantization"]
        with _global_rng_restored():  # quantized layers draw an init, then replace it
            quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
    mx.eval(model.parameters())
    # Logits are linear in the final norm's scale, so one measurement sets it.
    ids = mx.random.randint(0, config["vocab_size"], PROBE_SHAPE, key=probe_key)
    # Only the last position's logits: the vocabulary-wide head is most of the cost.
    hidden = model.model(ids)[:, -1]
    std = float(model.model.embed_tokens.as_linear(hidden).astype(mx.float32).std())
    norm = model.model.norm
    norm.weight = (norm.weight * (logit_std / max(std, 1e-6))).astype(dtype)
    mx.eval(model.parameters())
    return model


def _check_args(shape: str, bits: int | None, dtype: str, seed: int, logit_std: float) -> None:
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: must be one of {', '.join(SHAPES)}")
    if bits is not None and bits not in BITS:
        raise ValueError(f"bits={bits!r}: must be None or one of {BITS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r}: must be an int between 0 and {MAX_SEED}")
    if not (isinstance(logit_std, (int, float)) and math.isfinite(logit_std) and logit_std > 0):
        raise ValueError(f"logit_std={logit_std!r}: must be a finite number > 0")


def build_random_model(
    out_dir: str | Path,
    shape: str = "0.5b",
    bits: int | None = 4,
    dtype: str = "bfloat16",
    seed: int = 0,
    logit_std: float = 5.0,
    eos_reachable: bool = True,
) -> Path:
    """Write a random-weight checkpoint of a real model's size in the Hugging Face layout.

    Files written: ``config.json``, ``generation_config.json``, ``model.safetensors``,
    ``tokenizer.json`` and ``tokenizer_config.json`` (with the tiny model's chat
    template); others in ``out_dir`` are left alone. The same arguments give
    byte-identical files on the same machine. The 0.5b shape took about five
    minutes to build on a 2-core CPU, where half-precision quantized matmuls are slow.

    Args:
        out_dir: Directory to write into; created (with parents) if missing.
        shape: ``"tiny"`` (fast on a CPU, 4,096 tokens), ``"deep"`` (tiny's widths,
            24 layers: a pass's host work at a real model's count of ops), ``"0.5b"`` or
            ``"1.5b"`` (Qwen2.5's dims and its 151,936-token vocabulary).
        bits: Bits per weight for mlx's affine quantization (group size 64);
            None keeps the weights in ``dtype``.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the weights'
            dtype (the quantization scales' when quantized).
        seed: Non-negative integer that determines the weights.
        logit_std: Std of next-token logits on random prompts; 5 gives top_p=0.9
            nuclei of tens of tokens, like a trained model's, where random
            weights alone give a near-uniform distribution.
        eos_reachable: False makes end-of-sequence unreachable by any of the usual
            sampling params, so benchmarks compare runs of equal length.

    Returns:
        The output directory as a ``Path``.

    Raises:
        ValueError: An argument is out of range (the message names it), or
            ``out_dir`` exists and is not a directory.
    """
    _check_args(shape, bits, dtype, seed, logit_std)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = padded_tokenizer(SHAPES[shape]["vocab_size"])
    config = model_config(shape, tokenizer, bits, dtype)
    if not eos_reachable:
        config["eos_reachable"] = False  # read by nothing but whoever reuses the directory
    model = random_model(config, seed, float(logit_std), eos_reachable)
    weights = dict(cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())))
    # Unindented: a 151,936-token vocabulary makes an indented tokenizer.json large.
    write_checkpoint(out, weights, tokenizer, config, pretty=False)
    return out
