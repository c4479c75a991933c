"""The same chat jobs three ways: mlx-lm direct, ``Client.submit_many``, and the official
``openai`` client streaming through ``mlxq serve``; side by side, in one run.

Why: jobs that reach a worker one HTTP request at a time should decode as fast as jobs
submitted in one call. This measures both against mlx-lm's ``BatchGenerator`` driven
directly on the same checkpoint, and shows how the worker took the jobs in: decode steps
and tokens a step, prefill passes by rows and the new prefill shapes (``mlxq info``'s
``prefill_batch_sizes``, ``prefill_shapes``), steps held (``--admit-hold-steps``), claims
per claim call, and from the jobs' records how their enqueues spread and how long they
waited to start.

Starts a private redis-server, builds a random-weight model of --shape (tiny runs on a
CPU; 0.5b is the GPU's), starts one ``mlxq worker --max-batch B`` per --variant and one
``mlxq serve``, and for each --streams size N runs, each on prompts of its own:

  direct   every prompt inserted into one BatchGenerator in this process (greedy)
  submit   the N chat jobs through ``Client.submit_many``, until the last result
  each     the same through the Python client, one ``submit`` a job, all at once
           (how a gateway's jobs arrive, without HTTP; opt-in: --modes)
  serve    N concurrent streaming chat completions, ``AsyncOpenAI`` over one httpx
           client, all released together (greedy, ``max_tokens`` --tokens)
  serve-warm  the same, the client's pool holding a connection for each before the
           release (a web backend's long-lived client): each request's own TCP connect
           left out
  serve-split the same streams over --client-procs processes, an openai client each,
           released together: the gateway and the worker with the client's own Python
           process out of the way (opt-in: --modes)

then the first-token latency of a burst of --burst jobs on an idle worker: the Python
client's (``AsyncClient.submit_many``, submit to each job's first chunk), the openai
client's through the gateway (request to each stream's first chunk with text), cold and
with its pool's connections open beforehand, and raw HTTP's, p50 and max. Streamed
text must equal the job's stored result. Best of --rounds counts.

Usage:
    python ops/bench_serve.py                                # tiny model, CPU, a few minutes
    python ops/bench_serve.py --batch 64 --streams 64,256 --modes direct,submit,each,serve
    python ops/bench_serve.py --shape 0.5b --streams 64,256,1024 --tokens 128 --batch 64 \
        --variant="--admit-hold-steps 0 --prefill-buckets off" --variant="" --json out.json

A --variant is one worker's extra options (``--variant=""``: its defaults); ``NAME=value``
words in it set that worker's environment (``MLX_CUDA_USE_CUDNN_SDPA=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import procs
import redis
from bench_e2e import Direct, model_dir_for
from bench_gateway import (
    Stream,
    cpu_s,
    environment,
    oai_client,
    open_pool,
    raise_fd_limit,
    run_streams,
    start_gateway,
)
from procs import records, stop
from words import WORDS as ALL_WORDS

from mlxq.producer import AsyncClient, AsyncJob, Client
from mlxq.producer.info import collect
from mlxq.worker.random_model import SHAPES

WORDS = ALL_WORDS[:24]
WAIT_S = 3600.0
GREEDY: dict[str, Any] = {"temperature": 0.0}
DEFAULTS = {
    "tiny": dict(batch=16, tokens=32, streams=[16, 64], burst=16),
    "large": dict(batch=64, tokens=128, streams=[64, 256, 1024], burst=64),
}


def prompt(tag: str, i: int) -> str:
    """Prompts of one length in tokens, whatever ``tag`` and ``i`` (both fixed width)."""
    return f"{tag} {i:05d}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(16))


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- the worker's counters ----------------------------------------------------------------


def diff_hist(after: dict[str, int], before: dict[str, int]) -> dict[int, int]:
    out = {int(k): v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in sorted(out.items()) if v}


@dataclass
class Intake:
    """How the worker took one run's jobs in (differences of its counters)."""

    decode_steps: int = 0
    decode_sizes_new: int = 0  # batch sizes no decode step had run at before
    prefill_batch_sizes: dict[int, int] = field(default_factory=dict)
    prefill_shapes_new: int = 0
    window_sizes: dict[int, int] = field(default_factory=dict)
    claim_calls: int = 0
    jobs_claimed: int = 0
    admit_held_steps: int = 0
    busy_ms: dict[str, float] = field(default_factory=dict)  # decode thread, by stage

    @property
    def prefill_passes(self) -> int:
        return sum(self.prefill_batch_sizes.values())

    @property
    def rows_per_prefill(self) -> float:
        rows = sum(k * v for k, v in self.prefill_batch_sizes.items())
        return rows / self.prefill_passes if self.prefill_passes else float("nan")


