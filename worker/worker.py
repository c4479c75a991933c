"""The single MLX worker: Redis in, continuous batches through the engine, tokens out.

Each turn of the loop is schedule -> run -> postprocess: take jobs from rq into
a local buffer (waiting up to ``window_ms`` for company when idle), admit them
into free batch rows, run one engine step, and hand the step's chunks to the
sink thread. All MLX work stays on this one thread.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
from rq.job import Job
from rq.utils import as_text
from rq.utils import now as rq_now

from mlxq.batching.admission import AdmissionPolicy, Pending, Window, admit
from mlxq.producer import keys
from mlxq.producer.codec import Chunk, MsgpackSerializer, decode_entries
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import MAX_TOKENS_CAP, GenerationRequest
from mlxq.worker.cancels import CancelListener
from mlxq.worker.engine import Engine
from mlxq.worker.liveness import Liveness
from mlxq.worker.rqbridge import RqBridge, Running, decode_job
from mlxq.worker.sink import DEFAULT_STREAM_TTL, Out, Sink

log = logging.getLogger("mlxq.worker")

#: Default time window. 20 ms is short beside a single decode step of any real
#: model, yet long enough that a burst of submits shares one prefill pass.
DEFAULT_WINDOW_MS = 20.0
#: Default batch cap. mlx-lm's own default; tokens/s keeps rising past it on a
#: GPU (64 is a good choice there), while on a CPU larger batches mostly add latency.
DEFAULT_MAX_BATCH = 32
#: While decoding, look for new jobs at most this often (each look is a round trip).
POLL_S = 0.005
HEARTBEAT_S = 5.0
STATS_TTL = 60
#: How often deadlines (per-job timeout, ttl) are checked.
DEADLINE_CHECK_S = 0.1
#: A job started this many times (its worker died or its batch errored each time)
#: is failed instead of started again: one poison job cannot take workers down forever.
MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything ``mlxq worker`` takes; checked on construction.

    Args:
        model: mlx-lm model path or Hugging Face repo id.
        redis_url: Redis URL (``redis://``, ``rediss://``, with credentials).
        queue: Queue to serve.
        window_ms: How long an idle worker waits after a first job for others
            to share its prefill batch.
        max_batch: Most jobs decoding at once.
        name: Worker name; default ``host.pid.random`` (rq refuses reused names).
        grace_s: On SIGTERM, how long in-flight jobs may run before they are requeued.
        max_tokens_cap: Largest ``max_tokens`` the worker accepts.
        stream_ttl: Seconds a job's replay log lives after its last chunk.
        max_wait_steps: Admission ageing bound (see ``mlxq.batching.admission``).
    """

    model: str
    redis_url: str = "redis://localhost:6379/0"
    queue: str = "default"
    window_ms: float = DEFAULT_WINDOW_MS
    max_batch: int = DEFAULT_MAX_BATCH
    name: str | None = None
    grace_s: float = 30.0
    max_tokens_cap: int = MAX_TOKENS_CAP
    stream_ttl: int = DEFAULT_STREAM_TTL
    max_wait_steps: int = 32

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError(f"model={self.model!r}: give a model path or repo id")
        if not 0 <= self.window_ms <= 60_000:
            raise ValueError(f"window_ms={self.window_ms!r}: must be in [0, 60000]")
        if not 1 <= self.max_batch <= 4096:
            raise ValueError(f"max_batch={self.max_batch!r}: must be in [1, 4096]")
        if self.grace_s < 0:
            raise ValueError(f"grace_s={self.grace_s!r}: must be >= 0")
        if not self.queue:
            raise ValueError(f"queue={self.queue!r}: must not be empty")
        if self.stream_ttl < 1:
            raise ValueError(f"stream_ttl={self.stream_ttl!r}: must be >= 1 second")
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap={self.max_tokens_cap!r}: must be >= 1")
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps={self.max_wait_steps!r}: must be >= 0")


