"""What a producer imports: submit jobs, follow their token streams, read results.

Imports neither MLX nor mlx-lm, so it runs in any web backend.
"""

from __future__ import annotations

import base64
import logging
import re
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Queue

from mlxq.producer import keys, scripts
from mlxq.producer.codec import Chunk, MsgpackSerializer, decode_job_data
from mlxq.producer.connection import TRANSIENT, backoff, connect
from mlxq.producer.errors import JobFailed, JobTimeout, MlxqError, NoSuchJob, PayloadError
from mlxq.producer.errors import QueueFull as QueueFull
from mlxq.producer.mux import RESYNC, Subscriber
from mlxq.producer.params import MAX_TOKENS_CAP, GenerationRequest, check_names
from mlxq.producer.stream import DONE, END, READ_LOG, STATUS, TERMINAL, WAIT, Follow
from mlxq.producer.validate import integer_in

log = logging.getLogger("mlxq.producer")

DEFAULT_REDIS_URL = keys.DEFAULT_REDIS_URL
DEFAULT_RESULT_TTL = keys.DEFAULT_RESULT_TTL
DEFAULT_FAILURE_TTL = keys.DEFAULT_FAILURE_TTL
#: Most bytes of a failure reason read back (rq stores it compressed: never inflated
#: past this, whatever a rogue record holds).
MAX_REASON_BYTES = 64 * 1024

#: What a Client's integer settings' errors add: the TTLs among them are in seconds.
TTL_NOTE = " (seconds for TTLs)"
#: Jobs per round trip in ``submit_many``.
SUBMIT_SLICE = 256

_STATUS = {
    "queued": "queued",
    "deferred": "queued",
    "scheduled": "queued",
    "created": "queued",
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "canceled": "canceled",
    "stopped": "canceled",
}


