"""Interactive chat jobs beside a sweep: what levels of queues buy, measured side by side.

Issue 22's targets, in one run, against a redis-server and real ``mlxq worker`` processes
this script starts (one at a time; the tiny model unless --model names another):

  idle     interactive chat jobs (messages, max_tokens 32) on the highest queue, one every
           --interactive-every s, on an otherwise idle worker (``--queue chat --queue
           sweeps``): first-token p50 / p99, timed by the producer from submit to the
           first streamed chunk with text
  alone    a sweep of --sweep-jobs prompt-varied greedy jobs of 64 tokens, sent with
           submit_many to the lowest queue: its tokens per second, first submit to last end
  both     the same sweep with interactive jobs beside it (from the moment the sweep is all
           submitted, so the producer's own submit work delays no first chunk it times,
           until its last job ends): their first-token p50 / p99, the sweep's tokens per
           second, and the worker's preemptions, resumes and tokens prefilled again on
           resume, from ``mlxq info --json``
  weights  a worker serving one level of two queues, ``--queue a:3,b:1``, both kept
           backlogged for --duration s: tokens decoded per queue in every --window-s
           window, read at the window's edges from the worker's Prometheus counter
           ``mlxq_queue_generation_tokens``
  fifo     (--fifo) the mix of "both" on a worker serving ONE queue, what levels fix
  pairs    --pairs N more of "alone" and "both", each on a fresh worker, every other pair
           "both" first: a GPU whose pace drifts from one run to the next (an H100: 6.29
           against 6.83 ms a decode step, same code and layout, minutes apart; 6.7 to 10
           over one call's eight runs) is compared within each pair, the drift's bias
           turned one way then the other, and the sweep's share is the median of the
           pairs' own ratios
  turns    --turns N windows of --turn-s with interactive jobs, each between two without,
           all on one worker while one sweep of --sweep-jobs runs throughout: each "on"
           window's sweep tokens per second over the mean of the "off" windows either
           side (the first --guard-s of each window left out, where the last one's jobs
           end), read from the worker's Prometheus counter by queue; a pace that drifts
           over minutes cancels out of seconds-apart windows, where it does not out of
           pairs of runs (an H100's sweep alone: 5,806 to 8,058 tok/s within one call)

Then each target's figure: interactive p50 within 1.5x of idle, p99 within +100 ms of idle,
the sweep at >= 0.95 of alone less the rows interactive jobs took (their share of the
tokens decoded meanwhile), tokens prefilled again under 1% of the sweep's, every window
within 10% of 3:1. A missed target is printed, not an error: the exit status is 1 only when
output was wrong (an interactive job's or a followed sweep job's streamed text differs from
its result, a chunk came twice or a reset came, a job failed). Sweep jobs are greedy, so
the texts of "both" are also compared with those of "alone" (a figure, not a check: low
precision may break a near tie differently in another batch).

Usage:
    python ops/bench_priority.py                          # tiny model on the CPU, minutes
    python ops/bench_priority.py --sweep-jobs 300 --idle-jobs 20 --duration 20
    python ops/bench_priority.py --shape 0.5b --sweep-jobs 10000 --fifo --json out.json
    python ops/bench_priority.py --parts pairs --pairs 3 --sweep-jobs 5000   # the share alone
    python ops/bench_priority.py --parts turns --turns 8 --sweep-jobs 20000  # the same, one run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gil_sample
import redis
import redis.asyncio as aioredis
from procs import MLXQ, commit, free_port, records, start_redis, start_worker, stop, version
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue
from stage_trace import budget as trace_budget
from stage_trace import read as read_trace
from stage_trace import summary as trace_summary
from words import WORDS

from mlxq.producer import AsyncClient, AsyncJob, Client, Result
from mlxq.producer.batch.jobs import states
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.info import collect
from mlxq.producer.keys import canceled_registry, failed_registry, finished_registry, results_key
from mlxq.producer.outcome import TERMINAL
from mlxq.producer.result import latest_fields, value_of

SWEEP_TOKENS = 64
CHAT_TOKENS = 32
#: Jobs per submit_many call: a 10,000-job sweep goes in pieces, so the worker starts on
#: the first while the rest are sent and no one call builds 10,000 payloads at once.
SUBMIT_CHUNK = 500
#: Results read back per pipelined round trip.
READ_CHUNK = 1000
RECORD_TTL = 6 * 3600  # results outlive the run, whatever its size
WAIT_S = 3600.0  # for any one job: longer is broken, not slow
COUNTERS = (
    "preemptions",
    "resumes",
    "resume_tokens_recomputed",
    "tokens_generated",
    "decode_steps",
    "first_token_passes",
    "first_tokens_from_prefill",
    "fused_prefills",
    "prefill_shapes",
    "rows_joined_in_place",
    "rows_joined_by_copy",
    "slot_gathers",
)


# -- what was measured --------------------------------------------------------------------


@dataclass
class Followed:
    """One job as a listener saw it: first text, tokens, and what was wrong, if anything."""

    first_s: float | None = None  # submit (or the start of following) to the first text
    text: str = ""
    tokens: int = 0
    problem: str | None = None
    id: str | None = None
    sent: float | None = None  # wall clock at submit
    first_at: float | None = None  # wall clock at the first text
    # submit to enqueued, enqueued to started (claimed and given a row), started to the
    # first text (prefill, first step, publish, delivery): seconds, from its rq record
    split: tuple[float, float, float] | None = None


@dataclass
class Sweep:
    """A sweep's jobs, as read back from their results."""

    jobs: int
    tokens: int = 0
    wall_s: float = 0.0  # the first submit to the last job's end
    submit_s: float = 0.0  # the first submit to the last
    failed: int = 0
    texts: list[str | None] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class Phase:
    """One measurement: interactive jobs, a sweep, or both, on one worker."""

    name: str
    probes: list[Followed] = field(default_factory=list)
    sweep: Sweep | None = None
    counters: dict[str, int] = field(default_factory=dict)  # the worker's, over the phase
    followed: int = 0  # sweep jobs streamed by a listener
    problems: list[str] = field(default_factory=list)
    differs_from_alone: int | None = None  # sweep texts unlike the sweep alone's
    busy_ms: dict[str, float] = field(default_factory=dict)  # decode thread, by stage
    span: tuple[float, float] | None = None  # perf_counter at its start and end
    trace: str | None = None  # the worker's stage trace (--trace)

    def first_s(self) -> list[float]:
        return sorted(p.first_s for p in self.probes if p.first_s is not None)

    def split_p50(self) -> list[float] | None:
        """The interactive jobs' p50 of each part of the first token (``Followed.split``)."""
        got = [p.split for p in self.probes if p.split is not None]
        return [statistics.median(x) for x in zip(*got, strict=True)] if got else None

    def pct(self, q: float) -> float | None:
        return percentile(self.first_s(), q)

    @property
    def chat_tokens(self) -> int:
        return sum(p.tokens for p in self.probes)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest rank: the smallest value at least q percent of ``xs`` do not exceed."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


