"""Per-row logit bias, penalties and min_tokens for a whole batch, a few ops per step.

mlx-lm runs each row's ``make_logits_processors`` list on its own (1, V) slice
whenever any row has one, then concatenates. :func:`apply` gives every row the
same numbers, bit for bit, with one pass per processor kind for the whole
batch and no Python loop over rows. Order and arithmetic are mlx-lm's: logit
bias (added), repetition (x * p if x < 0 else x / p, once per distinct token),
presence (x - p, once per distinct token), frequency (p subtracted once per
occurrence, i.e. count * p), each over the row's last ``*_context_size``
tokens of prompt plus output (see :mod:`mlxq.batching.history`). Then
``min_tokens`` sets the row's stop and EOS tokens to -inf until it has
generated that many.

Why scatters with values computed on the side, not mlx-lm's gather-then-assign:
an MLX scatter reuses its input's buffer when nothing else reads that buffer,
so a chain of them costs one copy of the (B, V) logits, while reading the array
being updated forces a fresh copy (the cost is in docs/benchmarks.md). So every
update is a scatter (add, subtract, minimum, or a put) whose
values come from small (B, W) arrays or from the input logits, never from the
chain. Each row's window is sorted once per step, so a distinct token is hit
once where mlx-lm hits it once; entries that must change nothing write the
identity (x + 0, x - 0, min(x, inf), or a value that another entry writes to
the same place). A row that asks for nothing is a row of identities, and a
batch where no row asks for anything returns its logits untouched.

In a decode step, in batch order (nothing here waits on the device)::

    rows = LogitsRows.from_params(params, vocab_size, tokenizer.eos_token_ids)  # on joins/leaves
    history = history.extend(TokenHistory.from_prompts(prompts, sizes, vocab_size=V))  # joins
    history = history.select(keep)                                                     # leaves
    logits = apply(logits, history, rows)        # before the logsumexp, as mlx-lm's processors
    tokens = sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True), ...)
    history = history.append(tokens)             # every step, lazily
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxq.batching.history import TokenHistory
from mlxq.producer.logits_params import NOTHING, LogitsParams
from mlxq.producer.validate import token_id, value_error

#: Above this many (window x bias) pairs per row, the repetition penalty reads the
#: biased logits with a gather (one extra copy) instead of matching ids pairwise.
_MAX_BIAS_PAIRS = 32_768


@dataclass(frozen=True, slots=True)
class _Penalty:
    value: mx.array  # (B, 1) float32; neutral where the row has none
    context: mx.array  # (B, 1) int32; 0 where the row has none (no token in reach)


@dataclass(frozen=True, slots=True)
class LogitsRows:
    """The processors of one batch composition as arrays, built once per composition.

    Rebuild it whenever rows join or leave (as :class:`~mlxq.batching.sampler.RowParams`).
    A kind no row uses is None and costs nothing in :func:`apply`.

    Attributes:
        batch_size, vocab_size: The (B, V) the logits must have.
        width: The longest context any row reads; the history must be at least this wide.
        rows: (B, 1) int32 row indices, to scatter into (B, V).
        bias_ids, bias_values: (B, L) bias table, padded with (0, 0.0).
        repetition, presence, frequency: Per-row value and context size.
        min_tokens: (B, 1) int32 (0 where it masks nothing); stop_ids: (B, S),
            each row padded with its own first id (0 for rows with none).
    """

    batch_size: int
    vocab_size: int
    width: int
    rows: mx.array
    bias_ids: mx.array | None
    bias_values: mx.array | None
    repetition: _Penalty | None
    presence: _Penalty | None
    frequency: _Penalty | None
    min_tokens: mx.array | None
    stop_ids: mx.array | None

    @classmethod
    def from_params(
        cls,
        params: Sequence[LogitsParams | None],
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
    ) -> LogitsRows:
        """Build the arrays for one batch composition.

        Args:
            params: One per batch row, in row order; None asks for nothing.
            vocab_size: V of the logits :func:`apply` will get.
            eos_token_ids: The model's EOS ids (e.g. mlx-lm's
                ``TokenizerWrapper.eos_token_ids``, a set), masked like each row's
                ``stop_token_ids`` while the row is under its ``min_tokens``.

        Returns:
            The LogitsRows to pass to :func:`apply` while the batch stays the same.

        Raises:
            ValueError: If ``vocab_size`` < 1 or a token id is not below it.
        """
        if vocab_size < 1:
            raise value_error("vocab_size", vocab_size, "must be >= 1")
        ps = [p or NOTHING for p in params]
        eos = tuple(sorted({token_id("eos_token_ids", t) for t in eos_token_ids}))
        stops = [tuple(dict.fromkeys(p.stop_token_ids + eos)) if p.min_tokens else () for p in ps]
        biases = [tuple((p.logit_bias or {}).items()) for p in ps]
        _check_ids(biases, stops, vocab_size)
        n, n_stop = len(ps), max((len(s) for s in stops), default=0)
        reps = [p.repetition_penalty if p.repetition else None for p in ps]
        return cls(
            batch_size=n,
            vocab_size=vocab_size,
            width=max((p.context_size for p in ps), default=0),
            rows=mx.arange(n, dtype=mx.int32).reshape(-1, 1),
            bias_ids=_table([[t for t, _ in b] for b in biases], 0, mx.int32),
            bias_values=_table([[v for _, v in b] for b in biases], 0.0, mx.float32),
            repetition=_penalty(reps, [p.repetition_context_size for p in ps], 1.0),
            presence=_penalty(
                [p.presence_penalty or None for p in ps], [p.presence_context_size for p in ps], 0.0
            ),
            frequency=_penalty(
                [p.frequency_penalty or None for p in ps],
                [p.frequency_context_size for p in ps],
                0.0,
            ),
            min_tokens=_min_tokens(ps, stops),
            # Padded with the row's own first id: the same min() twice changes nothing.
            stop_ids=_table(
                [list(s) + list(s[:1]) * (n_stop - len(s)) for s in stops], 0, mx.int32
            ),
        )

    @property
    def any_active(self) -> bool:
        """False when :func:`apply` would return the logits unchanged."""
        kinds = (self.bias_ids, self.repetition, self.presence, self.frequency, self.min_tokens)
        return any(k is not None for k in kinds)


def _check_ids(
    biases: list[tuple[tuple[int, float], ...]], stops: list[tuple[int, ...]], vocab_size: int
) -> None:
    """Every row's biased and stop token ids are below ``vocab_size``."""
    for i, (b, s) in enumerate(zip(biases, stops, strict=True)):
        for name, t in [("logit_bias", t) for t, _ in b] + [("stop_token_ids", t) for t in s]:
            if t >= vocab_size:
                raise value_error(f"params[{i}].{name}", t, f"token id must be < {vocab_size}")


