"""How fast a burst of requests reaches the queue: ``mlxq serve``'s intake, alone.

Why: a burst of chats that reaches the gateway one HTTP request at a time must reach the
queue about as fast as ``submit_many`` puts it there, or the worker's batching window
closes on part of it and its first tokens wait for a second prefill. This measures only
the way in: the worker is suspended (``rq suspend``), so nothing else competes for the
cores, and each job's time is its request's send to its ``enqueued_at`` in rq's record.

Starts a private redis-server, builds the tiny model, starts one ``mlxq worker`` (then
suspends it) and one ``mlxq serve``, and for --rounds rounds sends --burst jobs each way:

  many      ``AsyncClient.submit_many``, one call
  each      ``AsyncClient.submit`` per job, all at once (the gateway's own path, no HTTP)
  http      streaming chat completions as raw HTTP/1.1 over sockets opened beforehand,
            written together: the gateway's intake without a client library's cost
  openai    the official ``openai`` client, ``AsyncOpenAI`` streaming (what users send;
            on a small machine the client's own CPU shares the cores), a fresh client
            that opens a connection for each request
  openai-warm  the same, its pool's connections opened beforehand (a web backend's
            long-lived client): the client library's own cost alone

and prints each way's p50 and max (ms), the best round's and the median round's.

Usage:
    python ops/bench_intake.py                       # 64 jobs, 5 rounds, every way
    python ops/bench_intake.py --burst 256 --ways each,http
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import procs
from bench_gateway import raise_fd_limit, start_gateway
from bench_serve import GREEDY, chat, http_burst, prompt, serve_burst
from procs import records

from mlxq.producer import AsyncClient

WAYS = ("many", "each", "http", "openai", "openai-warm")
Sent = tuple[list[float], list[str]]  # each job's send time (unix s) and its id


async def many(url: str, queue: str, texts: list[str]) -> Sent:
    async with AsyncClient(url, queue) as ac:
        sent = time.time()
        jobs = await ac.submit_many([dict(messages=chat(t), max_tokens=4, **GREEDY) for t in texts])
    return [sent] * len(jobs), [j.id for j in jobs]


async def each(url: str, queue: str, texts: list[str]) -> Sent:
    async with AsyncClient(url, queue) as ac:

        async def one(text: str) -> tuple[float, str]:
            sent = time.time()
            job = await ac.submit(messages=chat(text), max_tokens=4, **GREEDY)
            return sent, job.id

        got = await asyncio.gather(*map(one, texts))
    return [s for s, _ in got], [i for _, i in got]


async def openai_sent(base: str, queue: str, texts: list[str], warm: bool = False) -> Sent:
    b = await serve_burst(base, queue, texts, 4, text=False, warm=warm)
    return b.sent, b.ids


async def http_sent(base: str, queue: str, texts: list[str]) -> Sent:
    b = await http_burst(base, queue, texts, 4, text=False)
    return b.sent, b.ids


def to_queue_ms(url: str, sent: Sent) -> list[float]:
    """Each job's send to its enqueued_at, in ms."""
    times, ids = sent
    return [1e3 * (e - s) for s, (e, _) in zip(times, records(url, ids), strict=True) if e]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--burst", type=int, default=64, help="jobs a burst (default 64)")
    ap.add_argument("--rounds", type=int, default=5, help="bursts each way (default 5)")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"of {','.join(WAYS)}")
    args = ap.parse_args(argv)
    args.ways = [w for w in args.ways.split(",") if w]
    if bad := set(args.ways) - set(WAYS):
        ap.error(f"--ways: unknown {sorted(bad)}")
    if args.burst < 1 or args.rounds < 1:
        ap.error("--burst and --rounds must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    started: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-intake-") as tmp:
        work = Path(tmp)
        try:
            url, server = procs.start_redis(work, ["--maxclients", "10000"])
            started.append(server)
            model = work / "model"
            subprocess.run(
                [str(procs.MLXQ), "model", "tiny", str(model)], check=True, capture_output=True
            )
            queue = "bench-intake"
            procs.start_worker(model, url, queue, work / "worker.log", started=started)
            base, _ = start_gateway(url, work, started)
            # rq's CLI through this Python: where mlxq runs from a bare site (the GPU
            # machine's), there is no `rq` script on PATH.
            suspend = [sys.executable, "-m", "rq.cli", "suspend", "--url", url]
            subprocess.run(suspend, check=True, capture_output=True)
            run: dict[str, Callable[[list[str]], Awaitable[Sent]]] = {
                "many": lambda t: many(url, queue, t),
                "each": lambda t: each(url, queue, t),
                "http": lambda t: http_sent(base, queue, t),
                "openai": lambda t: openai_sent(base, queue, t),
                "openai-warm": lambda t: openai_sent(base, queue, t, warm=True),
            }
            print(f"burst={args.burst} rounds={args.rounds} (worker suspended)", flush=True)
            seen: dict[str, list[tuple[float, float]]] = {w: [] for w in args.ways}
            for rnd in range(args.rounds):
                for way in args.ways:
                    texts = [prompt(f"{way}{rnd}-", i) for i in range(args.burst)]
                    ms = to_queue_ms(url, asyncio.run(run[way](texts)))
                    seen[way].append((statistics.median(ms), max(ms)))
                    time.sleep(0.3)
            print(
                f"{'way':<12} {'p50 best':>9} {'p50 median':>11} {'max best':>9} {'max median':>11}"
            )
            for way, got in seen.items():
                p50s, maxes = [p for p, _ in got], [m for _, m in got]
                print(
                    f"{way:<12} {min(p50s):9.1f} {statistics.median(p50s):11.1f} "
                    f"{min(maxes):9.1f} {statistics.median(maxes):11.1f}"
                )
            print("ms from a job's send to its enqueued_at in rq's record")
            return 0
        finally:
            for proc in reversed(started):
                procs.stop(proc, 30)


if __name__ == "__main__":
    sys.exit(main())