# -- the worker ---------------------------------------------------------------------------


class Served:
    """A worker this script started: its levels, metrics port and process."""

    def __init__(
        self, args: argparse.Namespace, url: str, levels: Sequence[str], work: Path
    ) -> None:
        self.url, self.levels, self.port = url, list(levels), free_port()
        extra = [f"--queue={q}" for q in levels[1:]]
        extra += ["--max-batch", str(args.max_batch), "--metrics-port", str(self.port)]
        extra += ["--metrics-host", "127.0.0.1", *shlex.split(args.worker_args)]
        named = re.sub(r"[^\w-]", "_", "-".join(levels))  # a plain file name
        log = Path(args.logs or work) / f"worker-{named}-{uuid.uuid4().hex[:4]}.log"
        self.started: list[subprocess.Popen[bytes]] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.trace = None
        if args.trace:  # the decode thread's stages, pass by pass (ops/stage_trace.py)
            self.trace = str(Path(args.trace) / f"stages-{named}-{uuid.uuid4().hex[:4]}.jsonl")
            env["MLXQ_TRACE_STAGES"] = self.trace
        try:
            self.name, self.proc = start_worker(
                args.model, url, levels[0], log, extra, env=env, started=self.started
            )
        except BaseException:
            for p in self.started:
                stop(p)
            raise
        self.r = redis.Redis.from_url(url)
        print(f"worker {self.name}: --queue {' --queue '.join(levels)} (log {log})", flush=True)

    def metrics(self) -> dict[tuple[str, str], float]:
        """Its Prometheus samples now, by (name, queue label or "")."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        return {
            (s.name, s.labels.get("queue", "")): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def info(self, within: float = 10.0) -> dict[str, Any]:
        """Its ``mlxq info --json`` entry, once that counts every token the metrics count
        now (it is written about once a second)."""
        want = self.metrics().get(("mlxq_generation_tokens_total", ""), 0)
        deadline = time.monotonic() + within
        while True:
            mine = [w for w in collect(self.r)["workers"] if w["name"] == self.name]
            if (mine and mine[0]["tokens_generated"] >= want) or time.monotonic() > deadline:
                return mine[0] if mine else {}
            time.sleep(0.2)

    def close(self) -> None:
        self.r.close()
        stop(self.proc)


def queue_tokens(m: dict[tuple[str, str], float], queue: str) -> float:
    return m.get(("mlxq_queue_generation_tokens_total", queue), 0.0)


# -- jobs ---------------------------------------------------------------------------------


def sweep_jobs(tag: str, n: int) -> list[dict[str, Any]]:
    """n greedy jobs of 64 tokens, each prompt its own (index and words vary)."""
    rng = random.Random(tag)
    return [
        {
            "prompt": f"{tag} {i}: " + " ".join(rng.choice(WORDS) for _ in range(16)),
            "max_tokens": SWEEP_TOKENS,
            "temperature": 0.0,
        }
        for i in range(n)
    ]


def chat_job(k: int) -> dict[str, Any]:
    """Interactive chat job k: a short conversation, sampled (seeded), 32 tokens."""
    rng = random.Random(-k)
    words = " ".join(rng.sample(WORDS, 8))
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Question {k}: what links {words}?"},
        ],
        "max_tokens": CHAT_TOKENS,
        "temperature": 0.7,
        "seed": k,
    }


async def follow(job: AsyncJob, start: float) -> Followed:
    """Stream a job to its end and check it: no chunk twice, no reset, no error, and the
    streamed text equal to the stored result's."""
    f, seqs = Followed(), set()
    try:
        async for c in job.stream(timeout=WAIT_S):
            if f.first_s is None and c.text:
                f.first_s = time.perf_counter() - start
                f.first_at = time.time()
            if c.seq in seqs or c.kind != "tokens":
                f.problem = f"chunk {c.seq} {'again' if c.seq in seqs else c.kind}"
            seqs.add(c.seq)
            f.text += c.text
            if c.usage:
                f.tokens = c.usage["completion_tokens"]
        result = await job.result(timeout=60)
        if result.text != f.text and f.problem is None:
            f.problem = f"streamed {f.text!r} but the result is {result.text!r}"
    except Exception as e:  # counted and reported, never hidden
        f.problem = f"{type(e).__name__}: {e}"
    return f


async def probe(client: AsyncClient, queue: str, k: int) -> Followed:
    """Submit interactive job k and follow it; its first text is timed from the submit."""
    start, sent = time.perf_counter(), time.time()
    try:
        job = await client.submit(queue=queue, **chat_job(k))
    except Exception as e:
        return Followed(problem=f"submit: {type(e).__name__}: {e}")
    f = await follow(job, start)
    f.id, f.sent = job.id, sent
    return f


async def interactive(
    client: AsyncClient, queue: str, every: float, count: int | None, done: asyncio.Event
) -> list[Followed]:
    """One interactive job every ``every`` s (on a fixed schedule) until ``count`` were sent
    or ``done`` is set; then wait for all of them to end."""
    tasks: list[asyncio.Task[Followed]] = []
    t0 = time.perf_counter()
    while not done.is_set() and (count is None or len(tasks) < count):
        tasks.append(asyncio.create_task(probe(client, queue, len(tasks))))
        wait = t0 + len(tasks) * every - time.perf_counter()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, wait))
    return list(await asyncio.gather(*tasks))


async def ended(ar: aioredis.Redis, queue: str) -> int:
    """Jobs of ``queue`` in rq's finished, failed and canceled registries."""
    async with ar.pipeline(transaction=False) as p:
        for key in (finished_registry(queue), failed_registry(queue), canceled_registry(queue)):
            p.zcard(key)
        return sum(await p.execute())


