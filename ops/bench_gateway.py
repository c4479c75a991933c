"""``mlxq serve`` under many concurrent streams: its Redis connections and its CPU per token.

Starts a private redis-server (or uses --redis-url), builds the tiny model (``mlxq model
tiny``) unless --model is given, starts one real ``mlxq worker --max-batch 64`` and one
``mlxq serve``, then, for each point of --streams, opens that many concurrent streaming
chat completions at once with the official ``openai`` client (``AsyncOpenAI`` over one
httpx client whose connection limit exceeds the streams), greedy, ``max_tokens`` --tokens.

While a point runs, a thread samples Redis ``CLIENT LIST`` every --sample-ms and counts the
connections that belong to the gateway process: those whose client address is the local end
of one of the gateway's own TCP sockets (read from /proc/<pid>/fd and /proc/net/tcp), so the
worker's, this script's and anyone else's connections are never counted. It reports the
peak, how many of those were pub/sub connections, and the peak over all of Redis.

Gateway CPU is utime + stime of the gateway process (/proc/<pid>/stat) from just before the
first request to the last stream's end, per 1,000 tokens streamed (the usage chunk's
``completion_tokens``). Every stream must end with a finish reason and ``[DONE]``, its text
must equal its job's stored result (one Redis read a job), and --check streams are asked
again without streaming through the gateway, whose text must be the same.

The figures are this machine's: worker, gateway, Redis and this client share its cores.
Linux only (/proc).

Usage:
    python ops/bench_gateway.py                          # 100 then 1,000 streams, tiny model
    python ops/bench_gateway.py --streams 1000 --tokens 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis
from procs import MLXQ, commit, free_port, stop, version, wait_for
from procs import start_redis as start_private_redis
from procs import start_worker as start_mlxq_worker
from words import WORDS as ALL_WORDS

from mlxq.producer import Client
from mlxq.producer.info import collect

WORDS = ALL_WORDS[:12]
WAIT_S = 1800.0  # for any one stream: longer is broken, not slow


# -- processes ----------------------------------------------------------------------------


def spawn(
    cmd: list[str], log: Path, procs: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MLXQ_API_KEY", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    procs.append(proc)  # stopped by the caller's finally, whatever happens next
    return proc


def start_redis(work: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    # 1,000 streams need far fewer than 10,000 clients; the cap is only never the limit.
    url, proc = start_private_redis(work, ["--maxclients", "10000"])
    procs.append(proc)  # stopped by the caller's finally, whatever happens next
    return url


def start_worker(
    model: str, url: str, queue: str, batch: int, work: Path, procs: list[subprocess.Popen[bytes]]
) -> tuple[str, subprocess.Popen[bytes]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MLXQ_API_KEY", None)
    return start_mlxq_worker(
        model, url, queue, work / "worker.log", ["--max-batch", str(batch)], env=env, started=procs
    )


def start_gateway(
    url: str, work: Path, procs: list[subprocess.Popen[bytes]]
) -> tuple[str, subprocess.Popen[bytes]]:
    port, log = free_port(), work / "gateway.log"
    cmd = [str(MLXQ), "serve", "--port", str(port), "--redis-url", url, "--log-level", "warning"]
    proc = spawn(cmd, log, procs)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as res:
                return bool(json.load(res).get("live_workers"))
        except (urllib.error.URLError, ConnectionError, ValueError):
            return False

    wait_for("mlxq serve", up, proc, log, 60)
    return base, proc


def raise_fd_limit() -> int:
    """Lift this process's open-file limit to its hard limit (the children inherit it):
    each stream is a socket at both ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        new = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        return new
    return soft


# -- what a process holds -----------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


def socket_inodes(pid: int) -> set[str]:
    out = set()
    with os.scandir(f"/proc/{pid}/fd") as it:
        for e in it:
            with contextlib.suppress(OSError):  # closed since the listing
                target = os.readlink(e.path)
                if target.startswith("socket:["):
                    out.add(target[8:-1])
    return out


def local_ports_to(pid: int, port: int) -> set[int]:
    """Local ports of ``pid``'s established TCP connections to ``port`` (IPv4 and IPv6)."""
    mine, ports = socket_inodes(pid), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                # local, remote "HEX_IP:HEX_PORT", state 01 = ESTABLISHED, inode
                to = int(cols[2].rsplit(":", 1)[1], 16)
                if cols[3] == "01" and to == port and cols[9] in mine:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@dataclass
