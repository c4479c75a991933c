"""A row's streaming detokenizer: its chunks joined are ``decode(token_ids)``.

mlx-lm's streaming detokenizers are fast (linear in the tokens) but made for a
chat screen: the byte-level BPE one (Qwen, Llama 3, GPT-2 style vocabularies)
drops the first token's leading space, so a completion of ``"Once upon a
time,"`` reads ``"burns"`` where the tokenizer's own ``decode`` (and so vLLM
and OpenAI) gives ``" burns"``, and prompt plus completion loses a space. Each
also writes out special tokens a model may sample (``<|im_start|>``), which
``decode(..., skip_special_tokens=True)`` leaves out. This wraps mlx-lm's
detokenizer so that the text a job streams is the text of its tokens, exactly.
The SentencePiece one already trims only where the tokenizer's own decoder
strips a leading space (mlx-lm picks it by the decoder), so it stays as it is.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer


class _KeepSpaceBPE(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE detokenizer, less its trim of the first space."""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` leaves out: added tokens
    marked special (a model's control tokens, not words like Qwen's ``<think>``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(int(i) for i, tok in added.items() if getattr(tok, "special", False))


class Detokenizer:
    """One row's text, token by token, with mlx-lm's ``StreamingDetokenizer``
    interface (``add_token``, ``finalize``, ``last_segment``, ``text``)."""

    def __init__(self, tokenizer: Any, special: frozenset[int]) -> None:
        inner = tokenizer.detokenizer  # mlx-lm makes a fresh copy per access
        if type(inner) is BPEStreamingDetokenizer:
            # Same vocabulary map, shared rather than rebuilt for each row.
            keep = _KeepSpaceBPE.__new__(_KeepSpaceBPE)
            keep.__dict__.update(inner.__dict__)
            keep.reset()
            inner = keep
        self._inner = inner
        self._special = special

    def add_token(self, token: int) -> None:
        if token not in self._special:
            self._inner.add_token(token)

    def finalize(self) -> None:
        self._inner.finalize()

    @property
    def last_segment(self) -> str:
        return str(self._inner.last_segment)

    @property
    def text(self) -> str:
        return str(self._inner.text)
