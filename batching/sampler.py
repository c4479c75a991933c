"""One vectorized sampling call per decode step, whatever each row's params.

mlx-lm's ``GenerationBatch._step`` calls one sampler on the whole (B, V) array
when every row shares the sampler object, else a per-row loop. mlxq always hands
it one shared closure over :class:`RowParams`, so a mixed batch costs one call.

Each row draws from exactly the distribution mlx-lm's ``make_sampler`` gives its
params: top_p, min_p and top_k cut the temperature-1 log-probs (all three keep a
prefix of the ranked vocabulary, so together they keep the shortest prefix), then
the kept tokens are drawn from ``softmax(logprobs / temperature)`` by Gumbel-max.

Why not one full sort on a CPU: there a sort of (B, 152k) log-probs costs several
times an argpartition for the top 1024 (figures in docs/benchmarks.md). So each
row's cut is found among its top K candidates and the draw runs over those K only.
A row whose cut lies beyond them (a nucleus wider than K, or no filter at all) is
drawn over the whole vocabulary instead, after a full sort of just the rows whose
top_p needs one; that stays exact, at mlx-lm's own cost. Knowing which rows those
are takes one host sync per step, taken only when some row has a top_p or min_p
and no top_k. (A sync-free bisection for the top-p threshold was tried, and was
slower than the sort.)

On a GPU the trade is the other way round: a sort of the whole vocabulary is
cheap there, and a host sync is not, since it stalls mlx-lm's pipelining of the
next forward pass behind this one (measured on the H200: docs/benchmarks.md). So with
``num_candidates=0``, the default on a GPU, every row's top_p and top_k
thresholds come from ONE sort of the values and min_p from the row max, the
draw is one masked Gumbel-argmax over the vocabulary, and nothing waits on the
host: the same work as mlx-lm's own sampler, whatever the mix. Where most rows
are greedy (a sweep's batch with a chat row or two), the sampled rows alone are
drawn so and the rest take the batch's argmax, as on the candidates path: the
noise, sort and draw of one row, not of the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from mlxq.batching.seeded import Keys, first_key, hash_gumbel, second_key, second_keys, token_ids
from mlxq.producer.params import SamplingParams

#: Candidates kept per row before the cut (raised to the largest top_k in the batch).
NUM_CANDIDATES = 1024
_NEG_INF = -math.inf


#: What a greedy row's filters look like on the one-sort path: none (its draw is argmax).
_NEUTRAL = SamplingParams(temperature=1.0)


def default_num_candidates() -> int:
    """1024 candidates on a CPU; 0 (one sync-free sort) on a GPU. See the module doc."""
    return 0 if mx.default_device().type == mx.DeviceType.gpu else NUM_CANDIDATES


@dataclass(frozen=True, slots=True)
class RowParams:
    """Per-row sampling parameters for one batch composition, built once.

    The parameter arrays are (S, 1), one row per sampled (non-greedy) batch row in
    batch order, so they broadcast against (S, V) log-probs. The flags and static
    row sets let :func:`sample` skip whatever no row needs (vLLM v1 style) and
    never loop over rows in Python.

    Attributes:
        temperature, top_p, top_k, min_p: As in :class:`SamplingParams`.
        seed_hi: The seed's high 32 bits (0 for unseeded rows).
        key1: A seeded row's first key, a function of its seed alone (0 unseeded).
        seeded: Which sampled rows carry a seed.
        greedy: (B,) which batch rows take the argmax.
        all_greedy, homogeneous: Every row greedy; every row one
            :meth:`SamplingParams.key` and unseeded (one plain sampler would do).
        any_seeded, all_seeded: Over the sampled rows.
        num_candidates: K, the candidates each row examines before any
            full-vocabulary work (0: always sort the whole vocabulary).
    """

    temperature: mx.array
    top_p: mx.array
    top_k: mx.array
    min_p: mx.array
    inv_temperature: mx.array  # 1 / temperature and log(min_p) taken on the host in float64,
    log_min_p: mx.array  # as mlx-lm does, so thresholds round the same way
    seed_hi: mx.array
    key1: mx.array
    seeded: mx.array
    greedy: mx.array
    plain: mx.array  # sampled rows that take the plain argmax (greedy rows riding along)
    all_greedy: bool
    homogeneous: bool
    any_seeded: bool
    all_seeded: bool
    num_candidates: int
    max_top_k: int
    sampled: tuple[SamplingParams, ...]  # host copy, to build row subsets without a sync
    sampled_rows: mx.array
    #: (sampled row, batch row, seed, key1) of each seeded row: its second key is made on
    #: the host from its position, when the caller knows it (:func:`sample`).
    seeded_keys: tuple[tuple[int, int, int, int], ...]
    greedy_rows: mx.array
    unpermute: mx.array  # concat(greedy, sampled)[unpermute] restores batch order
    wide_rows: tuple[int, ...]  # no filter at all: always drawn over the whole vocabulary
    any_filter: bool
    any_top_p: bool
    any_min_p: bool
    any_top_k: bool
    needs_sync: bool  # some row's cut may lie beyond its candidates
    subsets: dict[tuple[int, ...], RowParams] = field(default_factory=dict, compare=False)

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], num_candidates: int | None = None
    ) -> RowParams:
        """Build the arrays for one batch composition.

        Args:
            params: One :class:`SamplingParams` per batch row, in row order.
            num_candidates: Candidates per row before the cut (1024 by default on a
                CPU, at most V // 8), raised to the largest top_k; 0 (the default on
                a GPU) draws over the whole vocabulary with no host sync.

        Returns:
            The RowParams to pass to :func:`sample` while the batch stays the same.

        Raises:
            ValueError: If ``params`` is empty or ``num_candidates`` is negative.
        """
        if not params:
            raise ValueError(f"params={params!r}: need at least one row")
        if num_candidates is None:
            num_candidates = default_num_candidates()
        if num_candidates < 0:
            raise ValueError(f"num_candidates={num_candidates!r}: must be >= 0")
        sampled, s_idx = _sampled(params, num_candidates)
        greedy = [p.greedy for p in params]
        seeds = [p.seed or 0 for p in sampled]
        key1 = [0 if p.seed is None else first_key(p.seed) for p in sampled]
        filters = [(p.top_p < 1, p.min_p > 0, p.top_k > 0) for p in sampled]
        greedy_rows, unpermute = _order(len(params), s_idx)
        return cls(
            temperature=_column([p.temperature for p in sampled], mx.float32),
            top_p=_column([p.top_p for p in sampled], mx.float32),
            top_k=_column([p.top_k for p in sampled], mx.int32),
            min_p=_column([p.min_p for p in sampled], mx.float32),
            inv_temperature=_column([1 / p.temperature for p in sampled], mx.float32),
            log_min_p=_column(
                [math.log(p.min_p) if p.min_p else _NEG_INF for p in sampled], mx.float32
            ),
            seed_hi=_column([s >> 32 for s in seeds], mx.uint32),
            key1=_column(key1, mx.uint32),
            seeded=_column([p.seed is not None for p in sampled], mx.bool_),
            greedy=mx.array(greedy),
            plain=_column(greedy, mx.bool_) if len(s_idx) == len(params) else mx.array(False),
            all_greedy=all(greedy),
            homogeneous=len({p.key() for p in params}) == 1 and all(p.seed is None for p in params),
            any_seeded=any(p.seed is not None for p in sampled),
            all_seeded=all(p.seed is not None for p in sampled),
            num_candidates=num_candidates,
            max_top_k=max([p.top_k for p in sampled], default=0),
            sampled=tuple(sampled),
            sampled_rows=mx.array(s_idx),
            seeded_keys=tuple(
                (i, b, p.seed, k)
                for i, (b, p, k) in enumerate(zip(s_idx, sampled, key1, strict=True))
                if p.seed is not None
            ),
            greedy_rows=greedy_rows,
            unpermute=unpermute,
            wide_rows=tuple(i for i, f in enumerate(filters) if not any(f)),
            any_filter=any(any(f) for f in filters),
            any_top_p=any(f[0] for f in filters),
            any_min_p=any(f[1] for f in filters),
            any_top_k=any(f[2] for f in filters),
            needs_sync=any((f[0] or f[1]) and not f[2] for f in filters),
        )


def _sampled(
    params: Sequence[SamplingParams], num_candidates: int
) -> tuple[list[SamplingParams], list[int]]:
    """The params of the rows drawn by sampling, and their batch rows."""
    if num_candidates or _mostly_greedy(sum(p.greedy for p in params), len(params)):
        # Drawn apart from the greedy rows, which take the batch's argmax: on the
        # one-sort path too where most rows are greedy (a sweep's batch with a chat row
        # or two), so its noise, sort and draw cover those rows, not the whole batch.
        return [p for p in params if not p.greedy], [
            i for i, p in enumerate(params) if not p.greedy
        ]
    # Mostly sampled, on the one-sort path: the few greedy rows ride along with no
    # filter and no noise, so the batch is never split and put back.
    return [_NEUTRAL if p.greedy else p for p in params], list(range(len(params)))


def _mostly_greedy(greedy: int, rows: int) -> bool:
    """Whether ``greedy`` of ``rows`` rows are most of them: the sampled rows are then
    drawn apart and put in place over the batch's argmax."""
    return 2 * greedy >= rows


