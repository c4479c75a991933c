"""What one queue served by several workers loses of the prompt cache, through Redis.

Each worker keeps its own prompt cache, and a job goes to whichever worker claims it first.
A sweep loses little: each worker prefills the shared prefix once. A chat resends its
history every turn, and a turn that lands on another worker than the last one finds less
of it cached. This runs the same chats (``--chats`` at once, ``--turns`` each, every turn
the whole history so far) against 1 worker, then against ``--workers`` workers, and
reports the share of prompt tokens served from the cache and the prefill tokens computed.
The difference is the most that routing a chat's turns to the worker holding its history
could win back.

Usage:
    python ops/bench_cache_workers.py                  # tiny model, CPU, a few minutes
    python ops/bench_cache_workers.py --workers 2 --chats 8 --turns 8 --model PATH
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from procs import start_redis, start_worker, stop

from mlxq.producer import Client
from mlxq.producer.info import collect

WORDS = ["the", "boats", "harbour", "dawn", "wind", "rope", "sail", "tide", "gull", "net"]
COUNTERS = (
    "prompt_tokens",
    "prompt_tokens_prefilled",
    "prompt_tokens_cached",
    "prompt_cache_queries",
    "prompt_cache_hits",
)


def start_workers(n: int, model: str, url: str, queue: str, work: Path, started: list[Any]) -> None:
    for i in range(n):
        extra = ["--max-batch", "16", "--prompt-cache-bytes", "auto"]
        start_worker(model, url, queue, work / f"worker{i}.log", extra, started=started)


def run_chats(url: str, queue: str, args: argparse.Namespace) -> float:
    client = Client(url, queue=queue)
    errors: list[BaseException] = []
    try:
        return _run_chats(client, args, errors)
    finally:
        client.close()


def _run_chats(client: Client, args: argparse.Namespace, errors: list[BaseException]) -> float:

    def chat(k: int) -> None:
        rng = random.Random(k)
        system = " ".join(rng.choice(WORDS) for _ in range(args.system_words))
        messages = [{"role": "system", "content": f"chat {k}: {system}"}]
        try:
            for turn in range(args.turns):
                words = " ".join(rng.choice(WORDS) for _ in range(args.user_words))
                messages.append({"role": "user", "content": f"{turn}: {words}"})
                res = client.submit(messages=messages, max_tokens=args.max_tokens).result(
                    timeout=600
                )
                messages.append({"role": "assistant", "content": res.text})
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=chat, args=(k,)) for k in range(args.chats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a chat failed: {errors[0]!r}")
    return time.perf_counter() - t0


def totals(url: str, queue: str, jobs: int) -> dict[str, int]:
    """The workers' counters summed, once their once-a-second stats count every job."""
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 30
    while True:
        ws = [w for w in collect(r)["workers"] if w["queue"] == queue and w["alive"]]
        out = {k: sum(int(w.get(k, 0)) for w in ws) for k in COUNTERS}
        if out["prompt_cache_queries"] >= jobs or time.monotonic() > deadline:
            return out
        time.sleep(0.3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="an mlx-lm model (default: build the tiny test model)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=120)
    p.add_argument("--user-words", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxq-cache-workers-"))
    model = args.model
    if model is None:
        from mlxq.worker.tiny import build_tiny_model

        model = str(build_tiny_model(work / "tiny", seed=0))
    rows = []
    for n in (1, args.workers):
        url, server = start_redis(work)
        queue = f"cw-{uuid.uuid4().hex[:6]}"
        procs: list[Any] = []
        try:
            start_workers(n, model, url, queue, work, procs)
            wall = run_chats(url, queue, args)
            t = totals(url, queue, args.chats * args.turns)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                stop(proc)
            stop(server)
        rows.append((n, wall, t))
    print(
        f"{args.chats} chats x {args.turns} turns, system prompt {args.system_words} words, "
        f"{args.user_words} words a turn, {args.max_tokens} tokens a reply, model {model}"
    )
    print(
        f"{'workers':>8}{'wall s':>9}{'prompt tok':>12}{'cached':>10}{'share':>8}{'prefilled':>11}"
    )
    for n, wall, t in rows:
        share = t["prompt_tokens_cached"] / max(1, t["prompt_tokens"])
        print(
            f"{n:>8}{wall:>9.1f}{t['prompt_tokens']:>12}{t['prompt_tokens_cached']:>10}"
            f"{share:>8.2f}{t['prompt_tokens_prefilled']:>11}"
        )
    (_, _, one), (_, _, many) = rows
    lost = (one["prompt_tokens_cached"] / max(1, one["prompt_tokens"])) - (
        many["prompt_tokens_cached"] / max(1, many["prompt_tokens"])
    )
    print(
        f"with {args.workers} workers {lost:.0%} of the prompt tokens that 1 worker took from "
        "its cache are prefilled again: the most routing could save"
    )


if __name__ == "__main__":
    main()
