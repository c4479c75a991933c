"""``mlxq run-batch`` vs the same jobs through ``Client.submit_many``, side by side in one run.

Starts its own redis-server (or uses --redis-url) and one real ``mlxq worker``, writes a
batch file of N greedy requests (chat and completions alternating, distinct prompts, the
same max_tokens), and times, in every round (the order alternates between rounds):

  submit_many   the jobs of that file (the same submit arguments, mapped by
                mlxq.producer.openai_api) sent with one Client.submit_many, then every
                result() read, in order
  run-batch     ``mlxq run-batch --input ... --output ...`` as a process, start to exit
                (its own start-up included); "sweep" is the time its summary reports

Both answer the same jobs greedily, so they make the same tokens (checked). Prints tok/s
of each, best of --rounds (other load on a shared machine only slows a run down), and
the ratio run-batch / submit_many.

Usage:
    python ops/bench_run_batch.py                        # tiny model on the CPU
    python ops/bench_run_batch.py --model mlx-community/Qwen2.5-0.5B-Instruct-4bit \\
        --requests 2000 --max-tokens 64 --max-batch 64
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from procs import MLXQ, start_redis, start_worker, stop
from words import WORDS as ALL_WORDS

from mlxq.producer import Client
from mlxq.producer.openai_api import CHAT, COMPLETIONS, parse_request

MODES = ("submit_many", "run-batch")
WORDS = ALL_WORDS[:9]


def batch_lines(n: int, queue: str, max_tokens: int, salt: str) -> list[dict[str, Any]]:
    lines = []
    for i in range(n):
        text = f"{salt} {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12))
        body: dict[str, Any] = {"model": queue, "max_tokens": max_tokens, "temperature": 0}
        if i % 2:
            body["messages"] = [{"role": "user", "content": text}]
            url = CHAT
        else:
            body["prompt"] = text
            url = COMPLETIONS
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})
    return lines


@dataclass
class Run:
    mode: str
    wall_s: float
    tokens: int
    cpu_s: float  # the producer's: this process's for submit_many, run-batch's process's
    sweep_s: float | None = None  # run-batch's own figure, start-up left out

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def via_submit_many(client: Client, lines: list[dict[str, Any]]) -> Run:
    kws = [parse_request(x["body"], x["url"]).submit for x in lines]
    cpu0, t0 = time.process_time(), time.perf_counter()
    jobs = client.submit_many(kws)
    tokens = sum(j.result().usage["completion_tokens"] for j in jobs)
    return Run("submit_many", time.perf_counter() - t0, tokens, time.process_time() - cpu0)


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def via_run_batch(url: str, queue: str, path: Path, work: Path, window: int) -> Run:
    out = work / f"out-{uuid.uuid4().hex[:6]}.jsonl"
    cmd = [str(MLXQ), "run-batch", "--input", str(path), "--output", str(out)]
    cmd += ["--queue", queue, "--redis-url", url, "--progress", "off"]
    cmd += ["--max-in-flight", str(window)]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if done.returncode != 0:
        sys.exit(f"run-batch exited {done.returncode}:\n{done.stderr}")
    m = re.search(r" in ([0-9.]+) s:", done.stderr)
    tokens = 0
    with out.open() as f:
        for line in f:
            rec = json.loads(line)
            if rec["response"]["status_code"] != 200:
                sys.exit(f"a request failed: {line}")
            tokens += rec["response"]["body"]["usage"]["completion_tokens"]
    return Run("run-batch", wall, tokens, cpu, float(m.group(1)) if m else None)


def report(args: argparse.Namespace, runs: list[Run]) -> None:
    best = {mode: max((r for r in runs if r.mode == mode), key=lambda r: r.tok_s) for mode in MODES}
    print(
        f"{args.requests} requests, max_tokens {args.max_tokens}, model {args.model or 'tiny'}, "
        f"worker --max-batch {args.max_batch}, run-batch --max-in-flight {args.max_in_flight}; "
        f"best of {args.rounds}"
    )
    for mode, r in best.items():
        sweep = f", its sweep alone {r.sweep_s:.2f} s" if r.sweep_s is not None else ""
        print(
            f"  {mode:12s} {r.wall_s:7.2f} s  {r.tok_s:8.1f} tok/s  "
            f"producer CPU {r.cpu_s:5.2f} s{sweep}"
        )
    ratio = best["run-batch"].tok_s / best["submit_many"].tok_s
    print(f"  ratio run-batch / submit_many: {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or repo id (default: tiny)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32, help="the worker's --max-batch")
    ap.add_argument("--max-in-flight", type=int, default=256, help="run-batch's window")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--redis-url", default=None, help="use this Redis (default: start one)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-run-batch-"))
    procs: list[subprocess.Popen[bytes]] = []
    client: Client | None = None
    try:
        url = args.redis_url
        if url is None:
            url, p = start_redis(work)
            procs.append(p)
        model = args.model
        if model is None:
            model = str(work / "tiny")
            subprocess.run([str(MLXQ), "model", "tiny", model], check=True, capture_output=True)
        queue = f"bench-{uuid.uuid4().hex[:6]}"
        extra = ["--max-batch", str(args.max_batch)]
        start_worker(model, url, queue, work / "worker.log", extra, started=procs)
        client = Client(url, queue=queue)
        via_submit_many(client, batch_lines(2 * args.max_batch, queue, args.max_tokens, "warm"))
        runs: list[Run] = []
        for i in range(args.rounds):
            lines = batch_lines(args.requests, queue, args.max_tokens, f"round{i}")
            path = work / f"in{i}.jsonl"
            path.write_text("".join(json.dumps(x) + "\n" for x in lines))
            # The order alternates, so neither mode always runs on a warmer machine.
            pair = [
                via_submit_many(client, lines)
                if mode == "submit_many"
                else via_run_batch(url, queue, path, work, args.max_in_flight)
                for mode in (MODES if i % 2 == 0 else MODES[::-1])
            ]
            if pair[0].tokens != pair[1].tokens:
                sys.exit(f"token counts differ: {pair}")
            for r in pair:
                print(f"round {i}: {r.mode:12s} {r.wall_s:7.2f} s", file=sys.stderr)
            runs += pair
        report(args, runs)
    finally:
        if client is not None:
            client.close()  # before its Redis goes
        for p in reversed(procs):
            stop(p, 30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