def read_sweep(r: redis.Redis, ids: Sequence[str], t0: float, submit_s: float) -> Sweep:
    """Tokens, texts and the last end (the worker's clock: run Redis on its host) of a
    sweep's jobs, from their rq result entries, a pipelined round trip per chunk."""
    sw = Sweep(len(ids), submit_s=submit_s)
    last = t0
    for i in range(0, len(ids), READ_CHUNK):
        with r.pipeline(transaction=False) as p:
            for job_id in ids[i : i + READ_CHUNK]:
                p.xrevrange(results_key(job_id), count=1)
            entries = p.execute()
        for e in entries:
            fields = latest_fields(e)
            value = value_of(fields)
            if value is None or fields is None:
                sw.failed += 1
                sw.texts.append(None)
                continue
            result = Result.from_value(value)
            sw.tokens += result.usage["completion_tokens"]
            sw.texts.append(result.text)
            last = max(last, float(fields[b"execution_ended_at"]))
    sw.wall_s = last - t0
    return sw


# -- the phases ---------------------------------------------------------------------------


class Bench:
    """The producer side of one worker: its queues, an async client, and the checks."""

    def __init__(self, served: Served, args: argparse.Namespace) -> None:
        self.w, self.args = served, args
        self.client = AsyncClient(
            served.url, served.levels[0], result_ttl=RECORD_TTL, failure_ttl=RECORD_TTL
        )
        self.ar = aioredis.Redis.from_url(served.url)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.ar.aclose()

    async def warm(self, sweep_q: str, chat_q: str | None) -> None:
        """Two batches of sweep-shaped jobs, with interactive jobs beside them when there
        is a chat queue (MLX builds its kernels; a pause and a resume run once)."""
        jobs = await self.client.submit_many(
            sweep_jobs(f"warm-{uuid.uuid4().hex[:6]}", 2 * self.args.max_batch), queue=sweep_q
        )
        if chat_q is not None:
            await asyncio.sleep(0.5)
            for k in range(3):
                await probe(self.client, chat_q, 10_000 + k)
        for j in jobs:
            await j.result(timeout=WAIT_S)

    async def idle(self, chat_q: str) -> Phase:
        before = self.w.info()
        never = asyncio.Event()
        ph = Phase("idle")
        ph.probes = await interactive(
            self.client, chat_q, self.args.interactive_every, self.args.idle_jobs, never
        )
        self.checked(ph, before)
        return ph

    async def sweep(self, name: str, sweep_q: str, chat_q: str | None) -> Phase:
        """The sweep on ``sweep_q``, with interactive jobs on ``chat_q`` beside it (None:
        alone), until its last job ended."""
        n, ph = self.args.sweep_jobs, Phase(name)
        kws = sweep_jobs("sweep", n)  # the same prompts every time
        before, ended0 = self.w.info(), await ended(self.ar, sweep_q)
        t0, start = time.time(), time.perf_counter()
        jobs: list[AsyncJob] = []
        for i in range(0, n, SUBMIT_CHUNK):
            jobs += await self.client.submit_many(kws[i : i + SUBMIT_CHUNK], queue=sweep_q)
        submit_s = time.perf_counter() - start
        step = max(1, n // self.args.follow) if self.args.follow else n + 1
        picked = jobs[::step][: self.args.follow]
        sample = [asyncio.create_task(follow(j, time.perf_counter())) for j in picked]
        done = asyncio.Event()
        chats = (
            asyncio.create_task(
                interactive(self.client, chat_q, self.args.interactive_every, None, done)
            )
            if chat_q is not None
            else None
        )
        ids = [j.id for j in jobs]
        while not await self.all_ended(sweep_q, ended0, ids):
            await asyncio.sleep(0.05)
        done.set()
        ph.probes = await chats if chats is not None else []
        followed = await asyncio.gather(*sample)
        ph.followed = len(followed)
        ph.problems += [f"sweep job: {f.problem}" for f in followed if f.problem]
        ph.sweep = await asyncio.to_thread(read_sweep, self.w.r, ids, t0, submit_s)
        if ph.sweep.failed:
            ph.problems.append(f"{ph.sweep.failed} sweep jobs have no result")
        self.checked(ph, before)
        return ph

    async def all_ended(self, queue: str, before: int, ids: list[str]) -> bool:
        """Whether every job of a sweep ended: its queue's registries count as many more
        ends (cheap, polled), then each job's status says so (once they do: interactive
        jobs on the same queue end too)."""
        if await ended(self.ar, queue) - before < len(ids):
            return False
        got = await asyncio.to_thread(states, self.w.r, ids)
        return all(s in TERMINAL for s in got)

    def checked(self, ph: Phase, before: dict[str, Any]) -> None:
        """Note the probes' problems and the worker's counters over the phase."""
        ph.problems += [f"interactive job: {p.problem}" for p in ph.probes if p.problem]
        split_first_tokens(self.w.url, ph.probes)
        now = self.w.info()
        ph.counters = {k: int(now.get(k, 0)) - int(before.get(k, 0)) for k in COUNTERS}
        # Prefill passes: on a GPU each costs about a decode step of the whole batch.
        ph.counters["prefill_passes"] = _passes(now) - _passes(before)
        was = before.get("busy_ms") or {}
        ph.busy_ms = {k: v - was.get(k, 0.0) for k, v in (now.get("busy_ms") or {}).items()}
        for p in ph.problems[:5]:
            print(f"  ERROR ({ph.name}): {p}", flush=True)


def split_first_tokens(url: str, probes: Sequence[Followed]) -> None:
    """Each interactive job's first token in three parts, from its rq record's
    enqueued_at and started_at (wall clocks of one machine)."""
    timed = [p for p in probes if p.id and p.sent and p.first_at]
    for p, (e, s) in zip(timed, records(url, [p.id for p in timed]), strict=True):
        if e is not None and s is not None and p.sent and p.first_at:
            p.split = (e - p.sent, s - e, p.first_at - s)


def _passes(info: dict[str, Any]) -> int:
    return sum(int(v) for v in (info.get("prefill_batch_sizes") or {}).values())


def say(ph: Phase) -> None:
    p50, p99 = ph.pct(50), ph.pct(99)
    parts = [f"  {ph.name:<6}"]
    if ph.probes:
        parts.append(f"{len(ph.probes)} interactive, first token p50 {ms(p50)} p99 {ms(p99)} ms")
    if ph.sweep is not None:
        sw = ph.sweep
        parts.append(f"sweep {sw.jobs} jobs {sw.tokens} tokens in {sw.wall_s:.1f} s")
        parts.append(f"{sw.tok_s:,.0f} tok/s")
    if ph.counters.get("preemptions"):
        parts.append(f"{ph.counters['preemptions']} paused, {ph.counters['resumes']} resumed")
    print(", ".join(parts), flush=True)


def ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:,.1f}"