class Peak:
    """The most connections seen at once, over all samples."""

    samples: int = 0
    gateway: int = 0  # Redis clients whose address is one of the gateway's sockets
    gateway_pubsub: int = 0  # of those, in pub/sub mode (flags P)
    gateway_os: int = 0  # the gateway's TCP connections to Redis, as the kernel sees them
    redis_total: int = 0  # every client of Redis, this script's sampler included
    worker: int = 0
    gateway_at_start: int = 0  # held before the first request of the point
    # At the latest sample of the most gateway connections: how many last ran each command.
    gateway_last_cmds: dict[str, int] = field(default_factory=dict)


class ConnectionSampler:
    """Samples ``CLIENT LIST`` in a thread until stopped; keeps the peaks."""

    def __init__(self, url: str, gateway_pid: int, worker_pid: int, every_s: float) -> None:
        self.r = redis.Redis.from_url(url)
        self.port = int(self.r.connection_pool.connection_kwargs["port"])
        self.gateway_pid, self.worker_pid, self.every_s = gateway_pid, worker_pid, every_s
        self.peak = Peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conn-sampler", daemon=True)

    def sample(self) -> dict[str, int]:
        gw_ports = local_ports_to(self.gateway_pid, self.port)
        wk_ports = local_ports_to(self.worker_pid, self.port)
        clients = self.r.client_list()
        gw = [c for c in clients if int(c["addr"].rsplit(":", 1)[1]) in gw_ports]
        if len(gw) >= self.peak.gateway:  # the latest sample at the peak
            self.peak.gateway_last_cmds = dict(Counter(c["cmd"] for c in gw).most_common())
        return {
            "gateway": len(gw),
            "gateway_pubsub": sum("P" in c["flags"] for c in gw),
            "gateway_os": len(gw_ports),
            "redis_total": len(clients),
            "worker": sum(int(c["addr"].rsplit(":", 1)[1]) in wk_ports for c in clients),
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, redis.RedisError):  # a process just exited
                now = self.sample()
                self.peak.samples += 1
                for k, v in now.items():
                    setattr(self.peak, k, max(getattr(self.peak, k), v))
            self._stop.wait(self.every_s)

    def __enter__(self) -> ConnectionSampler:
        self.peak.gateway_at_start = self.sample()["gateway"]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.r.close()


# -- the streams --------------------------------------------------------------------------


def prompt(tag: str, i: int) -> str:
    return f"{tag} {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12))


@dataclass
class Stream:
    id: str = ""
    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    done: bool = False  # the usage chunk arrived and the stream ended cleanly
    error: str | None = None


async def one_stream(
    client: openai.AsyncOpenAI, queue: str, text: str, max_tokens: int, go: asyncio.Event
) -> Stream:
    s = Stream()
    await go.wait()  # every request starts together
    try:
        stream = await client.chat.completions.create(
            model=queue,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for c in stream:
            s.id = c.id
            if c.choices:
                s.text += c.choices[0].delta.content or ""
                s.finish_reason = c.choices[0].finish_reason or s.finish_reason
            if c.usage:
                s.tokens = c.usage.completion_tokens
                s.done = True
        if not s.done or s.finish_reason not in ("stop", "length"):
            s.error = f"ended without usage or with finish_reason {s.finish_reason!r}"
    except Exception as e:  # counted and reported, never hidden
        s.error = f"{type(e).__name__}: {e}"
    return s


def http_module() -> Any:
    """The HTTP library this ``openai`` is built on (``httpx``, or ``httpx2`` in later
    releases): its ``Limits`` and ``Timeout`` are the ones its client takes."""
    for cls in openai.DefaultAsyncHttpxClient.__mro__:
        if cls.__name__ == "AsyncClient":
            return importlib.import_module(cls.__module__.split(".")[0])
    raise RuntimeError("cannot tell which HTTP library openai uses")


def oai_client(base: str, streams: int) -> openai.AsyncOpenAI:
    """An OpenAI client that holds ``streams`` connections open at once (httpx's default
    pool is 100 in openai's client, 1,000 in openai's own defaults: both would queue)."""
    http = http_module()
    room = streams + 16
    client = openai.DefaultAsyncHttpxClient(
        limits=http.Limits(max_connections=room, max_keepalive_connections=room),
        timeout=http.Timeout(WAIT_S, connect=60.0),
    )
    return openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="unused", http_client=client, max_retries=0
    )


