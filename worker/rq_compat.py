"""rq's side of a worker: its registration (``rq info``, ``mlxq info``), and rq's own
maintenance, made safe for records mlxq does not trust.

rq's registry cleanup fetches whole job records and inflates their ``data`` and
``exc_info``; a worker runs it for its queue (:func:`sweep`) with every job read bounded
(:class:`BoundedJob`), so a forged record can neither exhaust memory nor name code to run.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import Any

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job as RqJob
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.worker.base import BaseWorker
from rq.worker_registration import clean_worker_registry

from mlxq.producer import keys
from mlxq.producer.codec import MAX_JOB_DATA_BYTES, MsgpackSerializer
from mlxq.producer.errors import SetupError
from mlxq.worker.logs import THROTTLE
from mlxq.worker.scripts import text

log = logging.getLogger("mlxq.worker")

_CALLBACKS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")


def wrong_type(e: redis.ResponseError) -> bool:
    """Whether Redis refused a command for a key of another type (a rogue write)."""
    return str(e).startswith("WRONGTYPE")


def register(
    connection: redis.Redis, worker: BaseWorker, queues: Sequence[str], stale: bool
) -> None:
    """rq's registration of ``worker`` (``rq info``, ``mlxq info``), a stale one of the
    name replaced, and its ``queues`` listed in rq's set of queues.

    Raises:
        SetupError: a live worker of that name is registered.
    """
    if stale:
        log.warning(
            "worker %s: replaced the registration in rq (%s) that a previous worker of "
            "this name left (its process is gone)",
            worker.name,
            worker.key,
        )
        connection.delete(worker.key)
    try:
        worker.register_birth()
    except ValueError as e:  # rq's "There exists an active worker named ..."
        raise SetupError(f"worker name {worker.name!r} is taken: {e}") from None
    except redis.ResponseError as e:
        if not wrong_type(e):
            raise
        # Its set of workers (or of this queue's) is of another type: the rest of the
        # registration went through; rq's listings only lack this worker.
        THROTTLE.warning(
            "rq-workers",
            "rq's set of workers (%s) is of another type: this worker is not listed there (%s)",
            keys.RQ_WORKERS,
            e,
        )
    # rq lists a queue once something was enqueued to it; a served queue is listed
    # (in `mlxq info`, `rq info`) from the moment its first worker starts.
    try:
        connection.sadd(keys.RQ_QUEUES, *(keys.queue_key(q) for q in queues))
    except redis.ResponseError as e:
        if not wrong_type(e):
            raise
        THROTTLE.warning(
            "rq-queues",
            "rq's set of queues (%s) is of another type: these queues are not listed there",
            keys.RQ_QUEUES,
        )


def forget(connection: redis.Redis, worker: BaseWorker) -> None:
    """``worker`` off rq's sets of workers, and its registration gone (not kept a minute marked
    dead, as a clean stop leaves it: this worker never served)."""
    try:
        worker.register_death()
    except redis.ResponseError as e:
        if not wrong_type(e):
            raise
    connection.delete(worker.key)


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
        fields = {text(k): v for k, v in raw_data.items()}
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


def sweep(connection: redis.Redis, queue: str) -> None:
    """rq's registry maintenance for ``queue``, with every job read bounded: expired
    entries leave the finished and failed registries; expired started ones (a run whose
    worker vanished unseen) end failed, as rq's own cleanup does; workers whose
    registration expired leave rq's list of the queue's workers. A registry of another
    type (a rogue write) is skipped with a warning. rq's ready registry is
    left alone: recovering it fetches jobs unbounded, and mlxq jobs never wait on
    dependencies."""
    kw: dict[str, Any] = {"name": queue, "connection": connection, "serializer": MsgpackSerializer}
    for registry in (
        FinishedJobRegistry(**kw),
        _BoundedStartedRegistry(job_class=BoundedJob, **kw),
        FailedJobRegistry(**kw),
    ):
        try:
            registry.cleanup()
        except redis.ResponseError as e:
            if not str(e).startswith("WRONGTYPE"):
                raise
            # A rogue write made it another type: it holds no entry to clean, and the
            # next script that writes it replaces it.
            THROTTLE.warning(registry.key, "sweep: skipped %s: %s", registry.key, e)
    # rq's list of the queue's workers keeps a killed worker until its registration
    # expired and someone cleans it; the reapers read it (Bridge.roll), so it is kept short.
    try:
        clean_worker_registry(Queue(queue, connection=connection))
    except redis.ResponseError as e:
        if not str(e).startswith("WRONGTYPE"):
            raise
        THROTTLE.warning(f"workers of {queue}", "sweep: skipped rq's workers of %s: %s", queue, e)