async def phases_on(served: Served, args: argparse.Namespace, names: list[str]) -> list[Phase]:
    """Warm the worker up, then measure ``names`` on it in turn: the first level is the
    interactive jobs' queue, the last the sweep's (one and the same for a FIFO worker)."""
    chat_q, sweep_q = served.levels[0], served.levels[-1]
    b = Bench(served, args)
    out = []
    try:
        await b.warm(sweep_q, chat_q)
        for name in names:
            t0 = time.perf_counter()
            if name == "idle":
                ph = await b.idle(chat_q)
            else:
                ph = await b.sweep(name, sweep_q, None if name == "alone" else chat_q)
            ph.span, ph.trace = (t0, time.perf_counter()), served.trace
            say(ph)
            out.append(ph)
        return out
    finally:
        await b.aclose()


def read_baseline(path: str) -> dict[str, Phase]:
    """The idle and sweep-alone phases of an earlier run's ``--json`` (the same sizes), so
    the mix beside them may run in a call of its own."""
    doc = json.loads(Path(path).read_text())
    out = {}
    for name in ("idle", "alone"):
        saved = doc["phases"].get(name)
        if saved is None:
            raise SystemExit(f"--baseline {path}: no {name!r} phase in it (--parts base)")
        ph = Phase(name, counters=saved["counters"], busy_ms=saved.get("busy_ms") or {})
        ph.probes = [Followed(first_s=s) for s in saved["first_token_s"]]
        for f, split in zip(ph.probes, saved.get("splits_s") or [], strict=False):
            f.split = None if split is None else tuple(split)
        if saved["sweep"] is not None:
            sw = {k: v for k, v in saved["sweep"].items() if k not in ("texts", "tok_s")}
            ph.sweep = Sweep(**sw)
        out[name] = ph
    return out


def on_worker(
    args: argparse.Namespace, url: str, work: Path, levels: list[str], names: list[str]
) -> list[Phase]:
    """``names`` measured on a fresh worker serving ``levels`` (fresh: no prompt cached by
    an earlier phase makes a later one's prefill cheaper)."""
    served = Served(args, url, levels, work)
    try:
        return asyncio.run(phases_on(served, args, names))
    finally:
        served.close()


# -- weights ------------------------------------------------------------------------------


@dataclass
class Window:
    """Tokens decoded for each queue in one window, and the fewest jobs each queue held
    waiting when the feeder looked (never 0: both stayed backlogged)."""

    a: int
    b: int
    seconds: float
    least_queued_a: int = 0
    least_queued_b: int = 0

    @property
    def ratio(self) -> float:
        return self.a / self.b if self.b else math.inf


def weights_phase(served: Served, args: argparse.Namespace) -> list[Window]:
    """Keep both queues of the one level backlogged and read each queue's decoded tokens
    at every window's edge."""
    qa, qb = (s.split(":")[0] for s in served.levels[0].split(","))
    r = served.r
    queues = {q: Queue(q, connection=r, serializer=MsgpackSerializer) for q in (qa, qb)}
    client = Client(served.url, qa, result_ttl=60, failure_ttl=60)
    low = 2 * args.max_batch
    stop_feeding = threading.Event()
    serial = iter(range(10**9))

    least = dict.fromkeys(queues, low)  # per window: the fewest jobs seen queued

    def feed() -> None:
        while not stop_feeding.is_set():
            for q, rq_q in queues.items():
                queued = rq_q.count
                least[q] = min(least[q], queued)
                if queued < low:
                    kws = sweep_jobs(f"{q}-{next(serial)}", 2 * args.max_batch)
                    client.submit_many(kws, queue=q)
            stop_feeding.wait(0.1)

    warm = [j for q in queues for j in client.submit_many(sweep_jobs(f"warm-{q}", low), queue=q)]
    for j in warm:  # MLX builds its kernels
        j.result(timeout=WAIT_S)
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        time.sleep(3)  # the batch fills with both queues' jobs
        windows: list[Window] = []
        edge, m0 = time.monotonic(), served.metrics()
        least.update(dict.fromkeys(queues, low))  # what the feeder saw before is no window's
        while len(windows) < max(1, round(args.duration / args.window_s)):
            edge += args.window_s
            time.sleep(max(0.0, edge - time.monotonic()))
            t, m1 = time.monotonic(), served.metrics()
            a = int(queue_tokens(m1, qa) - queue_tokens(m0, qa))
            b = int(queue_tokens(m1, qb) - queue_tokens(m0, qb))
            w = Window(a, b, t - (edge - args.window_s), least[qa], least[qb])
            least.update(dict.fromkeys(queues, low))
            windows.append(w)
            print(
                f"  window {len(windows)}: {qa} {a} {qb} {b} tokens, a/b {w.ratio:.2f} "
                f"(fewest queued: {w.least_queued_a}, {w.least_queued_b})",
                flush=True,
            )
            m0 = m1
        return windows
    finally:
        stop_feeding.set()
        feeder.join()
        for rq_q in queues.values():
            rq_q.empty()  # what is left needs no serving
        client.close()


# -- turns --------------------------------------------------------------------------------


@dataclass
class Turn:
    """One window of a sweep that runs throughout, interactive jobs sent in it or not: the
    tokens each queue decoded from its guard's end to its own."""

    on: bool
    sweep: int
    chat: int
    seconds: float
    at: float = 0.0  # wall clock at the guard's end (beside the card's clocks, h200.sh)
    clock: float = 0.0  # perf_counter at the guard's end: the worker's trace's clock

    @property
    def rate(self) -> float:
        return self.sweep / self.seconds if self.seconds else 0.0


def turns_part(
    args: argparse.Namespace, url: str, work: Path, tag: str
) -> tuple[list[Turn], list[Followed], str | None]:
    """One worker, one sweep kept running, and windows of ``--turn-s`` with interactive
    jobs and without them in turn (off first and last, so each "on" window has an "off"
    one each side): the sweep alone and beside interactive jobs seconds apart, on a card
    whose pace drifts from one run to the next. Also the worker's trace (``--trace``)."""
    print(
        f"turns: one sweep, {args.turn_s:g} s windows without and with interactive jobs "
        f"in turn ({args.turns} with), the first {args.guard_s:g} s of each left out"
    )
    served = Served(args, url, [f"chat-{tag}", f"sweeps-{tag}"], work)
    try:
        return (*asyncio.run(_turns(served, args)), served.trace)
    finally:
        served.close()


