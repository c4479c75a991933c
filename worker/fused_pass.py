"""A decode step and a new row's prefill in one model pass.

Why. Beside a sweep, each chat job's prefill is a model pass of its own: on an H100 a
one-row prefill of a chat prompt cost the batch about what a decode step of 64 rows does
(16.3 against 15.1 ms, 0.5B shape: both mostly the cost of a pass's ~500 kernels), so each
chat job took the sweep one step's time besides its row. Most of a pass works token by
token (the norms, every projection, the MLP): those can take the decode rows' tokens and
the new row's prompt as one sequence. Only rotary positions, the caches and attention
are per row; they run twice, once for the batch (one token a row, its own cache and mask)
and once for the new row (its prompt, its own cache).

Which models. The common decoder layout of mlx-lm's llama, qwen2, qwen3 and mistral
models: ``model.model`` with ``embed_tokens``, ``layers`` and ``norm``; each layer
``input_layernorm``, ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``rope``, ``n_heads``, ``n_kv_heads``, ``scale``, optional ``q_norm`` / ``k_norm``),
``post_attention_layernorm`` and ``mlp``, every layer attending to all it holds. Any other
model, or one whose fused logits do not agree with its own calls' on a check at load
(:func:`fused_pass`), keeps two passes.

The head in parts. MLX's CUDA backend multiplies a 4-bit matrix by up to 64 rows in one
tile of rows (``qmm_sm80``: 16, 32 or 64 rows a tile, by the rows' next power of two), so
a 65th row doubles the tiles, and the head's product over a 152k vocabulary is hundreds
of tiles (on an H200, 0.5B shape, a sweep's decode step of 65 rows took 6.14 ms at p50
against 5.34 for 64; how much of that is the tiles is not yet timed apart:
``ops/bench_step_mix.py --pipelined``). There the head runs over full tiles of
:data:`HEAD_ROWS` rows and the few rows past them apart, which MLX multiplies row by row
(``qmv``, under 8 rows).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxq.worker import decode_attention, joined_linear
from mlxq.worker.env import env_switch
from mlxq.worker.joined_linear import Joined
from mlxq.worker.layer_attention import attend, attend_heads, heads
from mlxq.worker.mlx_settings import on_cuda
from mlxq.worker.model_head import close, head_of

log = logging.getLogger(__name__)

#: Whether a chat row's prompt runs in the batch's decode pass unless told (``auto``): off
#: on every backend. On an H100 (0.5B shape, a 10,000-job sweep beside chat jobs, two
#: pairs of runs) the sweep took 1.5% longer with it, its prefill stage 1.1-1.2 s more,
#: for a chat first token 3-6 ms sooner; on a CPU it saves nothing (docs/benchmarks.md).
FUSED_PREFILL = False

#: Rows of one tile of the head's product on MLX's CUDA backend (``qmm_sm80``); 0: the
#: head over every row at once (every other backend). ``MLXQ_HEAD_ROWS`` may set it
#: (:func:`head_rows`).
HEAD_ROWS = 64
HEAD_ROWS_ENV = "MLXQ_HEAD_ROWS"
#: Fewer rows past the last full tile than this run apart (MLX's ``qmv``, under 8 rows);
#: more would pay a tile of their own, as much as the one product.
_APART = 8

#: Whether a decode step's layers run as compiled parts (:func:`_compiled`) unless told:
#: off on every backend. On an H100 (0.5B shape, a sweep beside chat jobs, four runs each
#: way alternating) the parts took 0.4 ms a step off the host's graph but added more to
#: its launch (0.4 ms at 62 rows, 0.8-1.2 at 63), and the sweep's share fell from 0.947
#: to 0.864 at the mean of 16 windows each (docs/benchmarks.md). ``MLXQ_COMPILED_LAYERS``
#: ``1`` or ``0`` chooses either way.
COMPILED_LAYERS = False
COMPILED_ENV = "MLXQ_COMPILED_LAYERS"

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@dataclass(frozen=True, slots=True)
class FusedPass:
    """The model's body, its layers and its head, to run a decode step and one new row's
    prompt in one pass (:meth:`__call__`)."""

    inner: Any
    head: Callable[[mx.array], mx.array]
    #: The head's rows in parts of this many (0: one product; :data:`HEAD_ROWS`).
    head_rows: int = 0
    #: Whether a decode step's attention may run as one kernel a layer
    #: (:mod:`mlxq.worker.decode_attention`: CUDA only).
    one_kernel_attention: bool = False
    #: Each layer's query, key and value projections as one product, and its MLP's gate
    #: and up projections (:mod:`mlxq.worker.joined_linear`; empty: none joined).
    qkv: tuple[Joined | None, ...] = ()
    gate_up: tuple[Joined | None, ...] = ()
    #: Each layer's token-wise work before attention (its norm and projections) and after
    #: it (the output projection, the residuals, the norm and the MLP) as two compiled
    #: functions, for a decode step (:func:`_compiled`; empty: built op by op).
    compiled: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...] = ()

    def describe(self) -> str:
        """What the pass joins and how it attends, for a worker's log."""
        layers = len(self.inner.layers)
        return (
            f"query/key/value joined in {sum(map(bool, self.qkv))} of {layers} layers, "
            f"gate/up in {sum(map(bool, self.gate_up))}; decode attention "
            + ("one kernel a layer" if self.one_kernel_attention else "MLX's own")
            + ("; layers compiled" if self.compiled else "")
        )

    def decode(self, tokens: mx.array, caches: list[Any], keep: mx.array | None = None) -> mx.array:
        """Feed each batch row its next token (``tokens``, one a row, into ``caches``) as
        one sequence; return the rows' logits (rows x vocabulary; with ``keep``, only
        those rows', in its order: a batch's live slots, :mod:`mlxq.worker.kv_slots`)."""
        return self(tokens, caches, [], [], keep=keep)[0]

    def __call__(
        self,
        tokens: mx.array,
        caches: list[Any],
        prompt: list[int],
        new_caches: list[Any],
        end: int | None = None,
        keep: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Feed each batch row its next token (``tokens``, one a row, into ``caches``) and
        the new row its ``prompt`` (into ``new_caches``); return the batch's logits (rows x
        vocabulary; with ``keep``, only those rows', in its order) and the new row's after
        its prompt's token ``end`` (its last by default; a prompt right-padded to a
        bucketed width ends before), 1 x vocabulary (0 x vocabulary for no prompt)."""
        rows, width = tokens.shape[0], len(prompt)
        inner = self.inner
        ids = tokens.astype(mx.uint32)
        if width:
            ids = mx.concatenate([ids, mx.array(prompt, mx.uint32)])
        # (1, rows + width, dims): one sequence for the token-wise work. A quantized
        # projection of (rows, 1, dims) runs as rows products of one vector each on some
        # backends; of (1, rows, dims), as one product of a matrix.
        h = inner.embed_tokens(ids)[None]
        parts = [(slice(0, rows), rows, 1, caches, create_attention_mask(h[:, :1], caches[0]))]
        if width:
            mask = create_attention_mask(h[:, rows:], new_caches[0])
            parts.append((slice(rows, rows + width), 1, width, new_caches, mask))
        # A prefill's shapes vary, and a cache of one row counts its offset in Python (a
        # new trace each step): both op by op.
        compiled = self.compiled if not width and isinstance(caches[0].offset, mx.array) else ()
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            if compiled:  # one part: the batch's rows, a token each
                mask = parts[0][4]
                h = _layer(compiled[i], attn, h, caches[i], mask, self.one_kernel_attention)
                continue
            projected = _project(self, i, layer, h)
            k: mx.array | None
            if len(projected) == 2:  # queries and keys as one part (joined_linear)
                (q, v), k = projected, None
            else:
                q, k, v = projected
            out = [
                attend(
                    attn,
                    q[0, s],
                    None if k is None else k[0, s],
                    v[0, s],
                    b,
                    n,
                    c[i],
                    m,
                    self.one_kernel_attention,
                )
                for s, b, n, c, m in parts
            ]
            o = out[0] if len(out) == 1 else mx.concatenate(out, axis=1)
            h = _after_attention(self, i, layer, h, o)
        share_offsets(caches)
        h = inner.norm(h)
        last = rows + (width - 1 if end is None else end)  # the new row's, where width
        if keep is not None:
            h = _positions(
                h, mx.concatenate([keep, mx.array([last], keep.dtype)]) if width else keep
            )
            rows = keep.shape[0]
        elif width:
            h = _positions(h, mx.array([*range(rows), last]))
        logits = head_in_parts(self.head, h, self.head_rows)
        return logits[:rows], logits[rows:]


def _project(fused: FusedPass, i: int, layer: Any, h: mx.array) -> tuple[mx.array, ...]:
    """Layer ``i``'s norm and projections of the sequence ``h``: its queries, keys and
    values, or its queries and keys as one part and its values (joined_linear)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    qkv = fused.qkv[i] if fused.qkv else None
    if qkv is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return tuple(qkv(x))


