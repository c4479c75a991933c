"""`make soak`: evidence for crash safety and bounded resources, against real processes.

Starts its own redis-server (AOF, so a restart keeps every job), the tiny model and real
`mlxq worker` processes, then submits N short jobs at a steady pace while faults are injected:
kill -9 and SIGTERM of workers, a Redis restart, dropped client connections, cancels, and
poison jobs written straight to Redis; and the hostile entries of issue 8: valid jobs whose
other keys are poisoned, ids that are not UTF-8 on the queue, forged cancel and channel
messages and a forged log entry, a worker frozen (SIGSTOP) past its lease while another
runs, the same id queued twice, cancels racing the ends of jobs, and Redis at maxmemory
(noeviction) for a few seconds; and issue 23's queue-wide keys of another type: a busy
worker's own lease, the queue's roll while a worker holding jobs is killed, a registry and
a worker record of an unused queue. Beside them, a few chats run turn by turn, each turn
resending the history, so turns are handed to the worker holding it under every fault.
The workers serve two levels, ``--queue soak-chat --queue soak``: an interactive chat job
goes to the higher one every half second while the soak's jobs are submitted, and pauses
a soak job's row when none is free (its KV kept, resumed where it stopped). Each is
followed from its submit: it must end exactly once with its stream equal to its result,
and its first-token p50 is printed beside the soak jobs'. Some come right after a burst
that fills every row, so rows must have been paused.
Listeners follow a sample of streams; each worker's decode
steps are scraped from its metrics port every 0.2 s. Every job must end exactly once,
finished, failed with a reason, or canceled; no listener may see a chunk twice or a text
that differs from the result; no worker may go a second without a decode step while it has
jobs running (the one deliberately frozen excepted); Redis memory and worker RSS are
printed before, midway and after the TTLs expire. Exits 1 when a check fails (the temp dir
with the logs is kept).

``--sentinel`` runs another soak instead: a Sentinel-managed Redis whose primary is killed
under load (``ops/soak_sentinel.py``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from procs import MLXQ, free_port
from rq import Queue
from rq.registry import StartedJobRegistry, clean_registries
from words import WORDS

from mlxq.producer import Client, Job, JobFailed
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.info import collect
from mlxq.producer.keys import (
    JOB_FUNC,
    alive_key,
    cancel_channel,
    channel,
    job_key,
    queue_key,
    results_key,
    rq_worker_key,
    stream_key,
    wip_key,
    workers_key,
)

QUEUE = "soak"
#: The higher level: interactive chat jobs beside the soak's, which are its sweep.
CHAT_QUEUE = "soak-chat"
INTERACTIVE_EVERY_S = 0.5
MAX_BATCH = 32
TERMINAL = ("finished", "failed", "canceled")
# The five sampling-param groups; the fifth (seeded) is built per job.
GROUPS = [
    {},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 1.2, "min_p": 0.1},
]


@dataclass
class Tally:
    """What the soak saw; written by the submitter, poller, listener and fault threads."""

    faults: Counter[str] = field(default_factory=Counter)
    # (fault, start, end), soak time: what a slow first text overlapped
    fault_spans: list[tuple[str, float, float]] = field(default_factory=list)
    # job id -> soak | burst | poison | poisoned (a valid job with a rogue key) | race |
    # chat | interactive
    kind: dict[str, str] = field(default_factory=dict)
    final: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (status, reason)
    watch: set[str] = field(default_factory=set)  # ended jobs whose records still live
    ended_twice: dict[str, str] = field(default_factory=dict)  # id -> what was seen
    # poisoned job id -> (what was done, the ends allowed, a failure reason must contain)
    expect: dict[str, tuple[str, tuple[str, ...], str]] = field(default_factory=dict)
    poison_started: int = 0  # poison jobs that reached the engine (must be 0)
    submit_retries: int = 0
    listened: set[str] = field(default_factory=set)
    # job id -> seconds from its submit to its first text (interactive jobs, and the soak
    # jobs the submitter follows: the sweep beside them)
    first_text_s: dict[str, float] = field(default_factory=dict)
    sent_s: dict[str, float] = field(default_factory=dict)  # job id -> its submit, soak time
    chunks_seen: int = 0
    listener_errors: int = 0
    duplicates: int = 0
    mismatches: int = 0
    cancel_asked: dict[str, str] = field(default_factory=dict)  # id -> status when asked
    # id -> (which fault asked, what cancel() said): True must end canceled, False not
    cancel_said: dict[str, tuple[str, bool]] = field(default_factory=dict)
    stalls: list[str] = field(default_factory=list)
    stall_samples: int = 0
    busy_samples: int = 0  # scrapes that found jobs running
    longest_gap: float = 0.0  # the longest stretch without a decode step (upper bound)
    paused: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (paused, resumed)
    stray: list[str] = field(default_factory=list)  # rogue ids still in a list at the end
    sigterm_rcs: list[int] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    queue_wide_failures: list[str] = field(default_factory=list)  # keys that did not heal
    unexpected_exits: list[str] = field(default_factory=list)
    memory: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def refused(e: Exception) -> bool:
    """A write Redis refused for memory (maxmemory with noeviction: we cause that too)."""
    return isinstance(
        e,
        (
            redis.ConnectionError,
            redis.TimeoutError,
            redis.exceptions.OutOfMemoryError,
            redis.exceptions.ExecAbortError,  # a MULTI with a refused command in it
        ),
    ) or (isinstance(e, redis.ResponseError) and "maxmemory" in str(e))


def retry(fn: Callable[[], Any], within: float = 60) -> Any:
    """Call fn, riding out a Redis restart, a killed connection or a refused write (we
    cause all three)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return fn()
        except redis.RedisError as e:
            if not refused(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


class Cluster:
    """The processes under test: one redis-server and the workers, all ours to kill."""

    def __init__(self, work: Path, grace_s: float, stream_ttl: int) -> None:
        self.work, self.grace_s, self.stream_ttl = work, grace_s, stream_ttl
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.r = redis.Redis.from_url(self.url)
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}  # each worker's metrics port
        self.names = (f"soak-w{i}" for i in itertools.count())
        self.model = work / "tiny"

    def start_redis(self) -> None:
        exe = shutil.which("redis-server") or sys.exit("redis-server not found")
        self.redis_proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.work),
            ],
            stdout=(self.work / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        retry(self.r.ping, within=30)

    def stop_redis(self) -> None:
        if self.redis_proc is not None:
            self.redis_proc.terminate()  # SIGTERM: Redis flushes the AOF and exits
            self.redis_proc.wait(30)

    def start_worker(self) -> str:
        name = next(self.names)
        self.ports[name] = free_port()
        self.workers[name] = subprocess.Popen(
            [
                str(MLXQ),
                "worker",
                "--model",
                str(self.model),
                "--redis-url",
                self.url,
                "--queue",
                CHAT_QUEUE,
                "--queue",
                QUEUE,
                "--max-batch",
                str(MAX_BATCH),
                "--window-ms",
                "20",
                "--grace-s",
                str(self.grace_s),
                "--stream-ttl",
                str(self.stream_ttl),
                "--name",
                name,
                "--metrics-port",
                str(self.ports[name]),
                "--metrics-host",
                "127.0.0.1",
            ],
            stdout=(self.work / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not retry(lambda: self.r.exists(alive_key(name))):  # set once it serves
            if self.workers[name].poll() is not None or time.monotonic() > deadline:
                sys.exit(f"worker {name} did not start; see {self.work / name}.log")
            time.sleep(0.1)
        return name

    def wip(self, name: str) -> list[str]:
        return [i.decode() for i in retry(lambda: self.r.lrange(wip_key(name), 0, -1))]

    def kill9(self, name: str) -> None:
        proc = self.workers.pop(name)
        proc.kill()
        proc.wait()  # reap it, as any supervisor would: a zombie's pid still "exists"

    def sigterm(self, name: str) -> int:
        proc = self.workers.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(self.grace_s + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return -9

    def memory(self) -> tuple[int, dict[str, int]]:
        used = int(retry(lambda: self.r.info("memory"))["used_memory"])
        live = [(n, p) for n, p in list(self.workers.items()) if p.poll() is None]
        return used, {n: rss_mib(p.pid) for n, p in live}

    def stop_all(self) -> None:
        for name in list(self.workers):
            self.sigterm(name)
        self.stop_redis()


def scrape(port: int) -> tuple[int, int, int, int] | None:
    """A worker's (decode steps, jobs running, rows paused, rows resumed) from its metrics
    port; None if it is down."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    names = ("decode_steps_total", "num_requests_running", "preemptions_total", "resumes_total")
    found = [re.search(rf"^mlxq_{n} (\S+)$", text, re.M) for n in names]
    if any(m is None for m in found):
        return None
    steps, running, paused, resumed = (int(float(m.group(1))) for m in found if m is not None)
    return steps, running, paused, resumed


#: What every third soak job's prompt starts with (about 190 tokens of the tiny model's
#: tokenizer), so the workers' prompt caches hit under every fault.
SHARED_PREFIX = "Answer in the style of these notes. " + " ".join(
    WORDS[i * 7 % len(WORDS)] for i in range(60)
)


#: Chats that run turn by turn beside the soak's jobs (their turns are handed between
#: workers).
CHATS = 4


def job_kwargs(k: int) -> dict[str, Any]:
    """Job k of the soak: one of five sampling groups, a varied prompt (every third after
    a shared prefix), 8-24 tokens."""
    rng = random.Random(k)
    params = dict(GROUPS[k % 5]) if k % 5 < 4 else {"temperature": 0.8, "seed": k}
    text = f"{k} " + " ".join(rng.sample(WORDS, rng.randint(1, 12)))
    if k % 3 == 0:
        text = f"{SHARED_PREFIX}. {text}"
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": text}]} if k % 7 == 0 else {"prompt": text}
    )
    return {**prompt, "max_tokens": rng.randint(8, 24), **params}


def interactive_kwargs(k: int) -> dict[str, Any]:
    """Interactive job k: a short chat, seeded, 32 tokens."""
    rng = random.Random(-1 - k)
    content = f"quick question {k}: " + " ".join(rng.sample(WORDS, 6))
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 32,
        "temperature": 0.7,
        "seed": k,
    }


class Soak:
    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.c, self.args, self.t = cluster, args, Tally()
        self.client = Client(cluster.url, QUEUE, result_ttl=args.ttl, failure_ttl=args.ttl)
        self.listeners: list[threading.Thread] = []
        self.witness = ""  # the worker no fault touches
        self.doing = "no fault"  # the fault in progress, for the stall log
        self.excused: dict[str, float] = {}  # worker -> stalls before this time are ours
        self.serial = itertools.count()
        self.submitted = 0  # soak jobs the submitter queued: all of --jobs, or a failure
        self.rogue_ids: set[bytes] = set()
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    # -- submit and follow -------------------------------------------------------------

    def submit(self, kws: list[dict[str, Any]], kind: str, queue: str = QUEUE) -> list[Job]:
        def attempt() -> list[Job]:
            try:
                return self.client.submit_many(kws, queue=queue)
            except redis.RedisError as e:
                if refused(e):  # Redis is restarting or full: send the batch again
                    self.t.submit_retries += 1
                raise

        jobs: list[Job] = retry(attempt)
        with self.t.lock:
            self.t.kind.update((j.id, kind) for j in jobs)
        return jobs

    def submitter(self, half: threading.Event) -> None:
        """N soak jobs in batches of 10 at an even pace over --submit-s seconds."""
        n, batch, t0 = self.args.jobs, 10, time.monotonic()
        for start in range(0, n, batch):
            time.sleep(max(0.0, t0 + start * self.args.submit_s / n - time.monotonic()))
            kws = [job_kwargs(k) for k in range(start, min(n, start + batch))]
            sent = time.monotonic()
            for k, job in enumerate(self.submit(kws, "soak"), start):
                self.submitted += 1
                if k % 10 == 0:  # a sample of listeners; faults add the jobs they hit
                    self.listen(job.id, sent)
            if start + batch >= n // 2 and not half.is_set():
                self.t.memory["middle"] = self.c.memory()
                half.set()

    def chatter(self, k: int, stop: threading.Event) -> None:
        """One chat, turn by turn, while the soak runs: each turn resends the history, so
        the workers hand turns to the one holding it, under every fault. A turn that does
        not finish (canceled by a fault, Redis away) starts the chat over."""
        rng = random.Random(-k)
        messages: list[dict[str, str]] = []
        while not stop.is_set():
            if not messages or len(messages) > 6:  # prompts as long as the soak's longest
                messages = [{"role": "system", "content": f"chat {k}: {SHARED_PREFIX}"}]
            words = " ".join(rng.sample(WORDS, 6))
            messages.append({"role": "user", "content": f"turn {len(messages)}: {words}"})
            (job,) = self.submit(
                [{"messages": messages, "max_tokens": 8, "temperature": 0}], "chat"
            )
            try:
                messages.append({"role": "assistant", "content": job.result(timeout=60).text})
            except Exception:
                messages = []

    def interactive(self, stop: threading.Event) -> None:
        """An interactive chat job on the higher level every half second while the soak's
        jobs are submitted, each followed from its submit."""
        for k in itertools.count():
            if stop.wait(INTERACTIVE_EVERY_S):
                return
            sent = time.monotonic()
            (job,) = self.submit([interactive_kwargs(k)], "interactive", CHAT_QUEUE)
            self.listen(job.id, sent)

    def listen(self, job_id: str, sent: float | None = None) -> None:
        """Follow a job's stream in a thread of its own; ``sent``: when it was submitted
        (its first text is timed from then)."""
        with self.t.lock:
            if job_id in self.t.listened:
                return
            self.t.listened.add(job_id)
        job = Job(self.client, job_id)
        th = threading.Thread(target=self.follow, args=(job, sent), daemon=True)
        th.start()
        self.listeners.append(th)

    def follow(self, job: Job, sent: float | None = None) -> None:
        """Record every chunk; a reset voids the text shown before it."""
        seqs, text, ended = [], "", ""
        try:
            for c in job.stream(timeout=self.args.drain_s + self.args.submit_s + 120):
                if sent is not None and c.text:
                    with self.t.lock:
                        self.t.first_text_s[job.id] = time.monotonic() - sent
                        self.t.sent_s[job.id] = sent - self.t0
                    sent = None
                seqs.append(c.seq)
                text = "" if c.kind == "reset" else text + c.text
                ended = c.finish_reason or ended
            result = retry(job.result).text if ended in ("stop", "length") else None
        except JobFailed:
            result = None
        except Exception as e:  # anything else is a finding: count it, say it
            self.say(f"listener of {job.id}: {e!r}")
            with self.t.lock:
                self.t.listener_errors += 1
            return
        with self.t.lock:
            self.t.chunks_seen += len(seqs)
            self.t.duplicates += len(seqs) - len(set(seqs))
            if result is not None and result != text:
                self.t.mismatches += 1
                self.say(f"MISMATCH {job.id}: streamed {text!r} != result {result!r}")

    def listen_held(self, names: list[str], wait_s: float = 10) -> int:
        """Wait (a while) until these workers hold jobs, so the fault lands mid-batch,
        and follow every job they hold: those are the ones the fault hits."""
        deadline = time.monotonic() + wait_s
        while not (held := [j for n in names for j in self.c.wip(n)]):
            if time.monotonic() > deadline:
                return 0
            time.sleep(0.02)
        for j in held:
            self.listen(j)
        return len(held)

    def poll(self, stop: threading.Event) -> None:
        """Catch each job's terminal status before its record expires (--ttl), then keep
        watching the ended ones while their records live: a second end shows as a status
        that changes or a second entry in rq's result log."""
        while not stop.wait(0.5):
            self.poll_once()

    def poll_once(self) -> None:
        with self.t.lock:
            ids = [i for i in self.t.kind if i not in self.t.final]
            ended = list(self.t.watch)
        try:
            for i in range(0, len(ids), 500):
                self.record(ids[i : i + 500])
            for i in range(0, len(ended), 500):
                self.recheck(ended[i : i + 500])
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # Redis is restarting: the next pass catches up
        except Exception as e:
            self.say(f"poller: {e!r}")

    def record(self, ids: list[str]) -> None:
        with self.c.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hmget(job_key(i), "status", "mlxq_attempt")
                p.xlen(results_key(i))
            rows = p.execute(raise_on_error=False)
        for k, job_id in enumerate(ids):
            (status, attempt), n = rows[2 * k], rows[2 * k + 1]
            st = (status or b"vanished").decode()
            if st not in (*TERMINAL, "vanished"):
                continue
            reason = Job(self.client, job_id).failure_reason() if st == "failed" else ""
            with self.t.lock:
                self.t.final[job_id] = (st, reason)
                if st != "vanished":
                    self.t.watch.add(job_id)
                if isinstance(n, int) and n > 1:
                    self.t.ended_twice[job_id] = f"{st} with {n} results"
                if self.t.kind[job_id] == "poison" and attempt is not None:
                    self.t.poison_started += 1

    def recheck(self, ids: list[str]) -> None:
        with self.c.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hget(job_key(i), "status")
                p.xlen(results_key(i))
            rows = p.execute(raise_on_error=False)
        for k, job_id in enumerate(ids):
            status, n = rows[2 * k], rows[2 * k + 1]
            first = self.t.final[job_id][0]
            with self.t.lock:
                if status is None:
                    self.t.watch.discard(job_id)  # expired: nothing more to see
                elif status.decode() != first or (isinstance(n, int) and n > 1):
                    seen = f"ended {first}, then {status.decode()} with {n} results"
                    if self.t.ended_twice.get(job_id) != seen:
                        self.say(f"ENDED TWICE {job_id}: {seen}")
                    self.t.ended_twice[job_id] = seen

    # -- worker progress ---------------------------------------------------------------

    def monitor(self, stop: threading.Event) -> None:
        """Scrape each worker's decode-step counter every 0.2 s; a stretch of more than a
        second with jobs running and no step is a stall. Conservative: the stretch runs
        from the reply of the first scrape that saw the count to the request of the last
        one that saw it unchanged, so slow scrapes never make a stall. The longest stretch
        measured the other way (request of the first to reply of the one that saw it move)
        is printed too: an upper bound, scrape delays included."""
        runs: dict[str, tuple[float, float, float, int]] = {}  # since back, sent; last; steps
        while not stop.wait(0.2):
            for name, port in list(self.c.ports.items()):
                if name not in self.c.workers or time.monotonic() < self.excused.get(name, 0):
                    runs.pop(name, None)  # gone, or frozen on purpose (or just woken)
                    continue
                sent = time.monotonic()
                got = scrape(port)
                back = time.monotonic()
                run = runs.pop(name, None)
                if run is not None and got is not None and got[0] == run[3] and got[1] > 0:
                    runs[name] = (run[0], run[1], sent, run[3])  # still no step
                    continue
                if run is not None:
                    moved = got is not None and got[0] != run[3]
                    self.note_gap(name, run[0], run[2] - run[0], back - run[1] if moved else 0)
                if got is None:
                    continue  # down (killed, or not serving yet)
                self.t.paused[name] = (got[2], got[3])  # kept when the worker is killed
                self.t.stall_samples += 1
                if got[1] > 0:  # jobs running: a stretch starts at this count
                    self.t.busy_samples += 1
                    runs[name] = (back, sent, back, got[0])

    def note_gap(self, name: str, since: float, gap: float, upper: float) -> None:
        self.t.longest_gap = max(self.t.longest_gap, upper)
        if gap > 1.0:
            msg = f"{name} no decode step for {gap:.1f}s from t={since - self.t0:.1f}s"
            self.say(f"STALL {msg} ({self.doing})")
            self.t.stalls.append(f"{msg} ({self.doing})")

    # -- faults ------------------------------------------------------------------------

    def busy_spare(self) -> tuple[str, int]:
        """The spare worker (never the witness: its RSS is the trend), once it holds jobs."""
        name = next(n for n in self.c.workers if n != self.witness)
        return name, self.listen_held([name])

    def kill9_replace(self) -> str:
        name, held = self.busy_spare()
        self.c.kill9(name)
        new = self.c.start_worker()
        return f"kill -9 {name} holding {held} jobs; replacement {new}"

    def kill9_recover(self) -> str:
        (name, held), t = self.busy_spare(), time.monotonic()
        self.c.kill9(name)
        while self.c.wip(name) and time.monotonic() < t + 60:  # the witness requeues them
            time.sleep(0.05)
        self.t.recoveries.append(time.monotonic() - t)
        new = self.c.start_worker()
        return (
            f"kill -9 {name} holding {held} jobs; {self.witness} requeued them in "
            f"{self.t.recoveries[-1]:.2f}s; then started {new}"
        )

    def sigterm_replace(self) -> str:
        (name, held), t = self.busy_spare(), time.monotonic()
        rc = self.c.sigterm(name)
        self.t.sigterm_rcs.append(rc)
        left = len(self.c.wip(name))
        new = self.c.start_worker()
        return (
            f"SIGTERM {name} holding {held} jobs: exit {rc} after "
            f"{time.monotonic() - t:.1f}s, {left} left in its WIP list; started {new}"
        )

    def restart_redis(self) -> str:
        held = self.listen_held(list(self.c.workers))
        self.c.stop_redis()
        time.sleep(2)  # a real outage: workers and listeners must ride it out
        self.c.start_redis()
        return f"redis-server stopped for 2s and restarted (AOF) with {held} jobs held"

    def kill_clients(self) -> str:
        held = self.listen_held(list(self.c.workers))
        normal = retry(lambda: self.c.r.execute_command("CLIENT", "KILL", "TYPE", "normal"))
        pubsub = retry(lambda: self.c.r.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
        return f"CLIENT KILL: {normal} normal, {pubsub} pubsub connections; {held} jobs held"

    def cancel_sample(self) -> str:
        """A burst deep enough to leave some jobs queued, interactive jobs that pause some
        of its rows; cancel 5 running (or paused) and 5 queued."""
        jobs = self.submit(
            [{**job_kwargs(k), "max_tokens": 24} for k in range(4 * MAX_BATCH)], "burst"
        )
        for j in jobs:
            self.listen(j.id)
        time.sleep(0.3)
        # Interactive jobs now find every row taken: soak jobs are paused for them (and a
        # paused one may be among those canceled next).
        sent = time.monotonic()
        kws = [interactive_kwargs(10**6 + next(self.serial)) for _ in range(8)]
        for j in self.submit(kws, "interactive", CHAT_QUEUE):
            self.listen(j.id, sent)
        picked = Counter[str]()
        for j in jobs:
            st = retry(j.status)
            if st in ("started", "queued") and picked[st] < 5 and retry(j.cancel):
                picked[st] += 1
                self.t.cancel_asked[j.id] = st
                self.t.cancel_said[j.id] = ("cancel_sample", True)
        return (
            f"8 interactive jobs beside a burst of {len(jobs)}; canceled "
            f"{picked['started']} running and {picked['queued']} queued jobs"
        )

    def poison(self) -> str:
        r = self.c.r
        rogue = Queue(QUEUE, connection=r)  # rq's default serializer: pickle
        mq = Queue(QUEUE, connection=r, serializer=MsgpackSerializer)
        ids = [rogue.enqueue(JOB_FUNC, {"v": 1, "prompt": "pickled"}).id]
        for payload in (
            {"v": 1, "prompt": 42},
            {"v": 1, "prompt": "x", "max_tokens": "many"},
            {"v": 1, "prompt": "x", "top_p": 7},
            ["not", "a", "map"],
        ):
            ids.append(mq.enqueue(JOB_FUNC, payload).id)
        ids.append(mq.enqueue("os.system", {"v": 1, "prompt": "rm -rf /"}).id)
        job = mq.create_job(JOB_FUNC, args=({"v": 1, "prompt": "x"},))
        with r.pipeline() as p:  # one MULTI: no worker can dequeue it before the garbage lands
            mq.enqueue_job(job, pipeline=p)
            p.hset(job.key, "data", b"\xc1\xff\x00garbage")
            p.execute()
        ids.append(job.id)
        bare = mq.create_job(JOB_FUNC, args=({"v": 1, "prompt": "x"},))
        with r.pipeline() as p:  # a record without data (issue 8, 7): it fails by reason
            mq.enqueue_job(bare, pipeline=p)
            p.hdel(bare.key, "data")
            p.execute()
        ids.append(bare.id)
        long_prompt = self.client.submit("lorem ipsum dolor " * 300, max_tokens=8)
        ids.append(long_prompt.id)
        with self.t.lock:
            self.t.kind.update((i, "poison") for i in ids)
        for i in ids:
            self.listen(i)
        return (
            f"{len(ids)} poison jobs (pickle, wrong types, os.system, garbage, no data, too long)"
        )

    # -- issue 8's hostile entries -----------------------------------------------------

    def expect(self, job_id: str, what: str, ends: tuple[str, ...], reason: str = "") -> None:
        with self.t.lock:
            self.t.expect[job_id] = (what, ends, reason)

    def poisoned_keys(self) -> str:
        """Valid jobs whose other keys are rogue: an attempt count that is no int and a log
        key of the wrong type, written before the job is queued, and the log of a running
        job made a string. Each fails (or heals) that one job; the batch decodes on."""
        r, n = self.c.r, next(self.serial)
        attempt, log = f"poisoned-attempt-{n}-{uuid.uuid4().hex[:8]}", f"poisoned-log-{n}"
        log += f"-{uuid.uuid4().hex[:8]}"
        retry(lambda: r.set(stream_key(log), "x"))
        kws = [job_kwargs(10_000 + 2 * n), job_kwargs(10_001 + 2 * n)]
        self.expect(attempt, "mlxq_attempt=notanint", ("failed",), "mlxq_attempt")
        self.expect(log, "log key a string before the start", ("finished", "failed"))
        # A submit refuses an id whose key holds anything but an ended job, so the attempt
        # count is poisoned between the submit and the claim: queued where no worker looks,
        # then moved onto the soak's queue with the rogue field, in one script.
        hold = f"{QUEUE}-hold-{n}"
        (held,) = retry(lambda: self.client.submit_many(kws[:1], job_ids=[attempt], queue=hold))
        retry(
            lambda: r.eval(
                "redis.call('LREM', KEYS[1], 1, ARGV[1]); "
                "redis.call('HSET', KEYS[2], 'mlxq_attempt', 'notanint'); "
                "redis.call('RPUSH', KEYS[3], ARGV[1])",
                3,
                queue_key(hold),
                job_key(attempt),
                queue_key(QUEUE),
                attempt,
            )
        )
        jobs = [held, *retry(lambda: self.client.submit_many(kws[1:], job_ids=[log]))]
        (running,) = self.submit(
            [
                {
                    "prompt": f"A long tale, part {n}",
                    "max_tokens": 400,
                    "temperature": 1.0,
                    "seed": n,
                }
            ],
            "poisoned",
        )
        for j in (*jobs, running):
            self.listen(j.id)
        with self.t.lock:
            self.t.kind.update((j.id, "poisoned") for j in jobs)
        deadline = time.monotonic() + 10
        while retry(running.status) == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        with r.pipeline() as p:  # one MULTI: the status it had when its log went bad
            p.hget(job_key(running.id), "status")
            p.delete(stream_key(running.id))
            p.set(stream_key(running.id), "x")
            was = (retry(p.execute)[0] or b"?").decode()
        if was == "started":
            self.expect(running.id, "log key a string while running", ("failed",), "replay log")
        else:  # it ended (a random model may stop at once) or never started in time
            self.expect(running.id, f"log key a string while {was}", (*TERMINAL,))
        return f"3 valid jobs with rogue keys (attempt, log before start, log while {was})"

    def queue_wide_keys(self) -> str:
        """Queue-wide keys of another type. A busy worker's own lease made a hash: it must
        rewrite it and serve on. The queue's roll made a string, then a worker holding jobs
        killed: its jobs must be found without the roll, and the roll heal. A registry of
        a queue nobody uses and a worker record with a pid that is no number: every reader
        skips them. Every job still ends exactly once."""
        r = self.c.r
        name, held = self.busy_spare()
        lease, t = alive_key(name), time.monotonic()
        with r.pipeline() as p:  # one MULTI: the key is never missing, only wrong
            p.delete(lease)
            p.hset(lease, "x", "y")
            retry(p.execute)
        while retry(lambda: r.type(lease)) != b"string" and time.monotonic() < t + 30:
            time.sleep(0.05)
        lease_s = time.monotonic() - t
        roll = workers_key(QUEUE)
        with r.pipeline() as p:
            p.delete(roll)
            p.set(roll, "junk")
            retry(p.execute)
        victim, vheld = self.busy_spare()
        t = time.monotonic()
        self.c.kill9(victim)
        while self.c.wip(victim) and time.monotonic() < t + 60:  # found without the roll
            time.sleep(0.05)
        found_s, left = time.monotonic() - t, len(self.c.wip(victim))
        new = self.c.start_worker()
        t = time.monotonic()
        while retry(lambda: r.type(roll)) != b"set" and time.monotonic() < t + 30:
            time.sleep(0.05)
        roll_s = time.monotonic() - t
        zzz = f"zzz-{uuid.uuid4().hex[:6]}"
        rogue = rq_worker_key(f"w-{zzz}")
        with r.pipeline() as p:
            p.sadd("rq:queues", queue_key(zzz))
            p.set(f"rq:failed:{zzz}", "junk")
            p.hset(rogue, mapping={"pid": "abc", "birth": "not a date", "queues": zzz})
            p.sadd("rq:workers", rogue)
            retry(p.execute)
        if lease_s >= 30 or left or roll_s >= 30:
            self.t.queue_wide_failures.append(
                f"lease of {name} {'not ' if lease_s >= 30 else ''}rewritten; {left} jobs of "
                f"{victim} left in its WIP list; roll {'not ' if roll_s >= 30 else ''}healed"
            )
        return (
            f"lease of {name} (holding {held}) a hash: rewritten in {lease_s:.2f}s; roll a "
            f"string, kill -9 {victim} holding {vheld}: requeued in {found_s:.2f}s ({left} "
            f"left), roll a set again in {roll_s:.2f}s; started {new}; a junk registry and "
            f"worker record of queue {zzz}"
        )

    def bad_ids(self) -> str:
        """Ids that are not UTF-8, too long, or of no job, pushed onto the queue."""
        rogue = [b"\xc3\x28", b"\xff\xfe\xfd", b"x" * 300, f"no-such-job-{uuid.uuid4().hex}"]
        retry(lambda: self.c.r.rpush(queue_key(QUEUE), *rogue))
        self.rogue_ids.update(i if isinstance(i, bytes) else i.encode() for i in rogue)
        return f"RPUSH {len(rogue)} rogue ids (2 not UTF-8, 1 of 300 bytes, 1 of no job)"

    def forged_messages(self) -> str:
        """Junk on the channels of held jobs, a forged far-off log entry, junk and 500
        forged ids on each worker's cancel channel; then a cancel that must still work."""
        held = self.listen_held(list(self.c.workers))
        r, ids = self.c.r, [i for n in list(self.c.workers) for i in self.c.wip(n)]
        with r.pipeline(transaction=False) as p:
            for i in ids:
                p.publish(channel(i), b"\xff\xfe not msgpack")
            for name in list(self.c.workers):
                for junk in (b"\xff\xfe", b"", b"\x00" * 300):
                    p.publish(cancel_channel(name), junk)
                for k in range(500):
                    p.publish(cancel_channel(name), f"forged-{k}")
            retry(p.execute)
        forged = ""
        for i in ids:  # one far-off entry in the log of a running job whose log exists
            if retry(lambda i=i: r.hget(job_key(i), "status")) == b"started" and r.exists(
                stream_key(i)
            ):
                retry(lambda i=i: r.xadd(stream_key(i), {"c": b"\xc1 junk"}, id="99999999-0"))
                forged = f"; a forged log entry 99999999-0 in {i}"
                break
        probes = 0
        for name in list(self.c.workers):  # the cancel listeners outlived the junk
            for i in self.c.wip(name):
                if retry(lambda i=i: r.hget(job_key(i), "status")) == b"started" and i not in (
                    self.t.cancel_said
                ):
                    self.t.cancel_said[i] = ("forged_messages", retry(Job(self.client, i).cancel))
                    probes += 1
                    break
        return (
            f"junk on {len(ids)} job channels ({held} held), junk and 500 forged ids on "
            f"{len(self.c.workers)} cancel channels{forged}; {probes} cancels after it"
        )

    def freeze(self) -> str:
        """SIGSTOP a busy worker past its lease while the witness runs, then SIGCONT. A
        burst first, so it holds many jobs, and one during the freeze: a claim the frozen
        worker had waiting may be handed a job that its reaped WIP list must not swallow."""
        burst = [{**job_kwargs(k), "max_tokens": 24} for k in range(2 * MAX_BATCH)]
        for j in self.submit(burst, "burst"):
            self.listen(j.id)
        name = next(n for n in self.c.workers if n != self.witness)
        deadline = time.monotonic() + 5
        while len(self.c.wip(name)) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        held = self.listen_held([name])
        proc = self.c.workers[name]
        self.excused[name] = math.inf
        proc.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        for j in self.submit(burst, "burst"):
            self.listen(j.id)
        while self.c.wip(name) and time.monotonic() < t + 8:  # the witness reaps it
            time.sleep(0.05)
        reaped = time.monotonic() - t
        time.sleep(max(0.0, t + 8 - time.monotonic()))
        left = len(self.c.wip(name))
        proc.send_signal(signal.SIGCONT)
        self.excused[name] = time.monotonic() + 3
        return (
            f"SIGSTOP {name} holding {held} jobs for 8s: reaped after {reaped:.1f}s, "
            f"{left} in its WIP list at SIGCONT"
        )

    def duplicate_entries(self) -> str:
        """Ids already running (and one already finished) pushed onto the queue again."""
        self.listen_held(list(self.c.workers))
        running = [i for n in list(self.c.workers) for i in self.c.wip(n)][:4]
        with self.t.lock:
            done = [i for i in self.t.watch if self.t.final[i][0] == "finished"][:1]
        if running or done:
            retry(lambda: self.c.r.rpush(queue_key(QUEUE), *running, *done))
        return f"RPUSH again {len(running)} held and {len(done)} finished job ids"

    def cancel_race(self) -> str:
        """Cancel 24 short jobs around the moment each ends: cancel() must tell the truth."""
        rng = random.Random(next(self.serial))
        jobs = self.submit(
            [
                {"prompt": f"race {k}", "max_tokens": 6, "temperature": 1.0, "seed": k}
                for k in range(24)
            ],
            "race",
        )
        for j in jobs:
            self.listen(j.id)

        def race(job: Job, delay: float) -> None:
            try:
                chunks = job.stream(timeout=60)
                next(chunks, None)
                chunks.close()
                time.sleep(delay)
                said = retry(job.cancel)
            except Exception as e:
                self.say(f"cancel race of {job.id}: {e!r}")
                return
            with self.t.lock:
                self.t.cancel_said[job.id] = ("cancel_race", said)

        threads = [
            threading.Thread(target=race, args=(j, rng.uniform(0, 0.02)), daemon=True) for j in jobs
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
        said = Counter(v for i, (why, v) in self.t.cancel_said.items() if why == "cancel_race")
        return f"24 cancels racing ends so far: {said[True]} said True, {said[False]} False"

    def maxmemory(self) -> str:
        """Redis at maxmemory (noeviction) a few seconds: writes are refused, then go on."""
        r = self.c.r
        was = retry(lambda: r.config_get("maxmemory*"))
        held = self.listen_held(list(self.c.workers))
        oom = self.refusals()
        used = int(retry(lambda: r.info("memory"))["used_memory"])
        try:
            retry(lambda: r.config_set("maxmemory-policy", "noeviction"))
            retry(lambda: r.config_set("maxmemory", used + 64 * 1024))
            end = time.monotonic() + 4
            while time.monotonic() < end:  # memory falls as records expire: follow it down
                time.sleep(0.5)
                if self.refusals() == oom:
                    now = int(retry(lambda: r.info("memory"))["used_memory"])
                    retry(lambda now=now: r.config_set("maxmemory", now))
            peak = int(retry(lambda: r.info("memory"))["used_memory"])
        finally:
            retry(lambda: r.config_set("maxmemory", was.get("maxmemory", "0")))
            retry(lambda: r.config_set("maxmemory-policy", was["maxmemory-policy"]))
        return (
            f"maxmemory {(used + 64 * 1024) / 2**20:.2f} MiB (used {used / 2**20:.2f}, "
            f"{peak / 2**20:.2f} at the end; lowered to used memory while nothing was "
            f"refused) with noeviction for 4s: "
            f"{self.refusals() - oom} commands refused; {held} jobs held"
        )

    def refusals(self) -> int:
        """Commands Redis refused for memory so far (since its last start)."""
        stats = retry(lambda: self.c.r.info("errorstats"))
        return int(stats.get("errorstat_OOM", {}).get("count", 0))

    def check_workers(self) -> None:
        for name, proc in list(self.c.workers.items()):
            if proc.poll() is not None:
                self.t.unexpected_exits.append(f"{name} exit {proc.returncode}")
                self.c.workers.pop(name)
                self.c.start_worker()

    def inject(self, submitting: threading.Thread) -> None:
        faults = [
            self.kill9_replace,
            self.kill9_recover,
            self.sigterm_replace,
            self.restart_redis,
            self.kill_clients,
            self.cancel_sample,
            self.poison,
        ]
        hostile = [
            self.poisoned_keys,
            self.bad_ids,
            self.forged_messages,
            self.freeze,
            self.duplicate_entries,
            self.cancel_race,
            self.maxmemory,
            self.queue_wide_keys,
        ]
        pairs = itertools.zip_longest(faults, hostile)
        faults = [f for pair in pairs for f in pair if f is not None]
        for n, fault in enumerate(itertools.cycle(faults)):
            if n >= len(faults) and not submitting.is_alive():
                return
            time.sleep(self.args.gap_s)
            self.doing = fault.__name__
            start = time.monotonic() - self.t0
            said = fault()
            self.t.fault_spans.append((fault.__name__, start, time.monotonic() - self.t0))
            self.say(f"{fault.__name__}: {said}")
            self.doing = f"after {fault.__name__}"
            self.t.faults[fault.__name__] += 1
            self.check_workers()

    # -- the run -----------------------------------------------------------------------

    def run(self) -> bool:
        c = self.c
        watching = threading.Event()
        monitor = threading.Thread(target=self.monitor, args=(watching,), daemon=True)
        monitor.start()
        self.witness = c.start_worker()  # lives through the whole soak: its RSS is the trend
        c.start_worker()
        warm = self.client.submit_many([job_kwargs(k) for k in range(2 * MAX_BATCH)])
        for j in warm:
            j.result(timeout=120)
        self.t.memory["before"] = c.memory()
        self.say(f"workers {list(c.workers)} up and warm; soak of {self.args.jobs} jobs")
        stop, half = threading.Event(), threading.Event()
        poller = threading.Thread(target=self.poll, args=(stop,), daemon=True)
        poller.start()
        submitting = threading.Thread(target=self.submitter, args=(half,), daemon=True)
        submitting.start()
        talking = threading.Event()
        chats = [
            threading.Thread(target=self.chatter, args=(k, talking), daemon=True)
            for k in range(CHATS)
        ]
        chats.append(threading.Thread(target=self.interactive, args=(talking,), daemon=True))
        for th in chats:
            th.start()
        self.inject(submitting)
        submitting.join()
        talking.set()
        for th in chats:
            th.join(70)
        if self.submitted < self.args.jobs:
            self.say(f"the submitter stopped after {self.submitted} of {self.args.jobs} jobs")
        self.drain()
        self.doing = "drained"
        watching.set()
        monitor.join()
        self.t.stray = self.strays()
        time.sleep(3)  # a woken or duplicate copy had time to write, had it been let
        self.poll_once()
        # Every job ended, so rq must show none started: name any it still does.
        started = [
            f"{i[:8]} {self.t.final.get(i, ('untracked',))[0]}"
            for q in (CHAT_QUEUE, QUEUE)
            for i in retry(StartedJobRegistry(q, connection=c.r).get_job_ids)
        ]
        self.say(f"drained; StartedJobRegistry holds {started}; waiting out the TTLs")
        time.sleep(self.args.ttl + 3)
        stop.set()
        poller.join()
        self.poll_once()
        for q in (CHAT_QUEUE, QUEUE):
            clean_registries(Queue(q, connection=c.r, serializer=MsgpackSerializer))
        self.t.memory["after"] = c.memory()
        return self.report(started)

    def drain(self) -> None:
        deadline = time.monotonic() + self.args.drain_s
        while time.monotonic() < deadline and len(self.t.final) < len(self.t.kind):
            time.sleep(0.5)
        for th in self.listeners:
            th.join(max(0.1, deadline - time.monotonic()))

    def strays(self) -> list[str]:
        """What is left in the queue and in every WIP list once every job ended: each entry
        is a rogue id or a duplicate that nobody dropped."""
        r, out = self.c.r, []
        wips = (k.decode() for k in r.scan_iter(match=wip_key("*")))
        for k in [queue_key(CHAT_QUEUE), queue_key(QUEUE), *wips]:
            out += [f"{k}: {i!r}" for i in retry(lambda k=k: r.lrange(k, 0, -1))]
        return out

    def report(self, started: list[str]) -> bool:
        t = self.t
        status = Counter(t.final.get(i, ("lost", ""))[0] for i in t.kind)
        lost = [i for i in t.kind if t.final.get(i, ("lost",))[0] in ("lost", "vanished")]
        failed = [(t.kind[i], s[1]) for i, s in t.final.items() if s[0] == "failed"]
        poison_ok = sum(1 for k, why in failed if k == "poison" and why not in ("", "unknown"))
        poison_n = sum(1 for k in t.kind.values() if k == "poison")
        others = Counter(why.split(":")[0] for k, why in failed if k not in ("poison", "poisoned"))
        alive_listeners = sum(th.is_alive() for th in self.listeners)
        asked = Counter((st, t.final.get(i, ("lost",))[0]) for i, st in t.cancel_asked.items())
        queued_not_canceled = sum(
            n for (st, end), n in asked.items() if st == "queued" and end != "canceled"
        )
        said = Counter(
            (why, v, t.final.get(i, ("lost",))[0]) for i, (why, v) in t.cancel_said.items()
        )
        untruthful = [
            f"{i} said {v}, ended {t.final.get(i, ('lost',))[0]}"
            for i, (_, v) in t.cancel_said.items()
            if v != (t.final.get(i, ("lost",))[0] == "canceled")
        ]
        unexpected = []
        for i, (what, ends, must) in t.expect.items():
            st, why = t.final.get(i, ("lost", ""))
            if st not in ends or (st == "failed" and (must not in why or why == "unknown")):
                unexpected.append(f"{i} ({what}) ended {st}: {why!r}")
        poisoned_ends = Counter(t.final.get(i, ("lost",))[0] for i in t.expect)
        poisoned_why = sorted(
            {t.final[i][1][:60] for i in t.expect if t.final.get(i, ("",))[0] == "failed"}
        )
        rows = [
            ("faults injected", ", ".join(f"{k} x{v}" for k, v in t.faults.items())),
            (
                "jobs submitted",
                f"{len(t.kind)} ({dict(Counter(t.kind.values()))}); "
                f"{t.submit_retries} submit batches retried",
            ),
            *self.interactive_rows(),
            ("finished", status["finished"]),
            (
                "failed with reason: poison",
                f"{poison_ok} of {poison_n} poison jobs; {t.poison_started} reached the engine",
            ),
            (
                "failed with reason: poisoned keys",
                f"{poisoned_ends['failed']} of {len(t.expect)} valid jobs with rogue keys "
                f"({dict(poisoned_ends)}); {len(unexpected)} unexpected {unexpected or ''}; "
                f"reasons {poisoned_why}",
            ),
            (
                "failed with reason: other",
                f"{others.total()} {dict(others)}",
            ),
            ("canceled", f"{status['canceled']}; asked (status then, end): {dict(asked)}"),
            (
                "cancel() verdicts wrong (must be 0)",
                f"{len(untruthful)} not {untruthful[:5] or ''}; (fault, said, end): {dict(said)}",
            ),
            ("lost (must be 0)", f"{len(lost)} {self.whereabouts(lost[:5]) if lost else ''}"),
            (
                "ended twice (must be 0)",
                f"{len(t.ended_twice)} {list(t.ended_twice.items())[:5] or ''}",
            ),
            ("left in StartedJobRegistry (must be 0)", f"{len(started)} {started or ''}"),
            (
                "listeners",
                f"{len(t.listened)} jobs, {t.chunks_seen} chunks, "
                f"{alive_listeners} still waiting, {t.listener_errors} errors",
            ),
            ("duplicated chunks (must be 0)", t.duplicates),
            ("streamed text mismatches (must be 0)", t.mismatches),
            (
                "worker stalls > 1 s (must be 0)",
                f"{len(t.stalls)} {t.stalls[:5] or ''}; {t.stall_samples} scrapes, "
                f"{t.busy_samples} with jobs running; longest stretch without a step "
                f"{t.longest_gap:.2f}s at most",
            ),
            (
                "rogue ids left in queue or WIP (must be 0)",
                f"{len(t.stray)} {t.stray[:5] or ''}",
            ),
            ("SIGTERM exit codes", t.sigterm_rcs),
            ("kill -9 recovery by the live worker", [f"{s:.2f}s" for s in t.recoveries]),
            ("queue-wide keys not healed (must be 0)", t.queue_wide_failures or 0),
            ("workers that died unasked", t.unexpected_exits or 0),
        ]
        for phase, (used, rss) in t.memory.items():
            rows.append((f"redis used_memory {phase}", f"{used / 2**20:.2f} MiB"))
            rows.append((f"worker RSS {phase}", ", ".join(f"{n} {m} MiB" for n, m in rss.items())))
        live = collect(self.c.r)["workers"]
        hits = sum(w.get("prompt_cache_hits", 0) for w in live)
        rows.append(("prompt cache hits (must be > 0)", hits))
        handed = sum(w.get("jobs_handed_out", 0) for w in live)
        rows.append(("chat turns handed, by live workers (must be > 0)", handed))
        rows += self.leftovers()
        print()
        for k, v in rows:
            print(f"{k:>38} | {v}")
        bad = {
            "lost": len(lost),
            "duplicates": t.duplicates,
            "mismatches": t.mismatches,
            "poison not failed": poison_n - poison_ok,
            "poison started": t.poison_started,
            "soak jobs not submitted": self.args.jobs - self.submitted,
            "poisoned keys unexpected": len(unexpected),
            "ended twice": len(t.ended_twice),
            "cancel() untruthful": len(untruthful),
            "worker stalls": len(t.stalls),
            "rogue ids left": len(t.stray),
            "started registry": len(started),
            "listeners waiting": alive_listeners,
            "listener errors": t.listener_errors,
            "queued cancels ignored": queued_not_canceled,
            "SIGTERM exit != 0": sum(rc != 0 for rc in t.sigterm_rcs),
            "workers died unasked": len(t.unexpected_exits),
            "queue-wide keys not healed": len(t.queue_wide_failures),
            "no prompt cache hit": hits == 0,
            "no chat turn handed": handed == 0,
            "interactive not finished": len(self.unfinished_interactive()),
            "no row paused": sum(v[0] for v in t.paused.values()) == 0,
        }
        bad = {k: v for k, v in bad.items() if v}
        print(f"\n{'FAIL: ' + str(bad) if bad else 'PASS'}")
        return not bad

    def unfinished_interactive(self) -> list[str]:
        """Interactive jobs that did not finish, but for those a cancel said it canceled."""
        t, out = self.t, []
        for i, kind in t.kind.items():
            end = t.final.get(i, ("lost", ""))
            canceled = end[0] == "canceled" and t.cancel_said.get(i, ("", False))[1]
            if kind == "interactive" and end[0] != "finished" and not canceled:
                out.append(f"{i} {end}")
        return out

    def interactive_rows(self) -> list[tuple[str, Any]]:
        """The interactive jobs beside the soak's: their ends, their first text against
        the soak jobs', and the rows paused for them (by the workers alive now)."""
        t = self.t
        ids = [i for i, kind in t.kind.items() if kind == "interactive"]
        ends = Counter(t.final.get(i, ("lost",))[0] for i in ids)
        unfinished = self.unfinished_interactive()

        def during(i: str, s: float) -> list[str]:
            """The faults a job's wait for its first text overlapped."""
            sent = t.sent_s.get(i, 0.0)
            return [f for f, a, b in t.fault_spans if a <= sent + s and b >= sent]

        def p99(xs: list[float]) -> str:
            xs = sorted(xs)
            return f"{1e3 * xs[max(0, math.ceil(0.99 * len(xs)) - 1)]:,.0f} ms ({len(xs)})"

        def first(kind: str) -> str:
            xs = sorted(s for i, s in t.first_text_s.items() if t.kind.get(i) == kind)
            if not xs:
                return "none timed"
            return f"p50 {1e3 * xs[len(xs) // 2]:,.0f} ms, p99 {p99(xs)}"

        clear = [s for i, s in t.first_text_s.items() if i in ids and not during(i, s)]

        paused = [sum(v[k] for v in t.paused.values()) for k in (0, 1)]
        live = collect(self.c.r)["workers"]
        again = sum(w.get("resume_tokens_recomputed", 0) for w in live)
        return [
            (
                f"interactive jobs ({CHAT_QUEUE})",
                f"{len(ids)} submitted, ends {dict(ends)}; not finished (must be 0): "
                f"{len(unfinished)} {unfinished[:3] or ''}",
            ),
            (
                "first text from submit",
                f"interactive {first('interactive')}; soak jobs beside them {first('soak')}",
            ),
            (
                "the same, waits no fault overlapped",
                f"interactive p99 {p99(clear) if clear else 'none timed'}",
            ),
            (
                "slowest interactive first texts",
                ", ".join(
                    f"{i} {1e3 * s:,.0f} ms (sent at {t.sent_s.get(i, 0):.1f}s"
                    f"{''.join(f', {f}' for f in during(i, s))})"
                    for i, s in sorted(
                        ((i, s) for i, s in t.first_text_s.items() if i in ids),
                        key=lambda x: -x[1],
                    )[:6]
                ),
            ),
            (
                "rows paused (must be > 0) / resumed",
                f"{paused[0]} / {paused[1]}, by {len(t.paused)} workers (last scrape of "
                f"each); tokens prefilled again on resume {again} (workers alive at the end)",
            ),
        ]

    def whereabouts(self, ids: list[str]) -> list[str]:
        """Where lost jobs are: their rq status and which worker's WIP list holds them."""
        wips = {
            k.decode(): {i.decode() for i in self.c.r.lrange(k, 0, -1)}
            for k in self.c.r.scan_iter(match=wip_key("*"))
        }
        return [
            f"{i} {(self.c.r.hget(f'rq:job:{i}', 'status') or b'expired').decode()} in "
            f"{[k for k, held in wips.items() if i in held]}"
            for i in ids
        ]

    def leftovers(self) -> list[tuple[str, Any]]:
        """Keys still in Redis after the TTLs, by prefix; those with no TTL never go."""
        raw = list(self.c.r.scan_iter(count=1000))
        # A rogue id pushed by bad_ids may name a key: shown escaped, looked up as is.
        names = [k.decode(errors="backslashreplace") for k in raw]
        with self.c.r.pipeline(transaction=False) as p:
            for k in raw:
                p.ttl(k)
            ttls = p.execute()
        prefix = [":".join(k.split(":")[:2]) for k in names]
        forever = Counter(p for p, ttl in zip(prefix, ttls, strict=True) if ttl == -1)
        per_job = ("rq:job", "rq:results", "mlxq:stream", "rq:execution", "rq:executions")
        jobs_forever = [
            k for k, p, ttl in zip(names, prefix, ttls, strict=True) if ttl == -1 and p in per_job
        ]
        flagged = sum(
            1
            for k in self.c.r.scan_iter(match="rq:job:*", count=1000)
            if self.c.r.hget(k, "mlxq_cancel") is not None
        )
        return [
            ("keys left after TTLs", f"{len(names)} {dict(Counter(prefix).most_common())}"),
            ("of which without a TTL", f"{forever.total()} {dict(forever.most_common())}"),
            ("per-job keys without a TTL", f"{len(jobs_forever)} {jobs_forever[:5] or ''}"),
            ("job records left with a cancel flag", flagged),
        ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=5000, help="soak size (default %(default)s)")
    ap.add_argument("--submit-s", type=float, default=240, help="spread submits over this long")
    ap.add_argument("--ttl", type=int, default=30, help="result, failure and stream TTL, s")
    ap.add_argument("--gap-s", type=float, default=4, help="pause between faults")
    ap.add_argument("--drain-s", type=float, default=180, help="how long jobs may take to end")
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run (300 jobs)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir with the logs")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.submit_s, args.ttl, args.gap_s = 300, 25, 10, 1.5
    work = Path(tempfile.mkdtemp(prefix="mlxq-soak-"))
    cluster = Cluster(work, grace_s=5, stream_ttl=args.ttl)
    t0, ok = time.monotonic(), False
    try:
        cluster.start_redis()
        subprocess.run(
            [str(MLXQ), "model", "tiny", str(cluster.model)], check=True, stdout=subprocess.DEVNULL
        )
        ok = Soak(cluster, args).run()
    finally:
        cluster.stop_all()
        print(
            f"run time {time.monotonic() - t0:.0f}s; logs in {work}"
            + ("" if args.keep or not ok else " (removed)")
        )
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if "--sentinel" in sys.argv[1:]:  # primary kills under load: ops/soak_sentinel.py
        from soak_sentinel import main as sentinel_main

        sys.exit(sentinel_main(sys.argv[1:]))
    sys.exit(main())