async def _turns(served: Served, args: argparse.Namespace) -> tuple[list[Turn], list[Followed]]:
    chat_q, sweep_q = served.levels[0], served.levels[-1]
    b = Bench(served, args)
    chats: list[asyncio.Task[list[Followed]]] = []
    gil = gil_sample.Sampler(served.proc.pid, Path(args.gil)) if args.gil else None
    try:
        await b.warm(sweep_q, chat_q)
        kws = sweep_jobs(f"turns-{uuid.uuid4().hex[:6]}", args.sweep_jobs)
        for i in range(0, len(kws), SUBMIT_CHUNK):
            await b.client.submit_many(kws[i : i + SUBMIT_CHUNK], queue=sweep_q)
        await asyncio.sleep(args.turn_s)  # the batch fills: no window's
        turns: list[Turn] = []
        for i in range(2 * args.turns + 1):
            on, start = i % 2 == 1, time.perf_counter()
            done = asyncio.Event()
            if on:
                every = args.interactive_every
                chats.append(asyncio.create_task(interactive(b.client, chat_q, every, None, done)))
            await asyncio.sleep(args.guard_s)  # what the last window left ends
            at, t0, m0 = time.time(), time.perf_counter(), await asyncio.to_thread(served.metrics)
            if gil is not None:  # which threads hold the interpreter's lock in this window
                gil.window(i, on, start + args.turn_s - time.perf_counter())
            await asyncio.sleep(max(0.0, start + args.turn_s - time.perf_counter()))
            t1, m1 = time.perf_counter(), await asyncio.to_thread(served.metrics)
            done.set()
            turn = Turn(
                on,
                int(queue_tokens(m1, sweep_q) - queue_tokens(m0, sweep_q)),
                int(queue_tokens(m1, chat_q) - queue_tokens(m0, chat_q)),
                t1 - t0,
                at,
                t0,
            )
            turns.append(turn)
            spill = "" if on or not turn.chat else " (past the guard: a longer --guard-s)"
            print(
                f"  turn {i + 1} ({'on' if on else 'off'}): sweep {turn.rate:,.0f} tok/s, "
                f"interactive {turn.chat} tokens{spill}",
                flush=True,
            )
            left = await asyncio.to_thread(lambda: Queue(sweep_q, connection=served.r).count)
            if left < 2 * args.max_batch and i < 2 * args.turns:
                print(f"  the sweep ran low ({left} queued): stopping; give more --sweep-jobs")
                if on:
                    continue  # one more "off" window closes it
                break
        probes = [f for fs in await asyncio.gather(*chats) for f in fs]
        info = await asyncio.to_thread(b.w.info)  # the worker's counters since its start
        print("  worker: " + ", ".join(f"{k} {int(info.get(k, 0)):,}" for k in COUNTERS))
        return turns, probes
    finally:
        for t in chats:
            t.cancel()
        if gil is not None:
            await asyncio.to_thread(gil.close)
        await asyncio.to_thread(lambda: Queue(sweep_q, connection=served.r).empty())
        await b.aclose()


def turn_ratios(turns: Sequence[Turn]) -> list[float]:
    """Each "on" window's sweep rate over the mean of the "off" windows either side."""
    out = []
    for i, t in enumerate(turns):
        if t.on and 0 < i < len(turns) - 1 and not turns[i - 1].on and not turns[i + 1].on:
            beside = (turns[i - 1].rate + turns[i + 1].rate) / 2
            if beside:
                out.append(t.rate / beside)
    return out


def floor_of(chat: int, sweep: int) -> float:
    """The sweep's floor: 0.95 of its rate less the rows the interactive jobs took (their
    share of the ``chat + sweep`` tokens decoded while both ran)."""
    return 0.95 * (1 - chat / max(1, chat + sweep))


def turns_floor(turns: Sequence[Turn]) -> float:
    """The floor of a turns run, from its "on" windows' tokens."""
    on = [t for t in turns if t.on]
    return floor_of(sum(t.chat for t in on), sum(t.sweep for t in on))


def turns_target(turns: Sequence[Turn], probes: Sequence[Followed]) -> list[Target]:
    ratios = turn_ratios(turns)
    if not ratios:
        return []
    got, floor = statistics.median(ratios), turns_floor(turns)
    firsts = sorted(p.first_s for p in probes if p.first_s is not None)
    return [
        (
            f"sweep tok/s, on / off windows either side, median of {len(ratios)} (>= the floor)",
            f"{got:.3f} (mean {statistics.fmean(ratios):.3f}, range {min(ratios):.3f}-"
            f"{max(ratios):.3f}; floor {floor:.3f})",
            got >= floor,
        ),
        (
            "interactive first token in the windows, p50 / p99",
            f"{ms(percentile(firsts, 50))} / {ms(percentile(firsts, 99))} ms ({len(firsts)} jobs)",
            None,
        ),
    ]


# -- report -------------------------------------------------------------------------------


Target = tuple[str, str, bool | None]  # what, the figure, met (None: no target)


def targets(
    phases: dict[str, Phase],
    windows: list[Window],
    weight: float,
    pairs: Sequence[tuple[Phase, Phase]] = (),
) -> list[Target]:
    """Each of issue 22's targets that this run has the figures for."""
    out: list[Target] = []
    idle, both = phases.get("idle"), phases.get("both")
    if idle is not None and both is not None:
        out += latency_targets(idle, both)
        out += sweep_targets(phases["alone"], both)
    out += pairs_target(pairs)
    if windows:
        dev = max(abs(w.ratio / weight - 1) for w in windows)
        out.append(
            (
                f"tokens a/b per window, weights {weight:g}:1 (within 10%)",
                " ".join(f"{w.ratio:.2f}" for w in windows) + f"; worst {100 * dev:.1f}% off",
                dev <= 0.10,
            )
        )
    fifo = phases.get("fifo")
    i50 = None if idle is None else idle.pct(50)
    if fifo is not None and i50 and fifo.pct(50) is not None:
        f50 = fifo.pct(50) or 0.0
        out.append(("FIFO: interactive first-token p50 / idle", f"{f50 / i50:,.1f}x", None))
    return out


def latency_targets(idle: Phase, both: Phase) -> list[Target]:
    i50, i99, b50, b99 = idle.pct(50), idle.pct(99), both.pct(50), both.pct(99)
    if not i50 or i99 is None or b50 is None or b99 is None:
        return [("interactive first token", "no interactive job ran: a longer sweep", None)]
    d99 = b99 - i99
    return [
        (
            "interactive first-token p50, both / idle (<= 1.5x)",
            f"{b50 / i50:.2f}x ({ms(b50)} / {ms(i50)} ms)",
            b50 / i50 <= 1.5,
        ),
        (
            "interactive first-token p99, both - idle (<= +100 ms)",
            f"{1e3 * d99:+,.1f} ms ({ms(b99)} - {ms(i99)} ms)",
            d99 <= 0.1,
        ),
    ]


