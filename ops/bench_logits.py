"""Per-step cost of mlxq's batched logits processors and log-probs vs mlx-lm's per-row loop.

Times only the stage that differs, on random logits, all modes interleaved in one
run, best of N rounds (ms per decode step):

  none       no row has a processor: mlxq's apply() returns its input; mlx-lm
             skips its loop (``any(self.logits_processors)`` is false)
  pen-half   repetition 1.1, presence 0.5, frequency 0.5 and 10 logit_bias ids on
             half the rows (context 20, mlx-lm's default); the other half nothing
  pen-all    the same on every row
  pen-c256   as pen-half with context size 256
  lp-half    the chosen token's log-prob and the top 5 on half the rows
  lp20-half  the same with the top 20 (OpenAI's largest)

mlxq's side is ``apply`` plus ``TokenHistory.append``, or ``step_logprobs`` plus
``to_host``. mlx-lm's side is ``GenerationBatch._step``'s processor block (a
``TokenBuffer.update_and_fetch`` and the row's processors on its own slice, a
concatenate), or what ``mlx_lm.server`` does per row for log-probs (``.item()``
of the chosen token, an argpartition, ``.tolist()``). The scale: ``logsumexp``
is what every step pays to normalize the logits anyway.

Usage:
    python ops/bench_logits.py                      # B = 64, V = 151,936, float32
    python ops/bench_logits.py --dtype bfloat16 --rounds 10
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import make_logits_processors

from mlxq.batching.history import TokenHistory
from mlxq.batching.logits import LogitsRows, apply
from mlxq.batching.logprobs import LogprobRows, step_logprobs, to_host
from mlxq.producer.logits_params import LogitsParams

POOL = 3  # distinct logits arrays cycled through, so no step reads a cached result


def penalties(context: int, bias_ids: list[int]) -> LogitsParams:
    return LogitsParams(
        repetition_penalty=1.1,
        repetition_context_size=context,
        presence_penalty=0.5,
        presence_context_size=context,
        frequency_penalty=0.5,
        frequency_context_size=context,
        logit_bias=dict.fromkeys(bias_ids, -3.0),
    )


class PenaltyCase:
    """Both sides of one penalty scenario, each keeping its own token history."""

    def __init__(self, params: list[LogitsParams | None], prompts: list[list[int]], vocab: int):
        self.rows = LogitsRows.from_params(params, vocab)
        sizes = [p.context_size if p else 0 for p in params]
        self.history = TokenHistory.from_prompts(prompts, sizes, vocab_size=vocab)
        self.procs = [_mlx_lm_processors(p) for p in params]
        self.buffers = [TokenBuffer(t[:-1]) for t in prompts]

    def mlxq(self, logits: mx.array, tokens: mx.array) -> None:
        out = apply(logits, self.history, self.rows)
        self.history = self.history.append(tokens)
        mx.eval(out, self.history.tokens, self.history.generated)

    def mlx_lm(self, logits: mx.array, tokens: mx.array) -> None:
        if not any(self.procs):
            return
        processed, contexts = [], []
        for e, procs in enumerate(self.procs):
            row = logits[e : e + 1]
            if procs:
                context = self.buffers[e].update_and_fetch(tokens[e : e + 1])
                contexts.append(context)
                for proc in procs:
                    row = proc(context, row)
            processed.append(row)
        mx.eval(mx.concatenate(processed, axis=0), contexts)


def _mlx_lm_processors(p: LogitsParams | None) -> list[Any]:
    if p is None:
        return []
    return make_logits_processors(
        logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        repetition_penalty=p.repetition_penalty,
        repetition_context_size=p.repetition_context_size,
        presence_penalty=p.presence_penalty,
        presence_context_size=p.presence_context_size,
        frequency_penalty=p.frequency_penalty,
        frequency_context_size=p.frequency_context_size,
    )


class LogprobCase:
    def __init__(self, requested: list[int | None]) -> None:
        self.rows = LogprobRows.from_requests(requested)
        self.requested = requested

    def mlxq(self, logprobs: mx.array, tokens: mx.array) -> None:
        step = step_logprobs(logprobs, tokens, self.rows)
        to_host(step, self.rows)

    def mlx_lm(self, logprobs: mx.array, tokens: mx.array) -> None:
        rows = list(logprobs)  # GenerationBatch splits every step, asked or not
        toks = tokens.tolist()
        for e, k in enumerate(self.requested):
            if k is None:
                continue
            lp = rows[e]
            lp[toks[e]].item()  # type: ignore[index]
            idx = mx.argpartition(-lp, kth=k - 1)[:k].tolist()
            lp[idx].tolist()


def _once(fn: Callable[[mx.array, mx.array], None], x: mx.array, tokens: mx.array) -> float:
    t0 = time.perf_counter()
    fn(x, tokens)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="rows (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", help="logits dtype (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="best of N (default: %(default)s)")
    args = ap.parse_args()
    b, v = args.batch, args.vocab
    rng = np.random.default_rng(0)
    dtype = getattr(mx, args.dtype)
    logits = [
        mx.array(rng.normal(size=(b, v)).astype(np.float32) * 3).astype(dtype) for _ in range(POOL)
    ]
    logprobs = [x - mx.logsumexp(x, axis=-1, keepdims=True) for x in logits]
    mx.eval(logits, logprobs)
    # Prompts and sampled tokens from a narrow range, so windows hold repeats.
    prompts = [[int(t) for t in rng.integers(0, 2000, size=args.prompt)] for _ in range(b)]
    tokens = mx.array(rng.integers(0, 2000, size=b), dtype=mx.uint32)
    bias_ids = [int(t) for t in rng.choice(v, 10, replace=False)]
    half = [i % 2 == 0 for i in range(b)]
    pen = {
        "none": [None] * b,
        "pen-half": [penalties(20, bias_ids) if h else None for h in half],
        "pen-all": [penalties(20, bias_ids)] * b,
        "pen-c256": [penalties(256, bias_ids) if h else None for h in half],
    }
    lps = {
        "lp-half": [5 if h else None for h in half],
        "lp20-half": [20 if h else None for h in half],
    }
    cases: dict[str, Any] = {name: PenaltyCase(p, prompts, v) for name, p in pen.items()}
    cases.update({name: LogprobCase(r) for name, r in lps.items()})

    def norm(x: mx.array, _: mx.array) -> None:
        mx.eval(x - mx.logsumexp(x, axis=-1, keepdims=True))

    print(
        f"B={b} V={v} {args.dtype} prompt={args.prompt} best of {args.rounds}, "
        f"{mx.default_device()}"
    )
    scale = min(_once(norm, logits[i % POOL], tokens) for i in range(args.rounds))
    print(f"{'scale: logsumexp':<18}{scale:>9.2f} ms")
    print(f"{'mode':<12}{'mlxq ms':>10}{'mlx-lm ms':>11}{'mlx-lm/mlxq':>13}")
    for name, case in cases.items():
        inputs = logprobs if name.startswith("lp") else logits
        for fn in (case.mlxq, case.mlx_lm):  # warm-up: compiles, allocations
            fn(inputs[0], tokens)
        ours, theirs = float("inf"), float("inf")
        for i in range(args.rounds):  # interleaved, so drift hits both sides alike
            ours = min(ours, _once(case.mlxq, inputs[i % POOL], tokens))
            theirs = min(theirs, _once(case.mlx_lm, inputs[i % POOL], tokens))
        # Under 0.1 ms neither side does any real work: no ratio.
        ratio = f"{theirs / ours:>12.1f}x" if min(ours, theirs) > 0.1 else f"{'-':>13}"
        print(f"{name:<12}{ours:>10.2f}{theirs:>11.2f}{ratio}")


if __name__ == "__main__":
    main()
