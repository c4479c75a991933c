"""A check the engine tests run after each step: every batch layer's left padding is what
the host derives from the tokens each row holds (``mlxq.worker.kv_pack.filter_rows`` and
``row_copy`` rely on it instead of reading the device); and a left-padded batch's caches
for the decode pass's tests."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


def padding_agrees(engine: Any) -> None:
    """Each row's slot (``mlxq.worker.kv_slots``) holds the tokens the host says, by its
    padding and by its offset; a dead slot sees at least its newest column."""
    gen = engine._gen._generation_batch
    want = [len(t) for t in gen.tokens]
    slots = [gen.slots.slot(i) for i in range(len(want))]
    for layer, c in enumerate(gen.prompt_cache):
        if type(c) is BatchKVCache and c.keys is not None and want:
            assert c.keys.shape[0] == gen.slots.width(len(want)), f"layer {layer}: slots"
            pads = c.left_padding.tolist()
            got = [c._idx - pads[s] for s in slots]
            assert got == want, f"layer {layer}: rows hold {got} tokens, the host says {want}"
            offsets = c.offset.tolist()
            assert [offsets[s] for s in slots] == want, f"layer {layer}: offsets"
            dead = set(range(len(pads))) - set(slots)
            assert all(pads[s] < c._idx for s in dead), f"layer {layer}: a dead slot sees none"


def left_padded_batch(model: Any, prompts: list[list[int]]) -> list[BatchKVCache]:
    """A batch's caches after a left-padded prefill of ``prompts``."""
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    caches = [BatchKVCache(pads) for _ in model.layers]
    model(mx.array([[0] * n + p for n, p in zip(pads, prompts, strict=True)]), cache=caches)
    return caches


def decode_matches(model: Any, fused: Any, atol: float) -> tuple[list[Any], list[Any]]:
    """Four decode steps of three left-padded rows through ``fused`` and through the
    model's own calls: the same logits each step (within ``atol``). Returns both caches."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    theirs, ours = left_padded_batch(model, prompts), left_padded_batch(model, prompts)
    tokens = mx.array([3, 4, 5])
    for _ in range(4):
        want = model(tokens[:, None], cache=theirs)[:, -1, :]
        got = fused.decode(tokens, ours)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=atol).item()
        tokens = mx.argmax(want, axis=-1)
    return theirs, ours
