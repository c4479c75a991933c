"""Heartbeats and the reaper: a dead worker's jobs run again within seconds.

A thread of its own, so a long MLX step never delays a heartbeat: every
``BEAT_S`` it refreshes ``mlxq:alive:<name>`` (expiring after ``DEAD_AFTER_S``)
and looks over the queue's roll of workers. A worker whose key expired, or whose
process is gone from this host, is dead: one live worker takes its reap lock and
requeues everything in its WIP list (at the queue's front, in order). So after
a ``kill -9`` the jobs run again within ``DEAD_AFTER_S`` (5 s) on another worker,
or at once when a worker restarts on the same host -- far under rq's own
abandoned-job timeouts (420 s and more).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis
from rq import Queue
from rq.utils import as_text

from mlxq.producer import keys
from mlxq.worker.rqbridge import requeue_orphans

log = logging.getLogger("mlxq.worker")

BEAT_S = 1.0
DEAD_AFTER_S = 5.0
#: How often rq's registries are swept of expired entries.
SWEEP_S = 60.0
#: How long one reaper may hold a dead worker's lock before another may try.
REAP_LOCK_S = 60


def _process_gone(value: str) -> bool:
    """True when ``host:pid`` names a process of this host that no longer exists."""
    host, _, pid = value.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Liveness:
    """Heartbeat + reaper thread for one worker.

    Args:
        connection: Redis connection.
        queue: The rq queue served.
        name: This worker's name.
        on_reaped: Called (from this thread) if another worker declared this one
            dead, e.g. after a network partition longer than ``DEAD_AFTER_S``:
            its jobs were requeued, so it must drop them.
    """

    def __init__(self, connection: redis.Redis, queue: Queue, name: str,
                 on_reaped: Callable[[], None], sweep: Callable[[], None]) -> None:
        self.redis, self.queue, self.name, self.on_reaped = connection, queue, name, on_reaped
        self.value = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxq-liveness", daemon=True)
        self.reaped_jobs = 0
        self.sweep = sweep
        self._next_sweep = 0.0

    def start(self) -> None:
        self.beat()
        self.redis.sadd(keys.workers_key(self.queue.name), self.name)
        self._thread.start()

    def stop(self, leave: bool = True) -> None:
        """Stop beating. ``leave``: also leave the roll (the worker holds no job);
        otherwise stay on it, dead, for a live worker to requeue what it held."""
        self._stop.set()
        self._thread.join(5)
        with self.redis.pipeline() as p:
            if leave:
                p.srem(keys.workers_key(self.queue.name), self.name)
            p.delete(keys.alive_key(self.name))
            p.execute()

    def beat(self) -> None:
        self.redis.set(keys.alive_key(self.name), self.value, px=int(DEAD_AFTER_S * 1000))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
                if not self.redis.sismember(keys.workers_key(self.queue.name), self.name):
                    log.error("worker %s was declared dead and its jobs requeued", self.name)
                    self.on_reaped()
                    self.redis.sadd(keys.workers_key(self.queue.name), self.name)
                self.reap()
                if time.monotonic() >= self._next_sweep:
                    self._next_sweep = time.monotonic() + SWEEP_S
                    self.sweep()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("heartbeat: redis unavailable (%s)", e)
            except Exception:
                log.exception("heartbeat failed")
            self._stop.wait(BEAT_S)

    def reap(self) -> list[str]:
        """Requeue the jobs of every dead worker on this queue's roll."""
        requeued = []
        roll = self.redis.smembers(keys.workers_key(self.queue.name))
        for other in sorted(as_text(n) for n in roll):
            if other == self.name:
                continue
            value = self.redis.get(keys.alive_key(other))
            if value is not None and not _process_gone(as_text(value)):
                continue
            if not self.redis.set(keys.reap_lock(other), self.name, nx=True, ex=REAP_LOCK_S):
                continue
            ids = requeue_orphans(self.redis, self.queue, other)
            with self.redis.pipeline() as p:
                p.srem(keys.workers_key(self.queue.name), other)
                p.delete(keys.alive_key(other), keys.reap_lock(other))
                p.execute()
            if ids:
                log.warning("worker %s is dead: requeued its %d job(s)", other, len(ids))
            self.reaped_jobs += len(ids)
            requeued += ids
        return requeued
