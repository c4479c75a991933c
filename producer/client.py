"""What a producer imports: submit jobs, follow their token streams, read results.

Imports neither MLX nor mlx-lm, so it runs in any web backend.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job as RqJob
from rq.job import JobStatus
from rq.utils import as_text

from mlxq.producer import keys
from mlxq.producer.codec import Chunk, MsgpackSerializer, decode_chunk, decode_entries
from mlxq.producer.errors import JobFailed, JobTimeout, MlxqError, NoSuchJob
from mlxq.producer.params import MAX_TOKENS_CAP, GenerationRequest, SamplingParams

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: How long results are kept (rq's default is 500 s; eval sweeps read them later).
DEFAULT_RESULT_TTL = 24 * 3600
#: How long failure records are kept (rq's default is a year; Redis would only grow).
DEFAULT_FAILURE_TTL = 7 * 24 * 3600
#: How often a waiting stream re-reads the replay log, in case a pub/sub message was lost.
POLL_S = 0.5

_STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.DEFERRED: "queued",
    JobStatus.SCHEDULED: "queued",
    JobStatus.CREATED: "queued",
    JobStatus.STARTED: "started",
    JobStatus.FINISHED: "finished",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELED: "canceled",
    JobStatus.STOPPED: "canceled",
}
TERMINAL = frozenset({"finished", "failed", "canceled"})


class QueueFull(MlxqError):
    """The queue holds ``max_queued`` jobs already; try later."""


@dataclass(frozen=True, slots=True)
class Result:
    """A finished job's output.

    Attributes:
        text: The whole completion.
        token_ids: Its tokens (without the end-of-sequence token).
        finish_reason: ``"stop"`` (end of sequence or a stop string) or ``"length"``.
        usage: ``{"prompt_tokens": int, "completion_tokens": int}``.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]

    @classmethod
    def from_value(cls, v: Any) -> Result:
        if not isinstance(v, Mapping):
            raise MlxqError(f"result={v!r}: not an mlxq result")
        return cls(v["text"], list(v["token_ids"]), v["finish_reason"], dict(v["usage"]))


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop: str | Sequence[str] = (),
    seed: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    ttl: float | None = None,
    max_tokens_cap: int = MAX_TOKENS_CAP,
) -> GenerationRequest:
    """Check a submit's arguments; see :meth:`Client.submit`."""
    return GenerationRequest(
        prompt=prompt,
        messages=tuple(messages) if messages is not None else None,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature, top_p, top_k, min_p, seed),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        metadata=dict(metadata) if metadata is not None else None,
        timeout=timeout,
        ttl=ttl,
        max_tokens_cap=max_tokens_cap,
    )


class StreamCursor:
    """Where a listener is in one job's stream: dedupes and orders by ``seq``,
    keeps the deadline, and handles re-runs: chunks of a superseded attempt are
    skipped when replayed, and a listener that already showed some of them gets
    one ``kind="reset"`` chunk, meaning "clear what you showed"."""

    def __init__(self, job_id: str, timeout: float | None) -> None:
        self.job_id = job_id
        self.last = 0
        self.done = False
        self.shown = False
        self.text = ""  # what the caller was shown since the last reset
        self.num_tokens = 0
        self.timeout = timeout
        self._delay = 0.05
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def wait(self) -> float:
        """Seconds to block on pub/sub before re-reading the log.

        Raises:
            JobTimeout: the deadline passed.
        """
        if self.deadline is None:
            return POLL_S
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise JobTimeout(f"job {self.job_id}: no end within {self.timeout} s")
        return min(POLL_S, left)

    def backoff(self) -> float:
        """Seconds to wait before reconnecting: 50 ms doubling to 2 s, within the deadline.

        Raises:
            JobTimeout: the deadline passed.
        """
        delay = min(self._delay, self.wait())
        self._delay = min(self._delay * 2, 2.0)
        return delay

    def accept_all(self, chunks: Sequence[Chunk]) -> Iterator[Chunk]:
        """The chunks a caller should see, in order, each once.

        Raises:
            JobFailed: on an error chunk.
        """
        resets = [i for i, c in enumerate(chunks) if c.kind == "reset" and c.seq > self.last]
        if resets:  # text before the newest reset belongs to a superseded attempt
            chunks = chunks[resets[-1]:]
        for c in chunks:
            if self.done or c.seq <= self.last:
                continue
            self.last = c.seq
            if c.kind == "reset":
                if self.shown:  # the caller saw text that is now void: tell it to clear
                    self.shown, self.text, self.num_tokens = False, "", 0
                    yield c
                continue
            self.shown = True
            self.text += c.text
            self.num_tokens += len(c.token_ids)
            if c.kind == "error":
                self.done = True
                raise JobFailed(self.job_id, c.error or "unknown")
            self.done = c.final
            self._delay = 0.05
            yield c
            self.wait()


