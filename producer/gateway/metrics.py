"""The gateway's own Prometheus metrics: requests, latencies, streams, tokens, cancels.

Each app gets a registry of its own, so two gateways in one process never collide.
Names follow vLLM's where one exists (``time_to_first_token_seconds``,
``e2e_request_latency_seconds``); prometheus-client adds ``_total`` to counters.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxq.producer.codec import FINISH_REASONS

#: The HTTP methods labeled by name; any other is labeled "other".
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: finish_reason labels: mlxq's own (:data:`~mlxq.producer.codec.FINISH_REASONS`); any
#: other (a rogue record) is labeled "other".
_REASONS = frozenset(FINISH_REASONS)
OTHER = "other"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxq_gateway_requests",
            "HTTP requests answered, by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "mlxq_gateway_request_duration_seconds",
            "Seconds from request to the response's last byte (a stream's end)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mlxq_gateway_time_to_first_token_seconds",
            "Seconds from submit to a completion's first text",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mlxq_gateway_e2e_request_latency_seconds",
            "Seconds from submit to a completion's end",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.streams = Gauge("mlxq_gateway_streams_open", "Streams being relayed", registry=r)
        self.prompt_tokens = Counter(
            "mlxq_gateway_prompt_tokens",
            "Prompt tokens of finished completions",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "mlxq_gateway_generation_tokens",
            "Tokens generated for finished completions",
            ["model"],
            registry=r,
        )
        self.finished = Counter(
            "mlxq_gateway_request_success",
            "Completions that ended, by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.canceled = Counter(
            "mlxq_gateway_jobs_canceled",
            "Jobs the gateway canceled: client_disconnected, restarted (a stream it cannot redo)",
            ["reason"],
            registry=r,
        )

    def completed(self, model: str, finish_reason: str, usage: Mapping[str, int] | None) -> None:
        self.finished.labels(finish_reason if finish_reason in _REASONS else OTHER).inc()
        if usage:
            self.prompt_tokens.labels(model).inc(usage.get("prompt_tokens", 0))
            self.completion_tokens.labels(model).inc(usage.get("completion_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP request and times it to its last byte, labeled by route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # Every label comes from a fixed set, whatever a client sends: the router records
            # the matched route's template on the scope (unmatched paths share a label), and
            # a method of no known name is "other", so that neither scanning for URLs nor
            # inventing methods grows the label set.
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in METHODS else OTHER
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
