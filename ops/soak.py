"""`make soak`: evidence for crash safety and bounded resources, against real processes.

Starts its own redis-server (AOF, so a restart keeps every job), the tiny model and real
`mlxq worker` processes, then submits N short jobs at a steady pace while faults are injected:
kill -9 and SIGTERM of workers, a Redis restart, dropped client connections, cancels, and
poison jobs written straight to Redis. Listeners follow a sample of streams. Every job must
end finished, failed with a reason, or canceled; no listener may see a chunk twice or a text
that differs from the result; Redis memory and worker RSS are printed before, midway and
after the TTLs expire. Exits 1 when a check fails (the temp dir with the logs is kept).
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.registry import StartedJobRegistry, clean_registries

from mlxq.producer import Client, Job, JobFailed
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.keys import JOB_FUNC, alive_key, wip_key

QUEUE = "soak"
MAX_BATCH = 32
TERMINAL = ("finished", "failed", "canceled")
WORDS = [
    "river",
    "stone",
    "lamp",
    "harbor",
    "winter",
    "copper",
    "garden",
    "signal",
    "orchard",
    "violet",
    "thunder",
    "ladder",
    "meadow",
    "candle",
    "engine",
    "quiet",
    "falcon",
]
# The five sampling-param groups; the fifth (seeded) is built per job.
GROUPS = [
    {},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 1.2, "min_p": 0.1},
]
MLXQ = shutil.which("mlxq") or str(Path(sys.executable).with_name("mlxq"))


@dataclass
class Tally:
    """What the soak saw; written by the submitter, poller, listener and fault threads."""

    faults: Counter[str] = field(default_factory=Counter)
    kind: dict[str, str] = field(default_factory=dict)  # job id -> soak | burst | poison
    final: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (status, reason)
    poison_started: int = 0  # poison jobs that reached the engine (must be 0)
    submit_retries: int = 0
    listened: set[str] = field(default_factory=set)
    chunks_seen: int = 0
    listener_errors: int = 0
    duplicates: int = 0
    mismatches: int = 0
    cancel_asked: dict[str, str] = field(default_factory=dict)  # id -> status when asked
    sigterm_rcs: list[int] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    memory: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def retry(fn: Callable[[], Any], within: float = 60) -> Any:
    """Call fn, riding out a Redis restart or a killed connection (we cause both)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
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
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.r = redis.Redis.from_url(self.url)
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
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
        self.workers[name] = subprocess.Popen(
            [
                MLXQ,
                "worker",
                "--model",
                str(self.model),
                "--redis-url",
                self.url,
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


def job_kwargs(k: int) -> dict[str, Any]:
    """Job k of the soak: one of five sampling groups, a varied prompt, 8-24 tokens."""
    rng = random.Random(k)
    params = dict(GROUPS[k % 5]) if k % 5 < 4 else {"temperature": 0.8, "seed": k}
    text = f"{k} " + " ".join(rng.sample(WORDS, rng.randint(1, 12)))
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": text}]} if k % 7 == 0 else {"prompt": text}
    )
    return {**prompt, "max_tokens": rng.randint(8, 24), **params}


class Soak:
    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.c, self.args, self.t = cluster, args, Tally()
        self.client = Client(cluster.url, QUEUE, result_ttl=args.ttl, failure_ttl=args.ttl)
        self.listeners: list[threading.Thread] = []
        self.witness = ""  # the worker no fault touches
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    # -- submit and follow -------------------------------------------------------------

    def submit(self, kws: list[dict[str, Any]], kind: str) -> list[Job]:
        def attempt() -> list[Job]:
            try:
                return self.client.submit_many(kws)
            except (redis.ConnectionError, redis.TimeoutError):
                self.t.submit_retries += 1  # Redis is restarting: send the batch again
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
            for k, job in enumerate(self.submit(kws, "soak"), start):
                if k % 10 == 0:  # a sample of listeners; faults add the jobs they hit
                    self.listen(job.id)
            if start + batch >= n // 2 and not half.is_set():
                self.t.memory["middle"] = self.c.memory()
                half.set()

    def listen(self, job_id: str) -> None:
        with self.t.lock:
            if job_id in self.t.listened:
                return
            self.t.listened.add(job_id)
        th = threading.Thread(target=self.follow, args=(Job(self.client, job_id),), daemon=True)
        th.start()
        self.listeners.append(th)

    def follow(self, job: Job) -> None:
        """Record every chunk; a reset voids the text shown before it."""
        seqs, text, ended = [], "", ""
        try:
            for c in job.stream(timeout=self.args.drain_s + self.args.submit_s + 120):
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
        """Catch each job's terminal status before its record expires (--ttl)."""
        while not stop.wait(0.5):
            with self.t.lock:
                ids = [i for i in self.t.kind if i not in self.t.final]
            try:
                for i in range(0, len(ids), 500):
                    self.record(ids[i : i + 500])
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # Redis is restarting: the next pass catches up
            except Exception as e:
                self.say(f"poller: {e!r}")

    def record(self, ids: list[str]) -> None:
        with self.c.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hmget(f"rq:job:{i}", "status", "mlxq_attempt")
            rows = p.execute()
        for job_id, (status, attempt) in zip(ids, rows, strict=True):
            st = (status or b"vanished").decode()
            if st not in (*TERMINAL, "vanished"):
                continue
            reason = Job(self.client, job_id).failure_reason() if st == "failed" else ""
            with self.t.lock:
                self.t.final[job_id] = (st, reason)
                if self.t.kind[job_id] == "poison" and attempt is not None:
                    self.t.poison_started += 1

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
        """A burst deep enough to leave some jobs queued; cancel 5 running and 5 queued."""
        jobs = self.submit(
            [{**job_kwargs(k), "max_tokens": 24} for k in range(4 * MAX_BATCH)], "burst"
        )
        for j in jobs:
            self.listen(j.id)
        time.sleep(0.3)
        picked = Counter[str]()
        for j in jobs:
            st = retry(j.status)
            if st in ("started", "queued") and picked[st] < 5 and retry(j.cancel):
                picked[st] += 1
                self.t.cancel_asked[j.id] = st
        return f"canceled {picked['started']} running and {picked['queued']} queued jobs"

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
        long_prompt = self.client.submit("lorem ipsum dolor " * 300, max_tokens=8)
        ids.append(long_prompt.id)
        with self.t.lock:
            self.t.kind.update((i, "poison") for i in ids)
        for i in ids:
            self.listen(i)
        return f"{len(ids)} poison jobs (pickle, wrong types, os.system, garbage, too long)"

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
        for n, fault in enumerate(itertools.cycle(faults)):
            if n >= len(faults) and not submitting.is_alive():
                return
            time.sleep(self.args.gap_s)
            self.say(f"{fault.__name__}: {fault()}")
            self.t.faults[fault.__name__] += 1
            self.check_workers()

    # -- the run -----------------------------------------------------------------------

    def run(self) -> bool:
        c = self.c
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
        self.inject(submitting)
        submitting.join()
        self.drain()
        stop.set()
        poller.join()
        # Every job ended, so rq must show none started: name any it still does.
        started = [
            f"{i[:8]} {self.t.final.get(i, ('untracked',))[0]}"
            for i in retry(StartedJobRegistry(QUEUE, connection=c.r).get_job_ids)
        ]
        self.say(f"drained; StartedJobRegistry holds {started}; waiting out the TTLs")
        time.sleep(self.args.ttl + 3)
        clean_registries(Queue(QUEUE, connection=c.r, serializer=MsgpackSerializer))
        self.t.memory["after"] = c.memory()
        return self.report(started)

    def drain(self) -> None:
        deadline = time.monotonic() + self.args.drain_s
        while time.monotonic() < deadline and len(self.t.final) < len(self.t.kind):
            time.sleep(0.5)
        for th in self.listeners:
            th.join(max(0.1, deadline - time.monotonic()))

    def report(self, started: list[str]) -> bool:
        t = self.t
        status = Counter(t.final.get(i, ("lost", ""))[0] for i in t.kind)
        lost = [i for i in t.kind if t.final.get(i, ("lost",))[0] in ("lost", "vanished")]
        failed = [(t.kind[i], s[1]) for i, s in t.final.items() if s[0] == "failed"]
        poison_ok = sum(1 for k, why in failed if k == "poison" and why not in ("", "unknown"))
        poison_n = sum(1 for k in t.kind.values() if k == "poison")
        others = Counter(why.split(":")[0] for k, why in failed if k != "poison")
        alive_listeners = sum(th.is_alive() for th in self.listeners)
        asked = Counter((st, t.final.get(i, ("lost",))[0]) for i, st in t.cancel_asked.items())
        queued_not_canceled = sum(
            n for (st, end), n in asked.items() if st == "queued" and end != "canceled"
        )
        rows = [
            ("faults injected", ", ".join(f"{k} x{v}" for k, v in t.faults.items())),
            (
                "jobs submitted",
                f"{len(t.kind)} ({dict(Counter(t.kind.values()))}); "
                f"{t.submit_retries} submit batches retried",
            ),
            ("finished", status["finished"]),
            (
                "failed with reason: poison",
                f"{poison_ok} of {poison_n} poison jobs; {t.poison_started} reached the engine",
            ),
            ("failed with reason: other", f"{len(failed) - poison_ok} {dict(others)}"),
            ("canceled", f"{status['canceled']}; asked (status then, end): {dict(asked)}"),
            ("lost (must be 0)", f"{len(lost)} {self.whereabouts(lost[:5]) if lost else ''}"),
            ("left in StartedJobRegistry (must be 0)", f"{len(started)} {started or ''}"),
            (
                "listeners",
                f"{len(t.listened)} jobs, {t.chunks_seen} chunks, "
                f"{alive_listeners} still waiting, {t.listener_errors} errors",
            ),
            ("duplicated chunks (must be 0)", t.duplicates),
            ("streamed text mismatches (must be 0)", t.mismatches),
            ("SIGTERM exit codes", t.sigterm_rcs),
            ("kill -9 recovery by the live worker", [f"{s:.2f}s" for s in t.recoveries]),
            ("workers that died unasked", t.unexpected_exits or 0),
        ]
        for phase, (used, rss) in t.memory.items():
            rows.append((f"redis used_memory {phase}", f"{used / 2**20:.2f} MiB"))
            rows.append((f"worker RSS {phase}", ", ".join(f"{n} {m} MiB" for n, m in rss.items())))
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
            "started registry": len(started),
            "listeners waiting": alive_listeners,
            "listener errors": t.listener_errors,
            "queued cancels ignored": queued_not_canceled,
            "SIGTERM exit != 0": sum(rc != 0 for rc in t.sigterm_rcs),
            "workers died unasked": len(t.unexpected_exits),
        }
        bad = {k: v for k, v in bad.items() if v}
        print(f"\n{'FAIL: ' + str(bad) if bad else 'PASS'}")
        return not bad

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
        names = [k.decode() for k in self.c.r.scan_iter(count=1000)]
        with self.c.r.pipeline(transaction=False) as p:
            for k in names:
                p.ttl(k)
            ttls = p.execute()
        prefix = [":".join(k.split(":")[:2]) for k in names]
        forever = Counter(p for p, ttl in zip(prefix, ttls, strict=True) if ttl == -1)
        flagged = sum(
            1
            for k in self.c.r.scan_iter(match="rq:job:*", count=1000)
            if self.c.r.hget(k, "mlxq_cancel") is not None
        )
        return [
            ("keys left after TTLs", f"{len(names)} {dict(Counter(prefix).most_common())}"),
            ("of which without a TTL", f"{forever.total()} {dict(forever.most_common())}"),
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
            [MLXQ, "model", "tiny", str(cluster.model)], check=True, stdout=subprocess.DEVNULL
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
    sys.exit(main())