def _order(n: int, s_idx: list[int]) -> tuple[mx.array, mx.array]:
    """The greedy rows of a batch of ``n`` whose sampled rows are ``s_idx``, and the
    permutation putting ``concat(greedy, sampled)`` back in batch order."""
    order = [i for i in range(n) if i not in set(s_idx)] + s_idx
    return mx.array(order[: n - len(s_idx)]), mx.array(sorted(range(n), key=order.__getitem__))


def _column(values: Sequence[float | int | bool], dtype: mx.Dtype) -> mx.array:
    return mx.array(list(values), dtype=dtype).reshape(-1, 1)


def _noise(
    shape: tuple[int, ...],
    tokens: mx.array,
    key1: mx.array,
    key2: mx.array,
    seeded: mx.array,
    any_seeded: bool,
    all_seeded: bool,
) -> mx.array:
    """Gumbel noise: a hash of (seed, position, token id) for seeded rows, else mx.random
    (the rows' keys, a column and flags, so the compiled draw can call it on its inputs)."""
    if not any_seeded:
        return mx.random.gumbel(shape)
    hashed = hash_gumbel(tokens, key1, key2)  # (R, 1) keys
    if all_seeded:
        return hashed
    return mx.where(seeded, hashed, mx.random.gumbel(shape))


