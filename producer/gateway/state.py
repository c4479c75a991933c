"""What one gateway process holds: a client per queue, and a cached view of the workers.

The view is :func:`mlxq.producer.info.collect`'s document, re-read at most every
``sample_s`` by a background task and on demand when a request needs fresher news (a
model nobody served a moment ago). Every request shares that read instead of asking
Redis who serves what on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from mlxq.producer import keys
from mlxq.producer.aio import AsyncClient
from mlxq.producer.connection import connect
from mlxq.producer.gateway.config import GatewayConfig
from mlxq.producer.gateway.errors import APIError
from mlxq.producer.gateway.metrics import Metrics
from mlxq.producer.info import collect, decoding, levels_text
from mlxq.producer.throttle import Throttle

log = logging.getLogger("mlxq.gateway")

#: Worker counters arrive every few seconds (5 s while busy): rates span this window.
RATE_WINDOW_S = 10.0


def _live(w: dict[str, Any]) -> bool:
    return bool(w.get("alive", True))


def _queues_of(w: dict[str, Any]) -> list[str]:
    return [q for q in str(w.get("queue", "")).split(",") if q]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Queues and workers as read at ``at`` (monotonic seconds)."""

    at: float
    queues: dict[str, dict[str, int]]
    workers: list[dict[str, Any]]

    def serving(self, queue: str) -> list[dict[str, Any]]:
        """The live workers that serve ``queue``."""
        return [w for w in self.workers if _live(w) and queue in _queues_of(w)]

    def served(self) -> dict[str, list[dict[str, Any]]]:
        """Each queue that has a live worker, with those workers."""
        out: dict[str, list[dict[str, Any]]] = {}
        for w in self.workers:
            if _live(w):
                for q in _queues_of(w):
                    out.setdefault(q, []).append(w)
        return dict(sorted(out.items()))

    def knows(self, queue: str) -> bool:
        return queue in self.queues or any(queue in _queues_of(w) for w in self.workers)