class Worker:
    """One ``mlxq worker`` serving one queue, and its counters read through ``mlxq info``."""

    def __init__(self, url: str, name: str, proc: subprocess.Popen[bytes], queue: str) -> None:
        self.url, self.name, self.proc, self.queue = url, name, proc, queue
        self.r = redis.Redis.from_url(url)
        self.last: dict[str, Any] | None = None  # counters at the end of the last run

    def counters(self) -> dict[str, Any]:
        return next((w for w in collect(self.r)["workers"] if w["name"] == self.name), {})

    def settled(self) -> dict[str, Any]:
        """The counters as of now, every job before now done (the worker writes them about
        once a second): the end of one run, and so the start of the next."""
        now = time.time()
        deadline = time.monotonic() + 10.0
        while True:
            c = self.counters()
            done = float(c.get("updated_at", 0)) > now and not c.get("running", 1)
            if done or time.monotonic() > deadline:
                return c
            time.sleep(0.1)

    def run(self) -> tuple[dict[str, Any], Callable[[], Intake]]:
        """A run's start: its counters now (the last run's end, when nothing ran since),
        and what reads its intake once it is done."""
        before = self.last or self.settled()

        def done() -> Intake:
            self.last = self.settled()
            return self.intake(before, self.last)

        return before, done

    @staticmethod
    def intake(before: dict[str, Any], after: dict[str, Any]) -> Intake:
        def d(k: str) -> int:
            return int(after.get(k, 0)) - int(before.get(k, 0))

        seen = set(before.get("batch_sizes", {}))
        return Intake(
            d("decode_steps"),
            len(set(after.get("batch_sizes", {})) - seen),
            diff_hist(after.get("prefill_batch_sizes", {}), before.get("prefill_batch_sizes", {})),
            d("prefill_shapes"),
            diff_hist(after.get("window_sizes", {}), before.get("window_sizes", {})),
            d("claim_calls"),
            d("jobs_claimed"),
            d("admit_held_steps"),
            {
                k: v - float((before.get("busy_ms") or {}).get(k, 0.0))
                for k, v in (after.get("busy_ms") or {}).items()
            },
        )


# -- one run ------------------------------------------------------------------------------


def job_times(
    url: str, ids: Sequence[str], release: float | None = None, end: float | None = None
) -> dict[str, float]:
    """From the jobs' rq records: how long their enqueues spread (first to last), and
    how long they waited from enqueue to start (p50, max): how they reached the worker.
    With the client's ``release`` and ``end`` (unix seconds, this machine's clock): how
    long its first job took to reach the queue (head), and how long after the worker
    ended the last job the client had the last result or chunk (tail): the run's wall
    less the worker's span is these two."""
    got = records(url, ids, ("enqueued_at", "started_at", "ended_at"))
    enq = [e for e, _, _ in got if e is not None]
    waits = [s - e for e, s, _ in got if e is not None and s is not None]
    ends = [x for _, _, x in got if x is not None]
    if not enq or not waits:
        return {}
    times = {
        "enqueue_spread_s": max(enq) - min(enq),
        "wait_p50_s": statistics.median(waits),
        "wait_max_s": max(waits),
    }
    if release is not None and end is not None and len(ends) == len(ids):
        times |= {"head_s": min(enq) - release, "tail_s": end - max(ends)}
    return times


@dataclass
class Run:
    mode: str
    variant: str
    streams: int
    tokens: int
    wall_s: float
    errors: int = 0
    gateway_cpu_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's, the client's (serve modes)
    intake: Intake | None = None
    times: dict[str, float] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


