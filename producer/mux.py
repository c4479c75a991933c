"""One pub/sub connection per client, shared by every stream it follows.

A :class:`Subscriber` (threads) or :class:`AsyncSubscriber` (asyncio) owns one Redis
pub/sub connection and routes each message to the subscriptions of its channel, so a
thousand concurrent streams cost one connection, not a thousand. Only its own reader
touches that connection (redis-py's pub/sub objects are not thread-safe): a stream asks
for a channel, the reader subscribes and confirms, and a subscription is handed out
only once Redis has confirmed it, so a stream reads its log only after it can no longer
miss a message. When the connection drops, every subscription gets :data:`RESYNC` (read
the log: messages may have been missed) and the reader subscribes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from typing import Any

import redis
import redis.asyncio as aioredis

from mlxq.producer import keys
from mlxq.producer.connection import TRANSIENT, Outage, backoff

log = logging.getLogger("mlxq.producer")

#: What a subscription yields when messages may have been lost (a reconnect).
RESYNC = b"mlxq:resync"
#: How long a new subscription waits for Redis to confirm it before going on anyway
#: (the stream then relies on reading its log, as during an outage).
CONFIRM_S = 5.0
#: Longest wait for the async reader to stop: a little more than one read timeout (1 s).
CLOSE_S = 2.0


def _wake_channel() -> str:
    return f"{keys.PREFIX}:mux:{uuid.uuid4().hex}"


class Subscription:
    """One stream's view of one channel: its messages, in order."""

    def __init__(self, owner: Subscriber, channel: str) -> None:
        self.owner, self.channel = owner, channel
        self.messages: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.ready = threading.Event()

    def get(self, timeout: float) -> bytes | None:
        """The next message's data, :data:`RESYNC`, or None after ``timeout`` seconds."""
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.owner.release(self)


class Subscriber:
    """The shared pub/sub connection of a sync client (a daemon thread reads it).

    Args:
        connection: The client's Redis (its pool gives the reader its connection).
    """

    def __init__(self, connection: redis.Redis) -> None:
        self.redis = connection
        self._subs: dict[str, set[Subscription]] = {}
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self._changed: set[str] = set()
        self._wake = _wake_channel()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nudged = False  # a wake is on its way to the reader
        self._outage = Outage(log, "stream subscriber")

    def subscribe(self, channel: str) -> Subscription:
        sub = Subscription(self, channel)
        with self._lock:
            self._subs.setdefault(channel, set()).add(sub)
            if channel in self._active:
                sub.ready.set()
            else:
                self._changed.add(channel)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mlxq-subscriber", daemon=True
                )
                self._thread.start()
        if not sub.ready.is_set():
            self._nudge()
            sub.ready.wait(CONFIRM_S)
        return sub

    def release(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.channel)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.channel]
                    self._changed.add(sub.channel)
        self._nudge()

    def close(self) -> None:
        self._stop.set()
        self._nudge(always=True)
        if self._thread is not None:
            self._thread.join(2)

    def _nudge(self, always: bool = False) -> None:
        # The reader blocks reading its connection; a message on its own channel wakes it.
        # One wake at a time: the reader takes every change made before it wakes (and
        # clears the flag as it takes them), so many threads subscribing at once cost one
        # PUBLISH.
        with self._lock:
            if self._nudged and not always:
                return
            self._nudged = True
        with contextlib.suppress(*TRANSIENT):
            self.redis.publish(self._wake, b"")

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            pubsub = self.redis.pubsub()
            try:
                pubsub.subscribe(self._wake)
                with self._lock:
                    self._changed = set(self._subs)  # (re)subscribe to everything wanted
                while not self._stop.is_set():
                    self._apply(pubsub)
                    msg = pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._dispatch(msg)
                    self._outage.ok()
                    failures = 0
            except TRANSIENT as e:
                if self._idle():
                    return
                self._outage.failed(e)
                self._lost()
                failures += 1
                self._stop.wait(backoff().compute(failures))
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def _idle(self) -> bool:
        """No stream wants the connection back: the reader ends, quietly (a client left
        open while its Redis goes away retries nothing), and the next subscribe starts
        another. Decided under the lock that subscribe takes, so no subscription is
        left without a reader."""
        with self._lock:
            if self._subs:
                return False
            self._thread = None
            self._active.clear()
            return True

    def _apply(self, pubsub: Any) -> None:
        with self._lock:
            changed, self._changed = self._changed, set()
            self._nudged = False
            want = {c for c in changed if c in self._subs}
            drop = {c for c in changed if c not in self._subs and c in self._active}
        if want:
            pubsub.subscribe(*want)
        if drop:
            pubsub.unsubscribe(*drop)
            with self._lock:
                self._active -= drop

    def _dispatch(self, msg: dict[str, Any]) -> None:
        channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
        if msg["type"] == "subscribe":
            with self._lock:
                self._active.add(channel)
                for sub in self._subs.get(channel, ()):
                    sub.ready.set()
        elif msg["type"] == "message" and channel != self._wake:
            with self._lock:
                subs = list(self._subs.get(channel, ()))
            for sub in subs:
                sub.messages.put(msg["data"])

    def _lost(self) -> None:
        with self._lock:
            self._active.clear()
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.messages.put(RESYNC)
            sub.ready.set()  # nobody waits on a confirmation that cannot come yet


