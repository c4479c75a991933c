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
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import redis
from rq import Queue
from rq.worker import SimpleWorker
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from mlxq.producer import keys, scripts
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.connection import connect
from mlxq.worker import naming, rq_compat
from mlxq.worker import scripts as lua
from mlxq.worker.config import WorkerConfig
from mlxq.worker.logs import THROTTLE
from mlxq.worker.naming import LEASE_MS
from mlxq.worker.scripts import Claimed, Now, WorkerKeys, text

log = logging.getLogger("mlxq.worker")

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
        """Take this worker's name, then enter rq's registries and the queues' rolls.

        A dead predecessor of the same name (a worker killed, a start that failed) never
        blocks it for long: what it left in its WIP list goes back to the queue, and its
        registration in rq is replaced. Should a step fail, what was done is undone, so
        a failed start never blocks the next one either.

        Raises:
            SetupError: a live worker holds this name.
        """
        for s in lua.SCRIPTS.values():
            self.redis.script_load(s.source)
        seen, stale = naming.check_name(self.redis, self.name, self.k, self.rq_worker.key)
        try:
            back = naming.take_name(self.redis, self.name, self.k, self.token, seen)
            if back:
                log.warning(
                    "worker %s: a previous worker of this name left %d entr%s in its WIP "
                    "list: given back to the queue",
                    self.name,
                    back,
                    "y" if back == 1 else "ies",
                )
            self._register_rq(stale)
            self.set_state("idle")
            self.beat()
        except BaseException:
            self.undo_register()
            raise

    def _register_rq(self, stale: bool) -> None:
        rq_compat.register(self.redis, self.rq_worker, self.queues, stale)

    def undo_register(self) -> None:
        """Undo what :meth:`register` did (a start that failed): the lease, the rolls,
        rq's registration; best effort, each step on its own."""
        for step in (partial(self.unregister, True), self._forget_rq):
            try:
                step()
            except Exception as e:  # Redis away: the lease lapses on its own
                log.warning("undoing the registration: %s", e)

    def _forget_rq(self) -> None:
        rq_compat.forget(self.redis, self.rq_worker)

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

    def _rewriting(
        self, key: str, said: str, write: Callable[[], object], remake: Callable[[], None]
    ) -> None:
        """Do ``write``; should ``key`` have been made another type (a rogue write), say so
        (once a minute), delete it, ``remake`` what it held and write again."""
        try:
            write()
            return
        except redis.ResponseError as e:
            if not rq_compat.wrong_type(e):
                raise
            THROTTLE.warning(key, "worker %s: %s was of another type: made again", self.name, said)
        self.redis.delete(key)
        remake()
        write()

    def _rq(self, what: str, call: Callable[[], object]) -> None:
        """One of rq's writes of this worker's registration, made whole again should its
        key have been made another type."""
        key = self.rq_worker.key
        remake = partial(self._register_rq, stale=False)
        self._rewriting(key, f"its registration in rq ({key}) at {what}", call, remake)

    def set_state(self, state: str) -> None:
        if state != self._state:
            self._rq("set_state", partial(self.rq_worker.set_state, state))
            self._state = state

    def suspended(self) -> bool:
        """Whether ``rq suspend`` is in force (rq's own suspension key is set)."""
        # A plain EXISTS, not rq's is_suspended (a MULTI transaction, refused while Redis
        # is out of memory): the heartbeat thread reads it every beat.
        return bool(self.redis.exists(keys.RQ_SUSPENDED))

    def rq_heartbeat(self) -> None:
        self._rq("heartbeat", self.rq_worker.heartbeat)

    def beat(self) -> str:
        """Keep the lease and stay on the rolls: ``ok``, ``renewed`` (it had lapsed, or was
        made another type, and nobody took over) or ``reaped`` (declared dead: nothing is
        this worker's any more). Jobs handed here and left unclaimed past
        :data:`HAND_GRACE_MS` go back to the queue."""
        (verdict, replaced), _ = scripts.run(
            self.redis,
            [
                lua.beat(self.k, self.token, LEASE_MS),
                lua.giveback(self.k, self.token, int(time.time() * 1000) - HAND_GRACE_MS),
            ],
        )
        if replaced:
            THROTTLE.warning(
                f"beat {replaced}",
                "worker %s: replaced keys of the wrong type (a rogue write): %s; serving on",
                self.name,
                replaced,
            )
        return str(verdict)

    def rejoin(self) -> int:
        """After being reaped: a new token (old writes stay refused), and what a queue
        handed this worker meanwhile goes back. Returns how many entries it handed back."""
        self.epoch += 1
        self.token = self._new_token()
        return scripts.call(self.redis, lua.rejoin(self.k, self.token, Now.read(), LEASE_MS))

    def roll(self) -> list[tuple[str, str | None]]:
        """Every worker that may hold jobs of a queue this one serves, with its lease value
        (None: none, or a lease of another type, which reads as expired): those on the
        queues' rolls, and those rq lists as serving them that still hold a WIP list (a
        roll of another type is unreadable, and one replaced lost its dead workers: rq's
        list finds them meanwhile)."""
        rq_sets = [WORKERS_BY_QUEUE_KEY % q for q in self.queues]
        with self.redis.pipeline(transaction=False) as p:
            for key in (*self.k.rolls, *rq_sets):
                p.smembers(key)
            replies = p.execute(raise_on_error=False)
        on_roll: set[str] = set()
        listed: set[str] = set()
        for i, (key, reply) in enumerate(zip((*self.k.rolls, *rq_sets), replies, strict=True)):
            if isinstance(reply, Exception):
                THROTTLE.warning(
                    key, "%s cannot be read (%s): the worker list of rq stands in", key, reply
                )
                continue
            names = {text(n) for n in reply}
            if i < len(self.k.rolls):
                on_roll |= names
            else:
                prefix = keys.RQ_WORKER
                listed |= {n[len(prefix) :] for n in names if n.startswith(prefix)}
        found = sorted(on_roll | self._holding(listed - on_roll - {self.name}))
        if not found:
            return []
        values = self.redis.mget([keys.alive_key(n) for n in found])
        return [(n, None if v is None else text(v)) for n, v in zip(found, values, strict=True)]

    def _holding(self, names: set[str]) -> set[str]:
        """Those of ``names`` whose WIP list exists (of any type)."""
        if not names:
            return set()
        ordered = sorted(names)
        with self.redis.pipeline(transaction=False) as p:
            for n in ordered:
                p.exists(keys.wip_key(n))
            return {n for n, there in zip(ordered, p.execute(), strict=True) if there}

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
        write = partial(self._write_stats, state, stats)
        self._rewriting(key, f"its stats ({key})", write, lambda: None)

    def _write_stats(self, state: str, stats: dict[str, Any]) -> None:
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
            if not rq_compat.wrong_type(e):
                raise
            # The queue made another type (the claim said so), or its WIP list (the next
            # claim replaces it): wait as long as a blocked move would, not spin.
            time.sleep(timeout)
            return None
        return raw if isinstance(raw, bytes) else None

    def wip(self) -> list[bytes]:
        try:
            listed = self.mover.lrange(self.k.wip, 0, -1)
        except redis.ResponseError as e:
            if not rq_compat.wrong_type(e):
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