@dataclass(frozen=True, slots=True)
class Choice:
    """One sample of a job's prompt (a job asking ``n=3`` has three).

    Attributes:
        index: 0 to n - 1.
        text, token_ids, finish_reason: As :class:`Result`'s, for this sample.
        logprobs: With ``logprobs=True``, one entry per token of ``token_ids``, in
            OpenAI's chat shape: ``{"token", "logprob", "bytes", "top_logprobs":
            [{"token", "logprob", "bytes"}, ...]}``; else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Result:
    """A finished job's output.

    Attributes:
        text: The whole completion (of the first choice when ``n > 1``).
        token_ids: Its tokens (without the end-of-sequence token).
        finish_reason: ``"stop"`` (end of sequence, a stop string or stop token) or
            ``"length"``.
        usage: ``{"prompt_tokens": int, "completion_tokens": int}`` (every choice's).
        choices: Every sample, ``choices[0]`` being the one above.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.choices:
            object.__setattr__(
                self, "choices", [Choice(0, self.text, self.token_ids, self.finish_reason)]
            )

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        return self.choices[0].logprobs

    @classmethod
    def from_value(cls, v: Any) -> Result:
        if not isinstance(v, Mapping):
            raise MlxqError(f"result={v!r}: not an mlxq result")
        raw = v.get("choices") or [{**v, "index": 0}]
        choices = [
            Choice(
                int(c["index"]),
                c["text"],
                list(c["token_ids"]),
                c["finish_reason"],
                c.get("logprobs"),
            )
            for c in raw
        ]
        first = choices[0]
        return cls(first.text, first.token_ids, first.finish_reason, dict(v["usage"]), choices)


def build_request(
    prompt: str | None = None, *, max_tokens_cap: int = MAX_TOKENS_CAP, **options: Any
) -> GenerationRequest:
    """Check a submit's arguments (those of :meth:`Client.submit`) and make the request.

    Raises:
        TypeError: a keyword :meth:`Client.submit` does not take, or an argument of the
            wrong shape to convert (``stop=5``).
        PayloadError: (a ``ValueError``) naming the field and the bad value.
    """
    check_names(options, "build_request()")
    arguments = {"prompt": prompt, **options}
    return GenerationRequest.from_arguments(arguments, max_tokens_cap=max_tokens_cap)


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
        st = _status(self._redis.hget(keys.job_key(self.id), "status"))
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
        if self.status() == "canceled":
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
                        _status(self._redis.hget(keys.job_key(self.id), "status"))
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
        if st != "finished":
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


_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _check_ids(job_ids: Sequence[str] | None, n: int) -> list[str | None]:
    if job_ids is None:
        return [None] * n
    if isinstance(job_ids, str) or len(job_ids) != n:
        raise ValueError(f"job_ids: give one id per job ({n})")
    for i, job_id in enumerate(job_ids):
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
            raise ValueError(
                f"job_ids[{i}]={job_id!r}: must be 1 to 128 letters, digits, '_' or '-'"
            )
    if len(set(job_ids)) != n:
        raise ValueError("job_ids: must be distinct")
    return list(job_ids)


def _status(raw: Any) -> str | None:
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return _STATUS.get(text, "queued")


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


def _latest_result(connection: redis.Redis, job_id: str) -> dict[bytes, bytes] | None:
    return latest_fields(connection.xrevrange(keys.results_key(job_id), count=1))


def latest_fields(entries: Any) -> dict[bytes, bytes] | None:
    """The fields of the newest entry of an XREVRANGE reply of rq's result log."""
    return dict(entries[0][1]) if entries else None


def value_of(fields: dict[bytes, bytes] | None) -> Any:
    """The return value in a successful rq result entry, or None."""
    if not fields or fields.get(b"type") != b"1" or b"return_value" not in fields:
        return None
    return MsgpackSerializer.loads(base64.b64decode(fields[b"return_value"]))


def reason_of(fields: dict[bytes, bytes] | None) -> str:
    """The last line of a failed rq result entry's reason, inflated with a size limit."""
    raw = (fields or {}).get(b"exc_string")
    if not raw:
        return "unknown"
    try:
        text = zlib.decompressobj().decompress(base64.b64decode(raw), MAX_REASON_BYTES)
    except (ValueError, zlib.error):
        return "unknown (its failure record is unreadable)"
    lines = text.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "unknown"


def latest_value(connection: redis.Redis, job_id: str) -> Any:
    """The return value of the job's latest successful run (rq's result log), or None."""
    return value_of(_latest_result(connection, job_id))


def latest_failure(connection: redis.Redis, job_id: str) -> str:
    """The last line of the job's latest failure reason, read with a size limit."""
    return reason_of(_latest_result(connection, job_id))


def end_of(raw_status: Any, fields: dict[bytes, bytes] | None) -> tuple[Any, ...]:
    """What :meth:`Follow.on_end` takes, from the job's status and latest result entry."""
    st = _status(raw_status)
    if st == "finished":
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
    if st == "failed":
        return st, None, None, None, None, reason_of(fields)
    return st, None, None, None, None, None


def read_end(connection: redis.Redis, job_id: str) -> tuple[Any, ...]:
    with connection.pipeline(transaction=False) as p:
        p.hget(keys.job_key(job_id), "status")
        p.xrevrange(keys.results_key(job_id), count=1)
        raw, entries = p.execute()
    return end_of(raw, latest_fields(entries))


class Client:
    """Submit generation jobs to an mlxq queue.

    Args:
        redis_url: ``redis://[user:pass@]host:port/db`` or ``rediss://`` for TLS.
        queue: Queue name; workers started with ``--queue`` of the same name serve it.
        max_tokens_cap: Largest ``max_tokens`` a job may ask for.
        result_ttl: Seconds a finished job's result is kept.
        failure_ttl: Seconds a failed job's record is kept.
        max_queued: Refuse submits (``QueueFull``) when this many jobs wait; None: no cap.
        connection: An existing ``redis.Redis`` to use instead of ``redis_url``.
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        queue: str = "default",
        *,
        max_tokens_cap: int = MAX_TOKENS_CAP,
        result_ttl: int = DEFAULT_RESULT_TTL,
        failure_ttl: int = DEFAULT_FAILURE_TTL,
        max_queued: int | None = None,
        connection: redis.Redis | None = None,
    ) -> None:
        if not isinstance(queue, str) or not queue or len(queue) > 128:
            raise ValueError(f"queue={queue!r}: must be a non-empty string of at most 128 chars")
        for name, value, lo, hi in (
            ("max_tokens_cap", max_tokens_cap, 1, 1 << 24),
            ("result_ttl", result_ttl, 1, keys.MAX_RECORD_TTL),
            ("failure_ttl", failure_ttl, 1, keys.MAX_RECORD_TTL),
        ):
            integer_in(name, value, lo, hi, note=TTL_NOTE)
        if max_queued is not None:
            integer_in("max_queued", max_queued, 0, 1 << 40, note=TTL_NOTE)
        self.redis = connection or connect(redis_url)
        self._subscriber: Subscriber | None = None
        self.queue_name = queue
        self.max_tokens_cap = max_tokens_cap
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.max_queued = max_queued
        self._queue = Queue(queue, connection=self.redis, serializer=MsgpackSerializer)

    def submit(self, prompt: str | None = None, **options: Any) -> Job:
        """Queue one generation job.

        Its keyword arguments are the fields of
        :class:`~mlxq.producer.params.GenerationRequest` (and of its sampling and
        logits groups) that declare themselves submit options.

        Args:
            prompt: Raw text, tokenized as is. Give exactly one of prompt / messages.
            messages: Chat turns ``[{"role": ..., "content": ...}]``, rendered with
                the model's chat template; a turn may carry a ``"name"``, and its content
                may be a list of text parts ``[{"type": "text", "text": ...}]`` (joined).
            max_tokens: Most tokens to generate, 1 to ``max_tokens_cap``.
            temperature: 0 is greedy (argmax); as in mlx-lm's ``make_sampler``.
            top_p: Nucleus mass in (0, 1]; 1 disables it.
            top_k: Keep the k most likely tokens; 0 disables it.
            min_p: Relative probability floor in [0, 1]; 0 disables it.
            stop: Strings that end the completion (not included in the text).
            seed: Per-job seed: the same tokens whether the job runs alone or batched.
            metadata: Your own map, stored with the job.
            timeout: Seconds the job may run once started; past it, it fails
                ("timeout: ..."). None: no limit.
            ttl: Seconds the job may wait in the queue; a job not started by then
                fails ("ttl expired: ..."). None: no limit.
            n: Samples of the prompt, 1 to 16, as ``Result.choices``; choice i of a
                seeded job is seeded ``seed + i``.
            logprobs: Report each sampled token's log-probability (of the model's
                distribution after penalties and bias, before temperature and the
                top_p / top_k / min_p filters, as OpenAI reports them).
            top_logprobs: With ``logprobs``, also the 0 to 20 most likely tokens.
            presence_penalty: In [-2, 2]: subtracted once from the logit of each
                token among the last 20 of prompt and output (OpenAI's meaning).
            frequency_penalty: In [-2, 2]: subtracted once per occurrence there.
            repetition_penalty: > 0, as mlx-lm's (x * p if x < 0 else x / p for
                each token among the last 20); None or 1 disables it.
            logit_bias: Token id to a bias in [-100, 100] added to its logit.
            stop_token_ids: Token ids that end the completion (kept out of it).
            min_tokens: Until this many tokens are made, end-of-sequence and
                ``stop_token_ids`` cannot be sampled.

        Returns:
            The job's handle.

        Raises:
            ValueError: (``PayloadError``) naming the bad field and its value;
                nothing reached Redis.
            TypeError: a keyword argument it does not take.
            QueueFull: the queue holds ``max_queued`` jobs.
        """
        check_names(options, "Client.submit()")
        return self.submit_many([{"prompt": prompt, **options}])[0]

    def submit_many(
        self, jobs: Sequence[Mapping[str, Any]], *, job_ids: Sequence[str] | None = None
    ) -> list[Job]:
        """Queue many jobs in one pipelined round trip; each map holds
        :meth:`submit`'s keyword arguments. All are checked before any is sent.

        Args:
            jobs: One map of :meth:`submit` arguments per job.
            job_ids: The jobs' ids, chosen by the caller (letters, digits, ``_`` and
                ``-``), so it can record them before submitting (``mlxq run-batch`` does,
                to re-attach after a crash instead of submitting again). Each must be
                new: a job with the same id would be overwritten. None: fresh uuids.

        Raises:
            ValueError: naming the job's index, the field and the value.
            QueueFull: the queue would exceed ``max_queued``.
        """
        ids = _check_ids(job_ids, len(jobs))
        reqs = []
        for i, kw in enumerate(jobs):
            try:
                reqs.append(build_request(**kw, max_tokens_cap=self.max_tokens_cap))
            except TypeError as e:
                raise ValueError(f"jobs[{i}]: {e}") from None
            except ValueError as e:
                raise type(e)(f"jobs[{i}]: {e}" if len(jobs) > 1 else str(e)) from None
        datas = [
            Queue.prepare_data(
                keys.JOB_FUNC,
                args=(r.to_payload(),),
                description="mlxq generation",  # rq's default would copy the prompt
                timeout=-1,  # no SIGALRM inside a batch; mlxq enforces its own deadlines
                result_ttl=self.result_ttl,
                failure_ttl=self.failure_ttl,
                job_id=job_id,
            )
            for r, job_id in zip(reqs, ids, strict=True)
        ]
        if self.max_queued is not None:
            return self._enqueue_capped(datas, self.max_queued)
        handles: list[Job] = []
        # In slices, so a worker starts on the first jobs of a big sweep while the rest
        # are still being sent.
        for i in range(0, len(datas), SUBMIT_SLICE):
            with self.redis.pipeline() as pipe:
                rq_jobs = self._queue.enqueue_many(datas[i : i + SUBMIT_SLICE], pipeline=pipe)
                pipe.execute()
            handles += [Job(self, j.id) for j in rq_jobs]
        return handles

    def _enqueue_capped(self, datas: list[Any], cap: int) -> list[Job]:
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    # WATCH makes count-then-enqueue atomic across producers.
                    pipe.watch(self._queue.key)
                    queued = pipe.llen(self._queue.key)
                    if queued + len(datas) > cap:
                        raise QueueFull(
                            f"queue {self.queue_name!r} holds {queued} jobs (max_queued={cap})"
                        )
                    pipe.multi()
                    rq_jobs = self._queue.enqueue_many(datas, pipeline=pipe)
                    pipe.execute()
                    return [Job(self, j.id) for j in rq_jobs]
                except redis.WatchError:
                    continue

    def job(self, job_id: str) -> Job:
        """Re-attach to an existing job by id.

        Raises:
            NoSuchJob: no such job (or its records expired).
        """
        j = Job(self, job_id)
        j.status()
        return j

    @property
    def subscriber(self) -> Subscriber:
        """The one pub/sub connection all of this client's streams share."""
        if self._subscriber is None:
            self._subscriber = Subscriber(self.redis)
        return self._subscriber

    def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
