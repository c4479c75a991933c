"""Shared fixtures: a private redis-server, the tiny model, real worker processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sentinel import NoSentinel, SentinelRedis

from mlxq.producer.connection import connect


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`make test &`) with SIGINT ignored, and children
    # inherit an ignored signal: the CLIs the tests interrupt would then never see Ctrl-C
    # (`mlxq info --watch` runs on, `mlxq submit --stream` finishes with 0). A handled
    # signal is reset to the default in a child, so handle it here.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Rows keep their place in the batch's caches by default on a GPU, not on this CPU
    # (mlxq.worker.kv_slots): the engines and workers here run the GPU's way;
    # tests/test_kv_slots.py runs the other.
    os.environ.setdefault("MLXQ_KV_SLOTS", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A throwaway redis-server on a free port; ``restart()`` keeps the port."""

    def __init__(self, workdir: Path, persist: bool = False) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server not found: install Redis (e.g. apt-get install redis-server)")
        self.exe, self.workdir, self.port = exe, workdir, _free_port()
        # A persistent server (AOF, fsync always) keeps its data across restart().
        self.persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if persist
            else ["--appendonly", "no"]
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *self.persistence,
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.025)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def persistent_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own that keeps its data across ``restart()``."""
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, persist=True)
    yield server
    server.stop()


@pytest.fixture
def sentinel_redis(tmp_path: Path) -> Iterator[SentinelRedis]:
    """A primary, two replicas and three sentinels of the test's own (``.url`` names them
    in the ``redis+sentinel://`` form); the test may kill and restart the primary."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found: install Redis (e.g. apt-get install redis-server)")
    workdir = tmp_path / "sentinel"
    workdir.mkdir()
    try:
        setup = SentinelRedis(workdir)
    except NoSentinel as e:  # Debian's redis-server runs as one; another build may not
        pytest.skip(f"no Redis Sentinel here ({e}): install Debian's redis-server")
    yield setup
    setup.stop()


@pytest.fixture
def r(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture
def queue_name() -> str:
    """A queue of the test's own, so tests never see each other's jobs."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxq.worker.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


class WorkerProcess:
    """``mlxq worker`` as a real process, with its log kept for failures."""

    def __init__(
        self, args: list[str], log: Path, redis_url: str, queue: str, name: str | None = None
    ) -> None:
        self.log, self.name = log, name
        self.redis = connect(redis_url)
        self.queue = queue
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxq.producer.cli", "worker", *args],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        from rq import Worker

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.output()}")
            names = {
                w.name for w in Worker.all(connection=self.redis) if self.queue in w.queue_names()
            }
            if (self.name in names) if self.name else names:
                return
            time.sleep(0.05)
        raise RuntimeError(f"worker not ready in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def freeze(self, timeout: float = 10) -> None:
        """SIGSTOP, then wait until the process shows as stopped. Writes it sent just
        before may still land after: read what it left with ``opshelp.settled``."""
        from opshelp import wait_for

        self.proc.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{self.proc.pid}/stat")

        def stopped() -> bool:  # the state follows the command's name in parentheses
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "T"

        wait_for(stopped, f"worker {self.name} to stop on SIGSTOP", timeout)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


WorkerFactory = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(
    redis_server: RedisServer, tiny_model: Path, tmp_path: Path, queue_name: str
) -> Iterator[WorkerFactory]:
    """Start real workers: ``start_worker(max_batch=8, window_ms=50)``; ``queue`` may be a
    list of ``--queue`` values (levels, first the highest); ``name`` a worker name of the
    test's choosing (default: a fresh one)."""
    started: list[WorkerProcess] = []

    def start(
        queue: str | list[str] | None = None,
        ready: bool = True,
        redis_url: str | None = None,
        model: Path | None = None,
        name: str | None = None,
        **opts: object,
    ) -> WorkerProcess:
        values = [queue] if isinstance(queue, str) else list(queue or [queue_name])
        q, url = values[0].split(",")[0].split(":")[0], redis_url or redis_server.url
        name = name or f"w{len(started)}-{uuid.uuid4().hex[:8]}"
        args = ["--model", str(model or tiny_model), "--redis-url", url, "--name", name]
        for v in values:
            args += ["--queue", v]
        for k, v in opts.items():  # True: a flag without a value
            args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
        w = WorkerProcess(args, tmp_path / f"worker{len(started)}.log", url, q, name)
        started.append(w)
        if ready:
            w.wait_ready()
        return w

    yield start
    for w in started:
        w.stop()


class GatewayProcess:
    """``mlxq serve`` as a real process on a free port, with its log kept for failures."""

    def __init__(self, redis_url: str, log: Path, **opts: object) -> None:
        self.log, self.port = log, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--port", str(self.port), "--redis-url", redis_url]
        for k, v in opts.items():  # a list: the option once per value
            for one in v if isinstance(v, list) else [v]:
                args += [f"--{k.replace('_', '-')}", str(one)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("MLXQ_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxq.producer.cli", "serve", *args],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, timeout: float = 30) -> GatewayProcess:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as res:
                    if res.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"gateway not ready in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


GatewayFactory = Callable[..., GatewayProcess]


@pytest.fixture
def start_gateway(redis_server: RedisServer, tmp_path: Path) -> Iterator[GatewayFactory]:
    """Start real gateways: ``start_gateway(api_key="k", service_tier=["flex=q"])``."""
    started: list[GatewayProcess] = []

    def start(redis_url: str | None = None, **opts: object) -> GatewayProcess:
        g = GatewayProcess(
            redis_url or redis_server.url, tmp_path / f"gateway{len(started)}.log", **opts
        )
        started.append(g)
        return g.wait_ready()

    yield start
    for g in started:
        g.stop()
