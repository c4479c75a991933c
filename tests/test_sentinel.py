"""A Sentinel-managed Redis: the one URL form, and every component working through it
(real primary, replicas and sentinels on loopback, a real worker, the official openai
client)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest
from opshelp import mlxq as mlxq_cli
from sentinel import SERVICE

from mlxq.producer import AsyncClient, Client
from mlxq.producer.connection import Outage, connect, connect_async, redact, retry_forever
from mlxq.producer.sentinel import Recheck, RedisURLError, SentinelURL, parse


def test_the_url_form_is_read_in_full():
    u = parse(
        "redis+sentinel://app:s%40cret@h1:26380,[::1]:26381,h3/main-queue/3?sentinel_password=sp"
    )
    assert u == SentinelURL(
        sentinels=(("h1", 26380), ("::1", 26381), ("h3", 26379)),
        service="main-queue",
        db=3,
        username="app",
        password="s@cret",
        sentinel_password="sp",
    )
    plain = parse("redis+sentinel://127.0.0.1:5000/mlxq")
    assert (plain.db, plain.username, plain.password) == (0, None, None)
    assert parse("redis+sentinel://:pw@h:1/s").password == "pw"
    assert parse("redis+sentinel://h:1/s?sentinel_username=su").sentinel_username == "su"


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("redis+sentinel://h:1", "service name"),
        ("redis+sentinel://h:1/", "service name"),
        ("redis+sentinel:///svc", "no sentinel host"),
        ("redis+sentinel://h:x/svc", "bad port 'x'"),
        ("redis+sentinel://h:1,:2/svc", "has no host"),
        ("redis+sentinel://h:1/svc/one", "db 'one'"),
        ("redis+sentinel://h:1/svc/0/extra", "more than service_name/db"),
        (
            "redis+sentinel://h:1/svc?sentinel_pasword=x",
            "unknown query parameter 'sentinel_pasword'",
        ),
    ],
)
def test_a_bad_url_names_its_bad_part(url, names):
    with pytest.raises(RedisURLError, match=names):
        parse(url)
    with pytest.raises(RedisURLError, match=names):
        connect(url)


def test_passwords_are_hidden_in_the_sentinel_form():
    shown = redact("redis+sentinel://app:secret@h1:1,h2:2/svc/0?sentinel_password=other")
    assert "secret" not in shown and "other" not in shown
    assert shown == "redis+sentinel://app:***@h1:1,h2:2/svc/0?sentinel_password=***"
    assert redact("redis+sentinel://h1:1/svc") == "redis+sentinel://h1:1/svc"


def test_every_command_says_a_bad_url_in_one_line(tiny_model):
    bad = "redis+sentinel://app:secret@h1:1/"
    runs = [["info"], ["submit", "hi"], ["worker", "--model", str(tiny_model)]]
    for args in runs:
        out = mlxq_cli(*args, url=bad, timeout=300)
        assert out.returncode == 2, (args, out.stderr)
        assert "service name" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "secret" not in out.stderr


def test_clients_follow_a_demoted_master_to_the_new_one(sentinel_redis):
    """A coordinated failover leaves the old master up as a replica: kept connections get
    READONLY. A client without retries fails once and its caller's retry_forever reaches
    the new master; the asyncio client's own per-command retry does it in one call."""
    client = connect(sentinel_redis.url, retries=0)
    old = sentinel_redis.master_port()

    async def run() -> int:
        aclient = connect_async(sentinel_redis.url)
        await aclient.set("ak", "before")
        client.set("k", "before")
        new = await asyncio.to_thread(sentinel_redis.failover)
        await aclient.set("ak", "after")
        await aclient.aclose()
        return new

    new = asyncio.run(run())
    assert new != old
    outage = Outage(logging.getLogger("test"), "test")
    retry_forever(lambda: client.set("k", "after"), outage)
    assert sentinel_redis.client(new).get("k") == b"after"
    assert sentinel_redis.client(new).get("ak") == b"after"


