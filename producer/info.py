"""What ``mlxq info`` reports: rq's queues and registries, and each worker's counters."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
from rich.console import Group, RenderableType
from rich.table import Table
from rq import Queue, Worker

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer

log = logging.getLogger("mlxq.producer")

_COUNTERS = ("decode_steps", "vectorized_steps", "sampler_calls", "tokens_generated")
_PAUSES = ("paused", "preemptions", "resumes", "resume_tokens_recomputed")


def queue_counts(q: Queue) -> dict[str, int]:
    return {
        "queued": q.count,
        "started": q.started_job_registry.count,
        "finished": q.finished_job_registry.count,
        "failed": q.failed_job_registry.count,
        "canceled": q.canceled_job_registry.count,
    }


def decode_stats(raw: Any) -> dict[str, Any]:
    """A worker's stats map as stored in its ``mlxq:worker:<name>`` hash.

    Raises:
        ValueError: it is not a map, or a counter is not a number.
    """
    try:
        stats = MsgpackSerializer.loads(raw)
    except Exception as e:
        raise ValueError(f"undecodable ({type(e).__name__})") from None
    if not isinstance(stats, Mapping):
        raise ValueError(f"not a map but {type(stats).__name__}")
    for k in (*_COUNTERS, *_PAUSES, "running", "started_at", "tok_s_1m"):
        v = stats.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{k}={v!r} is not a number")
    return dict(stats)


def _read_stats(
    connection: redis.Redis, names: list[str], warn: Callable[[str], None]
) -> list[tuple[dict[str, Any], bool]]:
    """Each worker's stats (empty when missing or unreadable) and whether its lease is held."""
    with connection.pipeline(transaction=False) as p:
        for name in names:
            p.hget(keys.worker_stats_key(name), "stats")
            p.type(keys.alive_key(name))
        replies = p.execute(raise_on_error=False)
    out = []
    for i, name in enumerate(names):
        raw, alive = replies[2 * i], replies[2 * i + 1]
        stats: dict[str, Any] = {}
        try:
            if isinstance(raw, Exception):
                raise ValueError(str(raw))
            if raw is not None:
                stats = decode_stats(raw)
        except ValueError as e:
            warn(f"skipped the stats of worker {name} ({keys.worker_stats_key(name)}): {e}")
        out.append((stats, keys.lease_held(alive)))
    return out


def collect(connection: redis.Redis, warn: Callable[[str], None] = log.warning) -> dict[str, Any]:
    """The ``mlxq info --json`` document.

    Args:
        connection: Redis holding the queues.
        warn: Told of each worker whose stats cannot be read (that worker is listed
            without them).

    Returns:
        ``{"queues": {name: {"queued", "started", "finished", "failed", "canceled"}},
        "workers": [{"name", "state", "queue", "model", "alive", "decode_steps",
        "vectorized_steps", "tokens_generated", "sampler_calls", ...}]}``; ``alive``: the
        worker's lease is held; the rest of each worker's stats map follows (``running``,
        ``max_batch``, ``started_at``, ``tok_s_1m``, ``queues`` and ``levels`` (its queues
        in order, highest level first), ``paused``, ``preemptions``, ``resumes``, ...).
    """
    queues = {
        q.name: queue_counts(q)
        for q in sorted(
            Queue.all(connection=connection, serializer=MsgpackSerializer), key=lambda q: q.name
        )
    }
    rq_workers = sorted(Worker.all(connection=connection), key=lambda w: w.name)
    read = _read_stats(connection, [w.name for w in rq_workers], warn)
    workers = []
    for w, (stats, alive) in zip(rq_workers, read, strict=True):
        entry: dict[str, Any] = {
            "name": w.name,
            "state": w.get_state(),
            "queue": ",".join(w.queue_names()),
            "model": str(stats.get("model", "")),
            "alive": alive,
        }
        entry.update({k: int(stats.get(k, 0)) for k in _COUNTERS})
        entry.update({k: v for k, v in stats.items() if k not in entry and k != "name"})
        workers.append(entry)
    return {"queues": queues, "workers": workers}


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _model_name(model: str) -> str:
    # A local path shows as its last two parts; a repo id (org/name) as it is.
    parts = Path(model).parts
    return "/".join(parts[-2:]) if model.startswith(("/", ".", "~")) else model


