"""Two mlxq versions serving one queue: a rolling upgrade, checked end to end.

Starts a private redis-server, the tiny model, and two workers on one queue: this
checkout's ``mlxq`` and another install's (``--other``, e.g. the last release's venv). It
submits jobs in waves, follows a sample of their streams, and kills each worker with
SIGKILL once while it holds jobs (the survivor must requeue them, and a restarted worker of
the same version takes its place). Every job must end finished exactly once, and every
followed stream must equal its result. Exits 1 on any failure.

Usage:
    python ops/mixed_versions.py --other /path/to/old/venv/bin/mlxq [--jobs 400]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import procs
import redis
from words import WORDS

from mlxq.producer import Client, Job, keys


def _follow(job: Job, texts: dict[str, str]) -> None:
    text = ""
    for c in job.stream(timeout=300):
        text = "" if c.kind == "reset" else text + c.text  # a rerun voids what was shown
    texts[job.id] = text


def _held(r: redis.Redis, name: str) -> int:
    return int(r.llen(keys.wip_key(name)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the other version's mlxq executable")
    ap.add_argument("--jobs", type=int, default=400, help="jobs in all (default %(default)s)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxq-mixed-"))
    subprocess.run([str(procs.MLXQ), "model", "tiny", str(work / "tiny")], check=True)
    url, redis_proc = procs.start_redis(work)
    queue, started = f"mixed-{uuid.uuid4().hex[:6]}", []
    exes = {"this": None, "other": args.other}
    workers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        for v, exe in exes.items():
            workers[v] = procs.start_worker(
                work / "tiny", url, queue, work / f"{v}.log", started=started, exe=exe
            )
        r = redis.Redis.from_url(url)
        client = Client(url, queue=queue)
        jobs: list[Job] = []
        texts: dict[str, str] = {}
        followers: list[threading.Thread] = []
        per_wave = max(1, args.jobs // 4)
        for wave in range(4):
            batch = client.submit_many(
                [
                    {"prompt": " ".join(WORDS[(i + wave) % 7 :]), "max_tokens": 24, "seed": i}
                    for i in range(per_wave)
                ]
            )
            jobs += batch
            for job in batch[:8]:
                t = threading.Thread(target=_follow, args=(job, texts), daemon=True)
                t.start()
                followers.append(t)
            if wave in (1, 2):  # kill one version, then the other, while it holds jobs
                v = "other" if wave == 1 else "this"
                name, proc = workers[v]
                deadline = time.monotonic() + 60
                while _held(r, name) == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                held = _held(r, name)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                print(f"killed the {v} worker {name} holding {held} job(s)")
                workers[v] = procs.start_worker(
                    work / "tiny",
                    url,
                    queue,
                    work / f"{v}-{wave}.log",
                    started=started,
                    exe=exes[v],
                )
        results = {job.id: job.result(timeout=600) for job in jobs}
        for t in followers:
            t.join(300)
        bad = [j for j, res in results.items() if res.finish_reason not in ("length", "stop")]
        differ = [j for j, text in texts.items() if text != results[j].text]
        twice = [j.id for j in jobs if r.xlen(keys.results_key(j.id)) != 1]
        ran = {(r.hget(keys.job_key(j.id), "worker_name") or b"?").decode() for j in jobs}
        print(
            f"{len(results)} jobs: {len(results) - len(bad)} finished, "
            f"{len(jobs) - len(twice)} with exactly one result; streams followed: "
            f"{len(texts)}, equal to their results: {len(texts) - len(differ)}; "
            f"workers that ran jobs: {len(ran)}"
        )
        ok = not bad and not differ and not twice and len(texts) == len(followers)
        print(
            "PASS"
            if ok
            else f"FAIL: {bad[:5]} not finished, {twice[:5]} ended twice, "
            f"{differ[:5]} streams differ"
        )
        return 0 if ok else 1
    finally:
        for p in started:
            procs.stop(p, 30)
        procs.stop(redis_proc)


if __name__ == "__main__":
    sys.exit(main())