class Job:
    """A handle on one submitted job; cheap, holds no connection of its own."""

    def __init__(self, client: Client, job_id: str) -> None:
        self._client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def _rq(self) -> RqJob:
        try:
            return RqJob.fetch(self.id, connection=self._client.redis, serializer=MsgpackSerializer)
        except NoSuchJobError:
            raise NoSuchJob(self.id) from None

    def status(self) -> str:
        """``"queued" | "started" | "finished" | "failed" | "canceled"``.

        Raises:
            NoSuchJob: the job never existed or its records expired.
        """
        raw = self._client.redis.hget(f"rq:job:{self.id}", "status")
        if raw is None:
            raise NoSuchJob(self.id)
        return _STATUS.get(JobStatus(as_text(raw)), "queued")

    def failure_reason(self) -> str:
        """Why a failed job failed (the worker's one-line reason), or ``"canceled"``."""
        if self.status() == "canceled":
            return "canceled"
        res = self._rq().latest_result()
        text = (res.exc_string or "") if res is not None else ""
        return text.strip().splitlines()[-1] if text.strip() else "unknown"

    def stream(self, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield the job's chunks in order, each exactly once, live or replayed.

        Works whenever it is called: before the job starts, while it runs, or
        after it ended (while the replay log lives, ``stream_ttl``).

        Args:
            timeout: Seconds to wait in all; None waits as long as it takes.

        Yields:
            Chunks with ``.text``, ``.token_ids``; the last has ``.finish_reason``.

        Raises:
            JobFailed: the job failed (``.reason`` says why).
            JobTimeout: ``timeout`` passed first.
        """
        cur = StreamCursor(self.id, timeout)
        while not cur.done:
            try:
                yield from self._follow(cur)
            except (redis.ConnectionError, redis.TimeoutError):
                # Redis restarted or dropped us: resume from the last seq seen.
                time.sleep(cur.backoff())

    def _follow(self, cur: StreamCursor) -> Iterator[Chunk]:
        pubsub = self._client.redis.pubsub(ignore_subscribe_messages=True)
        try:
            # Subscribe before the first replay read, so nothing falls between the two.
            pubsub.subscribe(keys.channel(self.id))
            while not cur.done:
                yield from cur.accept_all(self.replay(cur.last))
                if cur.done:
                    return
                if self.end_without_final(cur) is not None:
                    # Ended: read the log once more, then close with whatever it lacks.
                    yield from cur.accept_all(self.replay(cur.last))
                    end = None if cur.done else self.end_without_final(cur)
                    yield from cur.accept_all([end] if end else [])
                    return
                while (msg := pubsub.get_message(timeout=cur.wait())) is not None:
                    c = decode_chunk(msg["data"])
                    if c.seq > cur.last + 1:
                        break  # a gap: fill it from the log
                    yield from cur.accept_all([c])
                    if cur.done:
                        return
        finally:
            pubsub.close()

    def replay(self, after: int) -> list[Chunk]:
        """The job's logged chunks with ``seq > after``."""
        return decode_entries(
            self._client.redis.xrange(keys.stream_key(self.id), min=f"0-{after + 1}"))

    def end_without_final(self, cur: StreamCursor) -> Chunk | None:
        """The chunk that ends the stream of a job that ended with no last chunk in
        its log yet: canceled while queued, failed before a worker wrote to it, or
        finished a moment before its last chunk was written. None while it runs.

        Raises:
            JobFailed: it failed.
        """
        try:
            st = self.status()
        except NoSuchJob:
            raise JobFailed(self.id, "job expired or never existed") from None
        if st == "failed":
            raise JobFailed(self.id, self.failure_reason())
        if st == "canceled":
            return Chunk(seq=cur.last + 1, finish_reason="canceled")
        if st == "finished":
            res = Result.from_value(self._rq().return_value())
            return Chunk(seq=cur.last + 1, text=res.text[len(cur.text):],
                         token_ids=res.token_ids[cur.num_tokens:],
                         finish_reason=res.finish_reason, usage=res.usage)
        return None

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the job to end and return its output.

        Args:
            timeout: Seconds to wait; None waits as long as it takes.

        Raises:
            JobFailed: the job failed or was canceled (``.reason`` says which).
            JobTimeout: ``timeout`` passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        st = self.status()
        if st not in TERMINAL:
            for _ in self.stream(timeout=timeout):
                pass
        # The worker commits the result just after publishing the last chunk.
        while (st := self.status()) not in TERMINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeout(f"job {self.id}: no result within {timeout} s")
            time.sleep(0.01)
        if st != "finished":
            raise JobFailed(self.id, self.failure_reason())
        return Result.from_value(self._rq().return_value())

    def cancel(self) -> bool:
        """Cancel the job: a queued job never runs; a running one leaves its batch
        at the next decode step and its stream ends with ``finish_reason="canceled"``.

        Returns:
            False if the job had already ended, else True.
        """
        st = self.status()
        if st in TERMINAL:
            return False
        r, q = self._client.redis, self._client.queue_name
        if st != "started":
            try:
                job = self._rq()
                job.cancel()
            except InvalidJobOperation:
                return False
            r.expire(job.key, self._client.failure_ttl)  # rq gives canceled jobs no expiry
        # Running, or dequeued into a worker's buffer meanwhile: tell the workers.
        with r.pipeline() as p:
            p.sadd(keys.cancel_set(q), self.id)
            p.publish(keys.cancel_channel(q), self.id)
            p.execute()
        return True


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
        self.redis = connection or redis.Redis.from_url(redis_url)
        self.queue_name = queue
        self.max_tokens_cap = max_tokens_cap
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.max_queued = max_queued
        self._queue = Queue(queue, connection=self.redis, serializer=MsgpackSerializer)

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        ttl: float | None = None,
    ) -> Job:
        """Queue one generation job.

        Args:
            prompt: Raw text, tokenized as is. Give exactly one of prompt / messages.
            messages: Chat turns ``[{"role": ..., "content": ...}]``, rendered with
                the model's chat template.
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

        Returns:
            The job's handle.

        Raises:
            ValueError: (``PayloadError``) naming the bad field and its value;
                nothing reached Redis.
            QueueFull: the queue holds ``max_queued`` jobs.
        """
        return self.submit_many([dict(prompt=prompt, messages=messages, max_tokens=max_tokens,
                                      temperature=temperature, top_p=top_p, top_k=top_k,
                                      min_p=min_p, stop=stop, seed=seed, metadata=metadata,
                                      timeout=timeout, ttl=ttl)])[0]

    def submit_many(self, jobs: Sequence[Mapping[str, Any]]) -> list[Job]:
        """Queue many jobs in one pipelined round trip; each map holds
        :meth:`submit`'s keyword arguments. All are checked before any is sent.

        Raises:
            ValueError: naming the job's index, the field and the value.
            QueueFull: the queue would exceed ``max_queued``.
        """
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
                timeout=-1,  # no SIGALRM inside a batch; mlxq enforces its own deadlines
                result_ttl=self.result_ttl,
                failure_ttl=self.failure_ttl,
            )
            for r in reqs
        ]
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    if self.max_queued is not None:
                        # WATCH makes count-then-enqueue atomic across producers.
                        pipe.watch(self._queue.key)
                        queued = pipe.llen(self._queue.key)
                        if queued + len(reqs) > self.max_queued:
                            raise QueueFull(f"queue {self.queue_name!r} holds {queued} jobs "
                                            f"(max_queued={self.max_queued})")
                        pipe.multi()
                    rq_jobs = self._queue.enqueue_many(datas, pipeline=pipe)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return [Job(self, j.id) for j in rq_jobs]

    def job(self, job_id: str) -> Job:
        """Re-attach to an existing job by id.

        Raises:
            NoSuchJob: no such job (or its records expired).
        """
        j = Job(self, job_id)
        j.status()
        return j

    def close(self) -> None:
        self.redis.close()
