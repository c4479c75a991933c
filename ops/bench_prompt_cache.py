"""What the prompt cache buys an eval sweep: N jobs sharing a long prefix, cache off and on
side by side in one run, on the worker's own engine (no Redis: prefill is what changes).

Every job is the same prefix of ``--prefix`` random tokens, then ``--suffix`` tokens of
its own, greedy, ``--max-tokens`` out; the engine admits jobs whenever rows are free, as
the worker does. Reported per mode: prompt tokens run through the model, wall time, the
cache's lookups and hits; then the off/on ratios, and whether every job's tokens are the
same in both modes (they must be).

With ``--chat-turns N`` it runs a chat instead: N turns, each resending the whole history
(system prompt, every user message and reply so far) through the model's chat template,
on an idle engine; it reports each turn's time to first token, cache off and on, and the
last turn's over the first's.

Usage:
    python ops/bench_prompt_cache.py                       # tiny model, ~a minute on CPU
    python ops/bench_prompt_cache.py --chat-turns 20       # the 20-turn chat
    python ops/bench_prompt_cache.py --jobs 2000 --prefix 1000 --suffix 30 \\
        --max-tokens 16 --batch 64 --shape 0.5b            # the issue's GPU target
    python ops/bench_prompt_cache.py --model PATH --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any

import mlx.core as mx
import mlx_lm

from mlxq.producer.params import GenerationRequest
from mlxq.worker.engine import Engine
from mlxq.worker.jobs import Job, apply_deltas

#: With ``--trace``: seconds spent in each of these, where a cached run's time goes.
PHASES: dict[str, float] = {}


def _timed(owner: Any, name: str, label: str, sync: bool) -> None:
    """Wrap ``owner.name`` (a method or classmethod) to add its seconds to PHASES[label];
    with ``sync``, wait for the device after each call so its work is counted there."""
    raw = owner.__dict__[name]
    func = raw.__func__ if isinstance(raw, classmethod) else raw

    def wrapper(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return func(*a, **kw)
        finally:
            if sync:
                mx.synchronize()
            PHASES[label] = PHASES.get(label, 0.0) + time.perf_counter() - t

    setattr(owner, name, classmethod(wrapper) if isinstance(raw, classmethod) else wrapper)


def trace_phases(sync: bool) -> None:
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache

    from mlxq.worker import kv_merge, prompt_cache

    for owner, name, label in [
        (prompt_cache.PromptCache, "fetch", "cache fetch"),
        (prompt_cache.PromptCache, "store_many", "cache store"),
        (prompt_cache.PromptCache, "prefill_shared", "shared prefill"),
        (kv_merge.RowKV, "merge", "merge (one entry)"),
        (BatchKVCache, "merge", "merge (mlx-lm)"),
        (PromptProcessingBatch, "prompt", "prefill"),
        (GenerationBatch, "next", "decode"),
    ]:
        _timed(owner, name, label, sync)


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    out = tempfile.mkdtemp(prefix="mlxq-bench-pc-")
    if args.shape == "tiny-test":
        from mlxq.worker.tiny import build_tiny_model

        return str(build_tiny_model(out, seed=0))
    from mlxq.worker.random_model import build_random_model

    return str(build_random_model(out, shape=args.shape))


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo = 16  # past the special tokens
    prefix = [rng.randrange(lo, vocab) for _ in range(args.prefix)]
    return [
        prefix + [rng.randrange(lo, vocab) for _ in range(args.suffix)] for _ in range(args.jobs)
    ]


def run(
    model: Any, tok: Any, prompts: list[list[int]], args: argparse.Namespace, cache_bytes: int
) -> dict[str, Any]:
    engine = Engine(model, tok, max_batch=args.batch, prompt_cache_bytes=cache_bytes)
    req = GenerationRequest(prompt="x", max_tokens=args.max_tokens)
    PHASES.clear()
    jobs = []
    for i, ids in enumerate(prompts):
        job = Job(f"j{i}", req, ids)
        job.start("bench")
        jobs.append(job)
    pending = list(jobs)
    t0 = last = time.perf_counter()
    admits, in_add, in_step = 0, 0.0, 0.0
    while pending or engine.active:
        if pending and engine.free_slots:
            n = engine.free_slots
            a = time.perf_counter()
            engine.add(pending[:n])
            in_add += time.perf_counter() - a
            pending = pending[n:]
            admits += 1
            if args.trace and admits % args.trace == 0:
                now = time.perf_counter()
                pc = engine.prompt_cache
                phases = ", ".join(f"{k} {v:.2f}" for k, v in PHASES.items())
                print(
                    f"  cache={cache_bytes} admit {admits}: {now - t0:.2f} s "
                    f"(last {now - last:.2f} s), "
                    f"add {in_add:.2f} s, step {in_step:.2f} s, active memory "
                    f"{mx.get_active_memory() / 2**30:.2f} GiB, entries {len(pc) if pc else 0}, "
                    f"counted {engine.prompt_cache_bytes / 2**30:.2f} GiB; s in {phases}",
                    flush=True,
                )
                last = now
        s = time.perf_counter()
        apply_deltas(engine.step())
        in_step += time.perf_counter() - s
    wall = time.perf_counter() - t0
    c = engine.counters
    return {
        "cache_bytes": cache_bytes,
        "wall_s": round(wall, 3),
        "prompt_tokens": c.prompt_tokens,
        "prompt_tokens_prefilled": c.prompt_tokens_prefilled,
        "prompt_cache_queries": c.prompt_cache_queries,
        "prompt_cache_hits": c.prompt_cache_hits,
        "prompt_tokens_cached": c.prompt_tokens_cached,
        "prompt_cache_bytes_end": engine.prompt_cache_bytes,
        "tokens_generated": c.tokens_generated,
        "outputs": [j.token_ids for j in jobs],
    }


def decode_floor(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """What mlx-lm's own BatchGenerator spends decoding the sweep, prefill left out: the
    bound under any queue built on it, however cheap its prefill.

    Three batches of the sweep's prompts, each prefilled untimed; then its decode steps
    timed from the device's idle to the last row's end. A job's first token comes from its
    prefill, so the sweep needs ``max_tokens - 1`` decode steps a batch, ``jobs / batch``
    batches (the last, partial batch counted pro rata: a floor, not an estimate)."""
    from mlx_lm.generate import BatchGenerator

    steps_s = []
    for r in range(3):
        rows = prompts[r * args.batch : (r + 1) * args.batch]
        gen = BatchGenerator(
            model,
            max_tokens=args.max_tokens,
            completion_batch_size=len(rows),
            prefill_batch_size=len(rows),
        )
        gen.insert(rows)
        started = 0
        while started < len(rows):  # prefill, untimed
            prefilled, _ = gen.next()
            started += sum(1 for o in prefilled if o.end_of_prompt)
        mx.synchronize()
        t, steps, ended = time.perf_counter(), 0, 0
        while ended < len(rows):
            _, out = gen.next()
            steps += 1
            ended += sum(1 for o in out if o.finish_reason is not None)
        mx.synchronize()
        steps_s.append((time.perf_counter() - t) / steps)
        gen.close()
    step = sorted(steps_s)[1]
    return {
        "decode_step_ms": round(step * 1e3, 2),
        "floor_s": round(step * (args.max_tokens - 1) * args.jobs / args.batch, 2),
    }


WORDS = [
    "the",
    "boats",
    "harbour",
    "dawn",
    "wind",
    "rope",
    "sail",
    "tide",
    "gull",
    "net",
    "lamp",
    "stone",
    "quay",
    "bell",
    "fog",
]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(model: Any, tok: Any, args: argparse.Namespace, cache_bytes: int) -> dict[str, Any]:
    """One chat of ``args.chat_turns`` turns on an idle engine; each turn's TTFT."""
    engine = Engine(model, tok, max_batch=args.batch, prompt_cache_bytes=cache_bytes)
    rng = random.Random(args.seed)
    messages = [{"role": "system", "content": _words(rng, args.prefix)}]
    ttfts, lengths, replies = [], [], []
    for turn in range(args.chat_turns):
        messages.append({"role": "user", "content": f"{turn}: " + _words(rng, args.suffix)})
        req = GenerationRequest(messages=messages, max_tokens=args.max_tokens)
        job = Job(f"turn{turn}", req, engine.encode(req))
        job.start("bench")
        t0 = time.perf_counter()
        engine.add([job])
        while not job.choices[0].generated:
            apply_deltas(engine.step())
        ttfts.append(time.perf_counter() - t0)
        while engine.active:
            apply_deltas(engine.step())
        lengths.append(len(job.prompt_ids))
        replies.append(job.token_ids)
        text = tok.decode(job.token_ids)
        messages.append({"role": "assistant", "content": text})
    return {
        "ttft_ms": [round(t * 1e3, 2) for t in ttfts],
        "prompt_tokens": lengths,
        "prompt_tokens_cached": engine.counters.prompt_tokens_cached,
        "outputs": replies,
    }


