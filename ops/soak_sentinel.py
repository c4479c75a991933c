"""`make soak SOAK_ARGS=--sentinel` (``ops/soak.py --sentinel``): primary kills under load.

Starts a Sentinel-managed Redis (a primary, two replicas, three sentinels:
``ops/sentinel_redis.py``), the tiny model and real ``mlxq worker`` processes with
``--wait-replicas``, then submits N jobs at a steady pace through ``Client(wait_replicas=)``
while listeners follow a sample of streams, and kills the primary with SIGKILL ``--kills``
times (the killed node comes back as a replica after each). A submit that fails (Redis
away, or ``NotReplicated``) is retried with the same id until it is acknowledged.

Reported: acknowledged jobs lost (no record, or never ended), jobs ended twice (two runs
in rq's result log), duplicated stream chunks (a seq seen twice by a listener within one
run, or a text that differs from the result), and per kill the seconds until a submit is
acknowledged again and until a worker commits an end again. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from procs import start_worker, stop
from sentinel_redis import DOWN_AFTER_MS, FAILOVER_GAP_S, SentinelRedis

from mlxq.producer import Client, Job
from mlxq.producer.connection import TRANSIENT
from mlxq.producer.errors import NotReplicated
from mlxq.producer.keys import finished_registry, job_key, results_key
from mlxq.worker.tiny import build_tiny_model

QUEUE = "soak-ha"


@dataclass
class Kill:
    at: float
    submit_back_s: float | None = None
    end_back_s: float | None = None
    failovers: int = 0  # more than 1: the new primary was itself failed over


@dataclass
class Tally:
    acked: list[str] = field(default_factory=list)
    submit_retries: int = 0
    dup_chunks: int = 0
    text_mismatch: int = 0
    listener_errors: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _submit(client: Client, kw: dict[str, object], job_id: str, tally: Tally) -> None:
    """Submit until acknowledged, always under the same id (a retry is safe)."""
    while True:
        try:
            client.submit_many([kw], job_ids=[job_id])
        except (NotReplicated, *TRANSIENT):
            with tally.lock:
                tally.submit_retries += 1
            time.sleep(0.05)
            continue
        with tally.lock:
            tally.acked.append(job_id)
            for k in tally.kills:
                if k.submit_back_s is None:
                    k.submit_back_s = time.monotonic() - k.at
        return


def _listen(job: Job, tally: Tally) -> None:
    seen: set[tuple[int, int]] = set()
    text = ""
    try:
        for c in job.stream(timeout=600):
            if (c.attempt, c.seq) in seen:
                with tally.lock:
                    tally.dup_chunks += 1
            seen.add((c.attempt, c.seq))
            text = "" if c.kind == "reset" else text + c.text
        if text != job.result(timeout=60).text:
            with tally.lock:
                tally.text_mismatch += 1
    except Exception as e:  # reported, never fatal to the soak
        with tally.lock:
            tally.listener_errors.append(f"{job.id}: {type(e).__name__}: {e}")


def _load(url: str, args: argparse.Namespace, tally: Tally, done: threading.Event) -> None:
    client = Client(url, queue=QUEUE, wait_replicas=args.wait_replicas)
    rnd = random.Random(0)
    threads = []
    for i in range(args.jobs):
        kw = dict(prompt=f"Soak {i}:", max_tokens=rnd.randint(4, args.max_tokens), seed=i)
        job_id = f"ha-{i:06d}"
        _submit(client, kw, job_id, tally)
        if i % args.listen_every == 0:
            t = threading.Thread(target=_listen, args=(client.job(job_id), tally), daemon=True)
            t.start()
            threads.append(t)
        time.sleep(args.interval)
    for t in threads:
        t.join(600)
    done.set()


def _watch_ends(setup: SentinelRedis, tally: Tally, done: threading.Event) -> None:
    """Time from each kill until a worker's end lands on the new primary (its count of
    finished jobs grows past what it held when first read)."""
    seen: tuple[int, int] = (-1, -1)  # (primary's port, its count of finished jobs)
    while not done.is_set():
        try:
            port = setup.master_port()
            n = setup.client(port).zcard(finished_registry(QUEUE))
        except (redis.RedisError, RuntimeError):
            time.sleep(0.05)
            continue
        with tally.lock:
            if port == seen[0] and n > seen[1]:
                for k in tally.kills:
                    if k.end_back_s is None:
                        k.end_back_s = time.monotonic() - k.at
            seen = (port, n) if port != seen[0] or n > seen[1] else seen
        time.sleep(0.05)


def _kill(setup: SentinelRedis, tally: Tally) -> None:
    before = setup.failovers()
    port = setup.kill_master()
    kill = Kill(time.monotonic())
    with tally.lock:
        tally.kills.append(kill)
    setup.wait_failover(port)
    setup.restart(port)
    setup.wait_primary_replicas(2)
    setup.wait_healthy()
    kill.failovers = setup.failovers() - before


def _check(setup: SentinelRedis, tally: Tally) -> dict[str, int]:
    r = setup.client(setup.master_port())
    deadline = time.monotonic() + 120  # every job ends within seconds of the last submit
    pending = list(tally.acked)
    while pending and time.monotonic() < deadline:
        statuses = [r.hget(job_key(i), "status") for i in pending]
        pending = [i for i, s in zip(pending, statuses, strict=True) if s != b"finished"]
        if pending:
            time.sleep(0.5)
    lost = [i for i in pending if not r.exists(job_key(i))]
    unended = [i for i in pending if r.exists(job_key(i))]
    twice = [i for i in tally.acked if r.xlen(results_key(i)) > 1]
    return {
        "acknowledged": len(tally.acked),
        "lost": len(lost),
        "never_ended": len(unended),
        "ended_twice": len(twice),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="soak.py --sentinel", description=__doc__)
    ap.add_argument("--sentinel", action="store_true", help="this mode")
    ap.add_argument("--jobs", type=int, default=600)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--wait-replicas", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--interval", type=float, default=0.01, help="seconds between submits")
    ap.add_argument("--listen-every", type=int, default=10, help="follow every Nth stream")
    ap.add_argument(
        "--down-after-ms",
        type=int,
        default=DOWN_AFTER_MS,
        help="the sentinels' down-after-milliseconds (default %(default)s)",
    )
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxq-soak-ha-"))
    setup = SentinelRedis(work / "redis", down_after_ms=args.down_after_ms)
    workers = []
    try:
        model = build_tiny_model(work / "tiny", seed=0)
        extra = ["--wait-replicas", str(args.wait_replicas), "--window-ms", "5"]
        for i in range(args.workers):
            workers.append(start_worker(model, setup.url, QUEUE, work / f"worker{i}.log", extra)[1])
        return _run(setup, args, work)
    finally:
        for w in workers:
            stop(w)
        setup.stop()


def _run(setup: SentinelRedis, args: argparse.Namespace, work: Path) -> int:
    tally, done = Tally(), threading.Event()
    t0 = time.monotonic()
    load = threading.Thread(target=_load, args=(setup.url, args, tally, done), daemon=True)
    watch = threading.Thread(target=_watch_ends, args=(setup, tally, done), daemon=True)
    load.start()
    watch.start()
    last = -FAILOVER_GAP_S
    for n in range(args.kills):
        target = args.jobs * (n + 1) // (args.kills + 1)
        # The sentinels fail a service over at most once per FAILOVER_GAP_S.
        while (len(tally.acked) < target or time.monotonic() - last < FAILOVER_GAP_S) and (
            load.is_alive()
        ):
            time.sleep(0.05)
        last = time.monotonic()
        _kill(setup, tally)
    load.join()
    figures = _check(setup, tally)
    elapsed = time.monotonic() - t0
    print(
        f"sentinel soak: {args.jobs} jobs, {args.kills} primary kills (SIGKILL), "
        f"--wait-replicas {args.wait_replicas}, {elapsed:.0f} s; logs in {work}"
    )
    for name, value in figures.items():
        print(f"  {name:>22}: {value}")
    print(f"  {'duplicated chunks':>22}: {tally.dup_chunks}")
    print(f"  {'stream != result':>22}: {tally.text_mismatch}")
    print(f"  {'listener errors':>22}: {len(tally.listener_errors)}")
    print(f"  {'submit retries':>22}: {tally.submit_retries}")
    bound = setup.down_after_ms / 1000 + 2
    for i, k in enumerate(tally.kills, 1):
        again = (
            ""
            if k.failovers <= 1
            else f"; {k.failovers} failovers: the sentinels called the new primary down "
            "too and promoted another (writes the first took after that are lost to "
            "any WAIT short of every replica: README)"
        )
        print(
            f"  kill {i}: submits acknowledged again after {_s(k.submit_back_s)}, "
            f"a worker's end after {_s(k.end_back_s)} (target {bound:.0f} s){again}"
        )
    for e in tally.listener_errors[:5]:
        print(f"    {e}")
    bad = figures["lost"] + figures["never_ended"] + figures["ended_twice"]
    bad += tally.dup_chunks + tally.text_mismatch + len(tally.listener_errors)
    return 1 if bad else 0


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
