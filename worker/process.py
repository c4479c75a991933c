"""The worker process: its threads, wired together, started, and stopped in order.

One decode thread (:class:`~mlxq.worker.loop.DecodeLoop`) does all MLX work; around it the
prefetcher claims and tokenizes jobs, the writer (:class:`~mlxq.worker.sink.Sink`) does
every Redis write of the loop's, the heartbeat (:class:`~mlxq.worker.liveness.Liveness`)
keeps the lease and reaps dead workers, and the cancel listener hears cancels. They share
the loop's inbox (:mod:`mlxq.worker.messages`) and one view of the held jobs
(:class:`~mlxq.worker.held.Held`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from typing import Any

from mlxq.producer.errors import SetupError
from mlxq.producer.outcome import Outcome
from mlxq.producer.params import MAX_PROMPT_CHARS
from mlxq.worker.bridge import Bridge
from mlxq.worker.cancels import CancelListener
from mlxq.worker.config import WorkerConfig
from mlxq.worker.engine import Engine
from mlxq.worker.held import Held
from mlxq.worker.jobs import Status
from mlxq.worker.liveness import Liveness
from mlxq.worker.loop import SETTLE_S, DecodeLoop
from mlxq.worker.messages import Inbox
from mlxq.worker.metrics import Metrics, TokenRate
from mlxq.worker.prefetch import MAX_CHARS_PER_TOKEN, Prefetcher
from mlxq.worker.sink import Sink
from mlxq.worker.stats import WorkerStats

log = logging.getLogger("mlxq.worker")


def _max_prompt_chars(engine: Engine) -> int:
    if not engine.max_context:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, engine.max_context * MAX_CHARS_PER_TOKEN)


class Worker:
    """Runs until SIGTERM/SIGINT (or :meth:`stop`); see :class:`WorkerConfig`.

    Args:
        config: What to serve and how.
        engine: A ready engine (tests inject one); by default ``config.model`` is loaded.
        model_digest: The model's fingerprint (:mod:`mlxq.worker.identity`), published
            with the stats for starting workers to compare theirs with.
    """

    def __init__(
        self, config: WorkerConfig, engine: Engine | None = None, model_digest: str = ""
    ) -> None:
        self.config = config
        self.model_digest = model_digest
        self.name = config.worker_name
        self.engine = engine or Engine.for_worker(config)
        self.bridge = Bridge(config)
        inbox: Inbox = queue.SimpleQueue()
        self.held = Held()
        self.sink = Sink(
            self.bridge,
            inbox,
            on_lease_lost=lambda: self.liveness.poke(),
            master_checked=lambda timeout: self.liveness.master_checked(timeout),
        )
        self.prefetch = Prefetcher(
            self.bridge,
            self.sink,
            self.engine.encode,
            max_tokens_cap=config.max_tokens_cap,
            max_prompt_chars=_max_prompt_chars(self.engine),
            held=self.held,
            routing=config.routing,
            levels=config.levels,
        )
        self.liveness = Liveness(
            self.bridge,
            inbox,
            self.stats,
            self.held,
            on_renewed=self.sink.refresh_ttls,
            on_suspend=self.prefetch.pause,  # at once: claim nothing more meanwhile
        )
        self.cancels = CancelListener(self.bridge, inbox, self.held)
        self.loop = DecodeLoop(
            config, self.engine, self.bridge, inbox, self.held, self.sink, self.prefetch
        )
        self.born = time.time()
        self.rate = TokenRate()

    def stop(self, *_: Any) -> None:
        """First call: stop admitting and drain. Second: requeue what is held, now."""
        self.loop.stop()

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        self._serve_metrics()  # before registering: a port in use leaves nothing behind
        try:
            self.bridge.register()  # undoes itself should it fail: a failed start blocks no name
        except BaseException:
            self.loop.metrics.close()
            raise
        try:
            for t in (self.sink, self.liveness, self.cancels, self.prefetch):
                t.start()
        except BaseException:
            self.bridge.undo_register()
            self.loop.metrics.close()
            raise
        log.info(
            "worker %s serving %s with %s (max_batch=%d, window=%.0f-%.0f ms)",
            self.name,
            _levels_text(self.config),
            self.config.model,
            self.config.max_batch,
            self.loop.intake.window.window_s * 1000,
            (self.loop.intake.window.longest_s or 0.0) * 1000,
        )
        try:
            self.loop.run()
        finally:
            self._shutdown()
        return 0

    def _serve_metrics(self) -> None:
        """Serve Prometheus metrics when asked to.

        Raises:
            SetupError: the port cannot be bound (in use, not allowed).
        """
        if self.config.metrics_port is None:
            return
        host, port = self.config.metrics_host, self.config.metrics_port
        metrics = Metrics(self.stats)
        try:
            port = metrics.serve(port, host)
        except OSError as e:
            raise SetupError(
                f"cannot serve metrics on {host}:{port}: {e.strerror or e}; choose another "
                "--metrics-port"
            ) from None
        self.loop.metrics = metrics
        log.info("metrics at http://%s:%d/metrics", host, port)

    def _shutdown(self) -> None:
        self.prefetch.stop()
        self.cancels.stop()
        settled = self.sink.close(SETTLE_S)
        self.liveness.stop()
        self.loop.metrics.close()
        self.engine.counters.stages.close()  # a trace's buffered tail, written out
        try:
            # Jobs handed here and not claimed go back to the queue; the roll is left only
            # with nothing held, else a live worker requeues what this one holds at once.
            self.bridge.unregister(settled)
        except Exception as e:  # Redis is gone: the reaper covers for us
            log.warning("on exit: %s", e)
        log.info("worker %s stopped", self.name)

    def stats(self) -> WorkerStats:
        """What this worker says of itself now (safe from any thread)."""
        c = self.engine.counters
        started, buffered = self.held.rows()
        paused = len(self.held.jobs(Status.PAUSED))
        running = started - paused  # decoding now (a paused job waits, as in vLLM)
        outcomes, suspended = self.loop.outcomes, self.loop.suspended
        # Stopping or suspended: no free rows, so no chat turn is handed here.
        closed = suspended or self.loop.stopping
        return WorkerStats(
            name=self.name,
            queue=self.config.queue,
            model=self.config.model,
            max_batch=self.config.max_batch,
            window_ms=self.config.window_ms,
            window_max_ms=self.config.window_max_ms,
            decode_steps=c.decode_steps,
            vectorized_steps=c.vectorized_steps,
            sampler_calls=c.sampler_calls,
            tokens_generated=c.tokens_generated,
            prompt_tokens=c.prompt_tokens,
            prompt_tokens_prefilled=c.prompt_tokens_prefilled,
            prompt_cache_queries=c.prompt_cache_queries,
            prompt_cache_hits=c.prompt_cache_hits,
            prompt_tokens_cached=c.prompt_tokens_cached,
            prompt_cache_bytes=self.engine.prompt_cache_bytes,
            jobs_finished=outcomes[Outcome.FINISHED],
            jobs_failed=outcomes[Outcome.FAILED] + self.prefetch.failed,
            jobs_canceled=outcomes[Outcome.CANCELED],
            jobs_requeued=outcomes[Outcome.REQUEUED],
            tok_s_1m=round(self.rate.sample(c.tokens_generated), 2),
            suspended=suspended,
            updated_at=time.time(),
            running=running,
            buffered=buffered,
            room=0 if closed else max(0, self.config.max_batch - started - buffered),
            load=started + buffered,
            jobs_handed_out=self.prefetch.handed,
            jobs_handed_in=self.prefetch.handed_in,
            pid=os.getpid(),
            cancels_ignored=self.cancels.ignored,
            started_at=self.born,
            batch_sizes={str(k): v for k, v in sorted(c.batch_sizes.items())},
            queues=list(self.config.levels.queues),
            levels=[[[s.queue, s.weight] for s in level] for level in self.config.levels.levels],
            paused=paused,
            preemptions=c.preemptions,
            resumes=c.resumes,
            resume_tokens_recomputed=c.resume_tokens_recomputed,
            rows_joined_in_place=c.rows_joined_in_place,
            rows_joined_by_copy=c.rows_joined_by_copy,
            slot_gathers=c.slot_gathers,
            tokens_by_queue=dict(self.loop.tokens_by_queue),
            held_by_queue=self.held.by_queue(),
            prefill_batch_sizes={str(k): v for k, v in sorted(c.prefill_batch_sizes.items())},
            prefill_shapes=len(c.prefill_shapes),
            window_sizes={str(k): v for k, v in sorted(self.loop.intake.window_sizes.items())},
            claim_calls=self.prefetch.claim_calls,
            jobs_claimed=self.prefetch.jobs_claimed,
            admit_held_steps=self.loop.schedule.gather.held_steps,
            first_token_passes=c.first_token_passes,
            first_tokens_from_prefill=c.first_tokens_from_prefill,
            one_sequence=self.engine.fused is not None,
            fused_prefill=self.engine.fused_prefill,
            fused_prefills=c.fused_prefills,
            admit_hold_steps=self.loop.schedule.hold_steps,
            prefill_buckets=self.engine.prefill_buckets,
            max_context=self.engine.max_context or 0,
            vocab_size=self.engine.vocab_size,
            tool_format=self.engine.tool_format,
            model_digest=self.model_digest,
            constrained_rows=c.constrained_rows,
            constraint_compiles=c.constraint_compiles,
            mask_ms=round(c.mask_ms, 3),
            busy_ms=c.stages.snapshot(),
        )


def _levels_text(config: WorkerConfig) -> str:
    """``queue 'default'``, or ``queues chat > team-a:3,team-b:1 > sweeps`` (by level)."""
    levels = config.levels.levels
    if len(config.levels.queues) == 1:
        return f"queue {config.queue!r}"
    shown = [
        ",".join(s.queue + (f":{s.weight}" if len(lv) > 1 else "") for s in lv) for lv in levels
    ]
    return "queues " + " > ".join(shown)
