"""`make demo`: a Redis, the tiny model, one worker, a few jobs streamed live, a summary.

Starts a private redis-server on a free port, so a Redis already on :6379 is never
written to; `--redis-url URL` or $MLXQ_REDIS_URL uses that Redis instead. Stops
everything it started.
"""

from __future__ import annotations

import argparse
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
from rich.cells import cell_len

from mlxq.producer import Client, Job
from mlxq.producer.terminal import for_terminal

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


def given_redis(url: str) -> str:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        sys.exit(
            f"no Redis answers at {url} ({e}); leave out --redis-url and MLXQ_REDIS_URL "
            "for a private one"
        )
    print(f"using the Redis at {url}")
    return url


def private_redis(workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit(
            "redis-server is not installed: install Redis 7 (Debian/Ubuntu: sudo apt-get "
            "install redis-server; macOS: brew install redis), or give a Redis with "
            "--redis-url or MLXQ_REDIS_URL."
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
    print(f"started a private redis-server on port {port}")
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
                line = last_cells(one_line(t) + d, width)
                sys.stdout.write(f"\x1b[2K{label:>20} | {line}\n")
            sys.stdout.flush()


def one_line(text: str) -> str:
    """A model's text for one row of the board: newlines as spaces, control characters
    (which would move the cursor) as U+FFFD, tabs expanded."""
    return for_terminal(text.replace("\n", " "), 0)


def last_cells(text: str, width: int) -> str:
    """The end of ``text`` that fits ``width`` terminal cells (a wide character is two)."""
    n, i = 0, len(text)
    while i > 0 and n + cell_len(text[i - 1]) <= width:
        i -= 1
        n += cell_len(text[i])
    return text[i:]


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--redis-url",
        default=os.environ.get("MLXQ_REDIS_URL") or None,
        help="use this Redis (default: $MLXQ_REDIS_URL, else a private redis-server)",
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxq-demo-"))
    redis_proc = None
    if args.redis_url:
        url = given_redis(args.redis_url)
    else:
        url, redis_proc = private_redis(work)
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
