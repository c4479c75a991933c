"""What a new user pastes first: the README's Python example, run as written against a
private Redis named only by ``$MLXQ_REDIS_URL`` and a worker on the tiny model; and
``Client()`` / ``AsyncClient()`` finding that Redis the same way."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import RedisServer, WorkerProcess, _free_port
from opshelp import env_for

from mlxq.producer import AsyncClient, Client

pytestmark = pytest.mark.e2e

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model) -> Iterator[str]:
    """A private Redis (nothing else's jobs, whatever answers on :6379) and a worker on its
    ``default`` queue, the README's; the Redis URL."""
    workdir = tmp_path_factory.mktemp("readme")
    server = RedisServer(workdir)
    args = ["--model", str(tiny_model), "--redis-url", server.url, "--queue", "default"]
    worker = WorkerProcess(args, workdir / "worker.log", server.url, "default")
    try:
        worker.wait_ready()
        yield server.url
    finally:
        assert worker.stop() == 0, worker.output()
        server.stop()


def test_the_python_example_runs_as_pasted(served, tmp_path):
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "Client(" in b]
    out = subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env_for(served),  # the URL only in the environment, as the README has it
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "What is MLX? ->" in out.stdout and "Why batch requests? ->" in out.stdout
    assert lines[-1] == "queued"  # the chat job: no worker serves "chat"
    conn = redis.Redis.from_url(served)
    assert conn.zcard("rq:canceled:chat") == 1 and conn.llen("rq:queue:chat") == 0


def test_client_and_async_client_read_the_url_from_the_environment(served, monkeypatch):
    monkeypatch.setenv("MLXQ_REDIS_URL", served)
    with Client() as client:
        res = client.submit("Hello", max_tokens=6).result(timeout=120)
    assert res.token_ids

    async def follow() -> tuple[str, str]:
        async with AsyncClient() as aclient:
            job = await aclient.submit("Hello", max_tokens=6)
            text = "".join([c.text async for c in job.stream(timeout=120)])
            return text, (await job.result(timeout=30)).text

    streamed, text = asyncio.run(follow())
    assert streamed == text == res.text  # greedy: the same job's same text
    # A URL given wins over the environment's.
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    with Client(dead) as client, pytest.raises(redis.ConnectionError):
        client.submit("x", max_tokens=1)
    monkeypatch.delenv("MLXQ_REDIS_URL")
    with Client() as client:
        assert client.redis.connection_pool.connection_kwargs["port"] == 6379