async def open_pool(client: openai.AsyncOpenAI, n: int) -> None:
    """``n`` requests at once through ``client``, so its pool keeps ``n`` connections
    open: what a web backend's long-lived client has after its first busy moment."""
    await asyncio.gather(*(client.models.list() for _ in range(n)))


async def run_streams(
    base: str,
    queue: str,
    prompts: Sequence[str],
    max_tokens: int,
    warm: bool = False,
    at: float | None = None,
) -> tuple[list[Stream], float]:
    """``prompts`` as concurrent streams released together, and the wall time from their
    release to the last one's end. ``warm``: the client's pool holds a connection for
    each before the release, else each request opens its own. ``at``: released at this
    wall-clock time (``time.time()``), so client processes can start together."""
    async with oai_client(base, len(prompts)) as client:
        if warm:
            await open_pool(client, len(prompts))
        go = asyncio.Event()
        tasks = [asyncio.create_task(one_stream(client, queue, p, max_tokens, go)) for p in prompts]
        await asyncio.sleep(0 if at is None else max(0.0, at - time.time()))
        t0 = time.perf_counter()
        go.set()
        streams = await asyncio.gather(*tasks)
        return list(streams), time.perf_counter() - t0


async def non_streamed(base: str, queue: str, prompts: Sequence[str], max_tokens: int) -> list[str]:
    async with oai_client(base, len(prompts)) as client:
        got = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=queue,
                    messages=[{"role": "user", "content": p}],
                    max_tokens=max_tokens,
                    temperature=0.0,
                )
                for p in prompts
            )
        )
        return [c.choices[0].message.content or "" for c in got]


# -- one point ----------------------------------------------------------------------------


@dataclass
class Point:
    streams: int
    tokens: int = 0
    wall_s: float = 0.0
    gateway_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    client_cpu_s: float = 0.0  # this script's (the openai client), for scale
    finished: int = 0
    errors: int = 0
    mismatched_result: int = 0  # streamed text != the job's stored result
    checked: int = 0  # non-streamed requests of the same prompt
    mismatched_non_streamed: int = 0
    decode_steps: int = 0
    peak: Peak = field(default_factory=Peak)
    first_errors: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def gateway_ms_per_1k(self) -> float:
        return 1e6 * self.gateway_cpu_s / self.tokens if self.tokens else float("nan")

    @property
    def mean_batch(self) -> float:
        return self.tokens / self.decode_steps if self.decode_steps else float("nan")


