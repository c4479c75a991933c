"""The random real-sized checkpoint must load, decode every id and serve jobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

from mlxq.producer import Client
from mlxq.worker.random_model import SHAPES, build_random_model
from mlxq.worker.tiny import IM_END

VOCAB = SHAPES["tiny"]["vocab_size"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("random") / "m", shape="tiny", seed=0)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(model_dir))[:2]
    return model, tokenizer


def test_config_is_quantized_as_mlx_lm_writes_it(model_dir: Path, loaded: tuple[Any, Any]) -> None:
    config = json.loads((model_dir / "config.json").read_text("utf-8"))
    assert config["vocab_size"] == VOCAB
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, _ = loaded
    assert type(model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"


def test_vocabularies_match(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    assert len(tokenizer.vocab) == VOCAB
    logits = model(mx.array([tokenizer.encode("the river")]))
    assert logits.shape[-1] == VOCAB
    assert tokenizer.eos_token_ids == {tokenizer.vocab[IM_END]}


def test_every_id_decodes(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    texts = [tokenizer.decode([i]) for i in range(VOCAB)]
    assert all(texts), [i for i, t in enumerate(texts) if not t][:10]
    assert texts[VOCAB - 1] == f"<x{VOCAB - 1 - 1024}>"
    # The worker streams through mlx-lm's detokenizer: padding ids must pass it too.
    detok = tokenizer.detokenizer
    detok.reset()
    for i in (VOCAB - 1, 5, 1500):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "".join(tokenizer.decode([i]) for i in (VOCAB - 1, 5, 1500))


def test_logits_are_as_peaked_as_asked(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    ids = mx.array([tokenizer.encode("a quiet harbor in winter, the copper lamp")])
    std = float(model(ids)[0, -1].astype(mx.float32).std())
    # Measured on other (random) prompts, so only roughly 5 here; deterministic.
    assert 2.5 < std < 10


def test_top_p_nuclei_are_tens_of_tokens(loaded: tuple[Any, Any]) -> None:
    # Not "repeat the last token" with probability ~1 (what tied embeddings of unit
    # scale give), nor near-uniform (what random weights alone give).
    model, tokenizer = loaded
    prompts = [f"{w} harbor lamp under the old {w}" for w in ("river", "stone", "city", "train")]
    last = [model(mx.array([tokenizer.encode(p)]))[0, -1] for p in prompts]
    logprobs = nn.log_softmax(mx.stack(last).astype(mx.float32))
    probs = np.sort(np.exp(np.array(logprobs)), axis=-1)[:, ::-1]
    nuclei = ((np.cumsum(probs, -1) - probs) < 0.9).sum(-1)
    assert all(2 <= n <= 500 for n in nuclei), nuclei


def test_same_seed_same_bytes(model_dir: Path, tmp_path: Path) -> None:
    again = build_random_model(tmp_path / "again", shape="tiny", seed=0)
    other = build_random_model(tmp_path / "other", shape="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors"
    ).read_bytes()


def test_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    mx.random.seed(123)
    expected = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(123)
    build_random_model(tmp_path / "m", shape="tiny", seed=3)
    assert mx.random.uniform(shape=(4,)).tolist() == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"shape": "7b"}, "shape"),
        ({"bits": 7}, "bits"),
        ({"dtype": "int8"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"logit_std": 0.0}, "logit_std"),
    ],
)
def test_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build_random_model(tmp_path / "m", **{"shape": "tiny", **kwargs})
    assert not (tmp_path / "m").exists()


@pytest.mark.e2e
def test_worker_serves_it(
    model_dir: Path, redis_server: Any, queue_name: str, start_worker: Any
) -> None:
    start_worker(model=model_dir, max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    jobs = client.submit_many(
        [
            dict(prompt="The old lighthouse", max_tokens=12, temperature=0.7, top_p=0.9, seed=1),
            dict(prompt="On a quiet morning", max_tokens=12, temperature=0.0),
        ]
    )
    for job in jobs:
        streamed = "".join(c.text for c in job.stream(timeout=60))
        res = job.result(timeout=60)
        assert res.finish_reason in ("stop", "length")
        assert 1 <= res.usage["completion_tokens"] <= 12
        assert streamed == res.text
