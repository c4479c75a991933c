"""A sampled token's log-probs in OpenAI's chat shape, as a job's chunks carry them."""

from __future__ import annotations

import math
from typing import Any

from mlxq.batching.logprobs import TokenLogprob

#: What OpenAI reports for a token that cannot be sampled at all (log-prob -inf).
LOGPROB_FLOOR = -9999.0


class LogprobEntries:
    """Builds each entry; every alternative's text is decoded once per token id.

    Args:
        tokenizer: The model's tokenizer (its ``decode``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def entry(self, lp: TokenLogprob, text: str) -> dict[str, Any]:
        """The entry of one sampled token whose text (what it added to the completion)
        is ``text``; alternatives are shown as each decodes alone."""
        return {
            "token": text,
            "logprob": _finite(lp.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": t, "logprob": _finite(v), "bytes": b}
                for t, b, v in ((*self._text(i), v) for i, v in lp.top)
            ],
        }

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        info = self._texts.get(token_id)
        if info is None:
            text = self.tokenizer.decode([token_id])
            info = self._texts[token_id] = (text, list(text.encode("utf-8")))
        return info


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR
