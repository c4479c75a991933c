"""End to end: mlx-lm's BatchGenerator driven directly vs mlxq through Redis, in one run.

Builds a random-weight model of a real size (mlxq.worker.random_model), starts its own
redis-server and one real ``mlxq worker``, and times, interleaved in every round:

  direct-shared      BatchGenerator, every prompt inserted, one shared make_sampler
  direct-rowmix      the same with per-row make_sampler objects in 4 param groups
                     (mlx-lm's per-row loop)
  mlxq-homog         the same prompts through Client.submit_many, until the last result()
  mlxq-mixed         the 4 param groups interleaved
  mlxq-mixed-listen  mixed, with N asyncio listeners streaming jobs live (text checked
                     against the result)
  short              many jobs of few tokens, direct vs mlxq
  ttft               time to first token: one job on an idle worker, then a burst of B
                     (mlxq's includes the worker's batching window, --window-ms)

For mlxq runs it also reports the worker's CPU seconds per job beyond the direct run of
the same work (Linux /proc only), Redis commands per generated token (INFO commandstats;
producer, worker and listeners together) and the worker's vectorized/decode steps.
Best of --rounds counts: on a shared machine other load only ever slows a run down.

Usage:
    python ops/bench_e2e.py                           # tiny model: a minute or two on CPU
    python ops/bench_e2e.py --shape 0.5b --json out.json
    python ops/bench_e2e.py --modes direct-shared,mlxq-homog --jobs 64
    python ops/bench_e2e.py --sentinel     # --wait-replicas 0 vs 1 (ops/bench_replicas.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import procs
import redis
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from procs import first_chunks_s, start_redis, stop

from mlxq.producer import AsyncClient, Client, Job, Result
from mlxq.producer.info import collect
from mlxq.worker.random_model import SHAPES, build_random_model

HOMOG: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9}
GROUPS: list[dict[str, Any]] = [
    HOMOG,
    {"temperature": 1.0, "top_k": 40},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 0.0},
]
# Every row as homogeneous runs, plus log-probs (top 5) / penalties and a bias: what
# those cost per step against mlxq-homog (opt-in: --modes ...,mlxq-logprobs).
EXTRAS: dict[str, dict[str, Any]] = {
    "mlxq-logprobs": {**HOMOG, "logprobs": True, "top_logprobs": 5},
    "mlxq-penalties": {
        **HOMOG,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "logit_bias": {i: 1.0 for i in range(3, 13)},
    },
}
STEADY = (
    "direct-shared",
    "direct-rowmix",
    "mlxq-homog",
    "mlxq-mixed",
    "mlxq-mixed-listen",
    *EXTRAS,
)
MODES = (*STEADY, "short", "ttft")
DEFAULT_MODES = tuple(m for m in MODES if m not in EXTRAS)
# The direct run doing the same work (same prompts, same params) as each mlxq run.
PAIR = {
    "mlxq-homog": "direct-shared",
    "mlxq-mixed": "direct-rowmix",
    "mlxq-mixed-listen": "direct-rowmix",
    "mlxq-logprobs": "direct-shared",
    "mlxq-penalties": "direct-shared",
    "short-mlxq": "short-direct",
}
DEFAULTS = {
    "tiny": dict(batch=16, tokens=32, jobs=[16, 64], short_jobs=200, listeners=16),
    "large": dict(batch=64, tokens=128, jobs=[64, 1024], short_jobs=2000, listeners=64),
}
_WORDS = (
    "river stone lamp harbor winter copper garden signal orchard violet thunder ladder meadow "
    "candle engine quiet falcon the of under bright morning city letter train silver old"
)
WORDS = _WORDS.split()
WAIT_S = 3600.0  # for any one result: a run that takes longer is broken, not slow
NOTE = """\
/paired: tok/s vs the direct run of the same params; /shared: vs direct-shared
wCPU+ms/job: worker CPU per job beyond direct (less the paired direct run's CPU; below
  zero where the worker's sampler costs less than mlx-lm's)
cmds/tok: Redis commands per generated token (producer, worker and listeners)
vec/steps: the worker's vectorized sampling steps / decode steps"""