def main_chat(model: Any, tok: Any, path: str, args: argparse.Namespace) -> None:
    print(
        f"model {path}: a {args.chat_turns}-turn chat, system prompt of {args.prefix} words, "
        f"{args.suffix} words a user turn, {args.max_tokens} tokens a reply"
    )
    # Warm-up, both modes, on a chat of other lengths: kernels get compiled, but the
    # measured turns, the first and the last alike, meet their shapes for the first time
    # (MLX's CUDA backend plans attention per shape; a worker that has run a while has
    # seen most of them: --chat-repeat shows that).
    warm = argparse.Namespace(
        **{**vars(args), "chat_turns": 3, "prefix": args.prefix + 17, "seed": args.seed + 1}
    )
    chat(model, tok, warm, 0)
    chat(model, tok, warm, args.cache_bytes)
    # Cache on first, so that its first turn (a miss) meets its shapes for the first time
    # as its last turn does; cache off, run after, finds its first turn's shapes seen.
    on = chat(model, tok, args, args.cache_bytes)
    off = chat(model, tok, args, 0)
    runs = [("cache off", off), ("cache on", on)]
    if args.chat_repeat:
        # The same chat again, cache on, in the same process: every kernel its shapes
        # need is compiled by now, so this is the steady state of a long-running worker.
        runs.append(("cache on, again", chat(model, tok, args, args.cache_bytes)))
    print(f"{'turn':>4}{'prompt tokens':>15}" + "".join(f"{n + ' ms':>20}" for n, _ in runs))
    for i, n in enumerate(off["prompt_tokens"]):
        print(f"{i + 1:>4}{n:>15}" + "".join(f"{r['ttft_ms'][i]:>20.1f}" for _, r in runs))
    for name, r in runs:
        first, last = r["ttft_ms"][0], r["ttft_ms"][-1]
        print(f"{name}: TTFT last turn / first = {last:.1f} / {first:.1f} ms = {last / first:.2f}x")
    same = off["outputs"] == on["outputs"]
    print(f"outputs identical: {same}")
    for turn, (a, b) in enumerate(zip(off["outputs"], on["outputs"], strict=True)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            print(f"  turn {turn + 1}: replies differ from token {at} of {len(a)}")
            break  # every later turn's prompt differs too
    if args.json:
        doc = {"args": vars(args), "model": path, "outputs_identical": same}
        doc.update(
            {
                k: {x: y for x, y in r.items() if x != "outputs"}
                for k, r in (("off", off), ("on", on))
            }
        )
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="an mlx-lm model directory (default: a random one, --shape)")
    p.add_argument(
        "--shape",
        default="tiny",
        choices=["tiny-test", "tiny", "0.5b", "1.5b"],
        help="random model when --model is not given; tiny-test: the test suite's model",
    )
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--prefix", type=int, default=500, help="shared prefix tokens")
    p.add_argument("--suffix", type=int, default=10, help="tokens of each job's own")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cache-bytes", type=int, default=1 << 30, help="the cached run's budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat-turns",
        type=int,
        default=0,
        help="run a chat of this many turns instead of the sweep (--prefix: system prompt "
        "words, --suffix: words a user turn, --max-tokens: tokens a reply)",
    )
    p.add_argument(
        "--chat-repeat",
        action="store_true",
        help="with --chat-turns, run the cached chat a second time in the same process "
        "and show its TTFT too (kernels compiled by then)",
    )
    p.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="N",
        help="every N admissions, print the time so far (in add and in step, and in each "
        "phase: lookups, stores, merges, prefill, decode), active memory and the cache's "
        "entries (default: 0, quiet)",
    )
    p.add_argument(
        "--trace-sync",
        action="store_true",
        help="with --trace, wait for the device after each phase so its GPU time is "
        "counted there (slower; default: off)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time mlx-lm's own BatchGenerator decoding the sweep (prefill left out): "
        "the least wall time any queue built on it could reach",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    if args.floor and args.jobs < 3 * args.batch:
        p.error(f"--floor times three batches: --jobs {args.jobs} < 3 x --batch {args.batch}")
    if args.trace:
        trace_phases(args.trace_sync)
    path = _model_path(args)
    loaded = mlx_lm.load(path)
    model, tok = loaded[0], loaded[1]
    if args.chat_turns:
        return main_chat(model, tok, path, args)
    vocab = len(tok.vocab)
    prompts = _prompts(args, vocab)
    print(
        f"model {path}: {args.jobs} jobs, prefix {args.prefix} + {args.suffix} tokens, "
        f"{args.max_tokens} out, batch {args.batch}"
    )
    # Warm-up, both modes: MLX's CUDA backend compiles each kernel the first time a
    # process on the machine needs it (cached on disk after), and the cached path needs
    # kernels the plain one does not (the broadcast merge, a prefill on top of a cache).
    run(model, tok, prompts[: args.batch], args, 0)
    run(model, tok, prompts[: 2 * args.batch], args, args.cache_bytes)
    off = run(model, tok, prompts, args, 0)
    on = run(model, tok, prompts, args, args.cache_bytes)
    same = off["outputs"] == on["outputs"]
    print(f"{'':24}{'cache off':>14}{'cache on':>14}{'off/on':>10}")
    for key in ("prompt_tokens_prefilled", "wall_s"):
        ratio = off[key] / on[key] if on[key] else float("inf")
        print(f"{key:24}{off[key]:>14}{on[key]:>14}{ratio:>9.1f}x")
    for key in ("prompt_tokens", "prompt_cache_queries", "prompt_cache_hits"):
        print(f"{key:24}{off[key]:>14}{on[key]:>14}")
    print(
        f"{'prompt_tokens_cached':24}{off['prompt_tokens_cached']:>14}{on['prompt_tokens_cached']:>14}"
    )
    print(f"{'cache bytes at the end':24}{0:>14}{on['prompt_cache_bytes_end']:>14}")
    print(f"outputs identical: {same}")
    floor = decode_floor(model, prompts, args) if args.floor else None
    if floor:
        print(
            f"mlx-lm BatchGenerator alone: {floor['decode_step_ms']} ms a decode step at batch "
            f"{args.batch}, so decoding the sweep takes at least {floor['floor_s']} s; "
            f"cache off's wall / on's at most {off['wall_s'] / floor['floor_s']:.2f}x"
        )
    if args.json:
        doc = {
            "args": vars(args),
            "decode_floor": floor,
            "model": path,
            "off": {k: v for k, v in off.items() if k != "outputs"},
            "on": {k: v for k, v in on.items() if k != "outputs"},
            "outputs_identical": same,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if not same:
        raise SystemExit("outputs differ between cache off and on")


if __name__ == "__main__":
    main()