class Bench:
    def __init__(self, args: argparse.Namespace, direct: Direct, base: str, gw_pid: int) -> None:
        self.args, self.direct, self.base, self.gw_pid = args, direct, base, gw_pid
        self.clients: ClientPool | None = None  # serve-split's processes, made once

    def direct_run(self, texts: list[str]) -> Run:
        ids = [self.direct.encode_chat(t) for t in texts]
        run = self.direct.run("direct", ids, self.args.tokens, [GREEDY])
        return Run("direct", "", len(texts), run.tokens, run.wall_s)

    def submit_run(self, w: Worker, variant: str, texts: list[str]) -> Run:
        client = Client(w.url, w.queue, result_ttl=3600)
        try:
            _, intake_of = w.run()
            kws = [dict(messages=chat(t), max_tokens=self.args.tokens, **GREEDY) for t in texts]
            t0, release = time.perf_counter(), time.time()
            jobs = client.submit_many(kws)
            results = [j.result(timeout=WAIT_S) for j in jobs]
            wall, end = time.perf_counter() - t0, time.time()
        finally:
            client.close()
        tokens = sum(r.usage["completion_tokens"] for r in results)
        intake = intake_of()
        times = job_times(w.url, [j.id for j in jobs], release, end)
        return Run("submit", variant, len(texts), tokens, wall, intake=intake, times=times)

    def each_run(self, w: Worker, variant: str, texts: list[str]) -> Run:
        """The jobs through the Python client, one ``submit`` each (concurrent), as a
        gateway sends them: their arrival without HTTP's cost on this machine's cores."""
        _, intake_of = w.run()
        kws = [dict(messages=chat(t), max_tokens=self.args.tokens, **GREEDY) for t in texts]
        t0, release = time.perf_counter(), time.time()
        ids, tokens = asyncio.run(submit_each(w.url, w.queue, kws))
        wall, end = time.perf_counter() - t0, time.time()
        intake, times = intake_of(), job_times(w.url, ids, release, end)
        return Run("each", variant, len(texts), tokens, wall, intake=intake, times=times)

    def serve_run(
        self,
        w: Worker,
        variant: str,
        texts: list[str],
        check: bool = True,
        warm: bool = False,
        split: int = 1,
    ) -> Run:
        _, intake_of = w.run()
        g0, c0 = cpu_s(self.gw_pid), time.process_time()
        if split > 1:
            if self.clients is None:
                self.clients = ClientPool(split)
            streams, wall, cli = self.clients.streams(self.base, w.queue, texts, self.args.tokens)
        else:
            run_ = run_streams(self.base, w.queue, texts, self.args.tokens, warm=warm)
            streams, wall = asyncio.run(run_)
            cli = time.process_time() - c0
        end = time.time()
        gw = cpu_s(self.gw_pid) - g0
        tokens = sum(s.tokens for s in streams)
        mode = "serve-split" if split > 1 else "serve-warm" if warm else "serve"
        run = Run(mode, variant, len(texts), tokens, wall, intake=intake_of())
        run.gateway_cpu_s, run.client_cpu_s = gw, cli
        ids = [s.id.split("-", 1)[1] for s in streams if s.id]
        run.times = job_times(w.url, ids, end - wall, end)
        client = Client(w.url, w.queue)
        try:
            for s in streams:
                if s.error is None and check:
                    result = client.job(s.id.split("-", 1)[1]).result(timeout=60)
                    if (result.text, result.finish_reason) != (s.text, s.finish_reason):
                        s.error = f"streamed {s.text!r} but the job's result is {result.text!r}"
                if s.error is not None:
                    run.errors += 1
                    if len(run.first_errors) < 3:
                        run.first_errors.append(s.error)
        finally:
            client.close()
        return run


def _pid(_: int) -> int:
    time.sleep(0.2)  # long enough that every process of the pool takes one
    return os.getpid()


def _client_part(
    base: str, queue: str, texts: list[str], tokens: int, at: float
) -> tuple[list[Stream], float, float]:
    """One process's share of a ``serve-split`` run: its streams through its own openai
    client, released at ``at``; the wall-clock time its last stream ended (``at`` plus
    its wall: not its client's close, nor the way back to the parent), its CPU seconds."""
    c0 = time.process_time()
    streams, wall = asyncio.run(run_streams(base, queue, texts, tokens, at=at))
    return streams, at + wall, time.process_time() - c0


