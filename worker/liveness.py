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
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from mlxq.producer.connection import TRANSIENT
from mlxq.worker.bridge import Bridge
from mlxq.worker.held import Held
from mlxq.worker.logs import THROTTLE
from mlxq.worker.messages import CancelRequested, Inbox, Reaped, Suspended
from mlxq.worker.naming import process_gone
from mlxq.worker.resync import MasterWatch, after_failover
from mlxq.worker.stats import WorkerStats
from mlxq.worker.threads import Helper

log = logging.getLogger("mlxq.worker")

BEAT_S = 1.0
STATS_S = 1.0
CANCEL_CHECK_S = 2.0
REFRESH_S = 60.0
RQ_HEARTBEAT_S = 15.0
#: How often rq's registries are swept of expired entries.
SWEEP_S = 60.0


class Liveness(Helper):
    """The heartbeat thread of one worker.

    Args:
        bridge: The worker's Redis.
        inbox: The decode loop's inbox, for :class:`~mlxq.worker.messages.Reaped`,
            :class:`~mlxq.worker.messages.CancelRequested` and
            :class:`~mlxq.worker.messages.Suspended`.
        stats: The worker's stats now, for ``mlxq info``.
        held: The jobs the worker holds.
        on_renewed: Called when the lease had lapsed and was taken again.
        on_suspend: Called with True when ``rq suspend`` is seen, False at ``rq resume``,
            before the loop hears of it.
    """

    def __init__(
        self,
        bridge: Bridge,
        inbox: Inbox,
        stats: Callable[[], WorkerStats],
        held: Held,
        on_renewed: Callable[[], None] = lambda: None,
        on_suspend: Callable[[bool], None] = lambda _: None,
    ) -> None:
        super().__init__("mlxq-liveness", "heartbeat", join_s=5)
        self.bridge, self.inbox, self.stats, self.held = bridge, inbox, stats, held
        self.on_renewed = on_renewed
        self.on_suspend = on_suspend
        self.suspended = False
        self.reaped_jobs = 0
        self._poke = threading.Event()
        self._reported_epoch = -1
        self._next: dict[str, float] = {}
        self.master = MasterWatch()

    def poke(self) -> None:
        """Beat now (a write was refused for the lease)."""
        self._poke.set()

    def _wake(self) -> None:
        self._poke.set()

    def _due(self, what: str, every: float) -> bool:
        now = time.monotonic()
        if now < self._next.get(what, 0.0):
            return False
        self._next[what] = now + every
        return True

    def _turn(self) -> None:
        """One beat: every step, then a pause until the next (a Redis outage cuts the
        steps short; the pause stays a beat, so the lease is kept as soon as it can be)."""
        for step in (
            self._beat,
            self._watch_master,
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
            except TRANSIENT:
                raise
            except Exception:  # this thread must outlive whatever one step hits
                log.exception("heartbeat: %s failed; going on", step.__name__)
        self._rest()

    def _on_outage(self) -> None:
        self._rest()

    def _rest(self) -> None:
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
            self.inbox.put(Reaped(self.bridge.epoch))
        elif verdict == "renewed":
            # The lease had lapsed: a long stall, or a Redis that restarted without its
            # data (the logs of running jobs went with it and must get their TTL again).
            self.on_renewed()
            if self._next:
                THROTTLE.warning(
                    "lease lapsed",
                    "worker %s: lease had lapsed or was unreadable (a stall, Redis restarted, "
                    "or a rogue write); nobody took its jobs",
                    self.bridge.name,
                )

    def _watch_master(self) -> None:
        # After a failover the new master may lack the old one's last writes.
        check = self.master.begin()
        if self.master.changed(self.bridge.redis):
            after_failover(self.bridge, self.held, self.inbox)
        self.master.done(check)

    def master_checked(self, timeout: float) -> bool:
        """Whether the master was checked (and resynced, if it changed) after this call,
        within ``timeout`` seconds: what the writer waits for after an outage."""
        return self.master.wait_fresh(timeout, self.poke)

    def _check_suspended(self) -> None:
        suspended = self.bridge.suspended()
        if suspended != self.suspended:
            self.suspended = suspended
            self.on_suspend(suspended)
            self.inbox.put(Suspended(suspended))

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
            stats = replace(self.stats(), jobs_requeued_from_dead_workers=self.reaped_jobs)
            self.bridge.write_stats(stats.state, stats.as_record())
            self.bridge.set_state(stats.state)

    def _check_cancels(self) -> None:
        if self._due("cancels", CANCEL_CHECK_S):
            held = self.held.ids()
            if held and (flagged := self.bridge.cancel_flags(held)):
                self.inbox.put(CancelRequested(tuple(flagged)))

    def _refresh(self) -> None:
        if self._due("rq", RQ_HEARTBEAT_S):
            self.bridge.rq_heartbeat()
        if self._due("refresh", REFRESH_S):
            self.bridge.refresh(self.held.running())

    def _sweep(self) -> None:
        if self._due("sweep", SWEEP_S):
            self.bridge.sweep()
