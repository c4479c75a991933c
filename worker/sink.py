"""Everything the worker writes after a decode step, off the decode thread.

The decode loop hands each step's chunks and job endings to :class:`Sink`; one
thread writes them in order. Chunks of every row made since the last write go
in ONE pipelined round trip (XADD to the replay log + PUBLISH for liveness), so
Redis latency never stalls the model and the cost per step does not grow with
the batch. A job's end is committed to rq only after its last chunk is written,
so a listener that sees the last chunk finds the result.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.codec import Chunk, encode_chunk

log = logging.getLogger("mlxq.worker")

#: Replay logs outlive their job by this much; a late listener can still replay.
DEFAULT_STREAM_TTL = 3600
#: Most chunks one replay log keeps (a runaway job cannot fill Redis).
STREAM_MAXLEN = 100_000


@dataclass(frozen=True, slots=True)
class Out:
    """One chunk for one job's stream."""

    job_id: str
    chunk: Chunk


class Sink:
    """A writer thread: ``put`` chunks and endings in order, ``close`` to drain.

    Args:
        connection: Redis connection (thread-safe pool).
        stream_ttl: Seconds a job's replay log lives after its last write.
    """

    def __init__(self, connection: redis.Redis, *, stream_ttl: int = DEFAULT_STREAM_TTL) -> None:
        self.redis = connection
        self.stream_ttl = stream_ttl
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._actions_pending = 0
        self._thread = threading.Thread(target=self._run, name="mlxq-sink", daemon=True)
        self._thread.start()

    def put(self, outs: list[Out]) -> None:
        if outs:
            self._q.put(outs)

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the writer thread once everything put before it is written."""
        with self._lock:
            self._actions_pending += 1
        self._q.put(action)

    @property
    def actions_pending(self) -> int:
        """Actions handed over and not yet run (job ends not yet committed to rq)."""
        return self._actions_pending

    def close(self, timeout: float = 30.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            items = [self._q.get()]
            while True:  # coalesce whatever queued up while the last write ran
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            batch: list[Out] = []
            for item in items:
                if item is None:
                    self._write(batch)
                    return
                if callable(item):
                    self._write(batch)
                    batch = []
                    self._retry(item)
                    with self._lock:
                        self._actions_pending -= 1
                else:
                    batch.extend(item)
            self._write(batch)

    def _write(self, batch: list[Out]) -> None:
        if batch:
            self._retry(lambda: self._write_once(batch))

    def _write_once(self, batch: list[Out]) -> None:
        with self.redis.pipeline(transaction=False) as p:
            for o in batch:
                data = encode_chunk(o.chunk)
                stream = keys.stream_key(o.job_id)
                p.xadd(stream, {"c": data}, id=f"0-{o.chunk.seq}",
                       maxlen=STREAM_MAXLEN, approximate=True)
                p.publish(keys.channel(o.job_id), data)
                if o.chunk.seq == 1 or o.chunk.final or o.chunk.kind == "reset":
                    p.expire(stream, self.stream_ttl)
            for res in p.execute(raise_on_error=False):
                # A chunk already in the log (a retried write) is refused; that is fine.
                if isinstance(res, redis.ResponseError) and "equal or smaller" not in str(res):
                    log.warning("stream write refused: %s", res)

    def _retry(self, fn: Callable[[], None]) -> None:
        delay = 0.05
        while True:
            try:
                fn()
                return
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # Redis is restarting or unreachable: keep order, wait, try again.
                log.warning("redis unavailable (%s); retrying in %.2fs", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except Exception:
                log.exception("sink write failed")
                return
