"""What a producer imports: submit jobs, follow their token streams, read results.

:class:`Client` submits; the handle it returns lives in :mod:`mlxq.producer.job` and a
finished job's output in :mod:`mlxq.producer.result`, both importable from here too.
Imports neither MLX nor mlx-lm, so it runs in any web backend.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis
from rq import Queue
from rq.job import JobStatus
from rq.utils import now as rq_now

from mlxq.producer import keys, scripts
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.connection import MAX_WAIT_S, WAIT_TIMEOUT_S, connect
from mlxq.producer.connection import redis_url as resolve_url
from mlxq.producer.connection import wait_replicas as wait_replicas_of
from mlxq.producer.errors import JobIdInUse as JobIdInUse
from mlxq.producer.errors import NotReplicated as NotReplicated
from mlxq.producer.errors import QueueBroken as QueueBroken
from mlxq.producer.errors import QueueFull as QueueFull
from mlxq.producer.job import Job as Job
from mlxq.producer.job import cancel_job as cancel_job
from mlxq.producer.job import end_of as end_of
from mlxq.producer.job import read_end as read_end
from mlxq.producer.job import read_log as read_log
from mlxq.producer.mux import Subscriber
from mlxq.producer.params import MAX_TOKENS_CAP, GenerationRequest, SubmitOptions, check_names
from mlxq.producer.result import MAX_REASON_BYTES as MAX_REASON_BYTES
from mlxq.producer.result import Choice as Choice
from mlxq.producer.result import Result as Result
from mlxq.producer.result import latest_failure as latest_failure
from mlxq.producer.result import latest_fields as latest_fields
from mlxq.producer.result import latest_value as latest_value
from mlxq.producer.result import reason_of as reason_of
from mlxq.producer.result import value_of as value_of
from mlxq.producer.validate import integer_in, number_in

if TYPE_CHECKING:
    from typing import Unpack

DEFAULT_REDIS_URL = keys.DEFAULT_REDIS_URL
DEFAULT_RESULT_TTL = keys.DEFAULT_RESULT_TTL
DEFAULT_FAILURE_TTL = keys.DEFAULT_FAILURE_TTL

#: What a Client's integer settings' errors add: the TTLs among them are in seconds.
TTL_NOTE = " (seconds for TTLs)"
#: Jobs per round trip in ``submit_many``.
SUBMIT_SLICE = 256


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


def _check_queue(queue: Any) -> None:
    if not isinstance(queue, str) or not queue or len(queue) > 128:
        raise ValueError(f"queue={queue!r}: must be a non-empty string of at most 128 chars")


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


class Client:
    """Submit generation jobs to an mlxq queue.

    Args:
        redis_url: ``redis://[user:pass@]host:port/db`` or ``rediss://`` for TLS; None:
            ``$MLXQ_REDIS_URL``, else ``redis://localhost:6379/0`` (as every ``mlxq``
            command does).
        queue: The queue jobs go to unless a submit names another; workers started with
            ``--queue`` of the same name serve it.
        max_tokens_cap: Largest ``max_tokens`` a job may ask for.
        result_ttl: Seconds a finished job's result is kept.
        failure_ttl: Seconds a failed job's record is kept.
        max_queued: Refuse submits (``QueueFull``) when this many jobs wait; None: no cap.
        connection: An existing ``redis.Redis`` to use instead of ``redis_url``.
        wait_replicas: A submit returns only once this many replicas confirm its jobs'
            records (Redis ``WAIT``), else raises ``NotReplicated``; None:
            ``$MLXQ_WAIT_REPLICAS``, else 0 (do not wait).
        wait_timeout: Seconds that ``WAIT`` may take, at most 4 (it holds a connection
            whose reads time out after 5 s).
    """

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str = "default",
        *,
        max_tokens_cap: int = MAX_TOKENS_CAP,
        result_ttl: int = DEFAULT_RESULT_TTL,
        failure_ttl: int = DEFAULT_FAILURE_TTL,
        max_queued: int | None = None,
        connection: redis.Redis | None = None,
        wait_replicas: int | None = None,
        wait_timeout: float = WAIT_TIMEOUT_S,
    ) -> None:
        _check_queue(queue)
        self.wait_replicas = wait_replicas_of(wait_replicas)
        number_in("wait_timeout", wait_timeout, 0.001, MAX_WAIT_S)
        self.wait_timeout = wait_timeout
        for name, value, lo, hi in (
            ("max_tokens_cap", max_tokens_cap, 1, 1 << 24),
            ("result_ttl", result_ttl, 1, keys.MAX_RECORD_TTL),
            ("failure_ttl", failure_ttl, 1, keys.MAX_RECORD_TTL),
        ):
            integer_in(name, value, lo, hi, note=TTL_NOTE)
        if max_queued is not None:
            integer_in("max_queued", max_queued, 0, 1 << 40, note=TTL_NOTE)
        self.redis = connection or connect(resolve_url(redis_url))
        self._subscriber: Subscriber | None = None
        self._subscriber_made = threading.Lock()
        self.queue_name = queue
        self.max_tokens_cap = max_tokens_cap
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.max_queued = max_queued
        self._queue = Queue(queue, connection=self.redis, serializer=MsgpackSerializer)
        self._queues = {queue: self._queue}

    def _rq_queue(self, queue: str | None) -> Queue:
        """The rq queue named ``queue`` (None: the client's own), made on first use."""
        if queue is None:
            return self._queue
        if queue not in self._queues:
            _check_queue(queue)
            self._queues[queue] = Queue(queue, connection=self.redis, serializer=MsgpackSerializer)
        return self._queues[queue]

    def submit(
        self,
        prompt: str | None = None,
        *,
        queue: str | None = None,
        **options: Unpack[SubmitOptions],
    ) -> Job:
        """Queue one generation job.

        Its keyword arguments are the fields of
        :class:`~mlxq.producer.params.GenerationRequest` (and of its sampling and
        logits groups) that declare themselves submit options; their types are
        :class:`~mlxq.producer.params.SubmitOptions`.

        Args:
            prompt: Raw text, tokenized as is. Give exactly one of prompt / messages.
            queue: The queue this job goes to; None: the client's own (``Client(queue=)``).
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
                distribution after penalties, bias and a constraint's mask, before
                temperature and the top_p / top_k / min_p filters, as OpenAI reports them).
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
            response_format: OpenAI's: ``{"type": "text"}`` (no constraint),
                ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
                {"name": ..., "schema": {...}, "strict": true}}``.
            json_schema: The answer is JSON valid against this schema (a map or its
                JSON text), laid out compactly.
            regex: The answer matches this regular expression whole.
            choice: The answer is exactly one of these strings.
            grammar: The answer derives from this grammar's ``start`` rule (Lark, as
                llguidance reads it, or GBNF).
            constraint: A :class:`~mlxq.producer.constraints.Constraint` made already.
                At most one of these six; the answer ends (``finish_reason`` "stop")
                once the constraint allows nothing but its end.
            tools: Functions the model may call, OpenAI's ``[{"type": "function",
                "function": {"name", "description", "parameters"}}]``, rendered through
                the model's chat template (``messages`` only). A chat may then carry an
                assistant turn's ``tool_calls`` (its content None) and ``tool`` turns
                with a ``tool_call_id``.
            tool_choice: ``"auto"`` (with tools, the default: the model may call them,
                in its own format), ``"none"``, ``"required"`` or ``{"type":
                "function", "function": {"name": ...}}``; the last two constrain the
                answer to the JSON of the call(s) (see :mod:`mlxq.producer.tools`).
            parallel_tool_calls: With ``tool_choice="required"``: a list of one or more
                calls (True, the default) or exactly one call.

        Returns:
            The job's handle.

        Raises:
            ValueError: (``PayloadError``) naming the bad field and its value;
                nothing reached Redis.
            TypeError: a keyword argument it does not take.
            QueueFull: the queue holds ``max_queued`` jobs.
            QueueBroken: the queue's Redis key is of another type (a rogue write).
        """
        check_names(options, "Client.submit()")
        return self.submit_many([{"prompt": prompt, **options}], queue=queue)[0]

    def submit_many(
        self,
        jobs: Sequence[Mapping[str, Any]],
        *,
        job_ids: Sequence[str] | None = None,
        queue: str | None = None,
    ) -> list[Job]:
        """Queue many jobs in one pipelined round trip; each map holds
        :meth:`submit`'s keyword arguments. All are checked before any is sent.

        Args:
            jobs: One map of :meth:`submit` arguments per job (typed, for a checker, by
                annotating them :class:`~mlxq.producer.params.JobOptions`).
            job_ids: The jobs' ids, chosen by the caller (letters, digits, ``_`` and
                ``-``), so it can record them before submitting (``mlxq run-batch`` does,
                to re-attach after a crash instead of submitting again). Each must be
                new, or an ended job's (its records, result and log are replaced by the
                new job's); the id of a job still queued or running is refused, and so
                the whole call, unless that job holds the same request (a retried
                submit: it is left as it is, queued once). None: fresh uuids.
            queue: The queue these jobs go to; None: the client's own. ``max_queued``
                caps each queue on its own.

        Nothing is queued unless every job is: each slice is one atomic script.

        Raises:
            ValueError: naming the job's index, the field and the value, or a bad queue.
            JobIdInUse: (a ``ValueError``) naming the id that is a live job's.
            QueueFull: the queue would exceed ``max_queued``.
            QueueBroken: the queue's Redis key is of another type (a rogue write).
            NotReplicated: fewer than ``wait_replicas`` replicas confirmed the records in
                time; the jobs may still run. Submitting again with ``job_ids=e.job_ids``
                is safe: a job still live with the same request is not queued twice.
        """
        q = self._rq_queue(queue)
        ids = _check_ids(job_ids, len(jobs))
        reqs = []
        for i, kw in enumerate(jobs):
            try:
                reqs.append(build_request(**kw, max_tokens_cap=self.max_tokens_cap))
            except TypeError as e:
                raise ValueError(f"jobs[{i}]: {e}") from None
            except ValueError as e:
                raise type(e)(f"jobs[{i}]: {e}" if len(jobs) > 1 else str(e)) from None
        records = [self._record(q, r, job_id) for r, job_id in zip(reqs, ids, strict=True)]
        return self._send(q, records, ids)

    def _submit_each(
        self, jobs: Sequence[Mapping[str, Any]], queue: str | None = None
    ) -> list[Job | Exception]:
        """Queue jobs that were asked for one by one (:meth:`submit`'s keyword arguments
        each) in one round trip: each job's outcome on its own, its handle or the error
        :meth:`submit` would have raised for it alone. What one job lacks fails it only;
        where the queue's cap refuses the group, each job is sent by itself, so the cap
        counts them as it would one at a time. How :class:`AsyncClient` sends submits
        that arrive together."""
        q = self._rq_queue(queue)
        out: list[Job | Exception | None] = [None] * len(jobs)
        records: list[tuple[int, tuple[str, Any]]] = []  # each its index in out
        for i, kw in enumerate(jobs):
            try:
                req = build_request(**kw, max_tokens_cap=self.max_tokens_cap)
            except (TypeError, ValueError) as e:
                out[i] = e
                continue
            records.append((i, self._record(q, req, None)))
        if records:
            sent = self._send_group(q, [r for _, r in records])
            for (i, _), got in zip(records, sent, strict=True):
                out[i] = got
        return [o for o in out if o is not None]

    def _send_group(self, q: Queue, records: list[tuple[str, Any]]) -> list[Job | Exception]:
        """Records of jobs asked for one by one, sent in one script where the cap lets
        them: each job's handle, or the error sending it alone would have raised."""
        try:
            return list(self._send(q, records, []))
        except QueueFull as e:
            if len(records) == 1:
                return [e]
            return [got for r in records for got in self._send_group(q, [r])]
        except NotReplicated as e:
            return [
                NotReplicated(e.asked, e.reached, self.wait_timeout, [job_id])
                for job_id, _ in records
            ]

    def _send(self, q: Queue, records: list[tuple[str, Any]], ids: list[str | None]) -> list[Job]:
        """Enqueue rq records (each its id and fields) in as few scripts as the cap allows;
        ``ids``: the ids the caller chose, one per record or none.

        Raises:
            QueueFull, QueueBroken, JobIdInUse, NotReplicated: as :meth:`submit_many`.
        """
        # One slice when capped: the cap is checked against all of them at once. Else in
        # slices, so a worker starts on the first jobs of a big sweep while the rest are
        # still being sent; the first slice checks every id the caller chose, so an id in
        # use refuses the whole call before anything is queued.
        ids = ids or [None] * len(records)
        step = max(1, len(records)) if self.max_queued is not None else SUBMIT_SLICE
        chosen = [
            (r[0], scripts.digest(r[1])) for r, j in zip(records, ids, strict=True) if j is not None
        ]
        handles: list[Job] = []
        for i in range(0, len(records), step):
            part = records[i : i + step]
            later = chosen[i + step :] if i == 0 else []
            (verdict,), reached = scripts.run_waited(
                self.redis,
                [scripts.submit(q.key, self.max_queued, part, check_too=later)],
                self.wait_replicas,
                int(self.wait_timeout * 1000),
            )
            _refused(verdict, q, self.max_queued, ids)
            if reached < self.wait_replicas:
                every = [job_id for job_id, _ in records]
                raise NotReplicated(self.wait_replicas, reached, self.wait_timeout, every)
            handles += [Job(self, job_id) for job_id, _ in part]
        return handles

    def _record(self, q: Queue, req: GenerationRequest, job_id: str | None) -> tuple[str, Any]:
        """A job's id and rq's record of it, as rq's ``enqueue_many`` would write it."""
        job = q.create_job(
            keys.JOB_FUNC,
            args=(req.to_payload(),),
            description="mlxq generation",  # rq's default would copy the prompt
            timeout=-1,  # no SIGALRM inside a batch; mlxq enforces its own deadlines
            result_ttl=self.result_ttl,
            failure_ttl=self.failure_ttl,
            job_id=job_id,
            status=JobStatus.QUEUED,
        )
        job.origin, job.enqueued_at = q.name, rq_now()
        return job.id, job.to_dict()

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
        """The one pub/sub connection all of this client's streams share (made once, by
        whichever of the threads that stream first gets there)."""
        if self._subscriber is None:
            with self._subscriber_made:
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


def _refused(verdict: list[str], q: Queue, cap: int | None, ids: list[str | None]) -> None:
    """Raise why the submit script wrote nothing, if it did not write.

    Raises:
        QueueBroken: the queue's key is of another type.
        QueueFull: the queue holds ``cap`` jobs.
        JobIdInUse: a chosen id is a live job's, or its key is no job record.
        redis.exceptions.OutOfMemoryError: Redis refused the write.
    """
    what, *rest = verdict
    if what == "ok":
        return
    if what == "queue":
        raise QueueBroken(
            f"queue {q.name!r}: its key {q.key} holds a {rest[0]}, not a list (a rogue "
            "write): nothing can be queued there until it is deleted (it holds no job)"
        )
    if what == "full":
        raise QueueFull(f"queue {q.name!r} holds {rest[0]} jobs (max_queued={cap})")
    if what == "oom":
        raise redis.exceptions.OutOfMemoryError("submit: refused by Redis (out of memory)")
    job_id, detail = rest
    where = f"job_ids[{ids.index(job_id)}]={job_id!r}" if job_id in ids else f"job {job_id!r}"
    if what == "live":
        raise JobIdInUse(
            f"{where}: a job of this id is still {detail or 'without a status'}, not ended: "
            "an id must be new (or an ended job's, which it replaces)"
        )
    raise JobIdInUse(f"{where}: its key {keys.job_key(job_id)} holds a {detail}, not a job")