def sweep_share(alone: Phase, both: Phase) -> tuple[float, float, float] | None:
    """The sweep's tokens per second beside interactive jobs over alone, its floor (0.95 of
    alone less the rows they took: their share of the tokens decoded while it ran), and
    that share; None without both sweeps."""
    if not (alone.sweep and both.sweep and alone.sweep.tok_s):
        return None
    share = both.chat_tokens / max(1, both.chat_tokens + both.sweep.tokens)
    ratio = both.sweep.tok_s / alone.sweep.tok_s
    return ratio, floor_of(both.chat_tokens, both.sweep.tokens), share


def pairs_target(pairs: Sequence[tuple[Phase, Phase]]) -> list[Target]:
    """The sweep's share by pairs run back to back: the median of their ratios against
    the median of their floors."""
    shares = [x for x in (sweep_share(a, b) for a, b in pairs) if x is not None]
    if not shares:
        return []
    got = statistics.median(g for g, _, _ in shares)
    floor = statistics.median(f for _, f, _ in shares)
    each = ", ".join(f"{g:.3f}" for g, _, _ in shares)
    return [
        (
            f"sweep tok/s, both / alone, median of {len(shares)} pairs (>= the floor)",
            f"{got:.3f} (pairs {each}; floor {floor:.3f})",
            got >= floor,
        )
    ]


def sweep_targets(alone: Phase, both: Phase) -> list[Target]:
    """The sweep beside interactive jobs against alone, allowing for the rows they took,
    and the tokens prefilled again."""
    if (figures := sweep_share(alone, both)) is None or both.sweep is None:
        return []
    got, floor, share = figures
    again = both.counters.get("resume_tokens_recomputed", 0)
    rec = again / max(1, both.sweep.tokens)
    return [
        (
            "sweep tok/s, both / alone (>= 0.95 x (1 - interactive token share))",
            f"{got:.3f} (floor 0.95 x (1 - {share:.4f}) = {floor:.3f})",
            got >= floor,
        ),
        (
            "tokens prefilled again on resume / sweep tokens (< 1%)",
            f"{100 * rec:.3f}% ({again:,} of {both.sweep.tokens:,})",
            rec < 0.01,
        ),
    ]


def table(phases: dict[str, Phase], args: argparse.Namespace) -> str:
    cols = [p for p in ("idle", "alone", "both", "fifo") if p in phases]
    heads = {
        "idle": "idle",
        "alone": "sweep alone",
        "both": "sweep + interactive",
        "fifo": "FIFO, one queue",
    }
    rows = [
        f"| tiny/--model, --max-batch {args.max_batch} | "
        + " | ".join(heads[c] for c in cols)
        + " |",
        "|---|" + "---|" * len(cols),
    ]

    def row(name: str, fmt: Callable[[Phase], str]) -> None:
        rows.append(f"| {name} | " + " | ".join(fmt(phases[c]) for c in cols) + " |")

    def sw(fmt: Callable[[Sweep], str]) -> Callable[[Phase], str]:
        return lambda p: "-" if p.sweep is None else fmt(p.sweep)

    row("interactive jobs (32 tokens)", lambda p: f"{len(p.probes):,}" if p.probes else "-")
    row(
        "interactive first token p50 / p99 ms",
        lambda p: f"{ms(p.pct(50))} / {ms(p.pct(99))}" if p.probes else "-",
    )
    row(
        "p50 split: submit to enqueued / to started / to first text ms",
        lambda p: " / ".join(ms(x) for x in sp) if (sp := p.split_p50()) else "-",
    )
    row("sweep jobs / tokens", sw(lambda s: f"{s.jobs:,} / {s.tokens:,}"))
    row("sweep wall s (of which submitting)", sw(lambda s: f"{s.wall_s:.1f} ({s.submit_s:.1f})"))
    row("sweep tok/s", sw(lambda s: f"**{s.tok_s:,.0f}**"))
    row("worker tokens, all queues", lambda p: f"{p.counters.get('tokens_generated', 0):,}")
    row(
        "preemptions / resumes / tokens prefilled again",
        lambda p: " / ".join(
            f"{p.counters.get(k, 0):,}"
            for k in ("preemptions", "resumes", "resume_tokens_recomputed")
        ),
    )

    def steps(p: Phase) -> str:
        c = p.counters
        per = c.get("tokens_generated", 0) / max(1, c.get("decode_steps", 0))
        return (
            f"{c.get('decode_steps', 0):,} ({c.get('first_token_passes', 0):,}) / "
            f"{c.get('prefill_passes', 0):,}, {c.get('prefill_shapes', 0):,} ({per:.1f})"
        )

    row(
        "model passes (of them first-token passes) / prefill passes, new shapes (rows a pass)",
        steps,
    )
    row(
        "streams followed: errors",
        lambda p: f"{len(p.probes) + p.followed}: {len(p.problems)}",
    )
    row(
        "sweep texts unlike alone's",
        lambda p: "-" if p.differs_from_alone is None else f"{p.differs_from_alone:,}",
    )
    return "\n".join(rows)


