"""What ``mlxq info`` reports: rq's queues and registries, and each worker's counters."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rq import Queue

from mlxq.producer import keys, shared
from mlxq.producer.codec import MsgpackSerializer

log = logging.getLogger("mlxq.producer")

_COUNTERS = ("decode_steps", "vectorized_steps", "sampler_calls", "tokens_generated")
_PAUSES = ("paused", "preemptions", "resumes", "resume_tokens_recomputed")
#: Deepest nesting read in a worker's stats map (a worker writes 3 levels).
MAX_STATS_DEPTH = 8


def queue_counts(q: Queue) -> dict[str, int]:
    """One queue's jobs by state, read as :func:`collect` reads them (nothing written).

    Raises:
        ValueError: the queue's list or a registry is of another type.
    """
    wrong: list[str] = []
    counts = shared.queue_counts(q.connection, [q.name], wrong.append, keep=[q.name])
    if wrong:
        raise ValueError(wrong[0])
    return counts[q.name]


def _finite(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is what JSON carries: maps with text keys, lists, text, finite
    numbers, booleans, None; nested at most :data:`MAX_STATS_DEPTH` deep."""
    if depth > MAX_STATS_DEPTH:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, list):
        return all(_finite(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite(v, depth + 1) for k, v in value.items())
    return False  # bytes, msgpack's ext types and timestamps: never what a worker writes


def _shape_problem(stats: Mapping[str, Any]) -> str | None:
    """What is wrong with the fields readers use, if anything."""
    for k in (*_COUNTERS, *_PAUSES, "running", "started_at", "tok_s_1m", "max_batch"):
        v = stats.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{k}={shared.shown(v)} is not a finite number"
    for k in ("model", "queue"):
        if not isinstance(stats.get(k, ""), str):
            return f"{k}={shared.shown(stats[k])} is not text"
    queues = stats.get("queues", [])
    if not isinstance(queues, list) or not all(isinstance(q, str) for q in queues):
        return f"queues={shared.shown(queues)} is not a list of names"
    levels = stats.get("levels", [])
    if not isinstance(levels, list) or not all(_level(x) for x in levels):
        return f"levels={shared.shown(levels)} is not a list of [[queue, weight], ...]"
    if not _finite(stats):
        return "it holds a value JSON cannot carry (NaN, infinity, bytes, or too deep)"
    return None


def _level(level: Any) -> bool:
    return isinstance(level, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], int)
        and not isinstance(p[1], bool)
        for p in level
    )


