"""The worker's own Redis: its lease, its queue and WIP list, the roll it reaps, rq's records.

rq's own worker runs one job at a time through Python methods that cost several round
trips each; mlxq's holds a whole batch, so it writes the very keys rq's methods write
(the job hash, StartedJobRegistry and executions, the result log, the finished / failed /
canceled registries, the worker's counters) from Lua scripts, many jobs per call, and
``rq info``, ``Job.get_status()`` and ``job.return_value()`` stay true. This module holds
the lease and the moving of jobs (claims, the heartbeat, reaps); the writer's side is
:mod:`mlxq.worker.commit`, the chat hand-off :mod:`mlxq.worker.routing`, the scripts'
wrappers :mod:`mlxq.worker.scripts`.

Fencing: every script first checks the worker's lease (``mlxq:alive:<name>`` holding this
worker's token). A worker that was frozen past its lease, or declared dead and reaped,
has every write refused until it has learned what it still owns (nothing, if reaped).
Each job's start and end also check that the job is still this worker's.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from rq import Queue
from rq.worker import SimpleWorker

from mlxq.producer import keys, scripts
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.connection import connect
from mlxq.worker import rq_compat
from mlxq.worker import scripts as lua
from mlxq.worker.config import WorkerConfig
from mlxq.worker.scripts import Claimed, Now, WorkerKeys, text

log = logging.getLogger("mlxq.worker")

#: Lease length; a worker not heard from for this long may be reaped.
LEASE_MS = 5000
#: How long rq's StartedJobRegistry entries and executions of running jobs last between
#: refreshes (``refresh`` runs far more often): rq's maintenance never calls a job of a
#: live mlxq worker abandoned.
STARTED_TTL = 3600
#: How long a reaped worker's marker lives (it tells that worker, should it wake).
REAPED_TTL = 24 * 3600
STATS_TTL = 60
#: The longest a blocking wait for a job holds a connection: well under the lease, so a job
#: Redis hands a worker that froze meanwhile lands before that worker can be reaped.
BLOCK_S = 1.0
#: A job handed to this worker and not claimed within this long (it stayed full) goes
#: back to the queue at its next heartbeat, for any worker: nothing waits on a busy one.
HAND_GRACE_MS = 500
#: Serving several queues, an idle worker blocks on its first level's queue this long at a
#: time and looks at the others in between: Redis can block one move on one list only
#: (BLMPOP takes several, but its pop and the push to the WIP list are not one step, so a
#: worker killed between them would lose the job).
POLL_S = 0.05


def _wrong_type(e: redis.ResponseError) -> bool:
    """Whether Redis refused a command for a key of another type (a rogue write)."""
    return str(e).startswith("WRONGTYPE")


class Bridge:
    """One worker's Redis: its queues, its WIP list, its lease, rq's records.

    One WIP list holds the jobs of every queue it serves; each job's scripts write its own
    queue's registries and requeue it to its own queue (rq's ``origin``).

    Args:
        config: The worker's configuration (URL, queues, name, TTLs).
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.name = config.worker_name
        self.queue_name = config.queue  # the first queue
        self.queues = config.levels.queues
        # Thread-safe pools: one for the writer, liveness and cancels; one whose commands
        # are never retried blindly, for moving jobs (a lost reply there is reconciled).
        self.redis = connect(config.redis_url)
        self.mover = connect(config.redis_url, retries=0, socket_timeout=BLOCK_S + 10)
        self.epoch = 0
        self.token = self._new_token()
        self.k = WorkerKeys.of(config.queue, self.name, self.queues)
        self.keys_of = {q: WorkerKeys.of(q, self.name, self.queues) for q in self.queues}
        rq_queues = [
            Queue(q, connection=self.redis, serializer=MsgpackSerializer) for q in self.queues
        ]
        # rq's own job log lines would name a job by its description; mlxq logs its own.
        self.rq_worker = SimpleWorker(
            rq_queues,
            connection=self.redis,
            name=self.name,
            serializer=MsgpackSerializer,
            log_job_description=False,
        )
        self._state = ""

    def _new_token(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"

    # -- lifecycle ---------------------------------------------------------------------

    def register(self) -> None:
        for s in lua.SCRIPTS.values():
            self.redis.script_load(s.source)
        self.rq_worker.register_birth()
        # rq lists a queue once something was enqueued to it; a served queue is listed
        # (in `mlxq info`, `rq info`) from the moment its first worker starts.
        self.redis.sadd(keys.RQ_QUEUES, *(k.queue for k in self.keys_of.values()))
        self.set_state("idle")
        self.beat()

    def unregister(self, settled: bool) -> int:
        """Leave for good, in one script: lease and stats dropped (nothing is handed here
        after), every job handed here and not claimed back to the queue; then, ``settled``
        (every job it ran has ended) and holding nothing, off the roll, else on it for a live
        worker to reap at once. Returns how many handed jobs went back."""
        verdict, n = scripts.call(self.redis, lua.leave(self.k, self.token, settled))
        if verdict != "left":
            log.info("stopped holding jobs: a live worker requeues them")
        self.rq_worker.register_death()
        return n

    def set_state(self, state: str) -> None:
        if state != self._state:
            self.rq_worker.set_state(state)
            self._state = state

    def suspended(self) -> bool:
        """Whether ``rq suspend`` is in force (rq's own suspension key is set)."""
        # A plain EXISTS, not rq's is_suspended (a MULTI transaction, refused while Redis
        # is out of memory): the heartbeat thread reads it every beat.
        return bool(self.redis.exists(keys.RQ_SUSPENDED))

    def rq_heartbeat(self) -> None:
        self.rq_worker.heartbeat()

    def beat(self) -> str:
        """Keep the lease: ``ok``, ``renewed`` (it had lapsed, nobody took over) or
        ``reaped`` (declared dead: nothing is this worker's any more). Jobs handed here
        and left unclaimed past :data:`HAND_GRACE_MS` go back to the queue."""
        verdict, _ = scripts.run(
            self.redis,
            [
                lua.beat(self.k, self.token, LEASE_MS),
                lua.giveback(self.k, self.token, int(time.time() * 1000) - HAND_GRACE_MS),
            ],
        )
        return str(verdict)

    def rejoin(self) -> int:
        """After being reaped: a new token (old writes stay refused), and what a queue
        handed this worker meanwhile goes back. Returns how many entries it handed back."""
        self.epoch += 1
        self.token = self._new_token()
        return scripts.call(self.redis, lua.rejoin(self.k, self.token, Now.read(), LEASE_MS))

    def roll(self) -> list[tuple[str, str | None]]:
        """Every worker on the roll of a queue this one serves, with its lease value
        (None: none)."""
        names = sorted({text(n) for r in self.k.rolls for n in self.redis.smembers(r)})
        values = self.redis.mget([keys.alive_key(n) for n in names]) if names else []
        return [(n, None if v is None else text(v)) for n, v in zip(names, values, strict=True)]

    def reap(self, worker: str, seen: str | None) -> list[str] | None:
        """Requeue a dead worker's jobs, each to its own queue, and take it off the rolls
        of this worker's queues; None when it turned out alive."""
        dead = WorkerKeys.of(self.queue_name, worker, self.queues)
        return scripts.call(self.redis, lua.reap(dead, seen, Now.read(), REAPED_TTL))

    def refresh(self, running: Sequence[tuple[str, str]]) -> None:
        """Keep rq's records of running jobs (id, execution id) from expiring."""
        scripts.call(self.redis, lua.refresh(self.k, self.token, Now.read(), STARTED_TTL, running))

    def sweep(self) -> None:
        """rq's registry maintenance for these queues (:func:`rq_compat.sweep`)."""
        for q in self.queues:
            rq_compat.sweep(self.redis, q)

    def write_stats(self, state: str, stats: dict[str, Any]) -> None:
        key = self.k.stats
        with self.redis.pipeline() as p:
            # Its free rows and load on their own: the hand script reads them (no msgpack).
            p.hset(
                key,
                mapping={
                    "state": state,
                    "stats": MsgpackSerializer.dumps(stats),
                    "room": int(stats.get("room", 0)),
                    "load": int(stats.get("load", 0)),
                },
            )
            p.expire(key, STATS_TTL)
            p.execute()

    def cancel_flags(self, job_ids: Sequence[str]) -> list[str]:
        """Which of these held jobs carry a cancel request."""
        with self.redis.pipeline(transaction=False) as p:
            for j in job_ids:
                p.hget(keys.job_key(j), "mlxq_cancel")
            flags = p.execute(raise_on_error=False)  # a rogue record of another type: no flag
        return [j for j, f in zip(job_ids, flags, strict=True) if f == b"1"]

    # -- moving jobs (the prefetch thread) ---------------------------------------------

    def wait_for_job(self, queue: str | None = None, timeout: float = BLOCK_S) -> bytes | None:
        """Block until one job id moves from ``queue`` (None: the first) into this
        worker's WIP list, or another worker hands this one a job and wakes it (then None,
        as on a timeout): :meth:`~mlxq.worker.routing.Router.note_blocker` first, so it
        can."""
        k = self.keys_of[queue] if queue is not None else self.k
        # redis-py annotates an int; BLMOVE takes fractions of a second (Redis >= 6).
        try:
            raw = self.mover.blmove(
                k.queue,
                self.k.wip,
                timeout,  # type: ignore[arg-type]
                "LEFT",
                "RIGHT",
            )
        except redis.ResponseError as e:
            if not _wrong_type(e):
                raise
            return None  # its WIP list made another type: the next claim replaces it
        return raw if isinstance(raw, bytes) else None

    def wip(self) -> list[bytes]:
        try:
            listed = self.mover.lrange(self.k.wip, 0, -1)
        except redis.ResponseError as e:
            if not _wrong_type(e):
                raise
            return []  # made another type: nothing listed, and the next claim replaces it
        return [x for x in listed if isinstance(x, bytes)]

    def claim(self, n: int | Mapping[str, int], moved: Sequence[bytes] = ()) -> list[Claimed]:
        """Claim up to ``n`` more jobs from the first queue (or, for a map, up to ``n[q]``
        from each queue ``q``, in the map's order, in one round trip), plus ``moved``
        (already in the WIP list). Jobs handed here come first.

        Raises:
            LeaseLost: the lease is not this worker's; what it was handed went back.
        """
        wanted = {self.queue_name: n} if isinstance(n, int) else dict(n)
        now = Now.read()
        calls = [
            lua.claim(self.keys_of[q], self.token, now, count, moved if i == 0 else ())
            for i, (q, count) in enumerate((q, c) for q, c in wanted.items() if c > 0)
        ]
        if not calls:
            calls = [lua.claim(self.k, self.token, now, 0, moved)]
        return [c for got in scripts.run(self.mover, calls) for c in got]
