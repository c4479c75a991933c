"""Each row's recent tokens, as one (B, W) array the penalties read in one op.

mlx-lm gives every row with logits processors a ``TokenBuffer`` that starts with
the tokens already in its cache (``all_tokens`` plus the prompt) and grows by
the row's input token at each decode step, so a processor sees everything
before the position being generated. :class:`TokenHistory` keeps the same
tokens, but only the last ``W`` of them (no processor looks further back than
its context size) for every row at once: right-aligned, oldest first, ``-1``
where a row has fewer. Padding is only ever on the left, so a row's real tokens
are always a suffix, which :func:`mlxq.batching.logits.apply` relies on.

Per step the engine calls :meth:`TokenHistory.append` with the sampled tokens:
one concatenate, lazy, no host sync. Rows joining and leaving go through
:meth:`extend` and :meth:`select`, which reorder exactly as mlx-lm's
``GenerationBatch.extend`` / ``filter`` reorder their per-row lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

#: Marks a window slot with no token (the row's history is shorter than the window).
NO_TOKEN = -1


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """The last ``width`` tokens of every row, and how many each has generated.

    Attributes:
        tokens: (B, W) int32, oldest first, :data:`NO_TOKEN` on the left where
            a row has fewer than W tokens.
        generated: (B,) int32, tokens appended since the row joined (what
            ``min_tokens`` counts).
    """

    tokens: mx.array
    generated: mx.array

    @classmethod
    def from_prompts(
        cls,
        prompts: Sequence[Sequence[int]],
        sizes: Sequence[int],
        *,
        vocab_size: int,
        generated: Sequence[int] | None = None,
    ) -> TokenHistory:
        """The history of rows joining the batch, built once at insertion.

        Args:
            prompts: Per row, every token before its first generated one: the
                tokens a prompt cache holds (mlx-lm's ``all_tokens``) followed
                by the prompt, as mlx-lm's processors see them.
            sizes: Per row, how many trailing tokens it needs (its
                :attr:`LogitsParams.context_size`; 0 for rows with no penalty).
            vocab_size: Every token must lie in ``[0, vocab_size)``; the
                penalties index the logits with them unchecked.
            generated: Per row, tokens it generated before it joined (a row put back
                after a pause); None: none.

        Returns:
            A history of width ``max(sizes)`` (0 when no row needs any).

        Raises:
            ValueError: If lengths differ, a size is negative or a token is out of range.
        """
        if len(prompts) != len(sizes):
            raise ValueError(f"sizes={list(sizes)!r}: want one per prompt ({len(prompts)})")
        if any(s < 0 for s in sizes):
            raise ValueError(f"sizes={list(sizes)!r}: must be >= 0")
        width = max(sizes, default=0)
        out = np.full((len(prompts), width), NO_TOKEN, dtype=np.int32)
        for i, (prompt, size) in enumerate(zip(prompts, sizes, strict=True)):
            tail = np.asarray(
                list(prompt[max(0, len(prompt) - size) :]) if size else [], dtype=np.int64
            )
            if tail.size and not (tail.min() >= 0 and tail.max() < vocab_size):
                bad = int(tail.min() if tail.min() < 0 else tail.max())
                raise ValueError(f"prompts[{i}] token {bad}: must be in [0, {vocab_size})")
            if tail.size:
                out[i, width - tail.size :] = tail
        counts = [0] * len(prompts) if generated is None else list(generated)
        if len(counts) != len(prompts):
            raise ValueError(f"generated={counts!r}: want one per prompt ({len(prompts)})")
        return cls(mx.array(out), mx.array(counts, dtype=mx.int32))

    @classmethod
    def empty(cls) -> TokenHistory:
        """No rows (what a batch starts from before anything joins)."""
        return cls(mx.zeros((0, 0), dtype=mx.int32), mx.zeros((0,), dtype=mx.int32))

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def append(self, tokens: mx.array) -> TokenHistory:
        """Add the step's sampled token to every row, dropping each row's oldest.

        Args:
            tokens: (B,) the tokens just sampled, in batch order (lazy is fine).

        Returns:
            The history the next step's penalties read.

        Raises:
            ValueError: If ``tokens`` is not one per row.
        """
        if tokens.shape != (self.batch_size,):
            raise ValueError(f"tokens shape {tokens.shape}: want ({self.batch_size},)")
        window = self.tokens
        if self.width:
            step = tokens.astype(mx.int32).reshape(-1, 1)
            window = mx.concatenate([window[:, 1:], step], axis=1)
        return TokenHistory(window, self.generated + 1)

    def select(self, rows: Sequence[int]) -> TokenHistory:
        """Keep ``rows``, in that order (mlx-lm's ``filter(keep)``).

        Args:
            rows: Indices into this batch.

        Returns:
            The history of the kept rows.

        Raises:
            ValueError: If an index is out of range.
        """
        if any(not 0 <= r < self.batch_size for r in rows):
            raise ValueError(f"rows={list(rows)!r}: must be in [0, {self.batch_size})")
        if not rows:
            return TokenHistory(self.tokens[:0], self.generated[:0])
        idx = mx.array(list(rows), dtype=mx.int32)
        return TokenHistory(self.tokens[idx], self.generated[idx])

    def extend(self, other: TokenHistory) -> TokenHistory:
        """Append ``other``'s rows after these (mlx-lm's ``extend``).

        The narrower of the two is padded on the left: its rows need no more
        tokens than it already holds.

        Args:
            other: The history of the rows joining.

        Returns:
            The history of both, this batch's rows first.
        """
        width = max(self.width, other.width)
        tokens = mx.concatenate([self.fit(width).tokens, other.fit(width).tokens], axis=0)
        return TokenHistory(tokens, mx.concatenate([self.generated, other.generated]))

    def fit(self, width: int) -> TokenHistory:
        """The same rows at another width: the oldest columns dropped or padded.

        Args:
            width: The new window width (e.g. a smaller batch's :attr:`LogitsRows.width`).

        Returns:
            This history if the width already matches.

        Raises:
            ValueError: If ``width`` is negative.
        """
        if width < 0:
            raise ValueError(f"width={width!r}: must be >= 0")
        if width == self.width:
            return self
        if width < self.width:
            return TokenHistory(self.tokens[:, self.width - width :], self.generated)
        pad = mx.full((self.batch_size, width - self.width), NO_TOKEN, dtype=mx.int32)
        return TokenHistory(mx.concatenate([pad, self.tokens], axis=1), self.generated)