def decode_stats(raw: Any) -> dict[str, Any]:
    """A worker's stats map as stored in its ``mlxq:worker:<name>`` hash.

    Raises:
        ValueError: it is not a map, a field readers use has another type, a number is
            not finite, or it holds something JSON cannot carry (the gateway answers it).
    """
    try:
        stats = MsgpackSerializer.loads(raw)
    except Exception as e:
        raise ValueError(f"undecodable ({type(e).__name__})") from None
    if not isinstance(stats, Mapping):
        raise ValueError(f"not a map but {type(stats).__name__}")
    if problem := _shape_problem(stats):
        raise ValueError(problem)
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

    Read through :mod:`mlxq.producer.shared`: whatever one key holds, the rest is
    answered. A queue is listed when it holds jobs or a listed worker serves it (rq never
    forgets a queue name; thousands of empty ones would hide the few in use).

    Args:
        connection: Redis holding the queues.
        warn: Told of each queue, worker or field skipped as unreadable (a worker whose
            stats cannot be read is listed without them).

    Returns:
        ``{"queues": {name: {"queued", "started", "finished", "failed", "canceled"}},
        "workers": [{"name", "state", "queue", "model", "alive", "decode_steps",
        "vectorized_steps", "tokens_generated", "sampler_calls", "birth", ...}]}``;
        ``alive``: the worker's lease is held; ``birth``: when rq registered it (Unix
        seconds, None if unknown); the rest of each worker's stats map follows
        (``running``, ``max_batch``, ``started_at``, ``tok_s_1m``, ``queues`` and
        ``levels`` (its queues in order, highest level first), ``paused``,
        ``preemptions``, ``resumes``, ...).
    """
    records = shared.worker_records(connection, warn)
    served = {q for w in records for q in w.queues}
    names = set(shared.queue_names(connection, warn)) | served
    queues = shared.queue_counts(connection, names, warn, keep=served)
    read = _read_stats(connection, [w.name for w in records], warn)
    workers = []
    for w, (stats, alive) in zip(records, read, strict=True):
        entry: dict[str, Any] = {
            "name": w.name,
            "state": w.state,
            "queue": ",".join(w.queues),
            "model": str(stats.get("model", "")),
            "alive": alive,
            "birth": w.birth,
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


#: Narrower than this, the workers table leaves out its least needed columns (they stay
#: in ``--json``), so that names and levels keep room enough to be read.
NARROW = 110
_DETAIL = ("vectorized", "tokens", "uptime")
_NAMES = ("worker", "queue", "model")
_MIN_NAME = 8


def render(doc: dict[str, Any], fit_height: bool = False) -> RenderableType:
    """:func:`collect`'s document as two tables (queues, workers), for a rich Console.

    A worker's queues show in order, by level (:func:`levels_text`); the column of paused
    rows shows only where some worker serves several queues (only there can rows pause).
    The tables fit the console's width: names and levels give way first, cut with an
    ellipsis (never folded mid-word into another row), and below :data:`NARROW` columns
    the details columns are left out. With ``fit_height`` (``--watch``, where what is
    taller than the terminal is cut off) the queues table gives way too: the queues with
    jobs queued or running, or a worker, come first, and a last row counts the rest,
    so the workers table stays on the screen however many queues Redis holds.
    """
    return _InfoView(doc, fit_height)


class _InfoView:
    """Builds the tables when printed, when the width they must fit is known."""

    def __init__(self, doc: dict[str, Any], fit_height: bool) -> None:
        self.doc, self.fit_height = doc, fit_height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, most = options.max_width, None
        if self.fit_height:  # each table: its rows, and 5 lines of title, header and rules
            most = max(1, options.size.height - (len(self.doc["workers"]) + 5) - 5 - 1)
        yield Group(_queues_table(self.doc, width, most), _workers_table(self.doc, width))


def _queues_table(doc: dict[str, Any], width: int, most: int | None = None) -> Table:
    qt = Table(title="queues", title_justify="left", expand=False)
    serving: dict[str, int] = {}
    for w in doc["workers"]:
        for q in str(w["queue"]).split(","):
            serving[q] = serving.get(q, 0) + bool(w.get("alive"))
    counts = ("queued", "started", "finished", "failed", "canceled")
    rows = [
        [name, *(str(c[k]) for k in counts), str(serving.get(name, 0))]
        for name, c in doc["queues"].items()
    ]
    if most is not None and len(rows) > most:  # busy ones first, in their order
        rows.sort(key=lambda r: r[1] == r[2] == r[-1] == "0")  # stable: busy, then idle
        rows = rows[: max(0, most - 1)]
        rows.append([f"... {len(doc['queues']) - len(rows)} more", *[""] * len(counts), ""])
    cols = ("queue", *counts, "workers")
    natural = [max([len(col), *(cell_len(r[i]) for r in rows)]) for i, col in enumerate(cols)]
    room = width - 1 - sum(n + 3 for n in natural[1:]) - 3
    for i, col in enumerate(cols):
        if i == 0:  # a long name is cut with an ellipsis (whole in --json)
            qt.add_column(
                col, overflow="ellipsis", no_wrap=True, max_width=_share(room, natural[:1])[0]
            )
        else:
            qt.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        qt.add_row(*r)
    return qt


def _workers_table(doc: dict[str, Any], width: int) -> Table:
    paused = any(_serves_levels(w) for w in doc["workers"])
    wt = Table(title=f"workers ({len(doc['workers'])})", title_justify="left", expand=False)
    now = time.time()
    rows = [_worker_row(w, now, paused) for w in doc["workers"]]
    cols = ["worker", "queue", "model", "state", "batch", *(["paused"] if paused else [])]
    cols += ["tok/s 1m", *_DETAIL]
    shown = [i for i, c in enumerate(cols) if width >= NARROW or c not in _DETAIL]
    natural = {i: max([len(cols[i]), *(cell_len(r[i]) for r in rows)]) for i in shown}
    names = [i for i in shown if cols[i] in _NAMES]
    # Each column costs its text, a space either side and a rule; the names share what
    # the short columns leave, each at least _MIN_NAME and at most what it needs.
    room = width - 1 - sum(natural[i] + 3 for i in shown if i not in names) - 3 * len(names)
    fit = _share(room, [natural[i] for i in names])
    for i in shown:
        col = cols[i]
        if i in names:  # cut with an ellipsis (whole in --json), never folded mid-word
            wt.add_column(col, overflow="ellipsis", no_wrap=True, max_width=fit[names.index(i)])
        else:
            right = col not in ("state", "batch")
            wt.add_column(col, justify="right" if right else "left", no_wrap=True)
    for r in rows:
        wt.add_row(*(r[i] for i in shown))
    return wt


def _share(room: int, wants: list[int]) -> list[int]:
    """Split ``room`` cells among columns that want ``wants``: none below ``_MIN_NAME``
    (or what it wants, if less), none above what it wants, the rest evenly."""
    fit = [min(w, _MIN_NAME) for w in wants]
    left = room - sum(fit)
    while left > 0 and any(f < w for f, w in zip(fit, wants, strict=True)):
        grow = [k for k, (f, w) in enumerate(zip(fit, wants, strict=True)) if f < w]
        step = max(1, left // len(grow))
        for k in grow:
            add = min(step, wants[k] - fit[k], left)
            fit[k] += add
            left -= add
    return fit