def levels_text(w: dict[str, Any]) -> str:
    """A worker's queues in order, its levels joined by ``" > "``: ``chat > team-a:3,team-b:1
    > sweeps`` (a weight shows where a level has several queues); a worker that reports no
    levels (an older one) shows its ``queue`` as rq lists it."""
    try:
        shown = [
            ",".join(f"{q}:{weight}" if len(level) > 1 else str(q) for q, weight in level)
            for level in w["levels"]
        ]
    except (KeyError, TypeError, ValueError):  # no levels, or not as a worker writes them
        shown = []
    return " > ".join(shown) if all(shown) and shown else str(w.get("queue", ""))


def decoding(w: dict[str, Any]) -> int:
    """The rows a worker decodes now: its ``running`` jobs (paused ones are apart)."""
    return max(0, int(w.get("running", 0)))


def _serves_levels(w: dict[str, Any]) -> bool:
    queues = w.get("queues")
    return isinstance(queues, list) and len(queues) > 1


def _worker_row(w: dict[str, Any], now: float, paused: bool) -> list[str]:
    steps = int(w.get("decode_steps", 0))
    vec = f"{100 * int(w.get('vectorized_steps', 0)) / steps:.0f}%" if steps else "-"
    batch = f"{decoding(w)}/{w['max_batch']}" if "running" in w and "max_batch" in w else "-"
    rate = f"{float(w['tok_s_1m']):.1f}" if "tok_s_1m" in w else "-"
    up = duration(now - float(w["started_at"])) if w.get("started_at") else "-"
    return [
        str(w["name"]),
        levels_text(w),
        _model_name(str(w["model"])) or "-",
        str(w["state"]) + ("" if w.get("alive") else " (no lease)"),
        batch,
        *([str(w.get("paused", "-"))] if paused else []),
        rate,
        vec,
        str(w.get("tokens_generated", 0)),
        up,
    ]


def render(doc: dict[str, Any]) -> RenderableType:
    """:func:`collect`'s document as two tables (queues, workers), for a rich Console.

    A worker's queues show in order, by level (:func:`levels_text`); the column of paused
    rows shows only where some worker serves several queues (only there can rows pause).
    """
    qt = Table(title="queues", title_justify="left", expand=False)
    for col in ("queue", "queued", "started", "finished", "failed", "canceled", "workers"):
        qt.add_column(col, justify="left" if col == "queue" else "right", overflow="fold")
    serving: dict[str, int] = {}
    for w in doc["workers"]:
        for q in str(w["queue"]).split(","):
            serving[q] = serving.get(q, 0) + bool(w.get("alive"))
    for name, c in doc["queues"].items():
        qt.add_row(
            name,
            *(str(c[k]) for k in ("queued", "started", "finished", "failed", "canceled")),
            str(serving.get(name, 0)),
        )
    paused = any(_serves_levels(w) for w in doc["workers"])
    wt = Table(title=f"workers ({len(doc['workers'])})", title_justify="left", expand=False)
    for col in ("worker", "queue", "model", "state", "batch"):
        wt.add_column(col, overflow="fold")
    if paused:
        wt.add_column("paused", justify="right")
    wt.add_column("tok/s 1m", overflow="fold", justify="right")
    wt.add_column("vectorized", overflow="fold")
    wt.add_column("tokens", justify="right")
    wt.add_column("uptime", justify="right")
    now = time.time()
    for w in doc["workers"]:
        wt.add_row(*_worker_row(w, now, paused))
    return Group(qt, wt)