class Bench:
    """One queue, its worker, and the gateway now in front of it (``base``, ``gateway_pid``)."""

    def __init__(self, url: str, queue: str, worker: tuple[str, int]) -> None:
        self.url, self.queue = url, queue
        self.worker_name, self.worker_pid = worker
        self.base, self.gateway_pid = "", 0
        self.r = redis.Redis.from_url(url)
        self.client = Client(url, queue=queue)

    def worker_counters(self) -> dict[str, Any]:
        return next((w for w in collect(self.r)["workers"] if w["name"] == self.worker_name), {})

    def counters_after(self, before: dict[str, Any], tokens: int, within: float = 8.0) -> int:
        """Decode steps the worker took for ``tokens`` more tokens (its counters are
        written every second or so: wait until they include them)."""
        want = int(before.get("tokens_generated", 0)) + tokens
        deadline = time.monotonic() + within
        while True:
            now = self.worker_counters()
            if int(now.get("tokens_generated", 0)) >= want or time.monotonic() > deadline:
                return int(now.get("decode_steps", 0)) - int(before.get("decode_steps", 0))
            time.sleep(0.2)

    def point(self, n: int, max_tokens: int, check: int, sample_s: float) -> Point:
        tag = uuid.uuid4().hex[:6]
        prompts = [prompt(tag, i) for i in range(n)]
        pt = Point(n)
        counters = self.worker_counters()
        with ConnectionSampler(self.url, self.gateway_pid, self.worker_pid, sample_s) as cs:
            g0, w0, c0 = cpu_s(self.gateway_pid), cpu_s(self.worker_pid), time.process_time()
            run = run_streams(self.base, self.queue, prompts, max_tokens)
            streams, pt.wall_s = asyncio.run(run)
            pt.gateway_cpu_s = cpu_s(self.gateway_pid) - g0
            pt.worker_cpu_s = cpu_s(self.worker_pid) - w0
            pt.client_cpu_s = time.process_time() - c0
        pt.peak = cs.peak
        pt.tokens = sum(s.tokens for s in streams)
        pt.decode_steps = self.counters_after(counters, pt.tokens)
        for s in streams:
            if s.error is None:
                result = self.client.job(s.id.split("-", 1)[1]).result(timeout=30)
                if (result.text, result.finish_reason) != (s.text, s.finish_reason):
                    s.error = f"streamed {s.text!r} but the job's result is {result.text!r}"
                    pt.mismatched_result += 1
            if s.error is not None:
                pt.errors += 1
                if len(pt.first_errors) < 5:
                    pt.first_errors.append(s.error)
        pt.finished = n - pt.errors
        picked = list(range(0, n, max(1, n // check)))[:check] if check else []
        if picked:
            again = [prompts[i] for i in picked]
            texts = asyncio.run(non_streamed(self.base, self.queue, again, max_tokens))
            pt.checked = len(picked)
            pt.mismatched_non_streamed = sum(
                t != streams[i].text for t, i in zip(texts, picked, strict=True)
            )
        return pt

    def close(self) -> None:
        self.client.close()
        self.r.close()


# -- report -------------------------------------------------------------------------------


def table(points: Sequence[Point], max_tokens: int, batch: int) -> str:
    rows = [
        f"| streams (max_tokens {max_tokens}, worker --max-batch {batch}) | "
        + " | ".join(f"{p.streams:,}" for p in points)
        + " |",
        "|---|" + "---|" * len(points),
    ]

    def row(name: str, fmt: Callable[[Point], str]) -> None:
        rows.append(f"| {name} | " + " | ".join(fmt(p) for p in points) + " |")

    row("finished / errors", lambda p: f"{p.finished:,} / {p.errors}")
    row(
        "streamed text = job result; = non-streamed (checked)",
        lambda p: (
            f"{p.finished - p.mismatched_result:,}; "
            f"{p.checked - p.mismatched_non_streamed}/{p.checked}"
        ),
    )
    row(
        "peak gateway Redis connections (pub/sub)",
        lambda p: f"**{p.peak.gateway}** ({p.peak.gateway_pubsub})",
    )
    row(
        "gateway Redis connections before the first request", lambda p: f"{p.peak.gateway_at_start}"
    )
    row("peak Redis clients, all (worker's)", lambda p: f"{p.peak.redis_total} ({p.peak.worker})")
    row("tokens streamed", lambda p: f"{p.tokens:,}")
    row("wall s / tok/s", lambda p: f"{p.wall_s:.1f} / {p.tok_s:,.0f}")
    row("worker mean batch (tokens / decode steps)", lambda p: f"{p.mean_batch:.1f}")
    row("gateway CPU ms per 1,000 tokens", lambda p: f"**{p.gateway_ms_per_1k:.0f}**")
    row(
        "gateway CPU s / wall s (cores busy)",
        lambda p: f"{p.gateway_cpu_s:.1f} / {p.gateway_cpu_s / p.wall_s:.2f}",
    )
    row(
        "worker CPU s; client (openai) CPU s",
        lambda p: f"{p.worker_cpu_s:.1f}; {p.client_cpu_s:.1f}",
    )
    return "\n".join(rows)


def environment() -> dict[str, Any]:
    redis_v = subprocess.run(
        [shutil.which("redis-server") or "redis-server", "--version"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "redis": next((w[2:] for w in redis_v if w.startswith("v=")), None),
        "commit": commit(),
        **{p: version(p) for p in ("mlxq", "mlx", "mlx-lm", "openai", "uvicorn", "fastapi")},
        "openai_http": f"{http_module().__name__} {http_module().__version__}",
    }


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog="Linux only: connections and CPU are read from /proc.",
    )
    ap.add_argument(
        "--streams",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[100, 1000],
        help="concurrent streams per point, comma-separated (default 100,1000)",
    )
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens a stream (default 16)")
    ap.add_argument("--max-batch", type=int, default=64, help="the worker's --max-batch")
    ap.add_argument(
        "--check", type=int, default=16, help="streams asked again without streaming (default 16)"
    )
    ap.add_argument("--sample-ms", type=float, default=50, help="CLIENT LIST every this often")
    ap.add_argument("--model", help="model path for the worker (default: build the tiny model)")
    ap.add_argument("--redis-url", help="use this Redis (default: start a private one)")
    ap.add_argument("--json", metavar="OUT", help="write every figure here")
    args = ap.parse_args(argv)
    if min(*args.streams, args.tokens, args.max_batch) < 1 or args.check < 0:
        ap.error("--streams, --tokens and --max-batch must be >= 1, --check >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path("/proc/self/stat").exists():
        sys.exit("bench_gateway reads /proc: Linux only")
    fds = raise_fd_limit()
    if fds < 2 * max(args.streams) + 256:
        sys.exit(f"open-file limit {fds} is too low for {max(args.streams)} streams")
    procs: list[subprocess.Popen[bytes]] = []
    bench: Bench | None = None
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-gw-") as tmp:
        work = Path(tmp)
        try:
            url = args.redis_url or start_redis(work, procs)
            model = args.model
            if model is None:
                model = str(work / "tiny")
                build = [str(MLXQ), "model", "tiny", model]
                subprocess.run(build, check=True, capture_output=True)
            queue = f"bench-gw-{uuid.uuid4().hex[:6]}"
            worker_name, worker = start_worker(model, url, queue, args.max_batch, work, procs)
            print(f"worker pid {worker.pid} (--max-batch {args.max_batch})", flush=True)
            bench = Bench(url, queue, (worker_name, worker.pid))
            sample_s = args.sample_ms / 1e3
            points = []
            # The first gateway only warms the worker up (MLX compiles, a first full batch).
            # Each point then gets a fresh gateway, so the connections its pools hold are
            # that point's own, not a high-water mark left by an earlier, larger one; two
            # streams warm it up (imports, the queue's client) outside the measurement.
            for n in [0, *args.streams]:
                base, gateway = start_gateway(url, work, procs)
                bench.base, bench.gateway_pid = base, gateway.pid
                try:
                    if n == 0:
                        bench.point(min(64, max(args.streams)), args.tokens, 0, sample_s)
                        continue
                    bench.point(2, args.tokens, 0, sample_s)
                    p = bench.point(n, args.tokens, args.check, sample_s)
                finally:
                    stop(gateway, 30)
                    procs.remove(gateway)
                print(
                    f"  {n:>5} streams: {p.finished} finished, {p.errors} errors, peak gateway "
                    f"Redis connections {p.peak.gateway}, {p.gateway_ms_per_1k:.0f} ms "
                    f"gateway CPU / 1k tokens, {p.wall_s:.1f} s",
                    flush=True,
                )
                points.append(p)
            print("\n" + table(points, args.tokens, args.max_batch))
            for p in points:
                cmds = ", ".join(f"{k} {v}" for k, v in p.peak.gateway_last_cmds.items())
                print(
                    f"{p.streams} streams, gateway connections at the peak by last command: {cmds}"
                )
            errors = sum(p.errors + p.mismatched_non_streamed for p in points)
            for p in points:
                for e in p.first_errors:
                    print(f"ERROR ({p.streams} streams): {e}")
            if args.json:
                doc = {
                    "env": environment(),
                    "args": vars(args),
                    "points": [
                        {
                            **asdict(p),
                            "tok_s": p.tok_s,
                            "gateway_cpu_ms_per_1k_tokens": p.gateway_ms_per_1k,
                            "mean_batch": p.mean_batch,
                        }
                        for p in points
                    ],
                }
                Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
                print(f"wrote {args.json}")
            return 1 if errors else 0
        finally:
            if bench is not None:
                bench.close()
            for proc in reversed(procs):  # gateway, worker, then Redis
                stop(proc, 30)


if __name__ == "__main__":
    sys.exit(main())
