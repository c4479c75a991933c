"""The worker's numbers: Prometheus metrics (``mlxq worker --metrics-port``) and the
tokens/s over the last minute that ``mlxq info`` shows.

Names follow vLLM's with an ``mlxq_`` prefix (prometheus-client adds ``_total`` to
counters): ``num_requests_running``, ``num_requests_waiting``, ``prompt_tokens_total``,
``generation_tokens_total``, ``request_success_total{finished_reason}``, and the
histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``, ``request_queue_time_seconds``,
``iteration_tokens_total``; then mlxq's own: ``decode_steps_total``,
``vectorized_steps_total``, ``jobs_total{outcome}`` and ``batch_size``; and the prompt
cache's, as vLLM names its prefix cache: ``prefix_cache_queries_total`` and
``prefix_cache_hits_total`` (rows looked up, rows that found a prefix: counters, not a
ratio), ``prefix_cache_tokens_total`` (prompt tokens reused), ``prefix_cache_bytes`` (held
now) and ``prompt_tokens_prefilled_total`` (prompt tokens computed); routing's
``jobs_handed_out_total`` and ``jobs_handed_in_total`` (chat turns handed to the worker
holding their history, and taken from others).

Counters and gauges are read from the worker's stats when scraped, so the decode loop
pays nothing for them; the latency histograms are fed by four calls of the loop:
:meth:`Metrics.started`, :meth:`Metrics.step`, :meth:`Metrics.settled` (and nothing when
metrics are off: :class:`NoMetrics`). Times since a job was queued count from rq's
``enqueued_at`` (as vLLM counts from a request's arrival).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from mlxq.producer.outcome import TERMINAL, Outcome
from mlxq.worker.jobs import Job
from mlxq.worker.stats import WorkerStats

# vLLM's buckets, so dashboards built for it read mlxq's the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
#: Rows per step: powers of two up to mlx-lm's largest sensible batch.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
OUTCOMES = (Outcome.FINISHED, Outcome.FAILED, Outcome.CANCELED, Outcome.REQUEUED)

Stats = Callable[[], WorkerStats]


class TokenRate:
    """Tokens per second over the last ``window_s``, from a ring of (time, total) samples
    taken at most once a second (thread-safe: the heartbeat and a scrape may both ask)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._ring: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def sample(self, total: int, now: float | None = None) -> float:
        """Record the running total; returns the rate over the window (0 until two
        samples a second apart exist)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ring = self._ring
            if not ring or now - ring[-1][0] >= 1.0:
                ring.append((now, total))
            while len(ring) > 2 and now - ring[1][0] >= self.window_s:
                ring.popleft()
            (t0, n0), (t1, n1) = ring[0], (now, total)
            return (n1 - n0) / (t1 - t0) if t1 - t0 >= 1.0 else 0.0


class _WeightedHistogram:
    """A histogram that takes one observation many times at once (an inter-token latency
    is the same for every row of a step: one call per step, not one per row)."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name, self.doc, self.bounds = name, doc, list(buckets)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += times
            self._sum += value * times

    def family(self) -> HistogramMetricFamily:
        with self._lock:
            counts, total = list(self._counts), self._sum
        return _histogram(self.name, self.doc, self.bounds, counts, total)


def _histogram(
    name: str, doc: str, bounds: Sequence[float], counts: Sequence[int], total: float
) -> HistogramMetricFamily:
    cumulative, run = [], 0
    for bound, n in zip([*(str(float(b)) for b in bounds), "+Inf"], counts, strict=True):
        run += n
        cumulative.append((bound, run))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


#: The counters read from the worker's stats: (metric name, stats field, help).
COUNTERS = (
    ("mlxq_prompt_tokens", "prompt_tokens", "Prompt tokens of started rows"),
    (
        "mlxq_prompt_tokens_prefilled",
        "prompt_tokens_prefilled",
        "Prompt tokens run through the model (those the prompt cache held excluded)",
    ),
    (
        "mlxq_prefix_cache_queries",
        "prompt_cache_queries",
        "Rows looked up in the prompt cache",
    ),
    ("mlxq_prefix_cache_hits", "prompt_cache_hits", "Rows that found a cached prefix"),
    (
        "mlxq_prefix_cache_tokens",
        "prompt_tokens_cached",
        "Prompt tokens taken from the prompt cache instead of prefilled",
    ),
    ("mlxq_generation_tokens", "tokens_generated", "Tokens generated"),
    ("mlxq_preemptions", "preemptions", "Rows paused for a higher level's job"),
    ("mlxq_resumes", "resumes", "Paused rows put back into the batch"),
    (
        "mlxq_resume_tokens_recomputed",
        "resume_tokens_recomputed",
        "Tokens prefilled again for resumed rows whose KV was dropped",
    ),
    ("mlxq_decode_steps", "decode_steps", "Decode steps run"),
    (
        "mlxq_first_token_passes",
        "first_token_passes",
        "Of the decode steps, passes new rows took for their first token alone",
    ),
    (
        "mlxq_first_tokens_from_prefill",
        "first_tokens_from_prefill",
        "New rows whose first token came from their prefill (no pass of their own)",
    ),
    (
        "mlxq_fused_prefills",
        "fused_prefills",
        "New rows whose prompt ran in the batch's decode pass (no prefill pass of their own)",
    ),
    ("mlxq_constrained_rows", "constrained_rows", "Rows decoded under a constraint"),
    (
        "mlxq_constraint_compiles",
        "constraint_compiles",
        "Constraints compiled for the model (each once, then cached)",
    ),
    ("mlxq_mask_ms", "mask_ms", "Milliseconds spent filling constrained rows' token masks"),
    ("mlxq_vectorized_steps", "vectorized_steps", "Decode steps sampled in one call"),
    (
        "mlxq_jobs_handed_out",
        "jobs_handed_out",
        "Chat turns this worker claimed and handed to the worker holding their history",
    ),
    (
        "mlxq_jobs_handed_in",
        "jobs_handed_in",
        "Chat turns another worker handed this one (it held their history)",
    ),
)


