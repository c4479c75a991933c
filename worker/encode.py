"""A request's prompt as the model's token ids, checked against what the model takes.

What depends on the model and not on the batch: the chat template, the context length,
the vocabulary's size, and a constraint compiled for the tokenizer. The worker runs it
ahead of need, off the decode thread (:meth:`mlxq.worker.engine.Engine.encode`).
"""

from __future__ import annotations

from typing import Any

from mlxq.producer.errors import PayloadError
from mlxq.producer.params import GenerationRequest
from mlxq.worker.chat import render
from mlxq.worker.grammars import Grammars


def encode(
    tokenizer: Any,
    req: GenerationRequest,
    *,
    max_context: int | None,
    vocab_size: int,
    grammars: Grammars,
) -> list[int]:
    """Tokenize a request's prompt (or render its chat through the template), and check
    what else of it depends on the model. Thread-safe.

    Raises:
        PayloadError: the prompt is empty once tokenized, or with ``max_tokens`` longer
            than the model's context; a token id past the vocabulary; a constraint that
            does not compile for this tokenizer.
    """
    tok = tokenizer
    if req.messages is not None:
        ids = tok.encode(render(tok, req), add_special_tokens=False)
    else:
        # A prompt that already starts with the BOS text gets no second BOS, as
        # mlx_lm.generate does it.
        prompt, bos = req.prompt or "", tok.bos_token
        ids = tok.encode(prompt, add_special_tokens=not bos or not prompt.startswith(bos))
    if not ids:
        raise PayloadError("prompt: tokenizes to nothing")
    if max_context and len(ids) + req.max_tokens > max_context:
        raise PayloadError(
            f"prompt: {len(ids)} tokens + max_tokens={req.max_tokens} exceed "
            f"the model's context of {max_context}"
        )
    lp = req.logits
    if lp is not None:
        named = [("logit_bias", t) for t in lp.logit_bias or ()]
        named += [("stop_token_ids", t) for t in lp.stop_token_ids]
        for name, t in named:
            if t >= vocab_size:
                raise PayloadError(
                    f"{name}: token id {t} is past the vocabulary ({vocab_size} tokens)"
                )
    if req.constraint is not None:  # compiled (once per constraint) ahead of need
        grammars.compile(req.constraint)
    return list(ids)


def context_length(model: Any) -> int | None:
    """The context the model's config names (None: it names none)."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def vocab_size(model: Any, tokenizer: Any) -> int:
    """Rows of the model's output layer (its config's), else the tokenizer's vocabulary."""
    n = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(n) if isinstance(n, int) and n > 0 else len(tokenizer.vocab)
