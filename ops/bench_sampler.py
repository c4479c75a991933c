"""How much one vectorized sampling call per step buys inside mlx-lm's BatchGenerator.

Drives ``mlx_lm.generate.BatchGenerator`` on a random-weight Llama-shaped model
(no downloads) for N decode steps at several batch sizes, all modes side by side
in one run:

  a  per-row   every row its own make_sampler object (mlx-lm's per-row loop)
  b  shared    one make_sampler object for the batch (homogeneous params only)
  c  vec-homog mlxq.batching.sampler.sample, every row the same params
  d  vec-mixed mlxq sample, rows in 4 param groups (top_p, top_k, min_p, greedy)
  e  row-mixed the same 4 groups as per-row make_sampler objects

``--micro`` instead times the sampler alone on random log-probs, which is how the
choices in batching/sampler.py were made (candidates vs full sort, mlxq vs
mlx-lm's own sampler for homogeneous batches).

Usage:
    python ops/bench_sampler.py                      # tiny model, a couple of minutes on CPU
    python ops/bench_sampler.py --shape 0.5b --tokens 16 --json out.json
    python ops/bench_sampler.py --micro
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.sample_utils import make_sampler

from mlxq.batching.sampler import NUM_CANDIDATES, RowParams, default_num_candidates, sample
from mlxq.producer.params import SamplingParams as SP

Sampler = Callable[[mx.array], mx.array]

#: Llama-shaped dims; 0.5b / 1.5b are Qwen2.5's (without its qkv bias), 4-bit.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32_000,
    ),
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151_936,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151_936,
    ),
}
HOMOGENEOUS = SP(temperature=0.7, top_p=0.9)
GROUPS = [
    SP(temperature=0.7, top_p=0.9),
    SP(temperature=1.0, top_k=40),
    SP(temperature=0.8, min_p=0.05),
    SP(temperature=0.0),
]
MODES = ("a", "b", "c", "d", "e")


def build_model(shape: str, vocab: int | None, logit_std: float, dtype: str = "float32") -> Model:
    """A random-weight model whose next-token logits have std ``logit_std``.

    Random weights give near-uniform logits, where every nucleus spans most of
    the vocabulary; a real model's are peaked. Scaling the final norm sets how
    peaked, and the run prints the nucleus sizes it produced.
    """
    dims = dict(SHAPES[shape])
    if vocab:
        dims["vocab_size"] = vocab
    model = Model(
        ModelArgs(
            model_type="llama", rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=True, **dims
        )
    )
    # Real checkpoints run in half precision; float32 activations would make every
    # forward pass (and the 152k-wide logits) several times slower than in use.
    model.set_dtype(getattr(mx, dtype))
    if shape != "tiny":
        nn.quantize(model, group_size=64, bits=4)
    probe = model(mx.random.randint(0, dims["vocab_size"], (4, 8)))[:, -1]
    scale = logit_std / max(float(probe.std()), 1e-6)
    model.model.norm.weight = model.model.norm.weight * scale
    mx.eval(model.parameters())
    return model


def nucleus_sizes(logprobs: np.ndarray, top_p: float = 0.9) -> list[int]:
    """Tokens each row's top_p nucleus keeps (mlx-lm's rule)."""
    p = np.sort(np.exp(logprobs.astype(np.float64)), axis=-1)[:, ::-1]
    return [int(n) for n in ((np.cumsum(p, -1) - p) < top_p).sum(-1)]


def vectorized(params: Sequence[SP]) -> Sampler:
    """mlxq's one-call sampler over a fixed batch, counting positions itself."""
    rows = RowParams.from_params(params)
    step = [0]

    def sampler(logprobs: mx.array) -> mx.array:
        if logprobs.shape[0] != len(params):
            raise ValueError(f"batch of {logprobs.shape[0]}, params for {len(params)}")
        positions = mx.full((len(params),), step[0], dtype=mx.int32)
        step[0] += 1
        return sample(logprobs, rows, positions)

    return sampler


