"""Every Redis read and write the worker makes: rq's bookkeeping and mlxq's, in bulk.

rq's own worker runs one job at a time through Python methods that cost several round
trips each; mlxq's holds a whole batch, so it writes the very keys rq's methods write
(the job hash, StartedJobRegistry and executions, the result log, the finished / failed /
canceled registries, the worker's counters) from Lua scripts, many jobs per call, and
``rq info``, ``Job.get_status()`` and ``job.return_value()`` stay true.

Fencing: every script first checks the worker's lease (``mlxq:alive:<name>`` holding this
worker's token). A worker that was frozen past its lease, or declared dead and reaped,
has every write refused until it has learned what it still owns (nothing, if reaped).
Each job's start and end also check that the job is still this worker's.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job as RqJob
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.utils import utcformat
from rq.worker import SimpleWorker

from mlxq.producer import keys, scripts
from mlxq.producer.codec import (
    MAX_JOB_DATA_BYTES,
    NOTICE,
    Chunk,
    MsgpackSerializer,
    encode_chunk,
    first_seq,
)
from mlxq.producer.connection import connect
from mlxq.worker.config import WorkerConfig, is_worker_name

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
#: A chat turn is handed to the worker holding its history only while that worker holds
#: at most this share more rows than the one that claimed it, plus :data:`HAND_SLACK`.
HAND_SHARE = 1.5
HAND_SLACK = 4
#: How long a worker's handed set outlives its last entry (a dead worker's goes).
HANDED_TTL_MS = 60_000
#: How long a worker is named as holding a finished conversation (its cache may have
#: dropped it sooner: then the next turn is a miss, as without routing).
ROUTE_TTL = 900
#: How often a worker, idle and about to block, writes its blocking connection's id anew.
BLOCKER_TTL = 60


_CALLBACKS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")


def _inflates_past(raw: bytes, limit: int) -> bool:
    try:
        inflater = zlib.decompressobj()
        inflater.decompress(raw, limit)
    except zlib.error:
        return False  # stored as is (rq's fallback); its size was checked already
    return bool(inflater.unconsumed_tail)


class BoundedJob(RqJob):
    """rq's Job read with limits, for rq's registry cleanup, which fetches whole job
    records and inflates their ``data`` and ``exc_info``: a record with a field larger
    than :data:`MAX_JOB_DATA_BYTES` or inflating past it (a zlib bomb), naming a callback
    to import (mlxq jobs have none), or of the wrong type reads as no job at all, so the
    cleanup skips it (its expired entry is dropped with the others)."""

    def _refuse(self, why: str) -> NoSuchJobError:
        log.warning("sweep: skipped job %s: %s", self.id, why)
        return NoSuchJobError(why)

    def refresh(self) -> None:
        try:
            with self.connection.pipeline(transaction=False) as p:
                p.hstrlen(self.key, "data")
                p.hstrlen(self.key, "exc_info")
                sizes = p.execute()
            if max(sizes) > MAX_JOB_DATA_BYTES:
                raise self._refuse(f"a field of {max(sizes)} bytes")
            super().refresh()
        except redis.ResponseError as e:
            raise self._refuse(f"its record cannot be read ({e})") from None

    def restore(self, raw_data: Any) -> Any:
        fields = {_s(k): v for k, v in raw_data.items()}
        for name in ("data", "exc_info"):
            v = fields.get(name)
            if isinstance(v, bytes) and len(v) > MAX_JOB_DATA_BYTES:
                raise self._refuse(f"its {name} is {len(v)} bytes")
            if isinstance(v, bytes) and _inflates_past(v, MAX_JOB_DATA_BYTES):
                raise self._refuse(f"its {name} inflates past {MAX_JOB_DATA_BYTES} bytes")
        if any(fields.get(c) for c in _CALLBACKS):
            raise self._refuse("it names a callback")
        return super().restore(raw_data)


class _BoundedStartedRegistry(StartedJobRegistry):
    """rq's StartedJobRegistry whose cleanup reads jobs (and their dependents) bounded."""

    def get_queue(self) -> Queue:
        return Queue(
            self.name, connection=self.connection, serializer=self.serializer, job_class=BoundedJob
        )