class ClientPool:
    """``n`` client processes for ``serve-split`` runs, kept for the whole benchmark so
    that each has imported the openai client and opened its lazy parts (the warm-up's
    run) before a timed one."""

    def __init__(self, n: int) -> None:
        self.n, self.pool = n, multiprocessing.get_context("spawn").Pool(n)
        for _ in range(100):  # until every process has imported this module and takes work
            if len(set(self.pool.map(_pid, range(3 * n), chunksize=1))) == n:
                return
        raise RuntimeError(f"{n} client processes did not all start")

    def streams(
        self, base: str, queue: str, texts: list[str], tokens: int
    ) -> tuple[list[Stream], float, float]:
        """``texts`` as streams over the processes, released together: the streams, the
        wall from the release to the last one's end, the clients' CPU seconds."""
        at = time.time() + 0.5
        shares = [(base, queue, texts[k :: self.n], tokens, at) for k in range(self.n)]
        parts = self.pool.starmap(_client_part, shares, chunksize=1)
        streams = [s for part, _, _ in parts for s in part]
        return streams, max(e for _, e, _ in parts) - at, sum(c for _, _, c in parts)

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


async def submit_each(url: str, queue: str, kws: list[dict[str, Any]]) -> tuple[list[str], int]:
    ac = AsyncClient(url, queue, result_ttl=3600)
    try:
        jobs = await asyncio.gather(*(ac.submit(**kw) for kw in kws))
        results = await asyncio.gather(*(j.result(timeout=WAIT_S) for j in jobs))
    finally:
        await ac.aclose()
    return [j.id for j in jobs], sum(r.usage["completion_tokens"] for r in results)


# -- first tokens -------------------------------------------------------------------------


@dataclass
class Firsts:
    """One burst's first chunks: for each job its id, the wall time its request was sent
    and the wall time its first chunk arrived."""

    ids: list[str] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)

    def seconds(self) -> list[float]:
        return [f - s for s, f in zip(self.sent, self.first, strict=True)]


async def python_burst(url: str, queue: str, texts: list[str], tokens: int) -> Firsts:
    """Submit (one call) to each job's first streamed chunk, for jobs submitted together."""
    kws = [dict(messages=chat(t), max_tokens=tokens, **GREEDY) for t in texts]
    ac = AsyncClient(url, queue)
    out = Firsts()

    async def first(job: AsyncJob) -> float:
        at = float("nan")
        async for _ in job.stream(timeout=WAIT_S):
            if at != at:
                at = time.time()
        return at

    try:
        sent = time.time()
        jobs = await ac.submit_many(kws)
        out.first = list(await asyncio.gather(*map(first, jobs)))
        out.ids, out.sent = [j.id for j in jobs], [sent] * len(jobs)
    finally:
        await ac.aclose()
    return out


async def serve_burst(
    base: str, queue: str, texts: list[str], tokens: int, text: bool = True, warm: bool = False
) -> Firsts:
    """Request to each stream's first chunk with text, for requests sent together.
    ``text``: read on to each stream's end; else its first chunk, then hung up (the job
    is canceled). ``warm``: the client's pool holds a connection for each request before
    the burst (a web backend's long-lived client), else each request opens its own."""
    async with oai_client(base, len(texts)) as client:
        if warm:
            await open_pool(client, len(texts))
        go = asyncio.Event()

        async def first(text_: str) -> tuple[str, float, float]:
            await go.wait()
            sent, at, cid = time.time(), float("nan"), ""
            stream = await client.chat.completions.create(
                model=queue, messages=chat(text_), max_tokens=tokens, stream=True, **GREEDY
            )
            async for c in stream:
                cid = cid or c.id
                if not text:
                    await stream.close()
                    return cid.split("-", 1)[-1], sent, sent
                if at != at and c.choices and (c.choices[0].delta.content or "") != "":
                    at = time.time()
            return cid.split("-", 1)[-1], sent, at

        tasks = [asyncio.create_task(first(t)) for t in texts]
        await asyncio.sleep(0)
        go.set()
        got = await asyncio.gather(*tasks)
    return Firsts([i for i, _, _ in got], [s for _, s, _ in got], [f for _, _, f in got])


