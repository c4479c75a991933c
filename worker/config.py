"""What ``mlxq worker`` takes, with its defaults: no MLX here, so ``--help`` works anywhere."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from mlxq.batching.levels import Levels
from mlxq.producer import keys
from mlxq.producer.params import MAX_TOKENS_CAP
from mlxq.producer.validate import integer_in, number_in

#: 20 ms is short beside a single decode step of any real model, yet long enough that a
#: burst of submits shares one prefill pass.
DEFAULT_WINDOW_MS = 20.0
DEFAULT_WINDOW_MAX_MS = 60.0
#: mlx-lm's own default; tokens/s keeps rising past it on a GPU (64 is a good choice
#: there), while on a CPU larger batches mostly add latency.
DEFAULT_MAX_BATCH = 32
#: Tokens a job makes within this interval go out as one chunk (its first token never
#: waits). 50 ms is 20 updates a second, smooth to a reader, while a busy batch writes
#: several tokens per Redis command instead of one.
DEFAULT_STREAM_INTERVAL_MS = 50.0
DEFAULT_GRACE_S = 30.0
#: A decode turn this long (ms) is logged with its stages: a stall every row waited for.
DEFAULT_SLOW_TURN_MS = 1000.0
#: Admission ageing bound (see ``mlxq.batching.admission``).
DEFAULT_MAX_WAIT_STEPS = 32
#: Decode steps a busy batch lets waiting jobs gather before their prefill (see
#: ``mlxq.batching.prefill.Gather``): a few, so rows freed one by one go back as a group.
DEFAULT_ADMIT_HOLD_STEPS = 4
#: The same where MLX runs on CUDA (``--admit-hold-steps auto``): there a refill pass
#: costs a few decode steps of the whole batch whatever its rows, so rows may wait longer
#: to refill together. An H100 with a 1,500-job sweep beside chat jobs: the sweep at 0.712
#: of alone with 4, 0.810 with 16 (docs/benchmarks.md).
CUDA_ADMIT_HOLD_STEPS = 16
#: Prometheus scrapes from another machine, as it does node exporters: every interface.
DEFAULT_METRICS_HOST = "0.0.0.0"
#: The prompt cache is on, sized from the device (None: ``auto``); 0 turns it off.
DEFAULT_PROMPT_CACHE_BYTES: int | None = None
#: A job is paused for a higher level's job at most this many times (nothing churns).
DEFAULT_MAX_PAUSES = 3
#: Longest queue name: it is part of several Redis key names.
MAX_QUEUE_CHARS = 128


def _check_prefill(admit_hold_steps: object, **auto: object) -> None:
    if admit_hold_steps is not None:
        integer_in("admit_hold_steps", admit_hold_steps, 0, 1000, note=" or None (auto)")
    for name, value in auto.items():
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: give True, False or None (auto)")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: give True or False")


def default_name() -> str:
    """``host.pid.random``: rq refuses a name whose dead twin is still registered."""
    return f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"


def is_worker_name(name: object) -> bool:
    """1 to 200 characters, no spaces or ':' (it is part of Redis key names)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 200
        and not any(c.isspace() or c == ":" for c in name)
    )


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything ``mlxq worker`` takes; checked on construction.

    Args:
        model: mlx-lm model path or Hugging Face repo id.
        redis_url: Redis URL (``redis://``, ``rediss://``, with credentials).
        queue: Queue to serve (when ``queues`` is empty).
        queues: The ``--queue`` values: one level each, the first the highest; one value
            may name several queues, with weights (``team-a:3,team-b:1``). Empty: just
            ``queue``. After construction ``queue`` is the first queue named.
        window_ms: How long an idle worker waits after a first job for others to share
            its prefill batch.
        window_max_ms: While jobs keep arriving (gaps under half of ``window_ms``),
            the window stays open up to this long (``mlxq.batching.window.Window``).
        max_batch: Most jobs decoding at once.
        name: Worker name; None picks ``host.pid.random``.
        grace_s: On SIGTERM, how long in-flight jobs may run before they are requeued.
        slow_turn_ms: A decode turn this long or longer is logged with where it went,
            by stage (every row waited for it); 0 logs none.
        max_tokens_cap: Largest ``max_tokens`` the worker accepts.
        stream_ttl: Seconds a job's replay log lives after its last chunk.
        stream_interval_ms: Tokens made within this interval share one chunk; 0 writes
            every token as it comes.
        max_wait_steps: Admission ageing bound (see ``mlxq.batching.admission``).
        metrics_port: Serve Prometheus metrics on this port; None: no metrics server
            (0 picks a free port).
        metrics_host: The address the metrics server binds.
        prompt_cache_bytes: Bytes of KV state kept for later jobs that start with the same
            tokens; None (the default): a quarter of what the loaded model leaves of the
            device's recommended working set, 1 GiB on a CPU (decided where MLX is
            loaded); 0: no prompt cache.
        routing: Hand a claimed chat turn to the live worker, with free rows, that
            finished its conversation's last turn (its prompt cache holds the history).
        preempt: Pause the youngest row of the lowest running level when a job of a
            strictly higher level waits and no row is free.
        reserve_rows: Rows kept for the first level's jobs, those it holds counted.
        max_pauses: A job is paused at most this many times.
        paused_kv_bytes: Bytes of KV state kept for paused rows; past it, the oldest
            pause's KV is dropped (it resumes by prefilling again). None: the prompt
            cache's budget (its own, beside it).
        admit_hold_steps: While the batch decodes, how many steps waiting jobs may gather
            before their prefill (``mlxq.batching.prefill.Gather``); 0: none. None (the
            default): :data:`CUDA_ADMIT_HOLD_STEPS` where MLX runs on CUDA, else
            :data:`DEFAULT_ADMIT_HOLD_STEPS`.
        prefill_buckets: Pad prefill passes to a few bucketed shapes, so a GPU backend's
            per-shape plans are reused; None (the default): on where MLX runs on CUDA.
        fused_prefill: A first-level row that starts alone beside a busy batch runs its
            prompt in the batch's decode pass (``mlxq.worker.fused_pass``) instead of a
            pass of its own; None (the default): that module's ``FUSED_PREFILL`` (off: on
            an H100 the sweep beside chat jobs ran slower with it; a CPU gains nothing).
        wait_replicas: A flush of ends counts as written once this many replicas confirm
            it (Redis ``WAIT``); until then the jobs are not freed. 0: do not wait.
        allow_mixed_models: Start even when live workers of its queues serve another
            model (by default it refuses: a job's answer would depend on the worker).
        warm_up: Run a few rows of each common kind through the batch before the first
            job (:mod:`mlxq.worker.warmup`), so no job's step waits for MLX to build a
            kernel or an attention plan it meets first.

    Raises:
        ValueError: naming the field and the bad value.
    """

    model: str
    redis_url: str = keys.DEFAULT_REDIS_URL
    queue: str = "default"
    window_ms: float = DEFAULT_WINDOW_MS
    window_max_ms: float = DEFAULT_WINDOW_MAX_MS
    max_batch: int = DEFAULT_MAX_BATCH
    name: str | None = None
    grace_s: float = DEFAULT_GRACE_S
    slow_turn_ms: float = DEFAULT_SLOW_TURN_MS
    max_tokens_cap: int = MAX_TOKENS_CAP
    stream_ttl: int = keys.DEFAULT_STREAM_TTL
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS
    max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST
    prompt_cache_bytes: int | None = DEFAULT_PROMPT_CACHE_BYTES
    routing: bool = True
    queues: tuple[str, ...] = ()
    preempt: bool = True
    reserve_rows: int = 0
    max_pauses: int = DEFAULT_MAX_PAUSES
    paused_kv_bytes: int | None = None
    admit_hold_steps: int | None = None
    prefill_buckets: bool | None = None
    fused_prefill: bool | None = None
    allow_mixed_models: bool = False
    wait_replicas: int = 0
    warm_up: bool = True
    levels: Levels = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r}: give a model path or repo id")
        values = tuple(self.queues) or (self.queue,)
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"queue={values!r}: give queue names")
        levels = Levels.parse(values)
        for q in levels.queues:
            if len(q) > MAX_QUEUE_CHARS or not q.isprintable():
                raise ValueError(
                    f"queue={q!r}: must be 1 to {MAX_QUEUE_CHARS} printable characters"
                )
        object.__setattr__(self, "queues", values)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "queue", levels.queues[0])
        integer_in("reserve_rows", self.reserve_rows, 0, 4096)
        integer_in("max_pauses", self.max_pauses, 0, 1000)
        if self.paused_kv_bytes is not None:
            integer_in("paused_kv_bytes", self.paused_kv_bytes, 0, 1 << 50)
        number_in("window_ms", self.window_ms, 0, 60_000)
        number_in("window_max_ms", self.window_max_ms, 0, 60_000)
        number_in("grace_s", self.grace_s, 0, 7 * 24 * 3600)
        number_in("slow_turn_ms", self.slow_turn_ms, 0, 3_600_000)
        number_in("stream_interval_ms", self.stream_interval_ms, 0, 10_000)
        integer_in("max_batch", self.max_batch, 1, 4096)
        if self.reserve_rows >= self.max_batch:
            raise ValueError(
                f"reserve_rows={self.reserve_rows}: must be less than max_batch={self.max_batch}"
            )
        integer_in("stream_ttl", self.stream_ttl, 1, keys.MAX_RECORD_TTL)
        integer_in("max_tokens_cap", self.max_tokens_cap, 1, 1 << 24)
        integer_in("max_wait_steps", self.max_wait_steps, 0, 1 << 20)
        integer_in("wait_replicas", self.wait_replicas, 0, 1000)
        _check_prefill(
            self.admit_hold_steps,
            prefill_buckets=self.prefill_buckets,
            fused_prefill=self.fused_prefill,
        )
        _check_bool("allow_mixed_models", self.allow_mixed_models)
        if self.metrics_port is not None:
            integer_in("metrics_port", self.metrics_port, 0, 65535)
        if self.prompt_cache_bytes is not None:
            integer_in("prompt_cache_bytes", self.prompt_cache_bytes, 0, 1 << 50)
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError(f"metrics_host={self.metrics_host!r}: give an address to bind")
        if self.name is None:
            object.__setattr__(self, "name", default_name())
        elif not is_worker_name(self.name):
            raise ValueError(f"name={self.name!r}: 1 to 200 characters, no spaces or ':'")

    @property
    def worker_name(self) -> str:
        return self.name or ""