def plain(p: SP) -> Sampler:
    return make_sampler(p.temperature, p.top_p, p.min_p, top_k=p.top_k)


def samplers_for(mode: str, b: int) -> tuple[Sampler | None, list[Sampler] | None]:
    """(fallback sampler, per-row samplers) for one mode at batch size b."""
    mixed = [GROUPS[i % len(GROUPS)] for i in range(b)]
    if mode == "a":
        return None, [plain(HOMOGENEOUS) for _ in range(b)]
    if mode == "b":
        return plain(HOMOGENEOUS), None
    if mode == "c":
        return vectorized([HOMOGENEOUS] * b), None
    if mode == "d":
        return vectorized(mixed), None
    return None, [plain(p) for p in mixed]


def decode_rate(
    model: Model,
    mode: str,
    b: int,
    tokens: int,
    prompt_len: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Generated tokens per second of ``clock`` over ``tokens`` decode steps, prefill
    excluded."""
    fallback, per_row = samplers_for(mode, b)
    vocab = model.args.vocab_size
    gen = BatchGenerator(
        model,
        max_tokens=tokens + 1,
        stop_tokens=None,
        sampler=fallback,
        completion_batch_size=b,
        prefill_batch_size=b,
    )
    try:
        prompts = mx.random.randint(0, vocab, (b, prompt_len)).tolist()
        uids = gen.insert(prompts, samplers=per_row)
        first = gen.next_generated()  # prefill + the first token: not timed
        if [r.uid for r in first] != uids:
            raise RuntimeError("generation rows are not in insertion order")
        count, start = 0, clock()
        while responses := gen.next_generated():
            count += len(responses)
        return count / (clock() - start)
    finally:
        gen.close()


def run_batch(model: Model, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each batch size: every mode once per round, interleaved; the best round counts,
    since on a shared machine other load only ever slows a run down."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for b in args.batch_sizes:
        rate = dict.fromkeys(MODES, 0.0)
        for _ in range(args.rounds):
            for m in MODES:
                r = decode_rate(model, m, b, args.tokens, args.prompt_len, clock)
                rate[m] = max(rate[m], r)
        rows.append(
            {
                "batch": b,
                **{f"tok_s_{m}": rate[m] for m in MODES},
                "vec_vs_shared": rate["c"] / rate["b"],
                "mixed_vs_homog": rate["d"] / rate["c"],
                "vec_vs_rowloop_mixed": rate["d"] / rate["e"],
                "vec_vs_rowloop_homog": rate["c"] / rate["a"],
            }
        )
        print(_format(rows[-1]), flush=True)
    return rows


def _format(r: dict[str, Any]) -> str:
    rates = " ".join(f"{r[f'tok_s_{m}']:9.1f}" for m in MODES)
    return (
        f"{r['batch']:>4} {rates} {r['vec_vs_shared']:7.2f} {r['mixed_vs_homog']:7.2f}"
        f" {r['vec_vs_rowloop_mixed']:7.2f} {r['vec_vs_rowloop_homog']:7.2f}"
    )


def _time_ms(fn: Callable[[], mx.array], reps: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def micro_case(x: mx.array, params: list[SP], reps: int) -> dict[str, float]:
    """Milliseconds per call: mlxq (candidates / full sort) vs mlx-lm's sampler(s)."""
    pos = mx.zeros((x.shape[0],), dtype=mx.int32)
    cand, full = RowParams.from_params(params, NUM_CANDIDATES), RowParams.from_params(params, 0)
    out = {
        "mlxq_candidates": _time_ms(lambda: sample(x, cand, pos), reps),
        "mlxq_full_sort": _time_ms(lambda: sample(x, full, pos), reps),
    }
    if cand.homogeneous:
        shared = plain(params[0])
        out["mlx_lm_shared"] = _time_ms(lambda: shared(x), reps)
    else:
        loop = [plain(p) for p in params]
        out["mlx_lm_row_loop"] = _time_ms(
            lambda: mx.concatenate([s(x[i : i + 1]) for i, s in enumerate(loop)]), reps
        )
    return out


def few_sampled(b: int) -> dict[str, list[SP]]:
    """A greedy sweep's batch with one or two seeded chat rows in it (how an interactive
    job rides beside a sweep), and the same batch all greedy: what those rows cost the
    step. (``mlxq_candidates`` there draws the sampled rows apart from the greedy ones;
    ``mlxq_full_sort``, a GPU's default, draws every row in one pass.)"""
    greedy = SP(temperature=0.0)
    chat = [SP(temperature=0.7, seed=k) for k in range(1, 3)]
    out = {"greedy": [greedy]}
    for n in (1, 2):
        if b > n:
            out[f"{n}seeded"] = chat[:n] + [greedy] * (b - n)
    return out


def run_micro(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = {
        "top_p": [HOMOGENEOUS],
        "top_k": [GROUPS[1]],
        "min_p": [GROUPS[2]],
        "temp": [SP(temperature=1.0)],
        "mixed4": GROUPS,
    }
    rows = []
    for vocab in (1024, 151_936):
        for b in args.batch_sizes:
            for dist, std in (("peaked", 5.0), ("flat", 1.0)):
                x = mx.random.normal((b, vocab)) * std
                x = x - mx.logsumexp(x, axis=-1, keepdims=True)
                median_nucleus = statistics.median(nucleus_sizes(np.array(x)))
                for name, groups in {**cases, **few_sampled(b)}.items():
                    params = [groups[i % len(groups)] for i in range(b)]
                    ms = micro_case(x, params, args.reps)
                    rows.append(
                        {
                            "vocab": vocab,
                            "batch": b,
                            "dist": dist,
                            "case": name,
                            "nucleus_0.9": median_nucleus,
                            **ms,
                        }
                    )
                    cells = " ".join(f"{k}={v:.2f}" for k, v in ms.items())
                    print(f"V={vocab:<6} B={b:<3} {dist:<6} {name:<6} {cells}", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--vocab", type=int, default=None, help="override the shape's vocabulary")
    ap.add_argument("--tokens", type=int, default=16, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode; the best counts")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: tokens per CPU-second of this process, steadier when "
        "other work shares the machine",
    )
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument(
        "--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64]
    )
    ap.add_argument(
        "--logit-std",
        type=float,
        default=5.0,
        help="std of the random model's logits (5: nuclei of tens of tokens)",
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model dtype (default: bfloat16 for 0.5b/1.5b, float32 for tiny)",
    )
    ap.add_argument("--micro", action="store_true", help="time the sampler alone instead")
    ap.add_argument("--reps", type=int, default=5, help="--micro: calls per timing")
    ap.add_argument("--json", metavar="OUT", help="also write the results here")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.shape == "tiny" else "bfloat16"
    mx.random.seed(0)
    result: dict[str, Any] = {"args": vars(args), "device": str(mx.default_device())}
    if args.micro:
        result["micro"] = run_micro(args)
    else:
        model = build_model(args.shape, args.vocab, args.logit_std, args.dtype)
        probe = model(mx.random.randint(0, model.args.vocab_size, (64, 8)))[:, -1]
        sizes = nucleus_sizes(
            np.array((probe - mx.logsumexp(probe, -1, keepdims=True)).astype(mx.float32))
        )
        result["nucleus_0.9"] = {"median": statistics.median(sizes), "max": max(sizes)}
        print(
            f"shape={args.shape} vocab={model.args.vocab_size} tokens={args.tokens} "
            f"top_p=0.9 nucleus median={statistics.median(sizes)} max={max(sizes)}"
        )
        print(
            f"device={mx.default_device()} dtype={args.dtype} mlxq candidates="
            f"{default_num_candidates() or 'none (one sync-free sort)'}; tokens per "
            f"{args.clock}-clock second; best of {args.rounds} rounds"
        )
        print(
            "   B      a:row     b:shr     c:vec   d:vecmix  e:rowmix   c/b     d/c     d/e     c/a"
        )
        result["batch"] = run_batch(model, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