def test_clients_leave_a_master_replaced_while_it_stayed_up(sentinel_redis):
    """The sentinels name another master while the old one stays up and writable (a stall
    or a partition they saw, which its clients did not): no error tells a client, yet
    within a second both clients ask the sentinels again and write to the new master, not
    over their kept connections to the old one (whose writes would be lost when it is made
    a replica)."""
    old = sentinel_redis.master_port()
    new = next(p for p in sentinel_redis.data_ports if p != old)
    client = connect(sentinel_redis.url)

    async def run() -> None:
        aclient = connect_async(sentinel_redis.url)
        await aclient.set("ak", "before")
        client.set("k", "before")
        sentinel_redis.client(new).replicaof("NO", "ONE")
        for port in sentinel_redis.sentinel_ports:  # they now watch the new one alone
            s = sentinel_redis.client(port)
            s.sentinel_remove(SERVICE)
            s.sentinel_monitor(SERVICE, "127.0.0.1", new, 2)
        await asyncio.sleep(1.2)  # past the clients' one-second look at the sentinels
        await aclient.set("ak", "after")
        client.set("k", "after")
        await aclient.aclose()

    asyncio.run(run())
    assert sentinel_redis.client(old).info("replication")["role"] == "master"  # still up
    for key in ("k", "ak"):
        assert sentinel_redis.client(new).get(key) == b"after", key
        assert sentinel_redis.client(old).get(key) == b"before", key


def test_unanswered_sentinels_are_asked_less_and_less_often():
    """A client asks once a second; while no sentinel answers (each costs its timeout on
    the caller's command), half as often each time, down to once a minute."""
    r = Recheck()
    assert not r.due()  # a new pool has just asked, opening its first connection
    r.next_at = 0
    assert r.due() and not r.due()  # one asker at a time
    waits = []
    for _ in range(8):
        r.unanswered()
        waits.append(r.every)
    assert waits == [2, 4, 8, 16, 32, 60, 60, 60]
    r.answered()
    assert r.every == 1


def _cluster_node(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    # A cluster node also listens on port + 10000 (its bus): both must be free and valid.
    for port in random.sample(range(20000, 55000), 200):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
                break
            except OSError:
                continue
    exe = shutil.which("redis-server") or "redis-server"
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)]
    proc = subprocess.Popen([*args, "--cluster-enabled", "yes"], stdout=subprocess.DEVNULL)
    return proc, port


def test_the_worker_refuses_a_redis_cluster_in_one_line(tmp_path, tiny_model):
    proc, port = _cluster_node(tmp_path)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        client = connect(url)
        deadline = time.monotonic() + 30
        while not _pings(client):
            assert time.monotonic() < deadline, "the cluster-mode redis-server did not start"
            time.sleep(0.05)
        out = mlxq_cli("worker", "--model", str(tiny_model), "--queue", "q", url=url, timeout=300)
        assert out.returncode == 1, out.stderr
        assert "mlxq: Redis Cluster is not supported" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    finally:
        proc.kill()
        proc.wait()


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@pytest.mark.e2e
def test_client_and_async_client_through_sentinel(sentinel_redis, queue_name, start_worker):
    url = sentinel_redis.url
    start_worker(redis_url=url)
    client = Client(url, queue=queue_name)
    job = client.submit("The quick brown fox", max_tokens=12)
    chunks = list(job.stream(timeout=60))
    res = job.result(timeout=30)
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert "".join(c.text for c in chunks) == res.text and res.token_ids

    async def run_async() -> tuple[str, str]:
        aclient = AsyncClient(url, queue=queue_name)
        try:
            ajob = await aclient.submit("Once upon a time", max_tokens=12)
            text = "".join([c.text async for c in ajob.stream(timeout=60)])
            return text, (await ajob.result(timeout=30)).text
        finally:
            await aclient.aclose()

    streamed, final = asyncio.run(run_async())
    assert streamed == final


@pytest.mark.e2e
def test_cli_and_gateway_through_sentinel(sentinel_redis, queue_name, start_worker, start_gateway):
    url = sentinel_redis.url
    start_worker(redis_url=url)
    out = mlxq_cli("submit", "hi", "--queue", queue_name, "--max-tokens", "4", "--stream", url=url)
    assert out.returncode == 0, out.stderr
    info = mlxq_cli("info", "--json", url=url)
    assert info.returncode == 0, info.stderr
    assert queue_name in json.loads(info.stdout)["queues"]
    gw = start_gateway(redis_url=url)
    oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
    done = oai.completions.create(model=queue_name, prompt="Hello", max_tokens=5)
    assert done.choices[0].text and done.usage.completion_tokens > 0
    streamed = oai.completions.create(model=queue_name, prompt="Hi", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices)