def _keys(rows: RowParams, positions: mx.array | Sequence[int]) -> Keys:
    """The sampled rows' keys at ``positions`` (one a batch row); host positions give keys
    made on the host (:mod:`mlxq.batching.seeded`). With no row seeded, the zero column
    twice: the draw reads no key."""
    if not rows.any_seeded:
        return rows.key1, rows.key1
    if isinstance(positions, mx.array):
        return rows.key1, second_keys(rows.key1, rows.seed_hi, positions[rows.sampled_rows])
    key2 = [0] * len(rows.sampled)
    for i, b, seed, first in rows.seeded_keys:
        key2[i] = second_key(first, seed, positions[b])
    return rows.key1, _column(key2, mx.uint32)


def _candidates(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest values per row, in descending order, and their token ids."""
    if k >= x.shape[-1]:
        idx = mx.argsort(-x, axis=-1)
    else:
        idx = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
        idx = mx.take_along_axis(idx, mx.argsort(-mx.take_along_axis(x, idx, axis=-1)), axis=-1)
    return mx.take_along_axis(x, idx, axis=-1).astype(mx.float32), idx.astype(mx.uint32)


def _cut(vals: mx.array, rows: RowParams) -> tuple[mx.array, mx.array]:
    """Which candidates each row keeps, and whether that settles the row.

    A row is settled when its cut provably lies inside the candidates: a top_k
    (K >= every top_k), or a top_p/min_p threshold above the last candidate (so no
    token outside the candidates, all <= that value, can reach it).
    """
    last = vals[:, -1:]
    on_p, on_k = rows.top_p < 1.0, rows.top_k > 0
    # Mass strictly above each candidate; log-probs are normalized, so total mass is 1.
    above = mx.cumsum(mx.exp(vals), axis=-1, inclusive=False)
    n_p = (above < rows.top_p).sum(axis=-1, keepdims=True)
    t_p = mx.where(on_p, mx.take_along_axis(vals, n_p - 1, axis=-1), _NEG_INF)
    t_m = vals[:, :1] + rows.log_min_p
    rank = mx.arange(vals.shape[-1]).reshape(1, -1)
    keep = (vals >= mx.maximum(t_p, t_m)) & (~on_k | (rank < rows.top_k))
    settled = on_k | (t_p > last) | (t_m > last)
    return keep, settled.reshape(-1)


def _full_top_p(x: mx.array, top_p: mx.array, srt: mx.array | None = None) -> mx.array:
    """mlx-lm's apply_top_p threshold with per-row top_p, from a full (ascending) sort."""
    srt = mx.sort(x, axis=-1) if srt is None else srt
    probs = mx.exp(srt.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[:, :1] + probs[:, :1]
    dropped = (above >= top_p * total).sum(axis=-1, keepdims=True)
    return mx.where(top_p < 1.0, mx.take_along_axis(srt, dropped, axis=-1), _NEG_INF)


def _subset(rows: RowParams, idx: tuple[int, ...]) -> RowParams:
    """The same params restricted to sampled rows ``idx``, for the whole-vocabulary draw.

    Cached, as the same rows tend to stay wide step after step; bounded, as the
    unsettled sets of a long-lived batch need not repeat.
    """
    if idx not in rows.subsets:
        if len(rows.subsets) >= 256:
            rows.subsets.clear()
        rows.subsets[idx] = RowParams.from_params([rows.sampled[i] for i in idx])
    return rows.subsets[idx]


def _full_top_k(srt: mx.array, top_k: mx.array) -> mx.array:
    """Each row's k-th largest value from an ascending sort (-inf where top_k is off)."""
    vocab = srt.shape[-1]
    at = mx.clip(vocab - top_k, 0, vocab - 1)
    on = (top_k > 0) & (top_k < vocab)
    return mx.where(on, mx.take_along_axis(srt, at, axis=-1), _NEG_INF)


def _draw_wide(x: mx.array, rows: RowParams, keys: Keys) -> mx.array:
    """Gumbel-max over the whole vocabulary above each row's top_p/top_k/min_p threshold.

    top_k is met as a value threshold (the k-th largest log-prob): exact ties at that
    value all stay in, where mlx-lm's argpartition would keep an arbitrary k of them.
    """
    draw = _wide(rows.any_top_p, rows.any_top_k, rows.any_min_p, rows.any_seeded, rows.all_seeded)
    return draw(
        x,
        token_ids(x.shape[-1]),
        rows.top_p,
        rows.top_k,
        rows.log_min_p,
        rows.inv_temperature,
        *keys,
        rows.seeded,
        rows.plain,
    )


@functools.cache
def _wide(
    any_top_p: bool, any_top_k: bool, any_min_p: bool, any_seeded: bool, all_seeded: bool
) -> Callable[..., mx.array]:
    """The whole-vocabulary draw for one set of flags, compiled as one function: the
    thresholds, the rows' noise (a seeded row's keys and hash, MLX's random for the
    others) and the masked argmax. On a GPU each of its ~30 small operations was a launch
    of its own, a fixed cost on every decode step with a sampled row in it, whatever the
    batch (an H100: 0.66 ms a call for one or two sampled rows beside 63 greedy ones,
    against 0.12 for the batch's argmax alone)."""

    def draw(
        x: mx.array,
        tokens: mx.array,
        top_p: mx.array,
        top_k: mx.array,
        log_min_p: mx.array,
        inv_temperature: mx.array,
        key1: mx.array,
        key2: mx.array,
        seeded: mx.array,
        plain: mx.array,
    ) -> mx.array:
        floor = mx.array(_NEG_INF)
        top = None
        if any_top_p or any_top_k:
            srt = mx.sort(x, axis=-1)  # one sort serves every row's top_p, top_k and min_p
            top = srt[:, -1:]
            if any_top_p:
                floor = _full_top_p(x, top_p, srt)
            if any_top_k:
                floor = mx.maximum(floor, _full_top_k(srt, top_k))
        if any_min_p:  # the row max alone costs ~15% of this draw: taken only if used
            peak = top if top is not None else x.max(axis=-1, keepdims=True)
            floor = mx.maximum(floor, peak + log_min_p)
        g = _noise(x.shape, tokens, key1, key2, seeded, any_seeded, all_seeded)
        x32 = x.astype(mx.float32)
        z = mx.where(x >= floor, mx.where(plain, x32, x32 * inv_temperature + g), _NEG_INF)
        return mx.argmax(z, axis=-1).astype(mx.uint32)

    # The unseeded rows' noise is drawn inside: MLX's random state goes in and out.
    state = [mx.random.state]
    return mx.compile(draw, inputs=state, outputs=state)


def _draw_narrow(
    vals: mx.array, idx: mx.array, keep: mx.array, rows: RowParams, keys: Keys
) -> mx.array:
    """Gumbel-max over each row's kept candidates only."""
    g = _noise(vals.shape, idx, *keys, rows.seeded, rows.any_seeded, rows.all_seeded)
    z = mx.where(keep, vals * rows.inv_temperature + g, _NEG_INF)
    pick = mx.argmax(z, axis=-1, keepdims=True)
    return mx.take_along_axis(idx, pick, axis=-1).reshape(-1)


def _num_candidates(rows: RowParams, vocab: int) -> int:
    # An argpartition costs about the same for K = 64 or 1024 at V = 152k, and a
    # wider K settles more nuclei without a full sort. At small V a full argsort is
    # cheap but still several times an argpartition, hence the V // 8 cap.
    if not rows.num_candidates:
        return vocab
    return min(vocab, max(min(rows.num_candidates, vocab // 8), rows.max_top_k, 1))


def _draw(x: mx.array, rows: RowParams, keys: Keys) -> mx.array:
    """Tokens for an all-sampled (no greedy) set of rows, with their keys."""
    if not rows.any_filter or not rows.num_candidates:
        return _draw_wide(x, rows, keys)
    vals, idx = _candidates(x, _num_candidates(rows, x.shape[-1]))
    keep, settled = _cut(vals, rows)
    out = _draw_narrow(vals, idx, keep, rows, keys)
    if rows.needs_sync:
        # The one host sync: which rows' cut fell beyond the candidates.
        unsettled = tuple(i for i, ok in enumerate(settled.tolist()) if not ok)  # type: ignore[arg-type]
    else:
        unsettled = rows.wide_rows
    # Rows needing the full sort apart from the rest, so only they pay for it.
    for group in (
        tuple(i for i in unsettled if rows.sampled[i].top_p < 1),
        tuple(i for i in unsettled if rows.sampled[i].top_p == 1),
    ):
        if group:
            wide, sub = mx.array(group), _subset(rows, group)
            sub_keys = (keys[0][wide], keys[1][wide]) if rows.any_seeded else (sub.key1,) * 2
            out[wide] = _draw_wide(x[wide], sub, sub_keys)
    return out


def sample(logprobs: mx.array, rows: RowParams, positions: mx.array | Sequence[int]) -> mx.array:
    """Draw one token per row, each from its own params' distribution, in one call.

    Args:
        logprobs: (B, V) normalized log-probabilities (as mlx-lm's batch hands them).
        rows: The batch's :class:`RowParams`; row i describes ``logprobs[i]``.
        positions: (B,) integer index of the token each row is generating, an array or
            host integers (then the seeded rows' keys are made on the host: the
            worker's way); only seeded rows read it, so their draw is a function of
            (seed, position, logits) alone, whatever the batch around them.

    Returns:
        (B,) uint32 token ids.

    Raises:
        ValueError: If ``logprobs`` has not one row per row of ``rows``.
    """
    if logprobs.ndim != 2 or logprobs.shape[0] != rows.greedy.size:
        raise ValueError(f"logprobs shape {logprobs.shape}: want ({rows.greedy.size}, V)")
    if rows.all_greedy:
        return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
    keys = _keys(rows, positions)
    if rows.greedy_rows.size == 0:
        return _draw(logprobs, rows, keys)
    sampled = _draw(logprobs[rows.sampled_rows], rows, keys)
    if _mostly_greedy(rows.greedy_rows.size, rows.greedy.size):
        # Mostly greedy (a sweep's batch with a chat row or two): every row's argmax, the
        # sampled rows' draws put in their place; no copy of the greedy rows' log-probs,
        # which cost more than the argmax itself (a CPU, V = 152k: 23 ms against 49).
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        tokens[rows.sampled_rows] = sampled
        return tokens
    greedy = mx.argmax(logprobs[rows.greedy_rows], axis=-1).astype(mx.uint32)
    return mx.concatenate([greedy, sampled])[rows.unpermute]
