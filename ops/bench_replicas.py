"""The price of ``--wait-replicas 1``: ``ops/bench_e2e.py --sentinel`` (this script).

Starts a Sentinel-managed Redis (a primary, two replicas, three sentinels:
``ops/sentinel_redis.py``), the tiny model and two real workers on it, one with
``--wait-replicas 0`` and one with ``--wait-replicas 1``, each serving its own queue, and
measures, interleaved in every round, for each setting:

  submit   jobs/s of one ``Client.submit`` at a time (each its own round trip, plus a
           ``WAIT`` with 1), to a queue no worker serves (purged after)
  batch    jobs/s of ``submit_many`` of the same jobs (one WAIT per slice)
  e2e      tokens/s of a sweep through the worker, from the submit to the last result
           (the worker waits for a replica once per committed batch of ends)

Best of --rounds counts (other load on a shared machine only ever slows a run down).

Usage:
    python ops/bench_e2e.py --sentinel                 # tiny model, a minute or two on CPU
    python ops/bench_e2e.py --sentinel --jobs 128 --tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from procs import start_worker, stop
from sentinel_redis import SentinelRedis

from mlxq.producer import Client
from mlxq.producer.keys import queue_key
from mlxq.worker.tiny import build_tiny_model

SETTINGS = (0, 1)


def _submit_rate(url: str, wait: int, n: int, many: bool) -> float:
    client = Client(url, queue=f"idle-{wait}", wait_replicas=wait)
    jobs = [dict(prompt=f"bench {i}", max_tokens=8) for i in range(n)]
    t0 = time.perf_counter()
    if many:
        client.submit_many(jobs)
    else:
        for kw in jobs:
            client.submit(**kw)
    rate = n / (time.perf_counter() - t0)
    for job_id in client.redis.lrange(queue_key(f"idle-{wait}"), 0, -1):
        client.job(job_id.decode()).cancel()
    client.redis.delete(queue_key(f"idle-{wait}"))
    client.close()
    return rate


def _e2e(url: str, wait: int, jobs: int, tokens: int) -> float:
    client = Client(url, queue=f"served-{wait}", wait_replicas=wait)
    kws = [dict(prompt=f"A tale {i}:", max_tokens=tokens, seed=i) for i in range(jobs)]
    t0 = time.perf_counter()
    made = [j.result(timeout=3600) for j in client.submit_many(kws)]
    wall = time.perf_counter() - t0
    client.close()
    return sum(r.usage["completion_tokens"] for r in made) / wall


def _measure(url: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    best: dict[int, dict[str, float]] = {w: {} for w in SETTINGS}
    for _ in range(args.rounds):
        for wait in SETTINGS:  # interleaved: both settings see the same machine
            got = {
                "submit": _submit_rate(url, wait, args.submits, many=False),
                "batch": _submit_rate(url, wait, args.submits, many=True),
                "e2e": _e2e(url, wait, args.jobs, args.tokens),
            }
            for k, v in got.items():
                best[wait][k] = max(best[wait].get(k, 0.0), v)
    return best


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_e2e.py --sentinel", description=__doc__)
    ap.add_argument("--sentinel", action="store_true", help="this benchmark")
    ap.add_argument("--submits", type=int, default=300, help="jobs per submit-rate run")
    ap.add_argument("--jobs", type=int, default=64, help="jobs per e2e run")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per e2e job")
    ap.add_argument("--batch", type=int, default=16, help="the workers' --max-batch")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxq-bench-ha-"))
    setup = SentinelRedis(work / "redis")
    workers = []
    try:
        model = build_tiny_model(work / "tiny", seed=0)
        for wait in SETTINGS:
            extra = ["--wait-replicas", str(wait), "--max-batch", str(args.batch)]
            log = work / f"worker-{wait}.log"
            workers.append(start_worker(model, setup.url, f"served-{wait}", log, extra)[1])
        best = _measure(setup.url, args)
    finally:
        for w in workers:
            stop(w)
        setup.stop()
    print(
        f"Sentinel (1 primary, 2 replicas, loopback), tiny model, {args.jobs} jobs x "
        f"{args.tokens} tokens, max_batch {args.batch}, best of {args.rounds}"
    )
    print(f"{'':>18} {'submit jobs/s':>14} {'submit_many jobs/s':>19} {'e2e tok/s':>10}")
    for wait in SETTINGS:
        b = best[wait]
        print(f"--wait-replicas {wait} {b['submit']:>14.0f} {b['batch']:>19.0f} {b['e2e']:>10.0f}")
    base, waited = best[0], best[1]
    print(
        "ratio (1 / 0):      "
        + "  ".join(f"{k} {waited[k] / base[k]:.2f}" for k in ("submit", "batch", "e2e"))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
