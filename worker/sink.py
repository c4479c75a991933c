"""The ordered writer: everything the decode loop decides goes to Redis from this thread.

The decode thread never waits on Redis. It hands over typed writes (starts, chunks, ends,
failures and hand-backs: :mod:`mlxq.worker.writes`); this thread writes whatever queued up
since its last write in one round trip (a :class:`~mlxq.worker.writes.Flush`), in order.
A start closes a flush: its reply (the job may have been canceled or taken meanwhile) is
known before anything later of that job is written. During an outage or under Redis OOM
it retries the same flush, in order, until it lands; running rows keep decoding meanwhile.
Back from an outage it writes nothing until the heartbeat has checked the master since (a
new one, after a failover, may lack the tail of a log: it is resynced first, so the runs
it keeps restream in full rather than go on past a gap). Replies go back through
``inbox`` (:mod:`mlxq.worker.messages`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import redis

from mlxq.producer.connection import TRANSIENT, Outage, retry_forever
from mlxq.producer.outcome import Outcome
from mlxq.worker.bridge import Bridge
from mlxq.worker.commit import commit
from mlxq.worker.errors import LeaseLost, ReplicasBehind
from mlxq.worker.jobs import unstarted_error
from mlxq.worker.logs import THROTTLE
from mlxq.worker.messages import Ended, Inbox, Settled, Started, WriteFailed
from mlxq.worker.writes import (
    ChunkWrite,
    End,
    FailWrite,
    Flush,
    FlushReply,
    Release,
    ReleaseMode,
    StartWrite,
    Write,
    ids_of,
)

log = logging.getLogger("mlxq.worker")

#: Jobs whose start was refused, remembered so their later writes are dropped.
VOID_MEMORY = 10_000
#: How long one try back from an outage waits for the master's check before backing off.
MASTER_CHECK_WAIT_S = 2.0


class _Stop(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Op:
    """Writes handed over in one call (a start closes a flush: all of a call's starts
    share one), under the lease of ``epoch``."""

    epoch: int
    writes: tuple[Write, ...]

    @property
    def job_ids(self) -> tuple[str, ...]:
        return tuple(j for w in self.writes for j in ids_of(w))


class Sink:
    """Writer thread for one worker.

    Args:
        bridge: The worker's Redis.
        inbox: Where replies go: :class:`Started` (start verdicts), :class:`Ended`,
            :class:`Settled` (failed before start, or handed back), :class:`WriteFailed`.
        on_lease_lost: Called when a write was refused for the lease (ask for a beat now).
        master_checked: Back from an outage, waits up to the seconds given for the master
            to be checked (and resynced, if it changed) since; False if it was not.
    """

    def __init__(
        self,
        bridge: Bridge,
        inbox: Inbox,
        on_lease_lost: Callable[[], None],
        master_checked: Callable[[float], bool] = lambda _: True,
    ) -> None:
        self.bridge, self.inbox, self.on_lease_lost = bridge, inbox, on_lease_lost
        self.master_checked = master_checked
        self._away = False  # a write met an outage: check the master before the next
        self._q: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._void: OrderedDict[str, None] = OrderedDict()
        self._abort = threading.Event()
        self._outage = Outage(log, "writer")
        # After an outage every log's TTL is set again with its next chunk: a Redis that
        # restarted without its data recreates logs with their first write after it.
        self._ttl_wanted = 0  # bumped when every log's TTL must be set again
        self._ttl_done = 0  # the last bump a committed flush served
        self._thread = threading.Thread(target=self._run, name="mlxq-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called by the decode loop (and the prefetcher, for jobs that never started) ----

    def starts(self, writes: list[StartWrite]) -> None:
        if writes:
            self._put(*writes)

    def chunks(self, writes: list[ChunkWrite]) -> None:
        if writes:
            self._put(*writes)

    def end(self, end: End) -> None:
        self._put(end)

    def fail(self, job_id: str, attempts_before: int, reason: str) -> None:
        """Fail a claimed job that never started, by ``reason``."""
        self._put(FailWrite(job_id, reason, unstarted_error(attempts_before, reason)))

    def release(self, mode: ReleaseMode, job_ids: list[str | bytes]) -> None:
        """Hand jobs back (``requeue``, ``clean``) or drop WIP entries (``drop``; ids may
        be raw bytes that are no text)."""
        if job_ids:
            self._put(Release(mode, tuple(job_ids)))

    def _put(self, *writes: Write) -> None:
        self._q.put(_Op(self.bridge.epoch, writes))

    def refresh_ttls(self) -> None:
        """Set every log's TTL again with its next chunk (Redis may have lost them)."""
        self._ttl_wanted += 1

    def close(self, timeout: float = 10.0) -> bool:
        """Write what is queued, then stop. Returns False if Redis would not take it
        within ``timeout`` (what is left is this worker's WIP list: a reaper's job)."""
        self._q.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(5)
            return False
        return True

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            ops = [self._q.get()]
            while True:  # everything that queued up while the last write ran
                try:
                    ops.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = None in ops
            try:
                for batch in self._split([op for op in ops if op is not None]):
                    self._commit_or_split(batch)
            except _Stop:
                return
            except Exception:  # a bug, not Redis: say so, drop this batch, keep writing
                log.exception("writer: a write failed and was dropped")
            if stop:
                return

    @staticmethod
    def _split(ops: list[_Op]) -> list[list[_Op]]:
        """Consecutive ops of one epoch, each batch ending at a start."""
        batches: list[list[_Op]] = [[]]
        for op in ops:
            if batches[-1] and batches[-1][-1].epoch != op.epoch:
                batches.append([])
            batches[-1].append(op)
            if isinstance(op.writes[0], StartWrite):
                batches.append([])
        return [b for b in batches if b]

    def _commit_or_split(self, ops: list[_Op]) -> None:
        """Commit a batch; when a script raises (a job's key of a kind it could not heal),
        commit its jobs one by one, so only the job whose writes raise loses them."""
        try:
            self._commit(ops)
            return
        except redis.ResponseError as e:
            if len({j for op in ops for j in op.job_ids}) <= 1:
                self._give_up(ops, e)
                return
            log.warning("writer: a write raised (%s); writing its jobs one by one", e)
        for one in self._per_job(ops):
            try:
                self._commit(one)
            except redis.ResponseError as e:
                self._give_up(one, e)

    @staticmethod
    def _per_job(ops: list[_Op]) -> list[list[_Op]]:
        """The same writes as one batch per job, each job's in their order (the scripts
        are idempotent: what a raising call wrote before it raised is written again)."""
        per: dict[str, list[_Op]] = {}
        for op in ops:
            for w in op.writes:
                match w:
                    case Release(mode=mode, job_ids=ids):
                        for raw in ids:
                            per.setdefault(str(raw), []).append(
                                _Op(op.epoch, (Release(mode, (raw,)),))
                            )
                    case _:
                        per.setdefault(w.job_id, []).append(_Op(op.epoch, (w,)))
        return list(per.values())

    def _give_up(self, ops: list[_Op], error: Exception) -> None:
        """One job's writes keep raising: drop them with the reason, and tell the decode
        loop, so the job leaves this worker (it fails if it still runs)."""
        for w in (w for op in ops for w in op.writes):
            for job_id in ids_of(w):
                log.error("job %s: its %s write raised (%s); dropped", job_id, w.kind, error)
                match w:
                    case ChunkWrite():
                        self.inbox.put(WriteFailed(job_id, f"{type(error).__name__}: {error}"))
                    case StartWrite():
                        self._void[job_id] = None
                        self.inbox.put(Started({job_id: "refused"}))
                    case _:
                        self.inbox.put(Settled({job_id: Outcome.DROPPED}))

    def _flush_of(self, ops: list[_Op]) -> Flush:
        f = Flush()
        ttl_lost = self._ttl_done < self._ttl_wanted
        for op in ops:
            if op.epoch != self.bridge.epoch:
                continue  # written for a lease this worker lost: void
            for w in op.writes:
                match w:
                    case StartWrite():
                        f.starts.append(w)
                    case ChunkWrite() if w.job_id not in self._void:
                        f.chunks.append(replace(w, refresh_ttl=True) if ttl_lost else w)
                    case End() if w.job_id not in self._void:
                        f.ends.append(w)
                    case FailWrite():
                        f.fails.append(w)
                    case Release():
                        f.releases.append(w)
        return f

    def _commit(self, ops: list[_Op]) -> None:
        def attempt() -> FlushReply | None:
            if self._abort.is_set():
                raise _Stop
            if self._away:
                if not self.master_checked(MASTER_CHECK_WAIT_S):
                    raise redis.ConnectionError("the master is not checked since the outage")
                self._away = False
            wanted = self._ttl_wanted
            flush = self._flush_of(ops)  # again each try: the lease may have moved on
            if not flush:
                return None
            try:
                reply = commit(self.bridge, flush)
            except LeaseLost:
                # A lease gone may be a Redis that restarted empty, its logs with it.
                self.refresh_ttls()
                self.on_lease_lost()
                raise
            except TRANSIENT as e:
                self.refresh_ttls()
                # Refused for memory, the same master answered; else it may be another.
                self._away |= not isinstance(e, redis.exceptions.OutOfMemoryError)
                raise
            if flush.chunks:
                self._ttl_done = max(self._ttl_done, wanted)
            return reply

        reply = retry_forever(attempt, self._outage, (*TRANSIENT, LeaseLost, ReplicasBehind))
        if reply is not None:
            self._deliver(reply)

    def _deliver(self, reply: FlushReply) -> None:
        for job_id, verdict in reply.started.items():
            if verdict != "ok":
                self._void[job_id] = None
                if len(self._void) > VOID_MEMORY:
                    self._void.popitem(last=False)
        if reply.started:
            self.inbox.put(Started(reply.started))
        if reply.ended:
            self.inbox.put(Ended(reply.ended))
        if reply.settled:
            self.inbox.put(Settled(reply.settled))
        for job_id, what in reply.healed:
            if job_id:
                log.warning("job %s: replaced a key of the wrong type: %s", job_id, what)
            else:  # a key its jobs share: one an attacker may keep rewriting
                THROTTLE.warning(what, "replaced a key of the wrong type: %s", what)
        for problem in reply.write_problems:
            log.warning("job %s: replay log write: %s", *problem)
            if problem[1] != "healed":
                self.inbox.put(WriteFailed(*problem))