async def http_burst(
    base: str, queue: str, texts: list[str], tokens: int, text: bool = True
) -> Firsts:
    """Streaming chat completions as raw HTTP/1.1 over sockets opened beforehand and
    written together: a burst as the gateway sees one, without a client library's own
    time (one ``AsyncOpenAI`` sends its requests one after another). ``text``: each
    stream's first chunk with text, read on to its end; else its first chunk, then hung
    up (the job is canceled)."""
    host, port = base.split("//", 1)[1].rsplit(":", 1)
    conns = [await asyncio.open_connection(host, int(port)) for _ in texts]
    go = asyncio.Event()

    async def one(k: int) -> tuple[str, float, float]:
        body = json.dumps(
            dict(model=queue, messages=chat(texts[k]), max_tokens=tokens, stream=True, **GREEDY)
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        reader, writer = conns[k]
        await go.wait()
        sent, at, cid, buf = time.time(), float("nan"), "", b""
        writer.write(head + body)
        try:
            while more := await reader.read(65536):
                buf += more
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if b"data: [DONE]" in event:
                        return cid.split("-", 1)[-1], sent, at
                    if (start := event.find(b"data: {")) < 0:  # headers, chunk sizes
                        continue
                    chunk = json.loads(event[start + 6 :])
                    cid = cid or chunk.get("id", "")
                    delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                    if at != at and delta.get("content"):
                        at = time.time()
                    if cid and not text:
                        return cid.split("-", 1)[-1], sent, sent
        finally:
            writer.close()
        raise RuntimeError(f"stream {cid or k} ended without [DONE]")

    tasks = [asyncio.create_task(one(k)) for k in range(len(texts))]
    await asyncio.sleep(0.05)  # every request built and waiting
    go.set()
    got = await asyncio.gather(*tasks)
    return Firsts([i for i, _, _ in got], [s for _, s, _ in got], [f for _, _, f in got])


def burst_parts(url: str, b: Firsts) -> dict[str, float]:
    """Where a burst's first token went, p50 of each job's: request sent to enqueued
    (the gateway's intake, or submit_many's round trip), enqueued to started (claim and
    the admission window), started to its first chunk at the client (prefill, publish,
    delivery). Wall clocks of one machine."""
    got = records(url, b.ids)
    joined = zip(b.sent, b.first, got, strict=True)
    rows = [(s, e, st, f) for s, f, (e, st) in joined if e and st and f == f]
    if not rows:
        return {}
    return {
        "intake_p50_s": statistics.median(e - s for s, e, _, _ in rows),
        "window_p50_s": statistics.median(st - e for _, e, st, _ in rows),
        "first_p50_s": statistics.median(f - st for _, _, st, f in rows),
    }


def ttft(w: Worker, base: str, tag: str, n: int, tokens: int) -> dict[str, float]:
    """First-token p50 and max (seconds) of a burst of ``n`` on an idle worker, three
    ways (the Python client, the openai client through the gateway, raw HTTP through it),
    and where each way's p50 went (``burst_parts``)."""
    w.last = None  # counted by no run
    out: dict[str, float] = {}
    for who, burst in (
        ("python", lambda t: python_burst(w.url, w.queue, t, tokens)),
        ("serve", lambda t: serve_burst(base, w.queue, t, tokens)),
        ("warm", lambda t: serve_burst(base, w.queue, t, tokens, warm=True)),
        ("http", lambda t: http_burst(base, w.queue, t, tokens)),
    ):
        b = asyncio.run(burst([prompt(f"{tag}{who[0]}", i) for i in range(n)]))
        time.sleep(0.5)
        out[f"{who}_p50_s"], out[f"{who}_max_s"] = statistics.median(b.seconds()), max(b.seconds())
        out.update({f"{who}_{k}": v for k, v in burst_parts(w.url, b).items()})
    return out


# -- report -------------------------------------------------------------------------------


def best_of(runs: Sequence[Run]) -> dict[tuple[str, str, int], Run]:
    best: dict[tuple[str, str, int], Run] = {}
    for r in runs:
        k = (r.mode, r.variant, r.streams)
        if k not in best or r.tok_s > best[k].tok_s:
            best[k] = r
    return best


def ratios(best: dict[tuple[str, str, int], Run], r: Run) -> dict[str, float]:
    out = {}
    d = best.get(("direct", "", r.streams))
    s = best.get(("submit", r.variant, r.streams))
    if d is not None and r.mode != "direct":
        out["vs_direct"] = r.tok_s / d.tok_s
    if s is not None and r.mode.startswith("serve"):
        out["vs_submit"] = r.tok_s / s.tok_s
    return out


def hist(h: dict[int, int], most: int = 6) -> str:
    top = sorted(h.items(), key=lambda kv: -kv[1])[:most]
    more = "" if len(h) <= most else f" +{len(h) - most} sizes"
    return " ".join(f"{k}x{v}" for k, v in sorted(top)) + more


def _row(r: Run, q: dict[str, float]) -> str:
    i, t = r.intake, r.times
    nan = float("nan")
    cells = [
        f"{r.mode:<11} {r.variant or '(default)':<28} {r.streams:>5} {r.tok_s:>8.1f}",
        f"{q.get('vs_direct', nan):>7.2f} {q.get('vs_submit', nan):>7.2f}",
    ]
    if i is not None:
        cells.append(
            f"{i.decode_steps:>6} {r.tokens / max(1, i.decode_steps):>5.1f} "
            f"{i.decode_sizes_new:>4} {i.prefill_passes:>5} "
            f"{i.rows_per_prefill:>6.1f} {i.prefill_shapes_new:>4} {i.admit_held_steps:>5} "
            f"{i.jobs_claimed:>5}/{i.claim_calls:<5} "
            f"{1e3 * t.get('enqueue_spread_s', nan):>7.0f} {1e3 * t.get('wait_p50_s', nan):>7.0f} "
            f"{1e3 * t.get('head_s', nan):>6.0f} {1e3 * t.get('tail_s', nan):>6.0f} "
            f"{r.gateway_cpu_s / r.wall_s if r.wall_s else 0:>5.2f} "
            f"{r.client_cpu_s / r.wall_s if r.wall_s else 0:>5.2f}  {hist(i.prefill_batch_sizes)}"
        )
    return " ".join(cells) + (f"  ERRORS {r.errors}" if r.errors else "")


#: The stages shown (worker/stages.py), the rest summed as "other".
SHOWN_STAGES = ("decode", "prefill", "first_token", "rows_join", "rows_leave", "intake")


def stages(best: dict[tuple[str, str, int], Run]) -> list[str]:
    """The worker's decode thread, ms a decode step by stage, for each run through it."""
    lines = ["decode thread, ms a decode step: " + " ".join(SHOWN_STAGES) + " other all"]
    for _, r in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        i = r.intake
        if i is None or not i.busy_ms or not i.decode_steps:
            continue
        shown = [i.busy_ms.get(k, 0.0) / i.decode_steps for k in SHOWN_STAGES]
        total = sum(i.busy_ms.values()) / i.decode_steps
        cells = " ".join(f"{v:.2f}" for v in [*shown, total - sum(shown), total])
        lines.append(f"  {r.mode:<11} {r.variant or '(default)':<28} {r.streams:>5}  {cells}")
    return lines


def summary(best: dict[tuple[str, str, int], Run], ttfts: dict[str, list[dict[str, float]]]) -> str:
    lines = [
        f"{'mode':<11} {'variant':<28} {'N':>5} {'tok/s':>8} {'/direct':>7} {'/submit':>7} "
        f"{'steps':>6} {'r/st':>5} {'bs+':>4} {'pf':>5} {'rows':>6} {'sh+':>4} {'held':>5} "
        f"{'claimed/calls':<11} {'enq ms':>7} {'wait ms':>7} {'head':>6} {'tail':>6} {'gwCPU':>5} "
        f"{'cliCPU':>5}  prefill rows x passes",
    ]
    for _, r in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        lines.append(_row(r, ratios(best, r)))
    for variant, ts in ttfts.items():
        best_t = {k: min(t[k] for t in ts) for k in ts[0]}
        ms = {k: 1e3 * v for k, v in best_t.items()}
        lines.append(
            f"first token, burst ({variant or 'default'}): python client p50 "
            f"{ms['python_p50_s']:.1f} ms (max {ms['python_max_s']:.1f}); openai via serve p50 "
            f"{ms['serve_p50_s']:.1f} ms (max {ms['serve_max_s']:.1f}); serve - python "
            f"{ms['serve_p50_s'] - ms['python_p50_s']:+.1f} ms; raw HTTP via serve p50 "
            f"{ms['http_p50_s']:.1f} ms ({ms['http_p50_s'] - ms['python_p50_s']:+.1f}); openai "
            f"via serve, its pool's connections open beforehand, p50 {ms['warm_p50_s']:.1f} ms "
            f"({ms['warm_p50_s'] - ms['python_p50_s']:+.1f})"
        )
        for who in ("python", "serve", "warm", "http"):
            if f"{who}_intake_p50_s" in ms:
                lines.append(
                    f"  {who} p50: sent to enqueued {ms[f'{who}_intake_p50_s']:.1f} ms, enqueued"
                    f" to started {ms[f'{who}_window_p50_s']:.1f}, started to first chunk "
                    f"{ms[f'{who}_first_p50_s']:.1f}"
                )
    lines += stages(best)
    lines.append(
        "steps: decode steps (r/st: tokens a step, which sets tokens/s where a step's time "
        "hardly depends on its rows, as on a GPU); bs+: decode batch sizes new to the "
        "worker; pf: prefill passes (rows: rows a pass); sh+: new (rows, padded length) "
        "prefill shapes; held: decode steps a busy batch let jobs gather; enq ms: first to "
        "last enqueue; wait ms: enqueue to start, p50; head: release to the first enqueue, "
        "ms; tail: the worker's last job ended to the client's last result or chunk, ms "
        "(wall = head + the worker's span + tail); gwCPU, cliCPU: gateway's and client's "
        "cores busy"
    )
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--model-dir", help="build the model here (reused if it holds the shape)")
    ap.add_argument("--batch", type=int, help="the worker's --max-batch (default 64; tiny 16)")
    ap.add_argument("--tokens", type=int, help="max_tokens a job (default 128; tiny 32)")
    ap.add_argument(
        "--streams",
        type=lambda s: [int(v) for v in s.split(",")],
        help="jobs (concurrent streams) per point (default 64,256,1024; tiny 16,64)",
    )
    ap.add_argument("--burst", type=int, help="first-token burst size (default 64; tiny 16)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per point; the best counts")
    ap.add_argument(
        "--variant",
        action="append",
        metavar="ARGS",
        help="extra mlxq worker options for one worker (repeat to compare; default: one "
        'worker with its defaults, as --variant "")',
    )
    ap.add_argument(
        "--modes",
        default="direct,submit,serve,serve-warm",
        help="subset of direct,submit,each,serve,serve-warm,serve-split (each: the Python "
        "client, one submit a job; serve-warm: serve with the client's connections open "
        "beforehand; serve-split: serve over --client-procs client processes)",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=4,
        help="client processes of a serve-split run (default 4)",
    )
    ap.add_argument("--no-ttft", action="store_true", help="skip the first-token bursts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--json", metavar="OUT", help="write every figure here")
    args = ap.parse_args(argv)
    tiny = args.shape == "tiny"
    for k, v in {**DEFAULTS["tiny" if tiny else "large"]}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dtype is None:
        args.dtype = "float32" if tiny else "bfloat16"
    args.eos_reachable = False  # jobs of equal length: refills line up on both sides
    args.variant = args.variant or [""]
    args.modes = args.modes.split(",")
    modes = {"direct", "submit", "each", "serve", "serve-warm", "serve-split"}
    if bad := set(args.modes) - modes:
        ap.error(f"--modes: unknown {','.join(sorted(bad))}")
    if min(args.batch, args.tokens, args.burst, args.rounds, args.client_procs, *args.streams) < 1:
        ap.error("--batch, --tokens, --burst, --rounds, --client-procs and --streams must be >= 1")
    return args


class ChatDirect(Direct):
    """mlx-lm direct on the worker's own tokenization of a chat turn."""

    def encode_chat(self, text: str) -> list[int]:
        t = self.tokenizer.apply_chat_template(
            chat(text), add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(t, add_special_tokens=False))


def start_workers(
    args: argparse.Namespace, model_dir: Path, url: str, work: Path, started: list[Any]
) -> list[tuple[str, Worker]]:
    """One worker per --variant: its words are ``mlxq worker`` options, but ``NAME=value``
    words, which set its environment (``MLX_CUDA_USE_CUDNN_SDPA=0``)."""
    workers = []
    for k, variant in enumerate(args.variant):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("MLXQ_API_KEY", None)
        words = variant.split()
        env.update(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
        options = [w for w in words if "=" not in w or w.startswith("-")]
        queue = f"bench-serve-{k}-{uuid.uuid4().hex[:6]}"
        extra = ["--max-batch", str(args.batch), *options]
        name, proc = procs.start_worker(
            model_dir, url, queue, work / f"worker-{k}.log", extra, env=env, started=started
        )
        workers.append((variant, Worker(url, name, proc, queue)))
    return workers


def run_point(bench: Bench, workers: list[tuple[str, Worker]], n: int, tag: str) -> list[Run]:
    """Every mode once at ``n`` streams, each on prompts of its own (so no run finds
    another's in the worker's prompt cache)."""
    runs = []
    if "direct" in bench.args.modes:
        runs.append(bench.direct_run([prompt(tag + "d", i) for i in range(n)]))
    for variant, w in workers:
        if "submit" in bench.args.modes:
            runs.append(bench.submit_run(w, variant, [prompt(tag + "q", i) for i in range(n)]))
        if "each" in bench.args.modes:
            runs.append(bench.each_run(w, variant, [prompt(tag + "e", i) for i in range(n)]))
        if "serve" in bench.args.modes:
            runs.append(bench.serve_run(w, variant, [prompt(tag + "o", i) for i in range(n)]))
        if "serve-warm" in bench.args.modes:
            texts = [prompt(tag + "w", i) for i in range(n)]
            runs.append(bench.serve_run(w, variant, texts, warm=True))
        if "serve-split" in bench.args.modes:
            texts = [prompt(tag + "p", i) for i in range(n)]
            runs.append(bench.serve_run(w, variant, texts, split=bench.args.client_procs))
    for r in runs:
        i = r.intake
        more = f", {i.prefill_passes} prefills, {i.admit_held_steps} held" if i else ""
        print(f"  {r.mode:<11} {r.variant or '(default)':<28} {n:>5} {r.tok_s:9.1f} tok/s{more}")
    return runs


def measure(args: argparse.Namespace, url: str, work: Path, started: list[Any]) -> dict[str, Any]:
    model_dir = model_dir_for(args, work)
    direct = ChatDirect(model_dir, args.batch)
    workers = start_workers(args, model_dir, url, work, started)
    base, gateway = start_gateway(url, work, started)
    bench = Bench(args, direct, base, gateway.pid)
    print(
        f"shape={args.shape} batch={args.batch} tokens={args.tokens} streams={args.streams} "
        f"device={mx.default_device()} prompt tokens={len(direct.encode_chat(prompt('w', 0)))} "
        f"variants={args.variant}",
        flush=True,
    )
    # Warm up: MLX builds kernels (and a GPU its plans) for each new shape; time none of it.
    warm = [prompt("warmup", i) for i in range(max(args.batch, args.burst))]
    direct.run("warmup", [direct.encode_chat(t) for t in warm], 4, [GREEDY])
    for variant, w in workers:
        bench.submit_run(w, variant, warm)
        bench.serve_run(w, variant, warm, check=False)
        if "serve-split" in args.modes:
            bench.serve_run(w, variant, warm, check=False, split=args.client_procs)
    runs: list[Run] = []
    ttfts: dict[str, list[dict[str, float]]] = {v: [] for v, _ in workers}
    try:
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
            for n in args.streams:
                runs += run_point(bench, workers, n, f"r{rnd}n{n}")
            for variant, w in workers if not args.no_ttft else ():
                ttfts[variant].append(ttft(w, base, f"t{rnd}", args.burst, args.tokens))
    finally:
        if bench.clients is not None:
            bench.clients.close()
    best = best_of(runs)
    print("\n" + summary(best, ttfts if not args.no_ttft else {}))
    for r in runs:
        for e in r.first_errors:
            print(f"ERROR ({r.mode} {r.variant} {r.streams}): {e}")
    return {
        "errors": sum(r.errors for r in runs),
        "best": [{**asdict(r), "tok_s": r.tok_s, **ratios(best, r)} for r in best.values()],
        "runs": [{**asdict(r), "tok_s": r.tok_s} for r in runs],
        "ttft": ttfts,
        "workers": {v: w.counters() for v, w in workers},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    started: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-serve-") as tmp:
        work = Path(tmp)
        try:
            url, server = procs.start_redis(work, ["--maxclients", "10000"])
            started.append(server)
            doc = measure(args, url, work, started)
            if args.json:
                out = {"env": environment(), "args": vars(args), **doc}
                Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
                print(f"wrote {args.json}")
            return 1 if doc["errors"] else 0
        finally:
            for proc in reversed(started):  # gateway, workers, then Redis
                stop(proc, 30)


if __name__ == "__main__":
    sys.exit(main())