class Worker:
    """Runs until SIGTERM/SIGINT (or :meth:`stop`); see :class:`WorkerConfig`."""

    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.name = config.name or f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        self.redis = redis.Redis.from_url(config.redis_url, health_check_interval=30)
        self.engine = engine or Engine.load(config.model, max_batch=config.max_batch)
        self.rq = RqBridge(self.redis, config.queue, self.name)
        self.policy = AdmissionPolicy(config.max_batch, config.max_wait_steps)
        self.window = Window(config.window_ms / 1000, config.max_batch)
        self.pending: dict[str, tuple[Pending, Job, GenerationRequest]] = {}
        self.running: dict[str, Running] = {}
        self.fresh: set[str] = set()  # admitted since the last good step: suspects if it fails
        self.steps = 0
        self.jobs_done = Counter[str]()
        self._stop = threading.Event()
        self._reaped = threading.Event()
        self._last_poll = self._last_beat = self._last_deadline_check = 0.0
        self.sink = Sink(self.redis, stream_ttl=config.stream_ttl)
        self.cancels = CancelListener(self.redis, config.queue)
        self.liveness = Liveness(self.redis, self.rq.queue, self.name, self._reaped.set,
                                 self.rq.sweep)
        self._resync = False
        self._starting: set[str] = set()
        self.ending: set[str] = set()  # ended here, end not yet committed by the sink
        self._drain_deadline: float | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.rq.register()
        self.liveness.start()
        self.cancels.start()
        log.info("worker %s serving queue %r with %s (max_batch=%d, window=%.0f ms)",
                 self.name, self.config.queue, self.config.model, self.config.max_batch,
                 self.config.window_ms)
        try:
            self._serve(self._turn, until=self._stop.is_set)
            self._serve(self._drain_turn, until=lambda: not (self.running or self.pending))
        finally:
            self.cancels.stop()
            self.sink.close()
            # Leave the roll only with nothing held; else stay on it, marked dead, so a
            # live worker requeues what this one still holds at once.
            leave = self._holds_nothing()
            for last_words in (partial(self._write_stats, "stopped"),
                               partial(self.liveness.stop, leave=leave), self.rq.unregister):
                try:
                    last_words()
                except redis.RedisError as e:  # Redis is gone: the reaper covers for us
                    log.warning("on exit: %s", e)
            log.info("worker %s stopped", self.name)
        return 0

    def _serve(self, turn: Callable[[], None], until: Callable[[], bool]) -> None:
        """Run turns until ``until()``, riding out Redis restarts and dropped connections:
        running rows keep decoding meanwhile, their chunks wait in the sink, in order."""
        delay = 0.05
        while not until():
            try:
                turn()
                delay = 0.05
            except Exception as e:
                # The one broad catch: whatever a turn hit (Redis gone, a reply rq did
                # not expect), the worker logs it, re-checks what it holds and serves on.
                if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                    log.warning("redis unavailable (%s); retrying in %.2fs", e, delay)
                    if self.running:
                        self._step()
                else:
                    log.exception("worker turn failed; going on")
                self._resync = True
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _holds_nothing(self) -> bool:
        try:
            return not self.redis.llen(self.rq.wip)
        except redis.RedisError:
            return False

    def _turn(self) -> None:
        if self._reaped.is_set():
            self._abandon()
        if self._resync:  # a reply lost with the connection may have moved a job to us
            for job in self.rq.reconcile({*self.pending, *self.running, *self.ending}):
                log.warning("recovered %s from this worker's WIP list", job.id)
                self._buffer(job)
            self._resync = False
        self._fill()
        self._apply_cancels()
        self._admit()
        if self.running:
            self._step()
        self._housekeeping()

    def _drain_turn(self) -> None:
        """After SIGTERM: admit nothing, let in-flight jobs finish within the grace
        period, then requeue what remains at the queue's front."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.config.grace_s
            log.info("stopping: %d running, %d buffered", len(self.running), len(self.pending))
        for job_id in list(self.pending):
            self.rq.requeue_unstarted(job_id)
            del self.pending[job_id]
        if self.running and time.monotonic() < self._drain_deadline:
            self._apply_cancels()
            self._step()
            self._housekeeping()
            return
        for job_id in self.engine.remove(list(self.running)):
            self._requeue(self.running.pop(job_id), "grace period over")

    def _requeue(self, r: Running, why: str) -> None:
        log.info("requeued %s (%s)", r.job.id, why)
        self.fresh.discard(r.job.id)
        self._hand_over(r.job.id, partial(self.rq.requeue, r))

    def _abandon(self) -> None:
        """Another worker declared this one dead and requeued its jobs: drop them all."""
        log.error("dropping %d running and %d buffered jobs now owned by the queue again",
                  len(self.running), len(self.pending))
        self.engine.reset()
        self.running.clear()
        self.pending.clear()
        self.fresh.clear()
        self._reaped.clear()

    # -- schedule ----------------------------------------------------------------------

    def _fill(self) -> None:
        now = time.monotonic()
        if not self.running and not self.pending:
            self.rq.set_state("idle")
            job = self.rq.dequeue(timeout=1)
            if job is None:
                return
            self._buffer(job)
            self.window.open(time.monotonic())
        if self.window.is_open:
            while not self.window.should_close(time.monotonic(), len(self.pending)):
                remaining = self.window.remaining(time.monotonic())
                job = self.rq.dequeue(timeout=remaining) if remaining > 0 else None
                if job is None:
                    break
                self._buffer(job)
            self.window.close()
            return
        if now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        want = self.engine.free_slots + self.config.max_batch // 4 - len(self.pending)
        for _ in range(max(0, want)):
            job = self.rq.dequeue(timeout=None)
            if job is None:
                break
            self._buffer(job)

    def _buffer(self, job: Job) -> None:
        try:
            req = decode_job(job, self.config.max_tokens_cap)
        except PayloadError as e:
            self._fail_unstarted(job, f"invalid job: {e}")
            return
        if (why := _ttl_expired(job, req)) is not None:
            self._fail_unstarted(job, why)
            return
        self.pending[job.id] = (Pending(job.id, req.sampling.key(), self.steps), job, req)

    def _fail_unstarted(self, job: Job, reason: str) -> None:
        self.pending.pop(job.id, None)
        self.rq.fail_unstarted(job, reason)
        self.jobs_done["failed"] += 1

    def _admit(self) -> None:
        # A row is free once its job's end is committed to rq, so rq never shows more
        # started jobs than max_batch.
        free = self.engine.free_slots - self.sink.actions_pending
        if not self.pending or free <= 0:
            return
        running = Counter(r.request.sampling.key() for r in self.running.values())
        chosen = admit([p for p, _, _ in self.pending.values()], running, free, self.steps,
                       self.policy)
        for p in chosen:
            _, job, req = self.pending[p.job_id]
            self._start(job, req)
            self.pending.pop(p.job_id, None)

    def _start(self, job: Job, req: GenerationRequest) -> None:
        try:
            ids = self.engine.encode(req)
        except Exception as e:  # a tokenizer or template error is this job's, not ours
            self._fail_unstarted(job, f"invalid job: {type(e).__name__}: {e}")
            return
        if job.id in self._starting:  # an earlier start of it was cut off by Redis
            self.rq.forget_executions(job)
        self._starting.add(job.id)
        r = self.rq.start(job, req)
        attempt, last_seq = self._next_attempt(job.id)  # counted once the start holds
        self._starting.discard(job.id)
        r.attempt, r.seq = attempt, last_seq
        r.deadline = None if req.timeout is None else time.monotonic() + req.timeout
        self.running[job.id] = r
        if attempt > MAX_ATTEMPTS:
            self._fail(r, f"gave up after {MAX_ATTEMPTS} attempts: its worker died or its "
                       "batch failed each time")
            return
        if attempt > 1:  # tell listeners to drop what an earlier attempt streamed
            r.seq += 1
            self.sink.put([Out(job.id, Chunk(r.seq, kind="reset", attempt=attempt))])
        try:
            self.engine.add(job.id, req, ids)
        except Exception as e:  # this job's, not the batch's: nothing of it reached MLX yet
            self._fail(r, f"engine error: {type(e).__name__}: {e}")
            return
        self.fresh.add(job.id)
        self.rq.set_state("busy")

    def _next_attempt(self, job_id: str) -> tuple[int, int]:
        """Count this start in the job's hash (it survives a crash of this worker) and
        find where its replay log ends: (attempt, last seq)."""
        with self.redis.pipeline() as p:
            p.hincrby(f"{Job.redis_job_namespace_prefix}{job_id}", "mlxq_attempt", 1)
            p.xrevrange(keys.stream_key(job_id), count=1)
            attempt, last = p.execute()
        chunks = decode_entries(last)
        return int(attempt), chunks[0].seq if chunks else 0

    # -- run + postprocess -------------------------------------------------------------

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            self._on_engine_error(e)
            return
        self.steps += 1
        self.fresh.clear()
        outs, ended = [], []
        for ev in events:
            r = self.running.get(ev.job_id)
            if r is None or not (ev.text or ev.token_ids or ev.finish_reason):
                continue
            r.seq += 1
            r.text.append(ev.text)
            r.token_ids.extend(ev.token_ids)
            chunk = Chunk(r.seq, ev.text, ev.token_ids, ev.finish_reason, attempt=r.attempt,
                          usage=ev.usage)
            if ev.finish_reason is None:
                outs.append(Out(ev.job_id, chunk))
            else:
                ended.append((r, chunk))
        self.sink.put(outs)
        for r, chunk in ended:
            self.jobs_done["finished"] += 1
            self._end(r, chunk, partial(self._commit_success, r, chunk))

    def _on_engine_error(self, e: Exception) -> None:
        """An MLX error leaves the batch state unusable. Jobs admitted since the last
        good step are the suspects and fail with the error; the others are requeued
        and start again (MAX_ATTEMPTS bounds that)."""
        reason = f"engine error: {type(e).__name__}: {e}"
        suspects = [r for j, r in self.running.items() if j in self.fresh]
        log.exception("engine step failed; failing %d suspect job(s), requeuing %d",
                      len(suspects), len(self.running) - len(suspects))
        for r in suspects:
            self._fail(r, reason)
        for r in list(self.running.values()):
            self._requeue(self.running.pop(r.job.id), reason)
        self.engine.reset()
        self.fresh.clear()

    def _end(self, r: Running, final: Chunk, commit: Callable[[], None]) -> None:
        """Commit a job's end to rq, then write its last chunk: whoever sees the last
        chunk finds the job's final state and result."""
        self.running.pop(r.job.id, None)
        self.fresh.discard(r.job.id)
        self._hand_over(r.job.id, commit)
        self.sink.put([Out(r.job.id, final)])

    def _hand_over(self, job_id: str, commit: Callable[[], None]) -> None:
        """Queue a job's end for the sink. Until it is committed the job is still in
        this worker's WIP list, and still this worker's: reconcile must not take it."""
        self.ending.add(job_id)

        def run() -> None:
            commit()
            self.ending.discard(job_id)

        self.sink.then(run)

    def _commit_success(self, r: Running, final: Chunk) -> None:
        # Built from the very chunks streamed, so streamed text joined equals the result.
        self.rq.succeed(r, {"text": "".join(r.text), "token_ids": r.token_ids,
                            "finish_reason": final.finish_reason, "usage": final.usage})

    def _fail(self, r: Running, reason: str) -> None:
        self.engine.remove([r.job.id])
        self.jobs_done["failed"] += 1
        r.seq += 1
        final = Chunk(r.seq, kind="error", finish_reason="error", attempt=r.attempt,
                      error=reason)
        self._end(r, final, partial(self.rq.fail, r, reason))

    # -- cancels and deadlines ---------------------------------------------------------

    def _apply_cancels(self) -> None:
        for job_id in self.cancels.take():
            if job_id not in self.pending and job_id not in self.running:
                self._forget_cancel_if_ended(job_id)
            elif job_id in self.pending:
                del self.pending[job_id]
                self.rq.drop_unstarted(job_id)
                self.cancels.done(job_id)
            elif job_id in self.running:
                r = self.running[job_id]
                self.engine.remove([job_id])
                self.jobs_done["canceled"] += 1
                r.seq += 1
                final = Chunk(r.seq, finish_reason="canceled", attempt=r.attempt)
                self._end(r, final, partial(self.rq.cancel, r))

    def _forget_cancel_if_ended(self, job_id: str) -> None:
        # Not ours: another worker may run it, so only an ended job's request is dropped.
        status = self.redis.hget(f"{Job.redis_job_namespace_prefix}{job_id}", "status")
        if status is None or as_text(status) in ("finished", "failed", "canceled", "stopped"):
            self.cancels.done(job_id)

    def _expire(self) -> None:
        """Fail jobs past their deadline: running past ``timeout``, queued past ``ttl``."""
        now = time.monotonic()
        for r in [r for r in self.running.values() if r.deadline and now > r.deadline]:
            self._fail(r, f"timeout: ran longer than timeout={r.request.timeout:g} s")
        for _, job, req in list(self.pending.values()):
            if (why := _ttl_expired(job, req)) is not None:
                self._fail_unstarted(job, why)

    # -- housekeeping ------------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_deadline_check >= DEADLINE_CHECK_S:
            self._last_deadline_check = now
            self._expire()
        if now - self._last_beat < (HEARTBEAT_S if self.running else 1.0):
            return
        self._last_beat = now
        self.rq.heartbeat(list(self.running.values()))
        self._write_stats("busy" if self.running else "idle")

    def stats(self) -> dict[str, Any]:
        c = self.engine.counters
        return {
            "name": self.name, "queue": self.config.queue, "model": self.config.model,
            "max_batch": self.config.max_batch, "window_ms": self.config.window_ms,
            "decode_steps": c.decode_steps, "vectorized_steps": c.vectorized_steps,
            "sampler_calls": c.sampler_calls, "tokens_generated": c.tokens_generated,
            "prompt_tokens": c.prompt_tokens, "jobs_finished": self.jobs_done["finished"],
            "jobs_failed": self.jobs_done["failed"], "jobs_canceled": self.jobs_done["canceled"],
            "jobs_requeued_from_dead_workers": self.liveness.reaped_jobs,
            "running": len(self.running), "pid": os.getpid(),
            "batch_sizes": {str(k): v for k, v in sorted(c.batch_sizes.items())},
        }

    def _write_stats(self, state: str) -> None:
        key = keys.worker_stats_key(self.name)
        with self.redis.pipeline() as p:
            p.hset(key, mapping={"state": state,
                                 "stats": MsgpackSerializer.dumps(self.stats())})
            p.expire(key, STATS_TTL)
            p.execute()


def _ttl_expired(job: Job, req: GenerationRequest) -> str | None:
    """Why a job waited past its ``ttl`` in the queue, or None."""
    if req.ttl is None or job.enqueued_at is None:
        return None
    waited = (rq_now() - job.enqueued_at).total_seconds()
    if waited <= req.ttl:
        return None
    return f"ttl expired: waited {waited:.1f} s in the queue (ttl={req.ttl:g} s)"
