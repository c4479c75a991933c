"""What one queue served by several workers loses of the prompt cache, and what routing
wins back, through Redis.

Each worker keeps its own prompt cache. A sweep loses little: each worker prefills the
shared prefix once. A chat resends its history every turn, and a turn that lands on
another worker than the last one finds less of it cached, unless the worker that claims
it hands it to the one holding its history (routing, on by default). This runs the same
chats (``--chats`` at once, ``--turns`` each, every turn the whole history so far)
against 1 worker, then ``--workers`` workers with ``--no-routing``, then with routing, and
reports the wall time, the mean time to each turn's first token, the share of prompt
tokens served from the cache and the prefill tokens computed.

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


def start_workers(
    n: int,
    routing: bool,
    args: argparse.Namespace,
    url: str,
    queue: str,
    work: Path,
    started: list[Any],
) -> None:
    model = args.model
    for i in range(n):
        extra = ["--max-batch", str(args.max_batch), "--prompt-cache-bytes", "auto"]
        extra += [] if routing else ["--no-routing"]
        start_worker(model, url, queue, work / f"worker{i}.log", extra, started=started)


def run_chats(url: str, queue: str, args: argparse.Namespace) -> tuple[float, float]:
    """Wall time of the whole run and the mean time to each turn's first token (s)."""
    client = Client(url, queue=queue)
    errors: list[BaseException] = []
    firsts: list[float] = []
    try:
        wall = _run_chats(client, args, errors, firsts)
        return wall, sum(firsts) / max(1, len(firsts))
    finally:
        client.close()


def _run_chats(
    client: Client, args: argparse.Namespace, errors: list[BaseException], firsts: list[float]
) -> float:

    def chat(k: int) -> None:
        rng = random.Random(k)
        system = " ".join(rng.choice(WORDS) for _ in range(args.system_words))
        messages = [{"role": "system", "content": f"chat {k}: {system}"}]
        try:
            for turn in range(args.turns):
                words = " ".join(rng.choice(WORDS) for _ in range(args.user_words))
                messages.append({"role": "user", "content": f"{turn}: {words}"})
                t0 = time.perf_counter()
                job = client.submit(messages=messages, max_tokens=args.max_tokens)
                first = None
                for chunk in job.stream(timeout=600):
                    if first is None and chunk.text:
                        first = time.perf_counter() - t0
                if first is not None:
                    firsts.append(first)
                messages.append({"role": "assistant", "content": job.result(timeout=600).text})
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
            out["spread"] = "/".join(str(w.get("jobs_finished", 0)) for w in ws)  # type: ignore[assignment]
            out["handed"] = sum(int(w.get("jobs_handed_out", 0)) for w in ws)
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
    p.add_argument("--max-batch", type=int, default=16, help="each worker's (default: 16)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxq-cache-workers-"))
    if args.model is None:
        from mlxq.worker.tiny import build_tiny_model

        args.model = str(build_tiny_model(work / "tiny", seed=0))
    model = args.model
    rows = []
    for n, routing in ((1, True), (args.workers, False), (args.workers, True)):
        url, server = start_redis(work)
        queue = f"cw-{uuid.uuid4().hex[:6]}"
        procs: list[Any] = []
        try:
            start_workers(n, routing, args, url, queue, work, procs)
            wall, first = run_chats(url, queue, args)
            t = totals(url, queue, args.chats * args.turns)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                stop(proc)
            stop(server)
        rows.append((n, routing, wall, first, t))
    print(
        f"{args.chats} chats x {args.turns} turns, system prompt {args.system_words} words, "
        f"{args.user_words} words a turn, {args.max_tokens} tokens a reply, model {model}"
    )
    print(
        f"{'workers':>8}{'routing':>9}{'wall s':>9}{'ttft ms':>9}{'prompt tok':>12}"
        f"{'cached':>10}{'share':>8}{'prefilled':>11}{'jobs each':>11}{'handed':>8}"
    )
    for n, routing, wall, first, t in rows:
        share = t["prompt_tokens_cached"] / max(1, t["prompt_tokens"])
        print(
            f"{n:>8}{'on' if routing else 'off':>9}{wall:>9.1f}{first * 1000:>9.1f}"
            f"{t['prompt_tokens']:>12}{t['prompt_tokens_cached']:>10}{share:>8.2f}"
            f"{t['prompt_tokens_prefilled']:>11}{t['spread']:>11}{t['handed']:>8}"
        )
    (_, _, _, _, off), (_, _, _, _, on) = rows[1:]
    print(
        f"with {args.workers} workers, routing: prefilled tokens "
        f"{on['prompt_tokens_prefilled'] / max(1, off['prompt_tokens_prefilled']):.2f}x of "
        f"without, wall {rows[2][2] / rows[1][2]:.2f}x, first token {rows[2][3] / rows[1][3]:.2f}x"
    )


if __name__ == "__main__":
    main()