def _after_attention(fused: FusedPass, i: int, layer: Any, h: mx.array, o: mx.array) -> mx.array:
    """Layer ``i``'s output projection of its attention ``o``, its residuals, its norm
    and its MLP, from the sequence ``h``."""
    h = h + layer.self_attn.o_proj(o)
    x = layer.post_attention_layernorm(h)
    gate_up = fused.gate_up[i] if fused.gate_up else None
    mlp: mx.array = layer.mlp.down_proj(swiglu(*gate_up(x))) if gate_up else layer.mlp(x)
    return h + mlp


def _compiled(fused: FusedPass) -> FusedPass:
    """``fused`` with each layer's work before and after attention compiled, for a decode
    step: before, its norm, projections, heads and rotary positions (the rows' offsets
    an input); after, the heads joined, the output projection, the residuals, the norm
    and the MLP.

    Why. On MLX's CUDA backend a decode step is the host's: the device waits for it (an
    H100 40-93% busy beside a sweep, docs/benchmarks.md), and Python building the pass
    op by op is a third of the host's part. A compiled function replays its recorded ops
    from C++: on this CPU a 24-layer decode pass of 62 rows took 1.20-1.43 ms to build
    against 1.90-2.31 op by op. MLX records one trace a shape: a batch's rows change at
    joins and leaves (rows that keep their place keep its shapes), and each new count is
    traced once. The caches and attention, whose shapes grow each step, stay op by op.
    On an H100 the launch of the compiled parts cost more than building them saved, so
    they are off unless asked for (:data:`COMPILED_LAYERS`)."""

    def layer_fns(i: int, layer: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        attn = layer.self_attn

        def before(h: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            projected = _project(fused, i, layer, h)
            rows = h.shape[1]
            if len(projected) == 2:  # queries and keys as one part (joined_linear)
                return heads(attn, projected[0][0], None, projected[1][0], rows, 1, offset)
            q, k, v = projected
            return heads(attn, q[0], k[0], v[0], rows, 1, offset)

        def after(h: mx.array, o: mx.array) -> mx.array:
            o = o.transpose(0, 2, 1, 3).reshape(1, o.shape[0] * o.shape[2], -1)
            return _after_attention(fused, i, layer, h, o)

        return mx.compile(before), mx.compile(after)

    return replace(fused, compiled=tuple(layer_fns(i, x) for i, x in enumerate(fused.inner.layers)))


def _layer(
    fns: tuple[Callable[..., Any], Callable[..., Any]],
    attn: Any,
    h: mx.array,
    cache: Any,
    mask: Any,
    one_kernel: bool,
) -> mx.array:
    """A decode step's layer by its compiled parts (:func:`_compiled`), from the sequence
    ``h`` of the batch's rows."""
    before, after = fns
    q, k, v = before(h, cache.offset)
    out: mx.array = after(h, attend_heads(attn, q, k, v, cache, mask, one_kernel))
    return out


def _positions(h: mx.array, at: mx.array) -> mx.array:
    """The sequence ``h`` (1 x positions x dims) at positions ``at``, in its order: one
    gather (``h[:, at]`` builds its indices of both axes first, four launches more)."""
    return mx.take(h.squeeze(0), at, axis=0)[None]


def share_offsets(caches: list[Any]) -> None:
    """Every layer's batch cache given the first's row offsets after a step. Each layer
    adds the step's tokens to its own copy of the same offsets (mlx-lm's
    ``update_and_fetch``); shared, the next step's rotary embeddings read one sum, and the
    others are dropped unevaluated: one launch a step where there were one a layer."""
    batch = [c for c in caches if type(c) is BatchKVCache]
    if len(batch) > 1:
        for c in batch[1:]:
            c.offset = batch[0].offset


def head_in_parts(head: Callable[[mx.array], mx.array], h: mx.array, part: int) -> mx.array:
    """``head(h)[0]`` for ``h`` of (1, n, dims): where ``part`` is set and n is past a
    multiple of it by fewer than 8 rows, the full parts in one product and the rest apart
    (see the module's doc); one product otherwise."""
    n = h.shape[1]
    rest = n % part if part else 0
    if not rest or rest >= _APART or n < part:
        return head(h)[0]
    cut = n - rest
    return mx.concatenate([head(h[:, :cut])[0], head(h[:, cut:])[0]])


def fused_pass(model: Any) -> FusedPass | None:
    """``model`` as a :class:`FusedPass` where its layout is the common one and a fused
    pass's logits agree with its own calls' (checked on a short batch); None otherwise."""
    name = type(model).__name__
    inner = getattr(model, "model", None)
    head = head_of(model)
    layers = getattr(inner, "layers", None)
    if (
        not callable(head)
        or not layers
        or not all(hasattr(inner, a) for a in ("embed_tokens", "norm"))
        or not all(hasattr(layer, a) for layer in layers for a in _LAYER)
        or not all(hasattr(layer.self_attn, a) for layer in layers for a in _ATTN)
        or any(getattr(layer, "use_sliding", False) for layer in layers)
    ):
        log.info("fused prefill: %s's layers are not the common layout", name)
        return None
    fused = FusedPass(inner, head, head_rows())
    try:
        same = _agrees(model, fused)
    except Exception as e:  # a layer whose parts are called otherwise
        log.info("fused prefill: %s: %s: %s", name, type(e).__name__, e)
        return None
    if not same:
        log.info("fused prefill: %s's fused pass differs from its own calls", name)
        return None
    if joined_linear.enabled():
        fused = _checked(model, "joined projections", lambda: _joined(fused, layers)) or fused
    if decode_attention.enabled():
        one_kernel = replace(fused, one_kernel_attention=True)
        fused = _checked(model, "decode attention", lambda: one_kernel) or fused
    if env_switch(COMPILED_ENV, COMPILED_LAYERS):
        fused = _checked(model, "compiled layers", lambda: _compiled(fused)) or fused
    return fused


def _checked(model: Any, what: str, make: Callable[[], FusedPass | None]) -> FusedPass | None:
    """``make()``'s pass where it agrees with the model's own calls, checked as the plain
    pass is; None where there is none, or where it differs or fails (a warning: the
    worker goes on with the pass it had)."""
    try:
        candidate = make()
        if candidate is None or _agrees(model, candidate):
            return candidate
        log.warning(
            "%s: %s's pass differs from its own calls; not used", what, type(model).__name__
        )
    except Exception as e:  # a layer called otherwise; a kernel a toolkit will not build
        log.warning("%s: %s: %s; not used", what, type(e).__name__, e)
    return None


def _joined(fused: FusedPass, layers: list[Any]) -> FusedPass | None:
    """``fused`` with each layer's attention and MLP projections joined
    (:mod:`~mlxq.worker.joined_linear`), an MLP's only where its own call is
    ``down(swiglu(gate, up))`` (checked on one input); None where no layer has any."""
    qkv = tuple(joined_linear.join_attention(layer.self_attn) for layer in layers)
    gate_up = tuple(
        j if (j := joined_linear.join_mlp(layer.mlp)) and _swiglu(layer.mlp, j) else None
        for layer in layers
    )
    if not any(qkv) and not any(gate_up):
        return None
    return replace(fused, qkv=qkv if any(qkv) else (), gate_up=gate_up if any(gate_up) else ())


def _swiglu(mlp: Any, joined: Joined) -> bool:
    dims = mlp.gate_proj.weight.shape[1] * 32 // mlp.gate_proj.bits
    x = mx.random.normal((1, 2, dims), key=mx.random.key(0))
    x = x.astype(mlp.gate_proj.scales.dtype)
    return close(mlp(x), mlp.down_proj(swiglu(*joined(x))))


def head_rows() -> int:
    """:data:`HEAD_ROWS` where MLX runs on CUDA, else 0. ``MLXQ_HEAD_ROWS`` (a count of
    rows; 0: one product) wins, to compare the two on one machine."""
    given = os.environ.get(HEAD_ROWS_ENV)
    if given is not None:
        if given.strip().isdigit():
            return int(given)
        log.warning("%s=%r: not a count of rows; the default holds", HEAD_ROWS_ENV, given)
    return HEAD_ROWS if on_cuda() else 0


def _agrees(model: Any, fused: FusedPass) -> bool:
    """Whether a fused pass gives what the model's own two calls give: a batch of two rows
    (one left-padded) decoding a token, and a new row of three prompt tokens."""
    prompts, prompt = [[5, 6, 7, 8], [9, 10]], [11, 12, 13]

    def batch() -> list[Any]:
        caches = [BatchKVCache([0, 2]) for _ in model.layers]
        model(mx.array([prompts[0], [0, 0, *prompts[1]]]), cache=caches)
        return caches

    ours, theirs = batch(), batch()
    tokens = mx.array([3, 4])
    want = model(tokens[:, None], cache=theirs)[:, -1, :]
    want_new = model(mx.array([prompt]), cache=make_prompt_cache(model))[:, -1, :]
    got, got_new = fused(tokens, ours, prompt, make_prompt_cache(model))
    again = model(tokens[:, None], cache=theirs)[:, -1, :]
    got_again = fused.decode(tokens, ours)
    pairs = ((want, got), (want_new, got_new), (again, got_again))
    return all(close(a, b) for a, b in pairs)
