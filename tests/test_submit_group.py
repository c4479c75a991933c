"""Submits that arrive together (a gateway's burst): ``AsyncClient.submit`` sends them in
one round trip, and each job is still checked, capped and queued as if it came alone."""

from __future__ import annotations

import asyncio

import pytest
import redis
from rq import Queue
from rq.job import Job as RqJob

from mlxq.producer import AsyncClient, AsyncJob, QueueFull
from mlxq.producer.codec import MsgpackSerializer


def _scripts_run(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


async def _submit_all(ac: AsyncClient, kws: list[dict]) -> list[AsyncJob | BaseException]:
    return await asyncio.gather(*(ac.submit(**kw) for kw in kws), return_exceptions=True)


def test_a_burst_goes_in_one_round_trip_and_a_bad_job_fails_alone(persistent_redis, queue_name):
    r = redis.Redis.from_url(persistent_redis.url)
    kws: list[dict] = [dict(prompt=f"job {i}", max_tokens=4) for i in range(64)]
    kws[10] = dict(prompt="bad", max_tokens=0)
    kws[20] = dict(prompt="bad too", temperature="hot")

    async def burst() -> list[AsyncJob | BaseException]:
        async with AsyncClient(persistent_redis.url, queue=queue_name) as ac:
            await ac.submit("loads the script", max_tokens=1)
            r.config_resetstat()
            return await _submit_all(ac, kws)

    got = asyncio.run(burst())
    assert _scripts_run(r) == 1  # one each would be 62
    assert isinstance(got[10], ValueError) and "max_tokens=0" in str(got[10])
    assert isinstance(got[20], ValueError) and "temperature" in str(got[20])
    jobs = [g for i, g in enumerate(got) if i not in (10, 20)]
    assert all(isinstance(j, AsyncJob) for j in jobs)
    # Queued in the order asked (FIFO within a queue), each with its own request.
    queued = Queue(queue_name, connection=r).job_ids[1:]
    assert queued == [j.id for j in jobs]
    prompts = [
        RqJob.fetch(j, connection=r, serializer=MsgpackSerializer).args[0]["prompt"] for j in queued
    ]
    assert prompts == [kw["prompt"] for i, kw in enumerate(kws) if i not in (10, 20)]
    r.close()


def test_a_burst_past_a_slice_goes_in_a_script_a_slice(persistent_redis, queue_name):
    # A group is at most one script's slice (256 jobs): a replica's WAIT then answers for
    # exactly the jobs of that script.
    r = redis.Redis.from_url(persistent_redis.url)

    async def burst() -> list[AsyncJob | BaseException]:
        async with AsyncClient(persistent_redis.url, queue=queue_name) as ac:
            await ac.submit("loads the script", max_tokens=1)
            r.config_resetstat()
            return await _submit_all(ac, [dict(prompt=f"j{i}", max_tokens=1) for i in range(300)])

    got = asyncio.run(burst())
    assert all(isinstance(g, AsyncJob) for g in got)
    assert _scripts_run(r) == 2
    assert Queue(queue_name, connection=r).count == 301
    r.close()


def test_a_capped_queue_counts_a_burst_one_job_at_a_time(persistent_redis, queue_name):
    # A group of five refused whole by a cap of three would queue none; one by one, three.
    r = redis.Redis.from_url(persistent_redis.url)

    async def burst() -> list[AsyncJob | BaseException]:
        async with AsyncClient(persistent_redis.url, queue=queue_name, max_queued=3) as ac:
            return await _submit_all(ac, [dict(prompt=f"j{i}", max_tokens=1) for i in range(5)])

    got = asyncio.run(burst())
    assert [type(g) for g in got] == [AsyncJob] * 3 + [QueueFull] * 2
    assert "max_queued=3" in str(got[3])
    assert Queue(queue_name, connection=r).job_ids == [g.id for g in got[:3]]
    r.close()


def test_a_submit_given_up_on_still_leaves_the_others_answered(persistent_redis, queue_name):
    # A caller canceled while its group is on the way (a client that left): the rest of
    # the group get their jobs all the same.
    async def burst() -> tuple[list[AsyncJob | BaseException], int]:
        async with AsyncClient(persistent_redis.url, queue=queue_name) as ac:
            tasks = [asyncio.ensure_future(ac.submit(f"j{i}", max_tokens=1)) for i in range(8)]
            await asyncio.sleep(0)  # every submit has joined the group
            tasks[3].cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            return got, len(Queue(queue_name, connection=ac._sync.redis).job_ids)

    got, queued = asyncio.run(burst())
    assert isinstance(got[3], asyncio.CancelledError)
    assert all(isinstance(g, AsyncJob) for i, g in enumerate(got) if i != 3)
    assert queued == 8  # the canceled caller's job was on its way: queued, as a submit is


def test_an_unknown_option_is_a_type_error_before_anything_is_sent(persistent_redis, queue_name):
    async def one() -> None:
        async with AsyncClient(persistent_redis.url, queue=queue_name) as ac:
            await ac.submit("x", max_tokens=1, nope=1)  # type: ignore[call-arg]

    with pytest.raises(TypeError, match="nope"):
        asyncio.run(one())
    assert Queue(queue_name, connection=redis.Redis.from_url(persistent_redis.url)).count == 0
