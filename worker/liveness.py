"""Heartbeat, lease and reaper: a dead worker's jobs run again within seconds.

A thread of its own, so a long MLX step never delays a heartbeat. Every ``BEAT_S`` it
keeps this worker's lease (``mlxq:alive:<name>``, expiring after ``LEASE_MS``), learns
when it lost it (another worker declared it dead: the decode loop must drop everything),
and reaps the other workers on the queue's roll whose lease expired or whose process is
gone from this host: their jobs go back to the queue's front, in order, within ~5 s of a
``kill -9`` (at once when the dead worker's host restarts a worker), far under rq's own
abandoned-job timeouts. It also publishes the worker's stats for ``mlxq info``, keeps rq's
records of long jobs fresh, checks held jobs for cancel requests a message missed, and
watches rq's suspend key (``rq suspend`` / ``rq resume``).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from mlxq.producer.connection import TRANSIENT, Outage
from mlxq.worker.bridge import Bridge

log = logging.getLogger("mlxq.worker")

BEAT_S = 1.0
STATS_S = 1.0
CANCEL_CHECK_S = 2.0
REFRESH_S = 60.0
RQ_HEARTBEAT_S = 15.0
#: How often rq's registries are swept of expired entries.
SWEEP_S = 60.0


def process_gone(value: str) -> bool:
    """True when a lease value ``host:pid:nonce`` names a process of this host that no
    longer exists."""
    host, _, rest = value.partition(":")
    pid = rest.partition(":")[0]
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
    """The heartbeat thread of one worker.

    Args:
        bridge: The worker's Redis.
        inbox: The decode loop's inbox: ``("reaped", None)`` and ``("cancel", ids)``.
        stats: Returns ``(state, stats map)`` for ``mlxq info``.
        held: Returns ``(held job ids, (id, execution id) of running jobs)``.
        on_renewed: Called when the lease had lapsed and was taken again.
        on_suspend: Called with True when ``rq suspend`` is seen, False at ``rq resume``.
    """

    def __init__(
        self,
        bridge: Bridge,
        inbox: queue.SimpleQueue[tuple[str, Any]],
        stats: Callable[[], tuple[str, dict[str, Any]]],
        held: Callable[[], tuple[list[str], list[tuple[str, str]]]],
        on_renewed: Callable[[], None] = lambda: None,
        on_suspend: Callable[[bool], None] | None = None,
    ) -> None:
        self.bridge, self.inbox, self.stats, self.held = bridge, inbox, stats, held
        self.on_renewed = on_renewed
        self.on_suspend = on_suspend
        self.suspended = False
        self.reaped_jobs = 0
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._reported_epoch = -1
        self._next: dict[str, float] = {}
        self._outage = Outage(log, "heartbeat")
        self._thread = threading.Thread(target=self._run, name="mlxq-liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        self._thread.join(5)

    def poke(self) -> None:
        """Beat now (a write was refused for the lease)."""
        self._poke.set()

    def _due(self, what: str, every: float) -> bool:
        now = time.monotonic()
        if now < self._next.get(what, 0.0):
            return False
        self._next[what] = now + every
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            for step in (
                self._beat,
                self._check_suspended,
                self._reap,
                self._publish,
                self._check_cancels,
                self._refresh,
                self._sweep,
            ):
                try:
                    step()
                    self._outage.ok()
                except TRANSIENT as e:
                    self._outage.failed(e)
                    break
                except Exception:  # this thread must outlive whatever one step hits
                    log.exception("heartbeat: %s failed; going on", step.__name__)
            self._poke.wait(BEAT_S)
            self._poke.clear()

    def _beat(self) -> None:
        verdict = self.bridge.beat()
        if verdict == "reaped" and self._reported_epoch != self.bridge.epoch:
            log.error(
                "worker %s was declared dead and its jobs requeued: dropping everything it held",
                self.bridge.name,
            )
            self._reported_epoch = self.bridge.epoch
            self.inbox.put(("reaped", self.bridge.epoch))
        elif verdict == "renewed":
            # The lease had lapsed: a long stall, or a Redis that restarted without its
            # data (the logs of running jobs went with it and must get their TTL again).
            self.on_renewed()
            if self._next:
                log.warning(
                    "worker %s: lease had lapsed (a stall, or Redis restarted); nobody took "
                    "its jobs",
                    self.bridge.name,
                )

    def _check_suspended(self) -> None:
        suspended = self.bridge.suspended()
        if suspended != self.suspended and self.on_suspend is not None:
            self.suspended = suspended
            self.on_suspend(suspended)

    def _reap(self) -> None:
        for other, value in self.bridge.roll():
            if other == self.bridge.name or (value is not None and not process_gone(value)):
                continue
            try:
                ids = self.bridge.reap(other, value)
            except TRANSIENT:
                raise
            except Exception:  # one dead worker's rogue entry never spares the others
                log.exception("heartbeat: reaping worker %s failed; going on", other)
                continue
            if ids is None:
                continue
            self.reaped_jobs += len(ids)
            if ids:
                log.warning("worker %s is dead: requeued its %d job(s)", other, len(ids))

    def _publish(self) -> None:
        if self._due("stats", STATS_S):
            state, stats = self.stats()
            stats["jobs_requeued_from_dead_workers"] = self.reaped_jobs
            self.bridge.write_stats(state, stats)
            self.bridge.set_state(state)

    def _check_cancels(self) -> None:
        if self._due("cancels", CANCEL_CHECK_S):
            held, _ = self.held()
            if held and (flagged := self.bridge.cancel_flags(held)):
                self.inbox.put(("cancel", flagged))

    def _refresh(self) -> None:
        if self._due("rq", RQ_HEARTBEAT_S):
            self.bridge.rq_heartbeat()
        if self._due("refresh", REFRESH_S):
            _, running = self.held()
            self.bridge.refresh(running)

    def _sweep(self) -> None:
        if self._due("sweep", SWEEP_S):
            self.bridge.sweep()
