"""`make demo`: a Redis, the tiny model, one worker, a few jobs streamed live, a summary.

Uses the Redis at $MLXQ_REDIS_URL (default redis://localhost:6379/0) when one
answers, else starts a private redis-server; stops everything it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import redis

from mlxq.producer import Client, Job

QUEUE = "mlxq-demo"
JOBS = [
    ("greedy", dict(prompt="The old lighthouse keeper", max_tokens=40)),
    (
        "t=0.7 top_p=0.9",
        dict(prompt="On a quiet morning", max_tokens=40, temperature=0.7, top_p=0.9),
    ),
    (
        "t=1.0 top_k=20",
        dict(prompt="Rain fell over the city", max_tokens=40, temperature=1.0, top_k=20),
    ),
    (
        "t=0.8 min_p=0.05",
        dict(prompt="She opened the letter", max_tokens=40, temperature=0.8, min_p=0.05),
    ),
    (
        "chat, seed=7",
        dict(
            messages=[{"role": "user", "content": "Tell me about trains."}],
            max_tokens=40,
            temperature=0.9,
            seed=7,
        ),
    ),
    ("t=0.7 top_p=0.9 #2", dict(prompt="In the garden", max_tokens=40, temperature=0.7, top_p=0.9)),
]


def find_redis(url: str, workdir: Path) -> tuple[str, subprocess.Popen[bytes] | None]:
    url_asked = url
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        print(f"using the Redis at {url}")
        return url, None
    except redis.RedisError:
        pass
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit(
            f"no Redis answers at {url} and redis-server is not installed.\n"
            "Install Redis 7 (Debian/Ubuntu: sudo apt-get install redis-server; "
            "macOS: brew install redis), or point MLXQ_REDIS_URL at one."
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.025)
    print(f"no Redis answers at {url_asked}: started a private redis-server on port {port}")
    return url, proc


class Board:
    """Each job's text, redrawn in place on a terminal, or printed chunk by chunk."""

    def __init__(self, labels: list[str]) -> None:
        self.labels, self.texts = labels, ["" for _ in labels]
        self.done = ["" for _ in labels]
        self.tty = sys.stdout.isatty()
        self.lock = threading.Lock()
        if self.tty:
            print("\n" * (len(labels) - 1))

    def add(self, i: int, text: str, finish: str | None) -> None:
        with self.lock:
            self.texts[i] += text
            if finish:
                self.done[i] = f" [{finish}]"
            if not self.tty:
                print(f"{self.labels[i]:>20} | {text!r}{self.done[i]}", flush=True)
                return
            width = shutil.get_terminal_size().columns - 24
            sys.stdout.write(f"\x1b[{len(self.labels)}F")
            for label, t, d in zip(self.labels, self.texts, self.done, strict=True):
                line = (t.replace("\n", " ") + d)[-width:]
                sys.stdout.write(f"\x1b[2K{label:>20} | {line}\n")
            sys.stdout.flush()


def follow(job: Job, i: int, board: Board, totals: list[int]) -> None:
    for c in job.stream(timeout=300):
        board.add(i, c.text, c.finish_reason)
        if c.usage:
            totals[i] = c.usage["completion_tokens"]


def worker_stats(r: redis.Redis) -> dict[str, object]:
    for key in r.scan_iter("mlxq:worker:*"):
        raw = r.hget(key, "stats")
        stats = msgpack.unpackb(raw) if raw else {}
        if stats.get("queue") == QUEUE and stats.get("pid"):
            return dict(stats)
    return {}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="mlxq-demo-"))
    url, redis_proc = find_redis(os.environ.get("MLXQ_REDIS_URL", "redis://localhost:6379/0"), work)
    worker = None
    try:
        model = work / "tiny"
        subprocess.run(["mlxq", "model", "tiny", str(model)], check=True, stdout=subprocess.DEVNULL)
        print(f"built the tiny model in {model}")
        log = work / "worker.log"
        worker = subprocess.Popen(
            [
                "mlxq",
                "worker",
                "--model",
                str(model),
                "--redis-url",
                url,
                "--queue",
                QUEUE,
                "--window-ms",
                "50",
                "--max-batch",
                "8",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        client = Client(url, queue=QUEUE)
        from rq import Worker

        while not any(QUEUE in w.queue_names() for w in Worker.all(connection=client.redis)):
            if worker.poll() is not None:
                sys.exit(f"the worker exited:\n{log.read_text()}")
            time.sleep(0.1)
        print(f"worker up (log: {log}); submitting {len(JOBS)} jobs with mixed sampling params\n")
        t0 = time.perf_counter()
        jobs = client.submit_many([kw for _, kw in JOBS])
        board = Board([label for label, _ in JOBS])
        totals = [0] * len(jobs)
        threads = [
            threading.Thread(target=follow, args=(j, i, board, totals)) for i, j in enumerate(jobs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        time.sleep(1.2)  # the worker publishes its counters about once a second
        stats = worker_stats(client.redis)
        tokens = sum(totals)
        print(
            f"\n{len(jobs)} jobs, {tokens} tokens in {wall:.2f}s: {tokens / wall:.0f} tok/s "
            "(tiny random model; the text is noise by design)"
        )
        if stats:
            print(
                f"decode steps {stats['decode_steps']}, vectorized {stats['vectorized_steps']} "
                f"({stats['sampler_calls']} sampler calls); batch sizes seen (size: steps) "
                f"{stats['batch_sizes']}"
            )
        print("statuses:", ", ".join(sorted({j.status() for j in jobs})))
        return 0
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(60)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
