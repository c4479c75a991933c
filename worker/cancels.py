"""Cancel requests for running jobs, heard as they are made.

Producers SADD the job id to the queue's cancel set (durable) and PUBLISH it
(prompt). This thread listens, reconnecting after Redis drops it, and re-reads
the set on every (re)connect so a request made while it was away is not lost.
"""

from __future__ import annotations

import logging
import threading

import redis
from rq.utils import as_text

from mlxq.producer import keys

log = logging.getLogger("mlxq.worker")


class CancelListener:
    """Collects cancel requests for one queue; :meth:`take` hands them over."""

    def __init__(self, connection: redis.Redis, queue: str) -> None:
        self.redis, self.queue = connection, queue
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxq-cancels", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def take(self) -> set[str]:
        with self._lock:
            ids, self._ids = self._ids, set()
        return ids

    def done(self, job_id: str) -> None:
        """The request was honoured (or the job is not ours to cancel): forget it."""
        self.redis.srem(keys.cancel_set(self.queue), job_id)

    def _add(self, ids: set[str]) -> None:
        with self._lock:
            self._ids |= ids

    def _run(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(keys.cancel_channel(self.queue))
                self._add({as_text(i) for i in self.redis.smembers(keys.cancel_set(self.queue))})
                delay = 0.05
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None:
                        self._add({as_text(msg["data"])})
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("cancel listener: redis unavailable (%s)", e)
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)
            finally:
                pubsub.close()