def _min_tokens(ps: list[LogitsParams], stops: list[tuple[int, ...]]) -> mx.array | None:
    """Each row's ``min_tokens`` (0 without stops to mask) as a column; None when no row
    masks any."""
    if not any(stops):
        return None
    return mx.array(
        [p.min_tokens if s else 0 for p, s in zip(ps, stops, strict=True)], dtype=mx.int32
    ).reshape(-1, 1)


def _table(rows: list[list[Any]], pad: Any, dtype: mx.Dtype) -> mx.array | None:
    width = max((len(r) for r in rows), default=0)
    if not width:
        return None
    return mx.array([r + [pad] * (width - len(r)) for r in rows], dtype=dtype)


def _penalty(values: list[float | None], contexts: list[int], neutral: float) -> _Penalty | None:
    if all(v is None for v in values):
        return None
    return _Penalty(
        value=mx.array([neutral if v is None else v for v in values]).reshape(-1, 1),
        context=mx.array(
            [0 if v is None else c for v, c in zip(values, contexts, strict=True)], dtype=mx.int32
        ).reshape(-1, 1),
    )


def apply(logits: mx.array, history: TokenHistory, rows: LogitsRows) -> mx.array:
    """Every row's processors on the step's logits, with no Python loop over rows.

    Args:
        logits: (B, V) the model's last-position logits, any float dtype; row i
            is ``rows``' and ``history``'s row i.
        history: The rows' tokens so far, at least ``rows.width`` wide.
        rows: The batch's :class:`LogitsRows`.

    Returns:
        (B, V) logits of the same dtype, equal to what mlx-lm's processors give
        row by row; ``logits`` itself when no row has a processor.

    Raises:
        ValueError: If the shapes do not match ``rows`` and ``history``.
    """
    if not rows.any_active:
        return logits
    want = (rows.batch_size, rows.vocab_size)
    if logits.shape != want or history.batch_size != rows.batch_size:
        raise ValueError(f"logits {logits.shape}, history {history.tokens.shape}: want {want}")
    if history.width < rows.width:
        raise ValueError(f"history width {history.width}: rows need {rows.width}")
    out = logits
    if rows.bias_ids is not None and rows.bias_values is not None:
        out = out.at[rows.rows, rows.bias_ids].add(rows.bias_values)
    if rows.width:
        window = history.tokens[:, history.width - rows.width :]
        out = _penalize(logits, out, window, rows)
    if rows.min_tokens is not None and rows.stop_ids is not None:
        early = history.generated.reshape(-1, 1) < rows.min_tokens
        mask = mx.where(early, -math.inf, math.inf).astype(logits.dtype)
        out = out.at[rows.rows, rows.stop_ids].minimum(mx.broadcast_to(mask, rows.stop_ids.shape))
    return out