class LeaseLost(Exception):
    """A write was refused: this worker's lease is not its own (frozen, or reaped)."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """What the claim script read of one job it moved into this worker's WIP list.

    ``verdict`` is ``"ok"`` (``data`` holds rq's stored job data) or why it was not:
    ``dup``, ``missing``, ``canceled``, ``nodata``, ``toolarge``, ``bad``, ``oom``.
    """

    id: bytes
    verdict: str
    data: bytes = b""
    attempts: int = 0
    clean: int = 0
    enqueued_at: str = ""
    detail: str = ""
    handed: bool = False  # another worker handed it here (it is never handed on)


@dataclass(slots=True)
class End:
    """One job's end for the end script."""

    job_id: str
    outcome: str  # finished | failed | canceled
    execution_id: str
    started_at: float
    final: Chunk
    canceled: Chunk  # written instead of final when a cancel won the race
    result: dict[str, Any] | None = None
    reason: str = ""
    route: str | None = None  # its conversation's route key, to name this worker in


@dataclass(slots=True)
class Flush:
    """One round trip of writes, in the order they must land: chunks, then ends and
    failures and hand-backs, then starts (a row's end lands before its next job's start,
    so rq never shows more started jobs than the batch holds)."""

    chunks: list[tuple[str, Chunk, bool]] = field(default_factory=list)
    ends: list[End] = field(default_factory=list)
    fails: list[tuple[str, int, str]] = field(default_factory=list)  # id, attempts, reason
    releases: list[tuple[str, list[str | bytes]]] = field(default_factory=list)  # mode, ids
    starts: list[tuple[str, int, str]] = field(default_factory=list)  # id, before, exec id

    def __bool__(self) -> bool:
        return bool(self.chunks or self.ends or self.fails or self.releases or self.starts)


@dataclass(slots=True)
class FlushReply:
    started: dict[str, str] = field(default_factory=dict)  # id -> ok | canceled | refused
    ended: dict[str, str] = field(default_factory=dict)  # id -> outcome | refused
    settled: dict[str, str] = field(default_factory=dict)  # failed before start, handed back
    write_problems: list[tuple[str, str]] = field(default_factory=list)
    #: Keys of a job a script found of the wrong type and replaced: (id, what).
    healed: list[tuple[str, str]] = field(default_factory=list)


_RELEASED = {"requeued": "requeued", "canceled": "canceled"}
_FAILED = {"failed": "failed", "canceled": "canceled"}


def _healed(reply: list[Any], at: int) -> list[tuple[str, str]]:
    """(id, what) for each entry of a script's reply that says it replaced a key."""
    return [(_s(e[0]), _s(e[at])) for e in reply if len(e) > at and e[at]]


def _now() -> tuple[float, str]:
    dt = datetime.now(timezone.utc)
    return dt.timestamp(), utcformat(dt)


def _zlib_text(text: str) -> bytes:
    return zlib.compress(text.encode("utf-8", "replace"))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _worker_name(v: Any) -> str | None:
    """A worker name read from Redis, or None when it could not be one."""
    name = v.decode("utf-8", "replace") if isinstance(v, bytes) else None
    return name if is_worker_name(name) else None


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _wrong_type(e: redis.ResponseError) -> bool:
    """Whether Redis refused a command for a key of another type (a rogue write)."""
    return str(e).startswith("WRONGTYPE")


class Bridge:
    """One worker's Redis: its queue, its WIP list, its lease, rq's records.

    Args:
        config: The worker's configuration (URL, queue, name, TTLs).
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.name = config.worker_name
        self.queue_name = config.queue
        # Thread-safe pools: one for the writer, liveness and cancels; one whose commands
        # are never retried blindly, for moving jobs (a lost reply there is reconciled).
        self.redis = connect(config.redis_url)
        self.mover = connect(config.redis_url, retries=0, socket_timeout=BLOCK_S + 10)
        self.epoch = 0
        self.token = self._new_token()
        q = config.queue
        self.k_queue, self.k_wip = keys.queue_key(q), keys.wip_key(self.name)
        self.k_alive, self.k_roll = keys.alive_key(self.name), keys.workers_key(q)
        self.k_started, self.k_rq_worker = keys.started_registry(q), keys.rq_worker_key(self.name)
        self.k_execs = keys.rq_worker_executions(self.name)
        self.k_finished, self.k_failed = keys.finished_registry(q), keys.failed_registry(q)
        self.k_canceled = keys.canceled_registry(q)
        self.k_handed, self.k_blocker = keys.handed_key(self.name), keys.blocker_key(self.name)
        self._blocker: tuple[int, float] | None = None  # (client id, write again after)
        self._blocker_refused = False
        self.rq_queue = Queue(q, connection=self.redis, serializer=MsgpackSerializer)
        # rq's own job log lines would name a job by its description; mlxq logs its own.
        self.rq_worker = SimpleWorker(
            [self.rq_queue],
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
        for s in scripts.SCRIPTS.values():
            self.redis.script_load(s.source)
        self.rq_worker.register_birth()
        # rq lists a queue once something was enqueued to it; a served queue is listed
        # (in `mlxq info`, `rq info`) from the moment its first worker starts.
        self.redis.sadd(keys.RQ_QUEUES, self.k_queue)
        self.set_state("idle")
        self.beat()

    def unregister(self, settled: bool) -> int:
        """Leave for good, in one script: lease and stats dropped (nothing is handed here
        after), every job handed here and not claimed back to the queue; then, ``settled``
        (every job it ran has ended) and holding nothing, off the roll, else on it for a live
        worker to reap at once. Returns how many handed jobs went back."""
        verdict, n = scripts.call(
            self.redis,
            "leave",
            [
                self.k_alive,
                self.k_roll,
                keys.worker_stats_key(self.name),
                self.k_handed,
                self.k_wip,
                self.k_queue,
            ],
            [self.token, self.name, "1" if settled else ""],
        )
        if _s(verdict) != "left":
            log.info("stopped holding jobs: a live worker requeues them")
        self.rq_worker.register_death()
        return int(n)

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
                (
                    "beat",
                    [self.k_alive, self.k_roll, keys.reaped_key(self.name)],
                    [self.token, self.name, LEASE_MS],
                ),
                (
                    "giveback",
                    [self.k_alive, self.k_handed, self.k_wip, self.k_queue],
                    [self.token, _now_ms() - HAND_GRACE_MS],
                ),
            ],
        )
        return _s(verdict)

    def rejoin(self) -> int:
        """After being reaped: a new token (old writes stay refused), and what a queue
        handed this worker meanwhile goes back. Returns how many entries it handed back."""
        self.epoch += 1
        self.token = self._new_token()
        now_ts, now_str = _now()
        n = scripts.call(
            self.redis,
            "rejoin",
            self._reap_keys(self.name),
            [self.token, self.name, now_ts, now_str, keys.DEFAULT_FAILURE_TTL, NOTICE, LEASE_MS],
        )
        return int(n)

    def _reap_keys(self, worker: str) -> list[str]:
        return [
            keys.alive_key(worker),
            keys.wip_key(worker),
            self.k_queue,
            self.k_roll,
            self.k_started,
            keys.rq_worker_executions(worker),
            keys.reaped_key(worker),
            self.k_canceled,
        ]

    def roll(self) -> list[tuple[str, str | None]]:
        """Every worker on this queue's roll, with its lease value (None: none)."""
        names = sorted(_s(n) for n in self.redis.smembers(self.k_roll))
        values = self.redis.mget([keys.alive_key(n) for n in names]) if names else []
        return [(n, None if v is None else _s(v)) for n, v in zip(names, values, strict=True)]

    def reap(self, worker: str, seen: str | None) -> list[str] | None:
        """Requeue a dead worker's jobs; None when it turned out alive."""
        now_ts, now_str = _now()
        out = scripts.call(
            self.redis,
            "reap",
            self._reap_keys(worker),
            [worker, seen or "", now_ts, now_str, keys.DEFAULT_FAILURE_TTL, NOTICE, REAPED_TTL],
        )
        if _s(out[0]) != "reaped":
            return None
        return [_s(i) for i in out[1:]]

    def refresh(self, running: Sequence[tuple[str, str]]) -> None:
        """Keep rq's records of running jobs (id, execution id) from expiring."""
        now_ts, now_str = _now()
        args: list[scripts.Arg] = [self.token, now_ts, now_str, STARTED_TTL]
        for job_id, execution_id in running:
            args += [job_id, execution_id]
        scripts.call(self.redis, "refresh", [self.k_alive, self.k_started, self.k_rq_worker], args)

    def sweep(self) -> None:
        """rq's registry maintenance for this queue, with every job read bounded: expired
        entries leave the finished and failed registries; expired started ones (a run
        whose worker vanished unseen) end failed, as rq's own cleanup does. rq's ready
        registry is left alone: recovering it fetches jobs unbounded, and mlxq jobs never
        wait on dependencies."""
        kw: dict[str, Any] = {
            "name": self.queue_name,
            "connection": self.redis,
            "serializer": MsgpackSerializer,
        }
        FinishedJobRegistry(**kw).cleanup()
        _BoundedStartedRegistry(job_class=BoundedJob, **kw).cleanup()
        FailedJobRegistry(**kw).cleanup()

    def write_stats(self, state: str, stats: dict[str, Any]) -> None:
        key = keys.worker_stats_key(self.name)
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

    def wait_for_job(self, timeout: float = BLOCK_S) -> bytes | None:
        """Block until one job id moves from the queue into this worker's WIP list, or
        another worker hands this one a job and wakes it (then None, as on a timeout)."""
        self._note_blocker()
        # redis-py annotates an int; BLMOVE takes fractions of a second (Redis >= 6).
        try:
            raw = self.mover.blmove(
                self.k_queue,
                self.k_wip,
                timeout,  # type: ignore[arg-type]
                "LEFT",
                "RIGHT",
            )
        except redis.ResponseError as e:
            if not _wrong_type(e):
                raise
            return None  # its WIP list made another type: the next claim replaces it
        return raw if isinstance(raw, bytes) else None

    def _note_blocker(self) -> None:
        """Name the connection this worker blocks on, so a worker handing it a job can
        wake it; written again when the connection changed, or every half TTL."""
        if self._blocker_refused:
            return
        try:
            cid = int(self.mover.client_id())
            now = time.monotonic()
            if self._blocker is None or self._blocker[0] != cid or now > self._blocker[1]:
                self.mover.set(self.k_blocker, cid, ex=BLOCKER_TTL)
                self._blocker = (cid, now + BLOCKER_TTL / 2)
        except redis.exceptions.NoPermissionError as e:  # an ACL without CLIENT: no wake-ups
            log.warning(
                "routing: cannot name this worker's idle connection (%s); a job "
                "handed to it while idle waits up to %.0f s",
                e,
                BLOCK_S,
            )
            self._blocker_refused = True
        except redis.ResponseError:  # out of memory, say: named at the next idle wait
            self._blocker = None

    def routes(self, route_keys: Sequence[str]) -> list[str | None]:
        """The worker each route key names (None: none, or no readable name)."""
        # MGET reads a key of another type as no value: a rogue key never raises here.
        names = self.mover.mget(route_keys) if route_keys else []
        return [_worker_name(v) for v in names]

    def hand(self, job_id: str, to: str, most_load: int) -> str:
        """Hand a claimed, unstarted job to worker ``to`` should it hold at most
        ``most_load`` rows; ``ok`` or why not (it stays)."""
        return _s(
            scripts.call(
                self.mover,
                "hand",
                [
                    self.k_alive,
                    self.k_wip,
                    keys.alive_key(to),
                    keys.wip_key(to),
                    keys.handed_key(to),
                    keys.worker_stats_key(to),
                    self.k_roll,
                ],
                [self.token, self.name, job_id, to, _now_ms(), HANDED_TTL_MS, most_load],
            )
        )

    def wake(self, to: str, job_id: str, tries: int = 25) -> bool:
        """Wake worker ``to`` should it be blocked waiting for the queue; gives up once
        it has claimed ``job_id`` (it was not blocked, or woke) or after ``tries``."""
        try:
            raw = self.mover.get(keys.blocker_key(to))
            cid = int(raw) if isinstance(raw, bytes) and raw.isdigit() else None
            for _ in range(tries):
                if cid is not None and self.mover.client_unblock(cid):
                    return True
                if self.mover.zscore(keys.handed_key(to), job_id) is None:
                    return True
                time.sleep(0.002)
        except redis.ResponseError:  # a rogue key of another type: its beat gives back
            pass
        return False

    def wip(self) -> list[bytes]:
        try:
            listed = self.mover.lrange(self.k_wip, 0, -1)
        except redis.ResponseError as e:
            if not _wrong_type(e):
                raise
            return []  # made another type: nothing listed, and the next claim replaces it
        return [x for x in listed if isinstance(x, bytes)]

    def claim(self, n: int, moved: Sequence[bytes] = ()) -> list[Claimed]:
        """Claim up to ``n`` more jobs from the queue, plus ``moved`` (already in the WIP
        list).

        Raises:
            LeaseLost: the lease is not this worker's; what it was handed went back.
        """
        now_ts, now_str = _now()
        out = scripts.call(
            self.mover,
            "claim",
            [self.k_queue, self.k_wip, self.k_alive, self.k_canceled, self.k_handed],
            [
                self.token,
                self.name,
                now_ts,
                now_str,
                n,
                MAX_JOB_DATA_BYTES,
                keys.DEFAULT_FAILURE_TTL,
                NOTICE,
                *moved,
            ],
        )
        if out and out[0] == b"lease":
            raise LeaseLost(self.name)
        claimed = []
        for e in out:
            verdict = _s(e[1])
            if verdict == "wip":
                log.warning(
                    "this worker's WIP list %s was a %s: replaced by an empty list (the jobs "
                    "it listed are not requeued should this worker die)",
                    self.k_wip,
                    _s(e[2]),
                )
                continue
            if verdict == "ok":
                handed = e[6] == b"1"
                claimed.append(
                    Claimed(e[0], verdict, e[2], int(e[3]), int(e[4]), _s(e[5]), handed=handed)
                )
            else:
                claimed.append(Claimed(e[0], verdict, detail=" ".join(_s(x) for x in e[2:])))
        return claimed

    # -- writing (the writer thread) ---------------------------------------------------

    def commit(self, f: Flush) -> FlushReply:
        """Write one flush in one round trip.

        Raises:
            LeaseLost: the lease is not this worker's (nothing was written).
            redis.exceptions.OutOfMemoryError: Redis refused it (nothing was written past
                the point it reports; the caller retries the same flush, idempotently).
        """
        now_ts, now_str = _now()
        calls: list[tuple[str, list[str], list[scripts.Arg]]] = []
        if f.chunks:
            calls.append(("chunks", [self.k_alive], self._chunk_args(f.chunks)))
        if routes := [e.route for e in f.ends if e.route and e.outcome == "finished"]:
            # Before the ends: a client that sees a turn end and sends the next finds it.
            calls.append(("route", [self.k_alive], [self.token, self.name, ROUTE_TTL, *routes]))
        if f.ends:
            calls.append(
                (
                    "end",
                    [
                        self.k_alive,
                        self.k_started,
                        self.k_rq_worker,
                        self.k_execs,
                        self.k_wip,
                        self.k_finished,
                        self.k_failed,
                        self.k_canceled,
                    ],
                    self._end_args(f.ends, now_ts, now_str),
                )
            )
        if f.fails:
            calls.append(
                (
                    "fail",
                    [self.k_alive, self.k_wip, self.k_failed, self.k_canceled],
                    self._fail_args(f.fails, now_ts, now_str),
                )
            )
        for mode, ids in f.releases:
            calls.append(
                (
                    "release",
                    [
                        self.k_alive,
                        self.k_wip,
                        self.k_queue,
                        self.k_started,
                        self.k_execs,
                        self.k_canceled,
                    ],
                    [
                        self.token,
                        self.name,
                        now_ts,
                        now_str,
                        keys.DEFAULT_FAILURE_TTL,
                        NOTICE,
                        mode,
                        *ids,
                    ],
                )
            )
        if f.starts:
            args: list[scripts.Arg] = [
                self.token,
                self.name,
                now_ts,
                now_str,
                STARTED_TTL,
                keys.DEFAULT_FAILURE_TTL,
                NOTICE,
            ]
            for job_id, before, exec_id in f.starts:
                args += [job_id, before, exec_id]
            calls.append(
                (
                    "start",
                    [
                        self.k_alive,
                        self.k_started,
                        self.k_rq_worker,
                        self.k_execs,
                        self.k_wip,
                        self.k_canceled,
                    ],
                    args,
                )
            )
        replies = scripts.run(self.redis, calls)
        return self._parse(calls, replies)

    def _chunk_args(self, chunks: list[tuple[str, Chunk, bool]]) -> list[scripts.Arg]:
        args: list[scripts.Arg] = [self.token, self.config.stream_ttl]
        for job_id, c, expire in chunks:
            args += [job_id, c.seq, encode_chunk(c), 1 if expire else 0]
        return args

    def _end_args(self, ends: list[End], now_ts: float, now_str: str) -> list[scripts.Arg]:
        args: list[scripts.Arg] = [
            self.token,
            self.name,
            now_ts,
            now_str,
            self.config.stream_ttl,
            keys.DEFAULT_RESULT_TTL,
            keys.DEFAULT_FAILURE_TTL,
            keys.MAX_RECORD_TTL,
        ]
        for e in ends:
            if e.outcome == "finished":
                value = base64.b64encode(MsgpackSerializer.dumps(e.result)).decode()
                exc_info = b""
            else:
                exc_info = _zlib_text(e.reason)
                value = base64.b64encode(exc_info).decode()
            args += [
                e.job_id,
                e.outcome,
                e.execution_id,
                value,
                exc_info,
                e.started_at,
                e.final.seq,
                encode_chunk(e.final),
                encode_chunk(e.canceled),
            ]
        return args

    def _fail_args(
        self, fails: list[tuple[str, int, str]], now_ts: float, now_str: str
    ) -> list[scripts.Arg]:
        args: list[scripts.Arg] = [
            self.token,
            self.name,
            now_ts,
            now_str,
            self.config.stream_ttl,
            keys.DEFAULT_FAILURE_TTL,
            keys.MAX_RECORD_TTL,
            NOTICE,
        ]
        for job_id, attempts, reason in fails:
            exc = _zlib_text(reason)
            # It never ran: its error chunk opens a run of its own, after the last one.
            chunk = Chunk(
                first_seq(attempts + 1),
                kind="error",
                finish_reason="error",
                attempt=attempts + 1,
                error=reason,
            )
            args += [job_id, base64.b64encode(exc).decode(), exc, chunk.seq, encode_chunk(chunk)]
        return args

    def _parse(
        self, calls: list[tuple[str, list[str], list[scripts.Arg]]], replies: list[Any]
    ) -> FlushReply:
        out = FlushReply()
        for (name, _, calls_args), reply in zip(calls, replies, strict=True):
            if reply and reply[0] == b"lease":
                raise LeaseLost(self.name)
            if reply and reply[0] == b"oom":
                raise redis.exceptions.OutOfMemoryError(f"{name}: refused (out of memory)")
            if name == "chunks":
                problems = reply[1]
                out.write_problems += [
                    (_s(problems[i]), _s(problems[i + 1])) for i in range(0, len(problems), 2)
                ]
            elif name == "start":
                out.started.update({_s(e[0]): _s(e[1]) for e in reply})
                out.healed += _healed(reply, 2)
            elif name == "end":
                for e in reply:
                    out.ended[_s(e[0])] = _s(e[1])
                    if len(e) > 2 and _s(e[2]) not in ("ok", "dup"):
                        out.write_problems.append((_s(e[0]), _s(e[2])))
                out.healed += _healed(reply, 3)
            elif name == "fail":
                out.settled.update({_s(e[0]): _FAILED.get(_s(e[1]), "dropped") for e in reply})
                out.healed += _healed(reply, 2)
            elif name == "release":
                ids = calls_args[7:]
                for job_id, what in zip(ids, reply, strict=True):
                    out.settled[_s(job_id)] = _RELEASED.get(_s(what), "dropped")
        return out
