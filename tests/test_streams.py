"""Many streams on one client: one pub/sub connection for all, every chunk exactly once."""

from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from mlxq.producer import AsyncClient, Client
from mlxq.producer.connection import connect

pytestmark = pytest.mark.e2e

N = 300


def _settled(r: redis.Redis, worker) -> None:
    """Once the worker's own cancel listener is subscribed."""
    import time

    from mlxq.producer import keys

    deadline = time.monotonic() + 10
    while not r.pubsub_numsub(keys.cancel_channel(worker.name))[0][1]:
        assert time.monotonic() < deadline, "the worker's cancel listener never subscribed"
        time.sleep(0.02)


def _pubsub_clients(r: redis.Redis, name: str) -> int:
    """Pub/sub connections of the client named ``name`` (its URL's ``client_name``): only
    the client under test is counted, whatever other subscribers come and go on this Redis."""
    return sum(
        1
        for c in r.client_list()
        if c.get("name") == name and (int(c.get("sub", 0)) or int(c.get("psub", 0)))
    )


def test_hundreds_of_threads_stream_through_one_pubsub_connection(
    redis_server, queue_name, start_worker, r
):
    worker = start_worker(max_batch=64, window_ms=50)
    r = connect(redis_server.url)  # 300 threads count connections through it: a blocking pool
    _settled(r, worker)
    client = Client(f"{redis_server.url}?client_name=streams-sync", queue=queue_name)
    jobs = client.submit_many(
        [dict(prompt=f"stream {i}", max_tokens=6, temperature=1.0, seed=i) for i in range(N)]
    )
    peak = [0]

    def follow(i: int) -> str:
        text = "".join(c.text for c in jobs[i].stream(timeout=120))
        peak[0] = max(peak[0], _pubsub_clients(r, "streams-sync"))
        return text

    with ThreadPoolExecutor(N) as pool:
        texts = list(pool.map(follow, range(N)))
    assert texts == [j.result(timeout=10).text for j in jobs]
    assert peak[0] == 1, "all of this client's streams shared one connection"
    client.close()


def test_threads_that_stream_first_at_once_make_one_subscriber(redis_server, queue_name):
    """The first streams of a client, in many threads at once, share one subscriber (one
    pub/sub connection, one reader thread): none makes a second that nothing closes."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race, if any
    try:
        for _ in range(20):
            client = Client(redis_server.url, queue=queue_name)
            start = threading.Barrier(32)
            seen: set[int] = set()

            def first(client: Client, start: threading.Barrier, seen: set[int]) -> None:
                start.wait()
                seen.add(id(client.subscriber))

            threads = [
                threading.Thread(target=first, args=(client, start, seen)) for _ in range(32)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            client.close()
            assert len(seen) == 1, f"{len(seen)} subscribers for one client"
    finally:
        sys.setswitchinterval(interval)


def test_hundreds_of_async_streams_through_one_pubsub_connection(
    redis_server, queue_name, start_worker, r
):
    worker = start_worker(max_batch=64, window_ms=50)
    _settled(r, worker)

    async def go() -> tuple[list[str], list[str], int]:
        client = AsyncClient(f"{redis_server.url}?client_name=streams-async", queue=queue_name)
        jobs = await client.submit_many(
            [dict(prompt=f"async {i}", max_tokens=6, temperature=1.0, seed=i) for i in range(N)]
        )

        peak = 0

        async def follow(job) -> str:
            nonlocal peak
            text = "".join([c.text async for c in job.stream(timeout=120)])
            peak = max(peak, _pubsub_clients(r, "streams-async"))
            return text

        texts = await asyncio.gather(*map(follow, jobs))
        results = [(await j.result(timeout=10)).text for j in jobs]
        await client.aclose()
        return list(texts), results, peak

    texts, results, peak = asyncio.run(go())
    assert texts == results
    assert peak == 1


def test_client_settings_are_checked_by_name():
    for kw, field in (
        (dict(result_ttl=-1), "result_ttl=-1"),
        (dict(result_ttl=0), "result_ttl=0"),
        (dict(failure_ttl=10**12), "failure_ttl"),
        (dict(max_queued=-1), "max_queued"),
    ):
        with pytest.raises(ValueError, match=field):
            Client("redis://127.0.0.1:1/0", **kw)


def test_metadata_nested_past_any_limit_is_refused_by_name(redis_server, queue_name):
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    with pytest.raises(ValueError, match="metadata"):
        Client(redis_server.url, queue=queue_name).submit("x", metadata=deep)


def test_an_idle_client_lets_a_redis_outage_pass_quietly(
    persistent_redis, queue_name, start_worker, caplog
):
    """A client whose streams have all ended keeps no reader retrying a Redis that went
    away (nothing is logged), and streams again once Redis is back; the same for the
    async client."""
    import logging
    import time

    start_worker(redis_url=persistent_redis.url)
    client = Client(persistent_redis.url, queue=queue_name)
    aclient = AsyncClient(persistent_redis.url, queue=queue_name)

    def streamed(prompt: str) -> None:
        job = client.submit(prompt, max_tokens=4)
        assert "".join(c.text for c in job.stream(timeout=60)) == job.result(timeout=60).text

    async def astreamed(prompt: str) -> None:
        job = await aclient.submit(prompt, max_tokens=4)
        text = "".join([c.text async for c in job.stream(timeout=60)])
        assert text == (await job.result(timeout=60)).text

    loop = asyncio.new_event_loop()
    try:
        streamed("before the outage")
        loop.run_until_complete(astreamed("before the outage, async"))
        with caplog.at_level(logging.WARNING, logger="mlxq.producer"):
            persistent_redis.stop()
            deadline = time.monotonic() + 15
            while client.subscriber._thread is not None and time.monotonic() < deadline:
                loop.run_until_complete(asyncio.sleep(0.1))  # the async reader runs too
            assert client.subscriber._thread is None, "the idle reader ended"
            assert aclient.subscriber._task is None, "the idle async reader ended"
            assert not [r for r in caplog.records if "subscriber" in r.getMessage()]
        persistent_redis.start()
        streamed("after the outage")
        loop.run_until_complete(astreamed("after the outage, async"))
    finally:
        client.close()
        loop.run_until_complete(aclient.aclose())
        loop.close()


def test_a_burst_of_async_subscriptions_wakes_the_reader_once(tmp_path):
    """A gateway's burst of streams subscribes all at once: one PUBLISH wakes the shared
    reader, which takes every subscription it finds (each then gets its messages)."""
    from conftest import RedisServer

    server = RedisServer(tmp_path)  # its own: no other client publishes there
    try:
        r = redis.Redis(port=server.port)

        async def run() -> tuple[int, list[bytes | None]]:
            client = AsyncClient(server.url, queue="q")
            try:
                channels = [f"burst-{i}" for i in range(50)]
                r.config_resetstat()
                subs = await asyncio.gather(*(client.subscriber.subscribe(c) for c in channels))
                wakes = int(r.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))
                for c in channels:
                    r.publish(c, c.encode())
                got = [await s.get(10) for s in subs]
                for s in subs:
                    await s.close()
                return wakes, got
            finally:
                await client.aclose()

        wakes, got = asyncio.run(run())
        assert got == [f"burst-{i}".encode() for i in range(50)]
        assert wakes == 1
    finally:
        server.stop()