def _distinct(window: mx.array, vocab: int) -> tuple[mx.array, mx.array, mx.array]:
    """Each row's window sorted by token: (token, age, last occurrence of its token).

    Padding sorts last as token ``vocab``. A token's last occurrence is its most
    recent, so it is in reach of a context size whenever any occurrence is.
    """
    width = window.shape[1]
    dtype = mx.int32 if (vocab + 1) * width < 2**31 else mx.int64
    tok = mx.where(window >= 0, window, vocab).astype(dtype)
    key = mx.sort(tok * width + mx.arange(width, dtype=dtype), axis=1)
    tok, age = key // width, (width - 1) - key % width
    last = mx.concatenate([tok[:, 1:] != tok[:, :-1], mx.ones_like(tok[:, :1], mx.bool_)], 1)
    return tok.astype(mx.int32), age.astype(mx.int32), last & (tok < vocab)


def _penalize(logits: mx.array, out: mx.array, window: mx.array, rows: LogitsRows) -> mx.array:
    dtype, r = logits.dtype, rows.rows
    if rows.repetition is not None or rows.presence is not None:
        tok, age, last = _distinct(window, rows.vocab_size)
    if rows.repetition is not None:
        rep = rows.repetition
        out = _repeat(logits, out, window, tok, last & (age < rep.context), rep, rows)
    if rows.presence is not None:
        hit = last & (age < rows.presence.context)
        p = rows.presence.value.astype(dtype)
        out = out.at[r, mx.where(hit, tok, 0)].subtract(mx.where(hit, p, mx.zeros_like(p)))
    if rows.frequency is not None:
        ages = mx.arange(window.shape[1] - 1, -1, -1, dtype=mx.int32)
        hit = (window >= 0) & (ages < rows.frequency.context)
        p = rows.frequency.value.astype(dtype)
        out = out.at[r, mx.where(hit, window, 0)].subtract(mx.where(hit, p, mx.zeros_like(p)))
    return out


def _repeat(
    logits: mx.array,
    out: mx.array,
    window: mx.array,
    tok: mx.array,
    hit: mx.array,
    rep: _Penalty,
    rows: LogitsRows,
) -> mx.array:
    """The repetition penalty, written with one put of values computed on the side.

    A scatter-divide is not IEEE division (it differs from mlx-lm's x / p in the
    last bit), so the new values are computed elementwise from the biased logits
    and put in place. Entries that change nothing are pointed at the row's most
    recent token with that token's new value, so no two writes to one place differ.
    """
    recent = window[:, -1:]
    anchor = mx.maximum(recent, 0)
    idx = mx.concatenate([mx.where(tok < rows.vocab_size, tok, 0), anchor], axis=1)
    hit = mx.concatenate([hit, (recent >= 0) & (rep.context > 0)], axis=1)
    x = _biased(logits, out, idx, rows)
    p = rep.value.astype(logits.dtype)
    new = mx.where(hit, mx.where(x < 0, x * p, x / p), x)
    return mx.put_along_axis(
        out,
        mx.where(hit[:, :-1], idx[:, :-1], anchor),
        mx.where(hit[:, :-1], new[:, :-1], new[:, -1:]),
        axis=1,
    )


def _biased(logits: mx.array, out: mx.array, idx: mx.array, rows: LogitsRows) -> mx.array:
    """The logits after the bias at ``idx``, read without touching ``out`` when cheap."""
    x = mx.take_along_axis(logits, idx, axis=1)
    if rows.bias_ids is None or rows.bias_values is None:
        return x
    if idx.shape[1] * rows.bias_ids.shape[1] > _MAX_BIAS_PAIRS:
        return mx.take_along_axis(out, idx, axis=1)  # costs a copy of the logits
    match = idx[:, :, None] == rows.bias_ids[:, None, :]
    return x + mx.where(match, rows.bias_values[:, None, :], 0.0).sum(-1).astype(x.dtype)
