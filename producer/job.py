"""A handle on one submitted job, and the reads behind it: its status, its replay log,
its end.

:meth:`Job.stream` is the sync shell of the follow protocol (:mod:`mlxq.producer.stream`);
the async shell shares :func:`end_of`, and ``mlxq cancel`` and run-batch :func:`cancel_job`;
the dashboard's retry button :func:`retry_job`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import redis

from mlxq.producer import admin, keys, scripts
from mlxq.producer.codec import Chunk, decode_job_data
from mlxq.producer.connection import TRANSIENT, backoff
from mlxq.producer.errors import JobFailed, JobTimeout, MlxqError, NoSuchJob, PayloadError
from mlxq.producer.mux import RESYNC
from mlxq.producer.outcome import TERMINAL, Outcome, job_status
from mlxq.producer.result import (
    Result,
    latest_failure,
    latest_fields,
    latest_value,
    reason_of,
    value_of,
)
from mlxq.producer.stream import DONE, END, READ_LOG, STATUS, WAIT, Follow

if TYPE_CHECKING:
    from mlxq.producer.client import Client

log = logging.getLogger("mlxq.producer")


class Job:
    """A handle on one submitted job; cheap, holds no connection of its own."""

    def __init__(self, client: Client, job_id: str) -> None:
        self._client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    @property
    def _redis(self) -> redis.Redis:
        return self._client.redis

    def status(self) -> str:
        """``"queued" | "started" | "finished" | "failed" | "canceled"``.

        Raises:
            NoSuchJob: the job never existed or its records expired.
        """
        st = job_status(self._redis.hget(keys.job_key(self.id), "status"))
        if st is None:
            raise NoSuchJob(f"no job {self.id!r} (never submitted, or its records expired)")
        return st

    def metadata(self) -> dict[str, Any] | None:
        """The ``metadata`` map the job was submitted with; None if it had none.

        Read from the job's stored payload with a size limit (never unpickled).

        Raises:
            NoSuchJob: the job never existed or its records expired.
            PayloadError: the stored job is not an mlxq job (written by something else).
        """
        raw = self._redis.hget(keys.job_key(self.id), "data")
        if not isinstance(raw, bytes):
            raise NoSuchJob(f"no job {self.id!r} (never submitted, or its records expired)")
        payload = decode_job_data(raw)
        meta = payload.get("metadata") if isinstance(payload, Mapping) else None
        if meta is not None and not isinstance(meta, Mapping):
            raise PayloadError(f"metadata={meta!r}: stored metadata is not a map")
        return None if meta is None else dict(meta)

    def failure_reason(self) -> str:
        """Why a failed job failed (the worker's one-line reason), or ``"canceled"``."""
        if self.status() == Outcome.CANCELED:
            return "canceled"
        return latest_failure(self._redis, self.id)

    def stream(self, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield the job's chunks in order, each exactly once, live or replayed.

        Works whenever it is called: before the job starts, while it runs, or
        after it ended (while the replay log lives, ``stream_ttl``).

        Args:
            timeout: Seconds to wait in all; None waits as long as it takes.

        Yields:
            Chunks with ``.text``, ``.token_ids``; the last has ``.finish_reason``.
            A ``kind="reset"`` chunk means the job restarted: clear what you showed.

        Raises:
            JobFailed: the job failed (``.reason`` says why).
            JobTimeout: ``timeout`` passed first.
        """
        follow = Follow(self.id, timeout)
        failures = 0
        while follow.next() != DONE:
            try:
                yield from self._follow(follow)
                failures = 0
            except TRANSIENT:
                # Redis restarted or dropped us: resume from the last seq seen.
                failures += 1
                time.sleep(min(backoff().compute(failures), follow.wait_s()))

    def _follow(self, follow: Follow) -> Iterator[Chunk]:
        # Subscribed (confirmed) before the first log read, so nothing falls between.
        sub = self._client.subscriber.subscribe(keys.channel(self.id))
        try:
            while (action := follow.next()) != DONE:
                if action == READ_LOG:
                    yield from follow.on_log(read_log(self._redis, self.id, follow.after))
                elif action == WAIT:
                    data = sub.get(follow.wait_s())
                    yield from follow.on_message(None if data == RESYNC else data)
                elif action == STATUS:
                    yield from follow.on_status(
                        job_status(self._redis.hget(keys.job_key(self.id), "status"))
                    )
                elif action == END:
                    yield from follow.on_end(*read_end(self._redis, self.id))
        finally:
            sub.close()

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the job to end and return its output.

        Args:
            timeout: Seconds to wait; None waits as long as it takes.

        Raises:
            JobFailed: the job failed or was canceled (``.reason`` says which).
            JobTimeout: ``timeout`` passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.status() not in TERMINAL:
            for _ in self.stream(timeout=timeout):
                pass
        while (st := self.status()) not in TERMINAL:  # a moment, after a synthesized end
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeout(f"job {self.id}: no result within {timeout} s")
            time.sleep(0.01)
        if st != Outcome.FINISHED:
            raise JobFailed(self.id, self.failure_reason())
        value = latest_value(self._redis, self.id)
        if value is None:
            raise JobFailed(self.id, "its result expired")
        return Result.from_value(value)

    def cancel(self) -> bool:
        """Cancel the job: a queued job never runs; a running one leaves its batch at the
        next decode step and its stream ends with ``finish_reason="canceled"``.

        Returns:
            True if the job will end canceled; False if it had already ended.

        Raises:
            NoSuchJob: the job never existed or its records expired.
        """
        verdict = cancel_job(self._redis, self.id)
        if verdict == "nosuch":
            raise NoSuchJob(f"no job {self.id!r} (never submitted, or its records expired)")
        return verdict in ("canceled", "requested")

    def retry(self) -> bool:
        """Requeue a job that failed or was canceled: the same request runs again, as a
        new attempt at the queue's end (``mlxq retry``). Its old stream is dropped; a
        listener that showed it gets a ``kind="reset"`` chunk, then the new run's text.

        Returns:
            True if it was requeued; False if it had not failed or been canceled.

        Raises:
            NoSuchJob: the job never existed or its records expired.
            MlxqError: Redis refused the write, or the job's record names no usable queue.
        """
        (verdict,) = admin.retry(self._redis, [self.id])
        if verdict == "nosuch":
            raise NoSuchJob(f"no job {self.id!r} (never submitted, or its records expired)")
        if verdict in admin.RETRY_ERRORS:
            raise MlxqError(f"job {self.id}: {admin.RETRY_ERRORS[verdict]}")
        return verdict == "requeued"


def read_log(connection: redis.Redis, job_id: str, after: int) -> Any:
    """The job's logged entries from seq ``after``; none when its log is not a stream
    (a rogue key: the job's state then says how it ended)."""
    try:
        return connection.xrange(keys.stream_key(job_id), min=f"0-{after}")
    except redis.ResponseError as e:
        log.warning("job %s: its log cannot be read (%s)", job_id, e)
        return []


def cancel_job(connection: redis.Redis, job_id: str) -> str:
    """Run the cancel script: ``nosuch``, ``ended``, ``canceled`` or ``requested``."""
    return scripts.call(connection, scripts.cancel(job_id, datetime.now(timezone.utc)))


def retry_job(connection: redis.Redis, job_id: str) -> str:
    """Requeue a failed or canceled job with its original request, as a new attempt at the
    back of its queue (see ``lua/retry.lua``), atomically.

    Returns:
        ``requeued``; ``nosuch`` (no such job), ``active`` (queued or running),
        ``finished``, ``noqueue`` (its record names no queue one can push to) or ``oom``
        (Redis is out of memory): nothing was changed.
    """
    verdict = scripts.call(connection, scripts.retry(job_id, datetime.now(timezone.utc)))
    if verdict in ("requeued", "nosuch", "oom", "noqueue", "finished"):
        return verdict
    # The script answers a queue key of another type, or a status that did not end.
    return "noqueue" if verdict == "badqueue" else "active"


def end_of(raw_status: Any, fields: dict[bytes, bytes] | None) -> tuple[Any, ...]:
    """What :meth:`Follow.on_end` takes, from the job's status and latest result entry."""
    st = job_status(raw_status)
    if st == Outcome.FINISHED:
        v = value_of(fields)
        if isinstance(v, Mapping):
            return (
                st,
                v.get("text"),
                v.get("token_ids"),
                v.get("finish_reason"),
                v.get("usage"),
                None,
            )
    if st == Outcome.FAILED:
        return st, None, None, None, None, reason_of(fields)
    return st, None, None, None, None, None


def read_end(connection: redis.Redis, job_id: str) -> tuple[Any, ...]:
    """What :meth:`Follow.on_end` takes, read in one round trip."""
    with connection.pipeline(transaction=False) as p:
        p.hget(keys.job_key(job_id), "status")
        p.xrevrange(keys.results_key(job_id), count=1)
        raw, entries = p.execute()
    return end_of(raw, latest_fields(entries))