class _StatsCollector(Collector):
    """Counters and gauges read from the worker's stats at scrape time."""

    def __init__(self, stats: Stats, itl: _WeightedHistogram) -> None:
        self.stats, self.itl = stats, itl

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        yield GaugeMetricFamily(
            "mlxq_num_requests_running", "Jobs decoding in the batch now", s.running
        )
        yield GaugeMetricFamily(
            "mlxq_num_requests_waiting",
            "Jobs claimed by this worker, waiting for a row",
            s.buffered,
        )
        yield GaugeMetricFamily(
            "mlxq_num_requests_paused",
            "Jobs paused for a higher level's job (their KV kept, or to prefill again)",
            s.paused,
        )
        by_queue = CounterMetricFamily(
            "mlxq_queue_generation_tokens", "Tokens generated, by queue", labels=["queue"]
        )
        for q, n in s.tokens_by_queue.items():
            by_queue.add_metric([q], n)
        yield by_queue
        for name, key, doc in COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(s, key))
        yield GaugeMetricFamily(
            "mlxq_prefix_cache_bytes",
            "Bytes of KV state the prompt cache holds",
            s.prompt_cache_bytes,
        )
        jobs = CounterMetricFamily(
            "mlxq_jobs", "Jobs this worker settled, by outcome", labels=["outcome"]
        )
        for outcome in OUTCOMES:
            jobs.add_metric([outcome.value], s.jobs(outcome))
        yield jobs
        yield _batch_sizes(s.batch_sizes)
        stages = CounterMetricFamily(
            "mlxq_loop_seconds",
            "The decode thread's time by stage, each stage's own (mlxq.worker.stages)",
            labels=["stage"],
        )
        for stage, ms in s.busy_ms.items():
            stages.add_metric([stage], ms / 1000)
        yield stages
        yield self.itl.family()


def _batch_sizes(batch_sizes: dict[str, int]) -> HistogramMetricFamily:
    """The batch sizes of every step so far (size: steps) as a histogram."""
    sizes = {int(k): v for k, v in batch_sizes.items()}
    counts = [0] * (len(BATCH_BUCKETS) + 1)
    for size, n in sizes.items():
        counts[bisect.bisect_left(BATCH_BUCKETS, size)] += n
    total = float(sum(size * n for size, n in sizes.items()))
    return _histogram(
        "mlxq_batch_size",
        "Rows in the batch at each decode step",
        BATCH_BUCKETS,
        counts,
        total,
    )


class NoMetrics:
    """What the loop calls when metrics are off: nothing happens."""

    def started(self, jobs: Sequence[Job]) -> None:
        pass

    def step(self, now: float, touched: Sequence[Job]) -> None:
        pass

    def settled(self, job: Job, outcome: Outcome) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics(NoMetrics):
    """Prometheus metrics of one worker, in a registry of its own.

    Args:
        stats: The worker's ``stats()``, read at each scrape.
    """

    def __init__(self, stats: Stats) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_time = Histogram(
            "mlxq_request_queue_time_seconds",
            "Seconds from enqueue to the start of the run",
            ["queue"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mlxq_time_to_first_token_seconds",
            "Seconds from enqueue to the run's first token",
            ["queue"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mlxq_e2e_request_latency_seconds",
            "Seconds from enqueue to the job's end",
            ["queue"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.iteration = Histogram(
            "mlxq_iteration_tokens_total",
            "Tokens generated per engine step",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "mlxq_request_success",
            "Jobs finished, by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.itl = _WeightedHistogram(
            "mlxq_inter_token_latency_seconds",
            "Seconds between a job's successive tokens",
            ITL_BUCKETS,
        )
        r.register(_StatsCollector(stats, self.itl))
        self._last_step: float | None = None
        self._server: Any = None

    def serve(self, port: int, host: str) -> int:
        """Serve ``/metrics`` on ``host:port`` from a thread; returns the port bound."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def started(self, jobs: Sequence[Job]) -> None:
        for job in jobs:
            if job.enqueued_at is not None:
                self.queue_time.labels(job.queue).observe(
                    max(0.0, job.started_at - job.enqueued_at)
                )

    def step(self, now: float, touched: Sequence[Job]) -> None:
        """One engine step ended at ``now`` (monotonic); ``touched`` made a token each."""
        self.iteration.observe(len(touched))
        later = 0
        wall = time.time()
        for job in touched:
            if job.generated == job.request.n:  # the first token of each choice
                since = job.enqueued_at if job.enqueued_at is not None else job.started_at
                self.ttft.labels(job.queue).observe(max(0.0, wall - since))
            else:
                later += 1
        if later and self._last_step is not None:
            self.itl.observe(now - self._last_step, later)
        self._last_step = now

    def settled(self, job: Job, outcome: Outcome) -> None:
        if outcome is Outcome.FINISHED and job.finish_reason:
            self.success.labels(job.finish_reason).inc()
        if outcome in TERMINAL and job.enqueued_at is not None:
            self.e2e.labels(job.queue).observe(max(0.0, time.time() - job.enqueued_at))