def level_groups(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's queues by level: one group per layout of levels that live workers
    serving several queues share, in the workers' order.

    Returns:
        ``[{"text": "chat > team-a:3,team-b:1", "workers": [names], "levels":
        [[{"queue", "weight"}], ...]}]``, each level highest first. A queue is in the
        first group that has it (a later layout sharing it lists only the rest); a queue
        of no group is not in any (the page lists it on its own).
    """
    groups: dict[str, dict[str, Any]] = {}
    placed: set[str] = set()
    for w in workers:
        if not _live(w) or len(w.get("queues") or []) < 2:
            continue
        text = levels_text(w)
        if text in groups:
            groups[text]["workers"].append(w["name"])
            continue
        try:
            levels = [[(str(q), int(n)) for q, n in level] for level in w["levels"]]
        except (KeyError, TypeError, ValueError):
            continue  # not as a worker writes them: its queues are listed on their own
        shown = []
        for level in levels:
            shown.append([{"queue": q, "weight": n} for q, n in level if q not in placed])
            placed.update(q for q, _ in level)
        groups[text] = {"text": text, "workers": [w["name"]], "levels": shown}
    return list(groups.values())


class Rates:
    """Tokens per second per worker, from successive reads of its ``tokens_generated``."""

    def __init__(self, history_s: float) -> None:
        self._seen: dict[str, deque[tuple[float, int]]] = {}
        self.history: deque[tuple[float, float]] = deque()  # (unix time, tok/s of all)
        self.history_s = history_s

    def observe(self, at: float, workers: list[dict[str, Any]]) -> None:
        for w in workers:
            seen = self._seen.setdefault(w["name"], deque())
            tokens = int(w.get("tokens_generated", 0))
            if seen and tokens < seen[-1][1]:
                seen.clear()  # the counter went back: a new process under the same name
            seen.append((at, tokens))
            while len(seen) > 2 and at - seen[1][0] >= RATE_WINDOW_S:
                seen.popleft()
        names = {w["name"] for w in workers}
        for gone in set(self._seen) - names:
            del self._seen[gone]

    def rate(self, name: str) -> float:
        seen = self._seen.get(name)
        if not seen or len(seen) < 2 or seen[-1][0] <= seen[0][0]:
            return 0.0
        return (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])

    def record(self, workers: list[dict[str, Any]]) -> None:
        now = time.time()
        self.history.append((now, sum(self.rate(w["name"]) for w in workers if _live(w))))
        while self.history and now - self.history[0][0] > self.history_s:
            self.history.popleft()


def _no_model(model: str) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist: no mlxq queue of that name",
        param="model",
        code="model_not_found",
    )


class Gateway:
    """The clients, the worker view and the metrics one app shares across requests."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.redis = connect(config.redis_url)
        self.metrics = Metrics()
        self.rates = Rates(config.history_s)
        self._clients: dict[str, AsyncClient] = {}
        self._snap: Snapshot | None = None
        self._lock = asyncio.Lock()
        #: Rate-limited warnings of what reads of shared state skip.
        self.warn = Throttle(log.warning)

    def client(self, queue: str) -> AsyncClient:
        """The one client of ``queue``, made on first use."""
        if queue not in self._clients:
            self._clients[queue] = AsyncClient(
                self.config.redis_url, queue=queue, max_queued=self.config.max_queued
            )
        return self._clients[queue]

    async def client_for(self, model: str) -> AsyncClient:
        """The client of the queue named ``model``, if a live worker serves it.

        Raises:
            APIError: 404 when no such queue exists, 503 when it has no live worker.
        """
        if await self._served(model):
            return self.client(model)
        if await self._exists(model):
            raise APIError(
                503,
                f"no live worker serves the model {model!r}: start one with "
                f"'mlxq worker --queue {model} --model PATH'",
                "server_error",
                param="model",
                code="model_unavailable",
            )
        raise _no_model(model)

    async def route(self, model: str, service_tier: str | None) -> tuple[AsyncClient, str]:
        """The client of the queue a request runs on, and the tier it is served at.

        A ``service_tier`` that ``--service-tier`` maps runs on its queue (``model`` must
        still name a queue); any other on the queue ``model`` names, at ``default``.

        Raises:
            APIError: 404 when ``model`` names no queue, 503 when the queue the request
                runs on has no live worker.
        """
        queue, tier = self.config.route(model, service_tier)
        if queue == model:
            return await self.client_for(model), tier
        if not await self._exists(model):
            raise _no_model(model)
        if await self._served(queue):
            return self.client(queue), tier
        raise APIError(
            503,
            f"no live worker serves the queue {queue!r} that service_tier {tier!r} runs on: "
            f"start one with 'mlxq worker --queue {queue} --model PATH'",
            "server_error",
            param="service_tier",
            code="service_tier_unavailable",
        )

    async def limits(self, queue: str) -> tuple[int, int]:
        """What input the live workers of ``queue`` all take: the smallest context (tokens)
        and vocabulary any of them published; 0 where none did (an older worker)."""
        snap = await self.snapshot(max_age=self.config.sample_s)

        def least(name: str) -> int:
            known = [v for w in snap.serving(queue) if isinstance(v := w.get(name), int) and v > 0]
            return min(known, default=0)

        return least("max_context"), least("vocab_size")

    async def tool_format(self, queue: str) -> str:
        """The tool-call format the live workers of ``queue`` all published; "" when
        they name none or differ."""
        snap = await self.snapshot(max_age=self.config.sample_s)
        formats = {w.get("tool_format") or "" for w in snap.serving(queue)}
        only = formats.pop() if len(formats) == 1 else ""
        return only if isinstance(only, str) else ""

    async def _served(self, queue: str) -> bool:
        snap = await self.snapshot(max_age=self.config.sample_s)
        if not snap.serving(queue):
            snap = await self.snapshot(max_age=0.25)  # news may be a moment old
        return bool(snap.serving(queue))

    async def _exists(self, queue: str) -> bool:
        snap = await self.snapshot(max_age=self.config.sample_s)
        return snap.knows(queue) or await asyncio.to_thread(self._known, queue)

    def _known(self, queue: str) -> bool:
        """Whether rq knows the queue, or an mlxq worker ever served it."""
        with self.redis.pipeline(transaction=False) as p:
            p.sismember(keys.RQ_QUEUES, keys.queue_key(queue))
            p.exists(keys.workers_key(queue))
            # A set of another type knows nothing (and says so where it is read in full).
            return any(not isinstance(r, Exception) and r for r in p.execute(raise_on_error=False))

    async def latest(self, max_age: float) -> Snapshot:
        """The view as :meth:`snapshot` gives it, except that while a read is under way the
        last view answers at once (``/health`` must not wait on reading the workers)."""
        if self._lock.locked() and self._snap is not None:
            return self._snap
        return await self.snapshot(max_age)

    async def snapshot(self, max_age: float) -> Snapshot:
        """The worker view, re-read when older than ``max_age`` seconds."""
        snap = self._snap
        if snap is not None and time.monotonic() - snap.at <= max_age:
            return snap
        async with self._lock:  # one read serves every request waiting on it
            snap = self._snap
            if snap is not None and time.monotonic() - snap.at <= max_age:
                return snap
            doc = await asyncio.to_thread(self._read)
            snap = Snapshot(time.monotonic(), doc["queues"], doc["workers"])
            self.rates.observe(snap.at, snap.workers)
            self._snap = snap
            return snap

    def _read(self) -> dict[str, Any]:
        # collect() skips what it cannot read, telling self.warn; rq keeps a killed
        # worker registered for minutes, but its mlxq lease (``alive``) lapses in seconds.
        doc = collect(self.redis, self.warn)
        for w in doc["workers"]:
            w["started_at"] = w.get("birth")
        return doc

    async def sample_forever(self) -> None:
        """Read the workers every ``sample_s`` and keep the tok/s history (a task).

        A round that fails, for any reason, is logged (rate-limited) and the next one runs:
        the history must not stop for good on one bad read.
        """
        while True:
            try:
                snap = await self.snapshot(max_age=0.0)
                self.rates.record(snap.workers)
            except redis.RedisError as e:
                self.warn(f"reading the workers' counters failed: {e}")
            except Exception as e:
                self.warn(f"reading the workers' counters failed: {type(e).__name__}: {e}")
                log.debug("sampler round failed", exc_info=True)
            await asyncio.sleep(self.config.sample_s)

    def workers_view(self, snap: Snapshot) -> list[dict[str, Any]]:
        """The dashboard's rows: each worker with its tok/s, vectorized share and uptime."""
        now = time.time()
        rows = []
        for w in snap.workers:
            steps = int(w.get("decode_steps", 0))
            started = w.get("started_at")
            rows.append(
                {
                    **{k: w.get(k) for k in ("name", "queue", "model", "state", "max_batch")},
                    "levels_text": levels_text(w),
                    "alive": _live(w),
                    "batch": decoding(w),
                    # None from a worker too old to pause rows.
                    **{k: w.get(k) for k in ("paused", "preemptions", "resumes")},
                    "tok_s": round(self.rates.rate(w["name"]), 1),
                    "vectorized_share": (int(w.get("vectorized_steps", 0)) / steps)
                    if steps
                    else None,
                    "tokens_generated": int(w.get("tokens_generated", 0)),
                    "uptime_s": None if started is None else max(0.0, now - started),
                }
            )
        return rows

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self.redis.close()
