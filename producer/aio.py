"""The asyncio twin of :class:`~mlxq.producer.client.Client`, for async web backends.

Streams wait on ``redis.asyncio`` without blocking the event loop; the short
calls (submit, status, cancel) run the sync client's code in a thread, so both
clients enqueue exactly the same rq jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from mlxq.producer import keys
from mlxq.producer.client import DEFAULT_REDIS_URL, TERMINAL, Client, Job, Result, StreamCursor
from mlxq.producer.codec import Chunk, decode_chunk, decode_entries


class AsyncJob:
    """A handle on one job; the methods of :class:`~mlxq.producer.client.Job` as coroutines."""

    def __init__(self, client: AsyncClient, job: Job) -> None:
        self._client = client
        self._job = job
        self.id = job.id

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def status(self) -> str:
        return await asyncio.to_thread(self._job.status)

    async def cancel(self) -> bool:
        return await asyncio.to_thread(self._job.cancel)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """Async-iterate the job's chunks; see :meth:`Job.stream`."""
        cur = StreamCursor(self.id, timeout)
        while not cur.done:
            try:
                async for c in self._follow(cur):
                    yield c
            except (redis.ConnectionError, redis.TimeoutError):
                # Redis restarted or dropped us: resume from the last seq seen.
                await asyncio.sleep(cur.backoff())

    async def _follow(self, cur: StreamCursor) -> AsyncIterator[Chunk]:
        pubsub = self._client.aredis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.channel(self.id))
            while not cur.done:
                for c in cur.accept_all(await self._replay(cur.last)):
                    yield c
                if cur.done:
                    return
                if await asyncio.to_thread(self._job.end_without_final, cur) is not None:
                    for c in cur.accept_all(await self._replay(cur.last)):
                        yield c
                    end = None if cur.done else await asyncio.to_thread(
                        self._job.end_without_final, cur)
                    for c in cur.accept_all([end] if end else []):
                        yield c
                    return
                while (msg := await pubsub.get_message(timeout=cur.wait())) is not None:
                    c = decode_chunk(msg["data"])
                    if c.seq > cur.last + 1:
                        break
                    for x in cur.accept_all([c]):
                        yield x
                    if cur.done:
                        return
        finally:
            await pubsub.aclose()

    async def _replay(self, after: int) -> list[Chunk]:
        return decode_entries(
            await self._client.aredis.xrange(keys.stream_key(self.id), min=f"0-{after + 1}"))

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the end and return the output; see :meth:`Job.result`."""
        if await self.status() not in TERMINAL:
            async for _ in self.stream(timeout=timeout):
                pass
        return await asyncio.to_thread(self._job.result, timeout)


class AsyncClient:
    """Submit and follow jobs from asyncio code; arguments as for
    :class:`~mlxq.producer.client.Client`."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = "default",
                 **kw: Any) -> None:
        self._sync = Client(redis_url, queue, **kw)
        self.aredis = aioredis.Redis.from_url(redis_url)
        self.queue_name = queue

    async def submit(self, prompt: str | None = None, **kw: Any) -> AsyncJob:
        """Queue one job; the arguments of :meth:`Client.submit`."""
        job = await asyncio.to_thread(self._sync.submit, prompt, **kw)
        return AsyncJob(self, job)

    async def submit_many(self, jobs: Sequence[Mapping[str, Any]]) -> list[AsyncJob]:
        """Queue many jobs in one pipelined round trip; see :meth:`Client.submit_many`."""
        return [AsyncJob(self, j) for j in await asyncio.to_thread(self._sync.submit_many, jobs)]

    async def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, await asyncio.to_thread(self._sync.job, job_id))

    async def aclose(self) -> None:
        await self.aredis.aclose()
        self._sync.close()