def stage_table(phases: dict[str, Phase]) -> str:
    """The decode thread's milliseconds per decode step, by stage, for each phase: which
    stage a mix grows (worker/stages.py)."""
    cols = [p for p in ("idle", "alone", "both", "fifo") if p in phases]
    stages = sorted({k for c in cols for k in phases[c].busy_ms}, key=lambda k: (k != "decode", k))
    rows = [
        "| decode thread, ms a decode step | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for stage in [*stages, "all"]:
        cells = []
        for c in cols:
            ph = phases[c]
            steps = max(1, ph.counters.get("decode_steps", 0))
            ms = sum(ph.busy_ms.values()) if stage == "all" else ph.busy_ms.get(stage, 0.0)
            cells.append(f"{ms / steps:.2f}")
        rows.append(f"| {stage} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "device": device(),
        "commit": commit(),
        "command": [sys.executable, *sys.argv],
        **{p: version(p) for p in ("mlxq", "mlx", "mlx-lm", "redis", "rq")},
    }


@functools.cache
def device() -> str:
    """MLX's default device, asked in a process of its own (this one keeps no MLX memory
    the worker could use)."""
    code = "import mlx.core as mx; print(mx.default_device())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return got.stdout.strip() if got.returncode == 0 else "unknown (no mlx here)"


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--model",
        help="mlx-lm model dir or repo id (default: build the tiny model, or --shape's)",
    )
    ap.add_argument(
        "--shape",
        choices=("0.5b", "1.5b"),
        help="build a random-weight model of this shape (4-bit, end of sequence "
        "unreachable, so every job runs its max_tokens) into --model, or a temp dir; a "
        "--model dir that holds a model already is used as it is",
    )
    ap.add_argument(
        "--sweep-jobs", type=int, help="jobs in the sweep (default 10000 on a GPU, 2000 else)"
    )
    ap.add_argument("--max-batch", type=int, default=64, help="the worker's --max-batch")
    ap.add_argument(
        "--interactive-every", type=float, default=0.5, help="s between interactive jobs"
    )
    ap.add_argument("--idle-jobs", type=int, default=60, help="interactive jobs on the idle worker")
    ap.add_argument(
        "--follow", type=int, default=64, help="sweep jobs streamed and checked (0: none)"
    )
    ap.add_argument(
        "--parts",
        type=lambda v: v.split(","),
        default=["mix", "weights"],
        help="what to run, comma-separated: mix (idle, alone, both), base (idle, alone), "
        "both, weights, fifo, pairs, turns (default mix,weights); base then both --baseline "
        "splits the mix over two runs",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=2,
        help="--parts pairs: how many times alone and both, each on a fresh worker (2)",
    )
    ap.add_argument(
        "--turns",
        type=int,
        default=8,
        help="--parts turns: windows with interactive jobs, each between two without (8)",
    )
    ap.add_argument("--turn-s", type=float, default=5.0, help="--parts turns: window length")
    ap.add_argument(
        "--guard-s",
        type=float,
        default=1.0,
        help="--parts turns: the start of each window left out (the last one's jobs end)",
    )
    ap.add_argument("--duration", type=float, default=60, help="s the weights run measures")
    ap.add_argument("--window-s", type=float, default=10, help="weights run: window length")
    ap.add_argument("--weights", default="3:1", help="the two queues' weights (default 3:1)")
    ap.add_argument(
        "--fifo",
        action="store_true",
        help="also the mix on a worker serving one queue (--parts ...,fifo)",
    )
    ap.add_argument("--worker-args", default="", help='more worker options, e.g. "--window-ms 5"')
    ap.add_argument("--logs", help="keep the workers' logs in this folder (default: not kept)")
    ap.add_argument(
        "--trace",
        metavar="DIR",
        help="each worker traces its decode thread's stages into this folder "
        "(MLXQ_TRACE_STAGES); each phase's passes are summed by ops/stage_trace.py",
    )
    ap.add_argument(
        "--gil",
        metavar="DIR",
        help="--parts turns: sample which of the worker's threads hold the interpreter's "
        "lock in each window (py-spy --gil, ops/gil_sample.py) into this folder",
    )
    ap.add_argument("--redis-url", help="use this Redis (default: start a private one)")
    ap.add_argument("--json", metavar="OUT", help="write every figure here")
    ap.add_argument(
        "--baseline",
        metavar="JSON",
        help="the idle and sweep-alone phases from an earlier run's --json (--parts base)",
    )
    args = ap.parse_args(argv)
    if args.sweep_jobs is None:
        args.sweep_jobs = 10_000 if "gpu" in device() else 2000
    wa, _, wb = args.weights.partition(":")
    if not (wa.isdigit() and wb.isdigit() and int(wa) >= 1 and int(wb) >= 1):
        ap.error(f"--weights {args.weights!r}: give two whole numbers >= 1, as 3:1")
    sizes = (args.sweep_jobs, args.max_batch, args.idle_jobs)
    if min(sizes) < 1 or args.interactive_every <= 0 or args.window_s <= 0:
        ap.error("--sweep-jobs, --max-batch, --idle-jobs, --interactive-every and --window-s > 0")
    if args.duration <= 0 or args.follow < 0:
        ap.error("--duration must be > 0, --follow >= 0")
    if args.fifo:
        args.parts.append("fifo")
    known = {"mix", "base", "both", "weights", "fifo", "pairs", "turns"}
    if bad := sorted(set(args.parts) - known):
        ap.error(f"--parts: unknown {','.join(bad)}; choose from {', '.join(sorted(known))}")
    if args.pairs < 1 or args.turns < 1:
        ap.error("--pairs and --turns must be >= 1")
    if not 0 <= args.guard_s < args.turn_s:
        ap.error("--guard-s must be >= 0 and under --turn-s")
    if args.gil and "turns" not in args.parts:
        ap.error("--gil samples the turns windows: give --parts turns")
    if args.gil:
        gil_sample.exe()  # no py-spy: say so before any worker starts
    return args


def model_for(args: argparse.Namespace, work: Path) -> str:
    """--model as given, or the model --shape names built (into --model when that is a
    dir without one), or the tiny model."""
    if args.shape is None:
        if args.model is not None:
            return str(args.model)
        tiny = str(work / "tiny")
        subprocess.run([str(MLXQ), "model", "tiny", tiny], check=True, capture_output=True)
        return tiny
    out = Path(args.model or work / f"model-{args.shape}")
    if (out / "config.json").exists():
        print(f"model: reusing {out}", flush=True)
        return str(out)
    t0 = time.perf_counter()
    # In a process of its own: this one keeps no MLX memory the worker could use.
    code = (
        "import sys; from mlxq.worker.random_model import build_random_model as b; "
        "b(sys.argv[1], shape=sys.argv[2], eos_reachable=False)"
    )
    subprocess.run([sys.executable, "-c", code, str(out), args.shape], check=True)
    print(f"model: built {args.shape} in {time.perf_counter() - t0:.0f} s at {out}", flush=True)
    return str(out)


def mix_phases(args: argparse.Namespace, url: str, work: Path, tag: str) -> dict[str, Phase]:
    """Idle, the sweep alone and the sweep beside interactive jobs, as ``--parts`` and
    ``--baseline`` ask; each worker fresh."""
    phases: dict[str, Phase] = {}
    levels = [f"chat-{tag}", f"sweeps-{tag}"]
    if args.baseline:
        phases.update(read_baseline(args.baseline))
        print(f"idle and sweep alone: {args.baseline} (an earlier run's --json)")
    if "mix" in args.parts or "base" in args.parts:
        phases.update((p.name, p) for p in on_worker(args, url, work, levels, ["idle", "alone"]))
    if "mix" in args.parts or "both" in args.parts:
        phases.update((p.name, p) for p in on_worker(args, url, work, levels, ["both"]))
    return phases


