"""What ``mlxq info`` reports: rq's queues and registries, and each worker's counters."""

from __future__ import annotations

from typing import Any, cast

import redis
from rq import Queue, Worker

from mlxq.producer import keys
from mlxq.producer.codec import MsgpackSerializer

_COUNTERS = ("decode_steps", "vectorized_steps", "sampler_calls", "tokens_generated")


def queue_counts(q: Queue) -> dict[str, int]:
    return {
        "queued": q.count,
        "started": q.started_job_registry.count,
        "finished": q.finished_job_registry.count,
        "failed": q.failed_job_registry.count,
        "canceled": q.canceled_job_registry.count,
    }


def collect(connection: redis.Redis) -> dict[str, Any]:
    """The ``mlxq info --json`` document.

    Returns:
        ``{"queues": {name: {"queued", "started", "finished", "failed", "canceled"}},
        "workers": [{"name", "state", "queue", "model", "decode_steps",
        "vectorized_steps", "tokens_generated", "sampler_calls", ...}]}``.
    """
    queues = {
        q.name: queue_counts(q)
        for q in sorted(
            Queue.all(connection=connection, serializer=MsgpackSerializer), key=lambda q: q.name
        )
    }
    workers = []
    for w in sorted(Worker.all(connection=connection), key=lambda w: w.name):
        raw = connection.hget(keys.worker_stats_key(w.name), "stats")
        stats: dict[str, Any] = MsgpackSerializer.loads(cast(bytes, raw)) if raw else {}
        entry: dict[str, Any] = {
            "name": w.name,
            "state": w.get_state(),
            "queue": ",".join(w.queue_names()),
            "model": stats.get("model", ""),
        }
        entry.update({k: int(stats.get(k, 0)) for k in _COUNTERS})
        entry.update({k: v for k, v in stats.items() if k not in entry and k != "name"})
        workers.append(entry)
    return {"queues": queues, "workers": workers}


def render(doc: dict[str, Any]) -> str:
    """A terminal table of :func:`collect`'s document."""
    lines = [
        f"{'queue':<20} {'queued':>7} {'started':>8} {'finished':>9} {'failed':>7} {'canceled':>9}"
    ]
    for name, c in doc["queues"].items():
        lines.append(
            f"{name:<20} {c['queued']:>7} {c['started']:>8} {c['finished']:>9} "
            f"{c['failed']:>7} {c['canceled']:>9}"
        )
    lines.append("")
    lines.append(f"{len(doc['workers'])} worker(s)")
    for w in doc["workers"]:
        steps = w["decode_steps"]
        vec = f"{100 * w['vectorized_steps'] / steps:.0f}%" if steps else "-"
        lines.append(
            f"  {w['name']} [{w['state']}] queue={w['queue']} model={w['model']} "
            f"tokens={w['tokens_generated']} steps={steps} vectorized={vec}"
        )
    return "\n".join(lines)
