"""The asyncio twin of :class:`~mlxq.producer.client.Client`, for async web backends.

Streams wait on ``redis.asyncio`` without blocking the event loop, through the same
follow protocol as the sync client (:mod:`mlxq.producer.stream`); the short calls
(submit, status, cancel) run the sync client's code in a thread, so both clients enqueue
exactly the same rq jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis

from mlxq.producer import keys
from mlxq.producer.client import SUBMIT_SLICE, Client
from mlxq.producer.codec import Chunk
from mlxq.producer.connection import TRANSIENT, backoff, connect_async
from mlxq.producer.connection import redis_url as resolve_url
from mlxq.producer.job import Job, end_of
from mlxq.producer.mux import RESYNC, AsyncSubscriber
from mlxq.producer.outcome import TERMINAL, job_status
from mlxq.producer.params import SubmitOptions, check_names
from mlxq.producer.result import Result, latest_fields
from mlxq.producer.stream import DONE, END, READ_LOG, STATUS, WAIT, Follow

if TYPE_CHECKING:
    from typing import Unpack


class AsyncJob:
    """A handle on one job; the methods of :class:`~mlxq.producer.job.Job` as coroutines."""

    def __init__(self, client: AsyncClient, job: Job) -> None:
        self._client = client
        self._job = job
        self.id = job.id

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def status(self) -> str:
        return await asyncio.to_thread(self._job.status)

    async def failure_reason(self) -> str:
        return await asyncio.to_thread(self._job.failure_reason)

    async def metadata(self) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._job.metadata)

    async def cancel(self) -> bool:
        return await asyncio.to_thread(self._job.cancel)

    async def retry(self) -> bool:
        """Requeue a failed or canceled job; see :meth:`Job.retry`."""
        return await asyncio.to_thread(self._job.retry)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """Async-iterate the job's chunks; see :meth:`Job.stream`."""
        follow = Follow(self.id, timeout)
        failures = 0
        while follow.next() != DONE:
            try:
                async for c in self._follow(follow):
                    yield c
                failures = 0
            except TRANSIENT:
                failures += 1
                await asyncio.sleep(min(backoff().compute(failures), follow.wait_s()))

    async def _follow(self, follow: Follow) -> AsyncIterator[Chunk]:
        r = self._client.aredis
        sub = await self._client.subscriber.subscribe(keys.channel(self.id))
        try:
            while (action := follow.next()) != DONE:
                if action == READ_LOG:
                    try:
                        entries = await r.xrange(keys.stream_key(self.id), min=f"0-{follow.after}")
                    except redis.ResponseError:  # not a stream (a rogue key): see its state
                        entries = []
                    out = follow.on_log(entries)
                elif action == WAIT:
                    data = await sub.get(follow.wait_s())
                    out = follow.on_message(None if data == RESYNC else data)
                elif action == STATUS:
                    raw = await r.hget(keys.job_key(self.id), "status")
                    out = follow.on_status(job_status(raw))
                elif action == END:
                    raw = await r.hget(keys.job_key(self.id), "status")
                    entries = await r.xrevrange(keys.results_key(self.id), count=1)
                    out = follow.on_end(*end_of(raw, latest_fields(entries)))
                for c in out:
                    yield c
        finally:
            await sub.close()

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the end and return the output; see :meth:`Job.result`."""
        if await self.status() not in TERMINAL:
            async for _ in self.stream(timeout=timeout):
                pass
        return await asyncio.to_thread(self._job.result, timeout)


class _Group:
    """Submits to one queue sent together, as a database commits a group: the first goes
    at once, and those that arrive while a round trip is under way go in the next one, as
    one script (how a gateway's burst of requests, each its own ``submit``, reaches the
    queue in a few round trips rather than one each, and the worker's batching window
    sees the burst whole). Each job is checked on its own and fails alone."""

    def __init__(self, client: Client, queue: str | None, loop: asyncio.AbstractEventLoop):
        self.client, self.queue, self.loop = client, queue, loop
        self.waiting: list[tuple[Mapping[str, Any], asyncio.Future[Job]]] = []
        self.sending: asyncio.Task[None] | None = None

    async def submit(self, kw: Mapping[str, Any]) -> Job:
        done: asyncio.Future[Job] = self.loop.create_future()
        self.waiting.append((kw, done))
        if self.sending is None:
            self.sending = self.loop.create_task(self._send())
        return await done

    async def _send(self) -> None:
        try:
            while self.waiting:  # a group at most one script's slice
                group, self.waiting = self.waiting[:SUBMIT_SLICE], self.waiting[SUBMIT_SLICE:]
                try:
                    got: list[Job | Exception] = await asyncio.to_thread(
                        self.client._submit_each, [kw for kw, _ in group], self.queue
                    )
                except Exception as e:  # the group's round trip failed: each job's error
                    got = [e] * len(group)
                for (_, done), outcome in zip(group, got, strict=True):
                    if done.done():  # its caller gave up waiting; the job is queued
                        continue
                    if isinstance(outcome, Exception):
                        done.set_exception(outcome)
                    else:
                        done.set_result(outcome)
        finally:
            self.sending = None


class AsyncClient:
    """Submit and follow jobs from asyncio code; arguments as for
    :class:`~mlxq.producer.client.Client`. Concurrent :meth:`submit` calls to one queue
    are sent together (each still checked and failed on its own)."""

    def __init__(self, redis_url: str | None = None, queue: str = "default", **kw: Any) -> None:
        url = resolve_url(redis_url)  # None: $MLXQ_REDIS_URL, else the default
        self._sync = Client(url, queue, **kw)
        self.aredis = connect_async(url)
        self.subscriber = AsyncSubscriber(self.aredis)
        self.queue_name = queue
        self._groups: dict[str | None, _Group] = {}  # by queue: submits sent together

    async def submit(
        self,
        prompt: str | None = None,
        *,
        queue: str | None = None,
        **options: Unpack[SubmitOptions],
    ) -> AsyncJob:
        """Queue one job; the arguments of :meth:`Client.submit`."""
        check_names(options, "AsyncClient.submit()")
        kw = {"prompt": prompt, **options}
        loop = asyncio.get_running_loop()
        group = self._groups.get(queue)
        if group is None or group.loop is not loop:
            group = self._groups[queue] = _Group(self._sync, queue, loop)
        return AsyncJob(self, await group.submit(kw))

    async def submit_many(
        self,
        jobs: Sequence[Mapping[str, Any]],
        *,
        job_ids: Sequence[str] | None = None,
        queue: str | None = None,
    ) -> list[AsyncJob]:
        """Queue many jobs in one pipelined round trip; see :meth:`Client.submit_many`."""
        made = await asyncio.to_thread(self._sync.submit_many, jobs, job_ids=job_ids, queue=queue)
        return [AsyncJob(self, j) for j in made]

    async def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, await asyncio.to_thread(self._sync.job, job_id))

    async def aclose(self) -> None:
        await self.subscriber.aclose()
        await self.aredis.aclose()
        self._sync.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