@dataclass
class Run:
    """One timed run of one mode; ``cpu_s`` is this process's for direct runs, the
    worker's for mlxq runs."""

    mode: str
    jobs: int
    tokens: int
    wall_s: float
    cpu_s: float | None = None
    redis_calls: int | None = None  # sum of INFO commandstats calls, ours excluded
    redis_total: int | None = None  # total_commands_processed, ours excluded
    decode_steps: int | None = None
    vectorized_steps: int | None = None
    listened: int = 0
    mismatches: int = 0  # listeners whose streamed text differed from the result

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def sampler_for(p: dict[str, Any]) -> Any:
    return make_sampler(
        p.get("temperature", 0.0),
        top_p=p.get("top_p", 1.0),
        min_p=p.get("min_p", 0.0),
        top_k=p.get("top_k", 0),
    )


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Distinct prompts of a few dozen tokens (the index makes each one unique)."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(16)) for i in range(n)]


def worker_cpu_s(pid: int) -> float | None:
    """utime + stime of a process, or None where there is no /proc."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return None
    fields = stat.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


class RedisMeter:
    """Commands Redis ran between two readings, less the readings' own INFO."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        r.ping()  # connect (and say hello) before calibrating
        # Back to back, a reading's delta is the earlier reading's own INFO; the least
        # of a few is that, should another client slip a command in between.
        pairs = [(self.read(), self.read()) for _ in range(5)]
        self.own = min((b[0] - a[0], b[1] - a[1]) for a, b in pairs)

    def read(self) -> tuple[int, int]:
        info = self.r.info("commandstats", "stats")
        calls = sum(v["calls"] for k, v in info.items() if k.startswith("cmdstat_"))
        return calls, int(info["total_commands_processed"])

    def delta(self, before: tuple[int, int]) -> tuple[int, int]:
        after = self.read()
        return after[0] - before[0] - self.own[0], after[1] - before[1] - self.own[1]


class Direct:
    """mlx-lm's BatchGenerator in this process, on the same checkpoint as the worker."""

    def __init__(self, model_dir: Path, batch: int) -> None:
        self.model, self.tokenizer = load(str(model_dir))[:2]
        self.batch = batch
        self.stop = [[t] for t in sorted(self.tokenizer.eos_token_ids)]

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode(p)) for p in prompts]  # as the worker does

    def generator(self, max_tokens: int, sampler: Any = None) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            stop_tokens=self.stop,
            sampler=sampler,
            completion_batch_size=self.batch,
            prefill_batch_size=self.batch,
        )

    def run(
        self, mode: str, ids: list[list[int]], max_tokens: int, params: Sequence[dict[str, Any]]
    ) -> Run:
        """Insert every prompt, step until every row ended; prefill is timed too."""
        shared = len(params) == 1
        gen = self.generator(max_tokens, sampler_for(params[0]) if shared else None)
        samplers = (
            None if shared else [sampler_for(params[i % len(params)]) for i in range(len(ids))]
        )
        cpu0, t0 = time.process_time(), time.perf_counter()
        gen.insert(ids, samplers=samplers)
        tokens, left = 0, len(ids)
        while left:
            _, responses = gen.next()
            tokens += len(responses)
            left -= sum(r.finish_reason is not None for r in responses)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        gen.close()
        mx.clear_cache()  # leave the device's memory to the worker
        return Run(mode, len(ids), tokens, wall, cpu)

    def first_token_s(self, ids: list[list[int]]) -> float:
        """Insert to the first generated tokens (all rows get theirs in one step)."""
        gen = self.generator(1, sampler_for(HOMOG))
        t0 = time.perf_counter()
        gen.insert(ids)
        while not gen.next()[1]:
            pass
        dt = time.perf_counter() - t0
        gen.close()
        return dt


