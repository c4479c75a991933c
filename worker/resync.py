"""After a failover: make the new master agree with what this live worker holds.

Redis replicates asynchronously, so the replica Sentinel promotes may lack the old master's
last writes: a claim or start (the job is queued again there), an end (the job is started
there, in this worker's WIP list, though the worker let it go), the tail of a replay log.
The heartbeat notices the change (the master's ``run_id`` is another one) and, in one
script (``resync.lua``): keeps or claims again every job the worker runs, under a new
attempt, so each stream starts a new run (listeners get a reset, then the full text: no
gap, no duplicate, whatever the log lost); puts their WIP entries back; and finds the
strays (started by this worker, not held: their end was lost), which go back to the
queue's front once the worker checked it still does not hold them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import redis

from mlxq.producer.scripts import call as run_call
from mlxq.worker.bridge import Bridge
from mlxq.worker.commit import release
from mlxq.worker.held import Held
from mlxq.worker.messages import Inbox, MasterChanged
from mlxq.worker.scripts import Now, resync
from mlxq.worker.writes import ReleaseMode

log = logging.getLogger("mlxq.worker")


class MasterWatch:
    """Tells when the master this worker writes to is another server than before, and
    lets a writer back from an outage wait for a check that began after it came back (so
    a new master is resynced before anything more is written to it)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.refused = False
        self._checks = threading.Condition()
        self._begun = 0  # checks begun
        self._done = 0  # the last check done, what a change called for included

    def begin(self) -> int:
        """A check begins; its number, for :meth:`done`."""
        with self._checks:
            self._begun += 1
            return self._begun

    def done(self, check: int) -> None:
        """Check ``check`` is done, and the resync a change called for with it."""
        with self._checks:
            self._done = max(self._done, check)
            self._checks.notify_all()

    def wait_fresh(self, timeout: float, poke: Callable[[], None]) -> bool:
        """Wait until a check that begins after this call is done (``poke`` asks for it
        now); False if none is within ``timeout`` seconds (Redis still away)."""
        with self._checks:
            want = self._begun + 1  # one begun before now may have read the old master
            poke()
            return self._checks.wait_for(lambda: self._done >= want, timeout)

    def changed(self, client: redis.Redis) -> bool:
        # Ask the sentinels too (a Sentinel pool only): a master they replaced while it
        # stayed up (a failover on a stall) answers as one until it is converted, and its
        # connections would keep taking writes the new master never sees.
        ask = getattr(client.connection_pool, "get_master_address", None)
        if ask is not None:
            with contextlib.suppress(redis.ConnectionError):
                ask()  # a new address: the pool drops its connections to the old one
        if self.refused:
            return False
        try:
            run_id = str(client.info("server").get("run_id", ""))
        except redis.ResponseError as e:  # INFO refused (an ACL): no watch, said once
            log.warning("cannot read the Redis master's run_id (%s): failovers go unseen", e)
            self.refused = True
            return False
        before, self.run_id = self.run_id, run_id
        return before is not None and run_id != before


def after_failover(bridge: Bridge, held: Held, inbox: Inbox) -> None:
    """Resync the new master with the jobs held, then tell the decode loop which runs go
    on under a new attempt and which are lost (it drops those)."""
    # A running job goes on under the next attempt; one ending keeps its own (its end,
    # already built, is being committed: claimed again if need be, it lands once).
    held_now = [h for h in held.attempts() if h[1]]
    runs = [(i, ex, attempt + 1 if running else attempt) for i, ex, attempt, running in held_now]
    verdicts, strays = run_call(bridge.redis, resync(bridge.k, bridge.token, Now.read(), runs))
    both = list(zip(runs, verdicts, [h[3] for h in held_now], strict=True))
    kept = tuple(r for r, v, running in both if v != "lost" and running)
    lost = tuple(r[:2] for r, v, running in both if v == "lost" and running)
    reclaimed = verdicts.count("reclaimed")
    give_back = [i for i in strays if not held.holds(i)]
    if give_back:
        now = Now.read()
        run_call(bridge.redis, release(bridge.k, bridge.token, now, ReleaseMode.CLEAN, give_back))
    log.warning(
        "redis master changed (a failover, or a restart): %d running job(s) go on under a "
        "new attempt, "
        "%d recorded as started again (the new master lacked their start), %d lost to "
        "another worker, %d whose end was lost requeued",
        len(kept),
        reclaimed,
        len(lost),
        len(give_back),
    )
    inbox.put(MasterChanged(kept, lost))