def pair_phases(
    args: argparse.Namespace, url: str, work: Path, tag: str
) -> list[tuple[Phase, Phase]]:
    """``--pairs`` times the sweep alone and beside interactive jobs, each on a fresh
    worker, saying each pair's ratio as it ends."""
    print(f"{args.pairs} pairs of the sweep alone and beside interactive jobs, in turn")
    levels, pairs = [f"chat-{tag}", f"sweeps-{tag}"], []
    for i in range(args.pairs):
        # Every other pair runs "both" first: a card whose pace drifts one way over the
        # call (an H100 slowed from 6.7 to 10 ms a decode step over eight runs) would
        # otherwise bias every pair's ratio the same way.
        order = ["alone", "both"] if i % 2 == 0 else ["both", "alone"]
        ran = {name: on_worker(args, url, work, levels, [name])[0] for name in order}
        alone, both = ran["alone"], ran["both"]
        pairs.append((alone, both))
        if (figures := sweep_share(alone, both)) is not None:
            got, floor, _ = figures
            print(f"  pair {i + 1}: both / alone {got:.3f} (floor {floor:.3f})", flush=True)
    return pairs


def print_traces(phases: dict[str, Phase], turns: Sequence[Turn], turns_trace: str | None) -> None:
    """Each traced phase's decode-thread passes; for turns, the on windows' and the off
    windows' apart (one worker throughout, so the difference is the interactive jobs')."""
    for ph in phases.values():
        if ph.trace and ph.span:
            print(f"\n{ph.name}: the decode thread's passes, ms (--trace {ph.trace})")
            print(trace_summary(read_trace(ph.trace, *ph.span), slowest=8))
    if turns_trace and turns:
        lines = read_trace(turns_trace)  # once: every window is a span of the one file
        inside, seconds = {}, {}
        for on in (False, True):
            spans = [(t.clock, t.clock + t.seconds) for t in turns if t.on == on]
            print(f"\nturns, the {'on' if on else 'off'} windows' passes, ms ({turns_trace})")
            inside[on] = [x for x in lines if any(a <= x.get("t", 0.0) <= b for a, b in spans)]
            seconds[on] = sum(t.seconds for t in turns if t.on == on)
            print(trace_summary(inside[on]))
        print("\nturns, where an on window's step went over an off window's")
        print(trace_budget(inside[False], seconds[False], inside[True], seconds[True]))


def run(args: argparse.Namespace, url: str, work: Path) -> int:
    tag = uuid.uuid4().hex[:6]
    phases = mix_phases(args, url, work, tag)
    windows: list[Window] = []
    wa, wb = args.weights.split(":")
    if "weights" in args.parts:
        print(f"weights {wa}:{wb}, both queues backlogged, {args.window_s:g} s windows")
        served = Served(args, url, [f"a-{tag}:{wa},b-{tag}:{wb}"], work)
        try:
            windows = weights_phase(served, args)
        finally:
            served.close()
    if "fifo" in args.parts:
        (phases["fifo"],) = on_worker(args, url, work, [f"fifo-{tag}"], ["fifo"])
    pairs = pair_phases(args, url, work, tag) if "pairs" in args.parts else []
    turns, turn_probes, turns_trace = (
        turns_part(args, url, work, tag) if "turns" in args.parts else ([], [], None)
    )
    alone = phases["alone"].sweep if "alone" in phases else None
    if alone is not None and not alone.texts:
        alone = None  # read from a baseline: its texts were not kept
    for ph in phases.values():
        if ph.sweep is not None and alone is not None and ph.name != "alone":
            ph.differs_from_alone = sum(
                a != b for a, b in zip(alone.texts, ph.sweep.texts, strict=True)
            )
    if phases:
        print("\n" + table(phases, args))
        print("\n" + stage_table(phases))
    print_traces(phases, turns, turns_trace)
    if args.gil and turns:
        print("\nturns, " + gil_sample.table(gil_sample.read(Path(args.gil))))
    print()
    met = targets(phases, windows, int(wa) / int(wb), pairs) + turns_target(turns, turn_probes)
    for what, figure, ok in met:
        verdict = "" if ok is None else ("  ok" if ok else "  MISSED")
        print(f"{what}: {figure}{verdict}")
    ran = [*phases.values(), *(ph for pair in pairs for ph in pair)]
    problems = [p for ph in ran for p in ph.problems]
    problems += [f"interactive job: {f.problem}" for f in turn_probes if f.problem]
    if args.json:
        doc = {
            "env": environment(args),
            "args": vars(args),
            "phases": {
                n: {
                    "first_token_s": ph.first_s(),
                    "p50_s": ph.pct(50),
                    "p99_s": ph.pct(99),
                    "split_p50_s": ph.split_p50(),
                    "splits_s": [p.split for p in ph.probes],
                    "interactive_tokens": ph.chat_tokens,
                    "sweep": None
                    if ph.sweep is None
                    else {**asdict(ph.sweep), "texts": None, "tok_s": ph.sweep.tok_s},
                    "counters": ph.counters,
                    "followed": ph.followed,
                    "problems": ph.problems,
                    "differs_from_alone": ph.differs_from_alone,
                    "busy_ms": ph.busy_ms,
                    "span_s": ph.span,
                    "trace": ph.trace,
                }
                for n, ph in phases.items()
            },
            "windows": [{**asdict(w), "ratio": w.ratio} for w in windows],
            "pairs": [pair_doc(a, b) for a, b in pairs],
            "turns": [{**asdict(t), "rate": t.rate} for t in turns],
            "turn_ratios": turn_ratios(turns),
            "targets": [{"target": w, "figure": f, "met": ok} for w, f, ok in met],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if problems:
        print(f"ERROR: {len(problems)} wrong streams or results, first: {problems[0]}")
    return 1 if problems else 0


def pair_doc(alone: Phase, both: Phase) -> dict[str, Any]:
    """One pair's figures for ``--json``."""
    figures = sweep_share(alone, both)
    return {
        "alone_tok_s": alone.sweep.tok_s if alone.sweep else None,
        "both_tok_s": both.sweep.tok_s if both.sweep else None,
        "ratio": None if figures is None else figures[0],
        "floor": None if figures is None else figures[1],
        "interactive": len(both.probes),
        "p50_s": both.pct(50),
        "p99_s": both.pct(99),
        "counters": {"alone": alone.counters, "both": both.counters},
        "busy_ms": {"alone": alone.busy_ms, "both": both.busy_ms},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for folder in (args.logs, args.trace):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-prio-") as tmp:
        work = Path(tmp)
        server = None
        try:
            url = args.redis_url
            if url is None:
                url, server = start_redis(work)
            args.model = model_for(args, work)
            t0 = time.monotonic()
            rc = run(args, url, work)
            print(f"run time {time.monotonic() - t0:.0f} s")
            return rc
        finally:
            stop(server)


if __name__ == "__main__":
    sys.exit(main())