class AsyncSubscription:
    def __init__(self, owner: AsyncSubscriber, channel: str) -> None:
        self.owner, self.channel = owner, channel
        self.messages: asyncio.Queue[bytes] = asyncio.Queue()
        self.ready = asyncio.Event()

    async def get(self, timeout: float) -> bytes | None:
        try:
            return await asyncio.wait_for(self.messages.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def close(self) -> None:
        await self.owner.release(self)


class AsyncSubscriber:
    """The shared pub/sub connection of an async client (one reader task)."""

    def __init__(self, connection: aioredis.Redis) -> None:
        self.redis = connection
        self._subs: dict[str, set[AsyncSubscription]] = {}
        self._active: set[str] = set()
        self._changed: set[str] = set()
        self._wake = _wake_channel()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._nudged = False  # a wake is on its way to the reader
        self._outage = Outage(log, "stream subscriber")

    async def subscribe(self, channel: str) -> AsyncSubscription:
        sub = AsyncSubscription(self, channel)
        self._subs.setdefault(channel, set()).add(sub)
        if channel in self._active:
            sub.ready.set()
            return sub
        self._changed.add(channel)
        if (self._task is None or self._task.done()) and not self._closed:
            self._task = asyncio.create_task(self._run())
        await self._nudge()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(sub.ready.wait(), CONFIRM_S)
        return sub

    async def release(self, sub: AsyncSubscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.channel]
                self._changed.add(sub.channel)
                await self._nudge()

    async def aclose(self) -> None:
        # The flag ends the reader within one read timeout even where the cancel is lost: a
        # cancel that lands inside redis-py's read can come out as a connection error, which
        # the reader would treat as an outage and retry for ever.
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_S)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as lost

    async def _nudge(self) -> None:
        # One wake at a time: the reader applies every change made before it wakes, so a
        # burst of subscriptions (a gateway's burst of streams) costs one PUBLISH, not one
        # each. The reader clears the flag as it takes the changes.
        if self._nudged:
            return
        self._nudged = True
        with contextlib.suppress(*TRANSIENT):
            await self.redis.publish(self._wake, b"")

    async def _run(self) -> None:
        failures = 0
        while not self._closed:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self._wake)
                self._changed = set(self._subs)
                while not self._closed:
                    self._nudged = False
                    await self._apply(pubsub)
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._dispatch(msg)
                    self._outage.ok()
                    failures = 0
            except TRANSIENT as e:
                if not self._subs:  # as the sync reader's _idle: end; subscribe starts another
                    self._active.clear()
                    if self._task is asyncio.current_task():
                        self._task = None
                    return
                self._outage.failed(e)
                self._active.clear()
                for group in self._subs.values():
                    for sub in group:
                        sub.messages.put_nowait(RESYNC)
                        sub.ready.set()
                failures += 1
                await asyncio.sleep(backoff().compute(failures))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _apply(self, pubsub: Any) -> None:
        changed, self._changed = self._changed, set()
        want = {c for c in changed if c in self._subs}
        drop = {c for c in changed if c not in self._subs and c in self._active}
        if want:
            await pubsub.subscribe(*want)
        if drop:
            await pubsub.unsubscribe(*drop)
            self._active -= drop

    def _dispatch(self, msg: dict[str, Any]) -> None:
        channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
        if msg["type"] == "subscribe":
            self._active.add(channel)
            for sub in self._subs.get(channel, ()):
                sub.ready.set()
        elif msg["type"] == "message" and channel != self._wake:
            for sub in self._subs.get(channel, ()):
                sub.messages.put_nowait(msg["data"])
