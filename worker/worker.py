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

from mlxq.batching.admission import AdmissionPolicy, Pending, Window, admit
from mlxq.producer import keys
from mlxq.producer.codec import Chunk, MsgpackSerializer, decode_entries
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import MAX_TOKENS_CAP, GenerationRequest
from mlxq.worker.engine import Engine
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
        self.steps = 0
        self.jobs_done = Counter[str]()
        self._stop = threading.Event()
        self._cancels: set[str] = set()
        self._cancel_lock = threading.Lock()
        self._last_poll = self._last_beat = 0.0
        self.sink = Sink(self.redis, stream_ttl=config.stream_ttl)

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.rq.register()
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(**{keys.cancel_channel(self.config.queue): self._on_cancel_msg})
        listener = pubsub.run_in_thread(sleep_time=0.05, daemon=True)
        self._load_cancels()
        log.info("worker %s serving queue %r with %s (max_batch=%d, window=%.0f ms)",
                 self.name, self.config.queue, self.config.model, self.config.max_batch,
                 self.config.window_ms)
        try:
            while not self._stop.is_set():
                self._turn()
            self._drain()
        finally:
            listener.stop()
            self._write_stats("stopped")
            self.sink.close()
            self.rq.unregister()
            log.info("worker %s stopped", self.name)
        return 0

    def _turn(self) -> None:
        self._fill()
        self._apply_cancels()
        self._admit()
        if self.running:
            self._step()
        self._housekeeping()

    def _drain(self) -> None:
        """Stop admitting; let in-flight jobs finish within the grace period, requeue the rest."""
        for job_id in list(self.pending):
            self.rq.requeue_unstarted(job_id)
        self.pending.clear()
        deadline = time.monotonic() + self.config.grace_s
        while self.running and time.monotonic() < deadline:
            self._apply_cancels()
            self._step()
            self._housekeeping()
        for job_id in self.engine.remove(list(self.running)):
            r = self.running.pop(job_id)
            self.sink.then(partial(self.rq.requeue, r))
            log.info("requeued %s (grace period over)", job_id)

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
            self.rq.fail_unstarted(job, f"invalid job: {e}")
            self.jobs_done["failed"] += 1
            return
        self.pending[job.id] = (Pending(job.id, req.sampling.key(), self.steps), job, req)

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
            _, job, req = self.pending.pop(p.job_id)
            self._start(job, req)

    def _start(self, job: Job, req: GenerationRequest) -> None:
        try:
            ids = self.engine.encode(req)
        except Exception as e:  # a tokenizer or template error is this job's, not ours
            self.rq.fail_unstarted(job, f"invalid job: {e}")
            self.jobs_done["failed"] += 1
            return
        r = self.rq.start(job, req)
        self._resume_stream(r)
        self.engine.add(job.id, req, ids)
        self.running[job.id] = r
        self.rq.set_state("busy")

    def _resume_stream(self, r: Running) -> None:
        # A re-run job (its worker died, or it was requeued) continues its log's
        # numbering and tells listeners to drop what the earlier attempt streamed.
        last = decode_entries(self.redis.xrevrange(keys.stream_key(r.job.id), count=1))
        if not last:
            return
        prev = last[0]
        r.seq, r.attempt = prev.seq + 1, prev.attempt + 1
        self.sink.put([Out(r.job.id, Chunk(r.seq, kind="reset", attempt=r.attempt))])

    # -- run + postprocess -------------------------------------------------------------

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            # An MLX error poisons the whole batch state: fail its jobs, start afresh.
            log.exception("engine step failed; failing %d jobs", len(self.running))
            for held in list(self.running.values()):
                self._fail(held, f"engine error: {type(e).__name__}: {e}")
            self.engine.reset()
            return
        self.steps += 1
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

    def _end(self, r: Running, final: Chunk, commit: Callable[[], None]) -> None:
        """Commit a job's end to rq, then write its last chunk: whoever sees the last
        chunk finds the job's final state and result."""
        self.running.pop(r.job.id, None)
        self.sink.then(commit)
        self.sink.put([Out(r.job.id, final)])

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

    # -- cancels -----------------------------------------------------------------------

    def _on_cancel_msg(self, msg: dict[str, Any]) -> None:
        with self._cancel_lock:
            self._cancels.add(msg["data"].decode())

    def _load_cancels(self) -> None:
        ids = self.redis.smembers(keys.cancel_set(self.config.queue))
        with self._cancel_lock:
            self._cancels.update(as_text(i) for i in ids)

    def _apply_cancels(self) -> None:
        with self._cancel_lock:
            ids, self._cancels = self._cancels, set()
        for job_id in ids:
            if job_id in self.pending:
                self.pending.pop(job_id)
                self.rq.drop_unstarted(job_id)
                self.redis.srem(keys.cancel_set(self.config.queue), job_id)
            elif job_id in self.running:
                r = self.running[job_id]
                self.engine.remove([job_id])
                self.jobs_done["canceled"] += 1
                r.seq += 1
                final = Chunk(r.seq, finish_reason="canceled", attempt=r.attempt)
                self._end(r, final, partial(self.rq.cancel, r))

    # -- housekeeping ------------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_S and self.running:
            return
        if now - self._last_beat < 1.0:
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