class Mlxq:
    """The producer side: one queue served by the one worker this script started."""

    def __init__(self, url: str, queue: str, worker_name: str, worker_pid: int) -> None:
        self.url, self.queue, self.name, self.pid = url, queue, worker_name, worker_pid
        self.client = Client(url, queue, result_ttl=3600)
        self.meter = RedisMeter(redis.Redis.from_url(url))
        self.counters = self.worker_counters()

    def worker_counters(self) -> dict[str, Any]:
        return next((w for w in collect(self.meter.r)["workers"] if w["name"] == self.name), {})

    def counters_after(self, tokens: int, within: float = 5.0) -> dict[str, Any]:
        """The worker's counters once they include ``tokens`` more (it writes them about
        once a second when idle)."""
        want = int(self.counters.get("tokens_generated", 0)) + tokens
        deadline = time.monotonic() + within
        while True:
            now = self.worker_counters()
            if int(now.get("tokens_generated", 0)) >= want or time.monotonic() > deadline:
                return now
            time.sleep(0.1)

    def run(
        self,
        mode: str,
        prompts: Sequence[str],
        max_tokens: int,
        params: Sequence[dict[str, Any]],
        listeners: int = 0,
    ) -> Run:
        """Submit every prompt at once and wait for the last result."""
        kws = [
            dict(prompt=p, max_tokens=max_tokens, **params[i % len(params)])
            for i, p in enumerate(prompts)
        ]
        cpu0, redis0 = worker_cpu_s(self.pid), self.meter.read()
        t0 = time.perf_counter()
        jobs = self.client.submit_many(kws)
        listened = mismatches = 0
        if listeners:
            results, listened, mismatches = asyncio.run(self.with_listeners(jobs, listeners))
        else:
            results = wait_results(jobs)
        wall = time.perf_counter() - t0
        calls, total = self.meter.delta(redis0)
        cpu1 = worker_cpu_s(self.pid)
        tokens = sum(r.usage["completion_tokens"] for r in results)
        before, self.counters = self.counters, self.counters_after(tokens)
        steps, vec = (
            int(self.counters.get(k, 0)) - int(before.get(k, 0))
            for k in ("decode_steps", "vectorized_steps")
        )
        cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        return Run(
            mode, len(jobs), tokens, wall, cpu, calls, total, steps, vec, listened, mismatches
        )

    async def with_listeners(self, jobs: list[Job], n: int) -> tuple[list[Result], int, int]:
        """Results as in a plain run, while ``n`` listeners spread over the jobs stream."""
        ac = AsyncClient(self.url, self.queue)
        picked = list(range(0, len(jobs), max(1, len(jobs) // n)))[:n]

        async def follow(job_id: str) -> str:
            text = ""
            async for c in (await ac.job(job_id)).stream(timeout=WAIT_S):
                text = "" if c.kind == "reset" else text + c.text
            return text

        try:
            tasks = [asyncio.create_task(follow(jobs[i].id)) for i in picked]
            results = await asyncio.to_thread(wait_results, jobs)
            texts = await asyncio.gather(*tasks)
        finally:
            await ac.aclose()
        bad = sum(t != results[i].text for t, i in zip(texts, picked, strict=True))
        return results, len(picked), bad

    def first_chunk_s(self, kw: dict[str, Any]) -> float:
        """Submit to the first streamed chunk of one job."""
        t0 = time.perf_counter()
        stream = self.client.submit(**kw).stream(timeout=WAIT_S)
        next(stream)
        dt = time.perf_counter() - t0
        for _ in stream:  # to the end, so the worker is idle again
            pass
        return dt

    async def burst_first_chunks_s(self, kws: list[dict[str, Any]]) -> list[float]:
        """Submit to each job's first streamed chunk, for jobs submitted together."""
        return await first_chunks_s(self.url, self.queue, kws, WAIT_S)


def wait_results(jobs: Sequence[Job]) -> list[Result]:
    return [j.result(timeout=WAIT_S) for j in jobs]


def measure_ttft(direct: Direct, mq: Mlxq, prompts: list[str], tokens: int) -> dict[str, float]:
    kws = [dict(prompt=p, max_tokens=tokens, **HOMOG) for p in prompts]
    ids = direct.encode(prompts)
    # Median of 5, each on an idle worker (a single sample is at the mercy of the GPU clock).
    one = {
        "mlxq_one_s": statistics.median(mq.first_chunk_s(kws[i]) for i in range(5)),
        "direct_one_s": statistics.median(direct.first_token_s(ids[i : i + 1]) for i in range(5)),
    }
    burst = asyncio.run(mq.burst_first_chunks_s(kws))
    return {
        **one,
        "mlxq_burst_median_s": statistics.median(burst),
        "mlxq_burst_max_s": max(burst),
        "direct_burst_s": direct.first_token_s(ids),
    }


# -- processes ----------------------------------------------------------------------------


def start_worker(
    model_dir: Path, url: str, queue: str, args: argparse.Namespace, work: Path
) -> tuple[str, subprocess.Popen[bytes]]:
    window = [] if args.window_ms is None else ["--window-ms", str(args.window_ms)]
    cache = (
        [] if args.prompt_cache_bytes is None else ["--prompt-cache-bytes", args.prompt_cache_bytes]
    )
    extra = ["--max-batch", str(args.batch), *window, *cache]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return procs.start_worker(model_dir, url, queue, work / "worker.log", extra, env=env)


def model_dir_for(args: argparse.Namespace, work: Path) -> Path:
    """Reuse ``--model-dir`` when it holds this shape already; else build into it."""
    out = Path(args.model_dir) if args.model_dir else work / f"model-{args.shape}"
    config = out / "config.json"
    if config.exists():
        have = {"eos_reachable": True, **json.loads(config.read_text("utf-8"))}
        want = {
            **SHAPES[args.shape],
            "torch_dtype": args.dtype,
            "eos_reachable": args.eos_reachable,
        }
        if all(have.get(k) == v for k, v in want.items()):
            print(f"model: reusing {out}", flush=True)
            return out
    t0 = time.perf_counter()
    build_random_model(
        out, shape=args.shape, dtype=args.dtype, seed=args.seed, eos_reachable=args.eos_reachable
    )
    print(f"model: built {args.shape} in {time.perf_counter() - t0:.1f} s at {out}", flush=True)
    return out


# -- report -------------------------------------------------------------------------------


def derived(run: Run, best: dict[tuple[str, int], Run]) -> dict[str, Any]:
    """Ratios against the paired direct run (and direct-shared), CPU beyond it."""
    out: dict[str, Any] = {"tok_s": run.tok_s}
    pair = best.get((PAIR.get(run.mode, ""), run.jobs))
    shared = best.get(("direct-shared", run.jobs))
    if pair is not None:
        out["paired_with"] = pair.mode
        out["vs_paired"] = run.tok_s / pair.tok_s
        if run.cpu_s is not None and pair.cpu_s is not None:
            out["worker_cpu_ms_per_job_beyond_direct"] = 1e3 * (run.cpu_s - pair.cpu_s) / run.jobs
    if shared is not None and run.mode.startswith("mlxq"):
        out["vs_direct_shared"] = run.tok_s / shared.tok_s
        if run.cpu_s is not None and shared.cpu_s is not None:
            beyond = 1e3 * (run.cpu_s - shared.cpu_s) / run.jobs
            out["worker_cpu_ms_per_job_beyond_direct_shared"] = beyond
    out["jobs_s"] = run.jobs / run.wall_s
    if run.redis_calls is not None and run.tokens:
        out["redis_calls_per_token"] = run.redis_calls / run.tokens
        out["redis_total_per_token"] = (run.redis_total or 0) / run.tokens
    return out


def summary(best: dict[tuple[str, int], Run], ttft: dict[str, float] | None, batch: int) -> str:
    """The table for people: one row per (mode, jobs), then TTFT and the column notes."""

    def f(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"{'mode':<18} {'jobs':>5} {'tokens':>7} {'tok/s':>9} {'jobs/s':>8} {'/paired':>8} "
        f"{'/shared':>8} {'wCPU+ms/job':>12} {'cmds/tok':>9} {'vec/steps':>11}"
    ]
    for (mode, jobs), run in best.items():
        d = derived(run, best)
        vec = "-" if run.decode_steps is None else f"{run.vectorized_steps}/{run.decode_steps}"
        lines.append(
            f"{mode:<18} {jobs:>5} {run.tokens:>7} {run.tok_s:>9.1f} {jobs / run.wall_s:>8.1f} "
            f"{f(d.get('vs_paired')):>8} {f(d.get('vs_direct_shared')):>8} "
            f"{f(d.get('worker_cpu_ms_per_job_beyond_direct')):>12} "
            f"{f(d.get('redis_calls_per_token')):>9} {vec:>11}"
        )
    if ttft:
        ms = {k: 1e3 * v for k, v in ttft.items()}
        lines += [
            f"TTFT, idle worker, one job: mlxq {ms['mlxq_one_s']:.1f} ms (submit -> first "
            f"chunk), direct {ms['direct_one_s']:.1f} ms (insert -> first token)",
            f"TTFT, burst of {batch}: mlxq median {ms['mlxq_burst_median_s']:.1f} ms, max "
            f"{ms['mlxq_burst_max_s']:.1f} ms; direct prefill of {batch} "
            f"{ms['direct_burst_s']:.1f} ms",
        ]
    return "\n".join([*lines, NOTE])


def environment(args: argparse.Namespace, url: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "mlx": getattr(mx, "__version__", "unknown"),
        "mlx_lm": metadata.version("mlx-lm"),
        "mlxq": metadata.version("mlxq"),
        "device": str(mx.default_device()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis": redis.Redis.from_url(url).info("server")["redis_version"],
        "command": [sys.executable, *sys.argv],
        "shape": args.shape,
        "batch": args.batch,
    }
    if hasattr(mx, "device_info"):
        info["device_info"] = mx.device_info()
    return info


def plot(best: dict[tuple[str, int], Run], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({j for m, j in best if m in STEADY})
    modes = [m for m in STEADY if any((m, j) in best for j in sizes)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(modes))
    for k, m in enumerate(modes):
        ax.bar(
            [i + k * width for i in range(len(sizes))],
            [best[(m, j)].tok_s if (m, j) in best else 0 for j in sizes],
            width,
            label=m,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{j} jobs" for j in sizes])
    ax.set_ylabel("generated tokens/s")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# -- main ---------------------------------------------------------------------------------


def steady_run(
    direct: Direct, mq: Mlxq, mode: str, prompts: list[str], args: argparse.Namespace
) -> Run:
    params = (
        [EXTRAS[mode]]
        if mode in EXTRAS
        else [HOMOG]
        if mode in ("direct-shared", "mlxq-homog")
        else GROUPS
    )
    if mode.startswith("direct"):
        return direct.run(mode, direct.encode(prompts), args.tokens, params)
    listeners = args.listeners if mode == "mlxq-mixed-listen" else 0
    return mq.run(mode, prompts, args.tokens, params, listeners)


def run_round(
    direct: Direct,
    mq: Mlxq,
    args: argparse.Namespace,
    prompts: list[str],
    best: dict[tuple[str, int], Run],
    runs: list[Run],
) -> None:
    """Every chosen mode once; a mode's best round is the one that counts."""

    def keep(run: Run) -> None:
        runs.append(run)
        key = (run.mode, run.jobs)
        if key not in best or run.tok_s > best[key].tok_s:
            best[key] = run
        print(f"  {run.mode:<18} {run.jobs:>5} jobs {run.tok_s:9.1f} tok/s", flush=True)

    for n in args.jobs:
        for mode in (m for m in STEADY if m in args.modes):
            keep(steady_run(direct, mq, mode, prompts[:n], args))
    if "short" in args.modes:
        ps = prompts[: args.short_jobs]
        keep(direct.run("short-direct", direct.encode(ps), args.short_tokens, [HOMOG]))
        keep(mq.run("short-mlxq", ps, args.short_tokens, [HOMOG]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, help="max batch, both sides (default 64; tiny: 16)")
    ap.add_argument("--tokens", type=int, help="max_tokens a job (default 128; tiny: 32)")
    ap.add_argument(
        "--jobs",
        type=lambda s: [int(v) for v in s.split(",")],
        help="jobs per run, comma-separated; more than "
        "--batch means continuous refill (default 64,1024; tiny: 16,64)",
    )
    ap.add_argument("--short-jobs", type=int, help="short sweep jobs (default 2000; tiny: 200)")
    ap.add_argument("--short-tokens", type=int, help="short sweep max_tokens (default 8)")
    ap.add_argument(
        "--listeners", type=int, help="mlxq-mixed-listen listeners (default 64; tiny: 16)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode; the best counts")
    ap.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=list(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all but {','.join(EXTRAS)})",
    )
    ap.add_argument("--model-dir", help="build the model here (reused if it holds the shape)")
    ap.add_argument(
        "--eos-reachable",
        action="store_true",
        help="let jobs end early at end-of-sequence (default: unreachable, so "
        "both sides run jobs of equal length and continuous refill stays "
        "comparable)",
    )
    ap.add_argument("--seed", type=int, default=0, help="model weights' seed")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="model dtype (default bfloat16; tiny: float32, as CPUs run half precision slowly)",
    )
    ap.add_argument("--window-ms", type=float, help="the worker's --window-ms (default: its own)")
    ap.add_argument(
        "--prompt-cache-bytes",
        help="the worker's --prompt-cache-bytes (default: its own; 0 turns the cache off)",
    )
    ap.add_argument("--redis-url", help="use this Redis (default: start a private one)")
    ap.add_argument(
        "--json",
        metavar="OUT",
        help="write every figure here (and a PNG next to it if matplotlib is installed)",
    )
    args = ap.parse_args(argv)
    tiny = args.shape == "tiny"
    defaults = {**DEFAULTS["tiny" if tiny else "large"], "short_tokens": 8}
    defaults["dtype"] = "float32" if tiny else "bfloat16"
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if bad := sorted(set(args.modes) - set(MODES)):
        ap.error(f"--modes: unknown {','.join(bad)}; choose from {','.join(MODES)}")
    sizes = [args.batch, args.tokens, args.short_jobs, args.short_tokens, args.listeners]
    if min(*sizes, args.rounds, *args.jobs) < 1:
        ap.error("--batch, --tokens, --jobs, --short-*, --listeners and --rounds must be >= 1")
    return args


@dataclass
class Outcome:
    """What a whole bench measured: each (mode, jobs)'s best run, every run, best TTFTs."""

    best: dict[tuple[str, int], Run]
    runs: list[Run]
    ttft: dict[str, float] | None


def measure(direct: Direct, mq: Mlxq, args: argparse.Namespace) -> Outcome:
    """Warm both paths up, then run every round."""
    prompts = make_prompts(max(*args.jobs, args.short_jobs, args.batch))
    lens = [len(x) for x in direct.encode(prompts[:64])]
    print(
        f"shape={args.shape} batch={args.batch} tokens={args.tokens} jobs={args.jobs} "
        f"device={mx.default_device()} prompt tokens median={statistics.median(lens)}",
        flush=True,
    )
    # First MLX compiles (and the worker's first batch) are not what we time.
    for params in ([HOMOG], GROUPS):
        direct.run("warmup", direct.encode(prompts[: args.batch]), 4, params)
        mq.run("warmup", prompts[: args.batch], 4, params)
    best: dict[tuple[str, int], Run] = {}
    runs: list[Run] = []
    ttfts: list[dict[str, float]] = []
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
        run_round(direct, mq, args, prompts, best, runs)
        if "ttft" in args.modes:
            ttfts.append(measure_ttft(direct, mq, prompts[: args.batch], args.short_tokens))
    ttft = {k: min(t[k] for t in ttfts) for k in ttfts[0]} if ttfts else None
    return Outcome(best, runs, ttft)


def bench(args: argparse.Namespace, url: str, work: Path) -> int:
    model_dir = model_dir_for(args, work)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    worker = None
    try:
        name, worker = start_worker(model_dir, url, queue, args, work)
        direct, mq = Direct(model_dir, args.batch), Mlxq(url, queue, name, worker.pid)
        got = measure(direct, mq, args)
        best, runs = got.best, got.runs
        print("\n" + summary(best, got.ttft, args.batch))
        if worker_cpu_s(worker.pid) is None:
            print("worker CPU per job: not measured (no /proc on this platform)")
        if mismatches := sum(r.mismatches for r in runs):
            print(f"ERROR: {mismatches} listener(s) streamed a text other than the result")
        if args.json:
            doc = {
                "env": environment(args, url),
                "args": vars(args),
                "ttft": got.ttft,
                "best": [{**asdict(r), **derived(r, best)} for r in best.values()],
                "runs": [{**asdict(r), "tok_s": r.tok_s} for r in runs],
            }
            Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
            png = Path(args.json).with_suffix(".png")
            print(f"wrote {args.json}" + (f" and {png}" if plot(best, png) else ""))
        return 1 if mismatches else 0
    finally:
        stop(worker)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-") as tmp:
        work = Path(tmp)
        server = None
        try:
            url = args.redis_url
            if url is None:
                url, server = start_redis(work)
            return bench(args, url, work)
        finally:
            stop(server)


if __name__ == "__main__":
    if "--sentinel" in sys.argv[1:]:  # the price of --wait-replicas: ops/bench_replicas.py
        from bench_replicas import main as replicas_main

        sys.exit(replicas_main(sys.argv[1:]))
    sys.exit(main())
