"""A model's body and head apart, so a prefill can take logits at a few positions only.

Why. A prefill that feeds a row's last prompt token gives that row's first token from the
logits after it (:class:`~mlxq.worker.generator.Generator`), but an mlx-lm model's call
runs its head over every position of the pass: a pass of one 500-token chat prompt at a
152k vocabulary computes 76M logits to read 152k of them (on a 7B model, ~0.5 TFLOP).
Most mlx-lm language models are a body, ``model.model(inputs, cache=...)``, whose hidden
states go through a head, ``model.lm_head`` or the tied ``model.model.embed_tokens.
as_linear``; with the two apart the head runs on each row's last position alone.

Some models do more after the body (a soft cap, a scale, a different attribute): the
split is checked once on the model itself (the two ways' logits of a short pass must
agree) and not used where they differ or where the parts are missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)

#: How far the split's logits may be from the model's own call's (relative and absolute,
#: compared in float32): a bfloat16 model's head over one row and over four may round
#: apart; a soft cap or a scale moves them further.
TOLERANCE = 1e-2


@dataclass(frozen=True, slots=True)
class Head:
    """A model as ``body(inputs, cache=...)`` -> hidden states and ``head(hidden)`` ->
    logits."""

    body: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]

    def last_logits(self, inputs: mx.array, cache: list[Any], ends: list[int]) -> mx.array:
        """Run ``inputs`` (rows x width) through the body into ``cache`` and return the
        logits of row ``i`` at position ``ends[i]`` for the first ``len(ends)`` rows
        (rows x vocabulary): the head runs on those positions alone."""
        hidden = self.body(inputs, cache=cache)
        picked = hidden[mx.arange(len(ends)), mx.array(ends)]
        return self.head(picked[:, None, :])[:, 0, :]


def head_of(model: Any) -> Any:
    """The model's head: ``lm_head``, or its tied embedding as a linear layer; None where it
    has neither."""
    head = getattr(model, "lm_head", None)
    if head is None:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    return head


def close(a: mx.array, b: mx.array) -> bool:
    """Whether two logits arrays have one shape and agree within :data:`TOLERANCE`,
    compared in float32."""
    if a.shape != b.shape:
        return False
    near = mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=TOLERANCE, atol=TOLERANCE)
    return bool(near.item())


def model_head(model: Any) -> Head | None:
    """``model`` as a body and a head, where its own call is exactly those two (checked on
    a short pass); None where it is not, or where the check fails."""
    body = getattr(model, "model", None)
    head = head_of(model)
    if not callable(body) or not callable(head):
        log.info("prefill logits: no body and head to split on %s", type(model).__name__)
        return None
    split = Head(body, head)
    try:
        inputs = mx.array([[1, 2, 3, 4]])
        want = model(inputs, cache=make_prompt_cache(model))[:, -1, :]
        same = close(want, split.last_logits(inputs, make_prompt_cache(model), [3]))
    except Exception as e:  # a model whose parts are called otherwise
        name = type(model).__name__
        log.info("prefill logits: %s's body and head: %s: %s", name, type(e).__name__, e)
        return None
    if not same:
        log.info("prefill logits: %s does more than its body and head", type(model).__name__)
        return None
    return split
