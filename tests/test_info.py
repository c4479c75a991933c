"""``mlxq info`` for workers that serve several queues: each worker's queues in order, by
level (``chat > team-a:3,team-b:1 > sweeps``), and the rows it paused; ``--json`` keeps
every key it had and adds the worker's levels and pause counters. And the dashboard's
grouping of queues by level (the page itself: test_page.py)."""

from __future__ import annotations

import io
import json
import re
import time
import uuid
from typing import Any

import pytest
import redis
from opshelp import mlxq, wait_for
from rich.cells import cell_len
from rich.console import Console

from mlxq.producer import Client, keys
from mlxq.producer.gateway.state import level_groups
from mlxq.producer.info import collect, levels_text, render
from mlxq.producer.listing import recent_jobs

LEVELS = [[["chat", 1]], [["team-a", 3], ["team-b", 1]], [["sweeps", 1]]]


def _worker(name: str, **stats: Any) -> dict[str, Any]:
    """A worker as :func:`collect` lists it."""
    w = dict(name=name, state="busy", queue="default", model="/models/tiny", alive=True)
    w.update(decode_steps=10, vectorized_steps=10, tokens_generated=99, sampler_calls=10)
    w.update(running=1, max_batch=8, started_at=time.time() - 60, tok_s_1m=12.5)
    return {**w, **stats}


def _text(doc: dict[str, Any]) -> str:
    out = io.StringIO()
    Console(width=200, file=out).print(render(doc))
    return out.getvalue()


def _cells(text: str, name: str) -> list[str]:
    (row,) = [line for line in text.splitlines() if f" {name} " in line]
    return [c.strip() for c in re.split("[│┃]", row)[1:-1]]


def test_levels_text_joins_levels_and_shows_weights_where_a_level_is_shared():
    assert levels_text({"levels": LEVELS}) == "chat > team-a:3,team-b:1 > sweeps"
    assert levels_text({"levels": [[["a", 1], ["b", 1]]]}) == "a:1,b:1"
    assert levels_text({"queue": "default", "levels": [[["default", 1]]]}) == "default"
    # A worker that reports no levels (an older one), or not as a worker writes them.
    for bad in ({}, {"levels": None}, {"levels": [["x"]]}, {"levels": [[]]}, {"levels": []}):
        assert levels_text({"queue": "q1,q2", **bad}) == "q1,q2"


def test_table_shows_queues_in_order_and_paused_rows():
    queues = ["chat", "team-a", "team-b", "sweeps"]
    doc = {
        "queues": {},
        "workers": [
            _worker(
                "w-levels",
                queue=",".join(queues),
                queues=queues,
                levels=LEVELS,
                running=1,
                paused=2,
            ),
            _worker(
                "w-plain", queue="default", queues=["default"], levels=[[["default", 1]]], paused=0
            ),
            _worker("w-old"),
        ],
    }
    text = _text(doc)
    header = _cells(text, "worker")
    assert header[:6] == ["worker", "queue", "model", "state", "batch", "paused"]
    levels = _cells(text, "w-levels")
    # The batch is the rows decoding: the paused ones are apart.
    assert levels[1:2] + levels[4:6] == ["chat > team-a:3,team-b:1 > sweeps", "1/8", "2"]
    assert _cells(text, "w-plain")[4:6] == ["1/8", "0"]
    assert _cells(text, "w-old")[1:2] + _cells(text, "w-old")[4:6] == ["default", "1/8", "-"]
    # No worker serves several queues: no rows can pause, and the table is as it was.
    plain = _text({"queues": {}, "workers": doc["workers"][1:]})
    assert "paused" not in plain and _cells(plain, "w-plain")[4:6] == ["1/8", "12.5"]


def test_dashboard_groups_each_layout_of_levels_once():
    def w(name: str, *levels: list[list[Any]]) -> dict[str, Any]:
        queues = [q for level in levels for q, _ in level]
        return {"name": name, "queues": queues, "levels": list(levels)}

    groups = level_groups(
        [
            w("w1", *LEVELS),
            w("solo", [["default", 1]]),  # one queue: listed on its own
            w("w2", *LEVELS),  # the same layout: one group, two workers
            w("w3", [["chat", 1]], [["batch", 1]]),  # chat is in w1's group already
            {"name": "odd", "queues": ["x", "y"], "levels": [["x"]]},  # unreadable
            {"name": "old", "queue": "legacy"},
            {**w("gone", [["hi", 1]], [["lo", 1]]), "alive": False},  # its layout is gone too
        ]
    )
    assert groups == [
        {
            "text": "chat > team-a:3,team-b:1 > sweeps",
            "workers": ["w1", "w2"],
            "levels": [
                [{"queue": "chat", "weight": 1}],
                [{"queue": "team-a", "weight": 3}, {"queue": "team-b", "weight": 1}],
                [{"queue": "sweeps", "weight": 1}],
            ],
        },
        {
            "text": "chat > batch",
            "workers": ["w3"],
            "levels": [[], [{"queue": "batch", "weight": 1}]],
        },
    ]


def _long(url: str, queue: str, seed: int) -> Any:
    """A job that decodes 2,000 tokens unless canceled (some seconds alone)."""
    client = Client(url, queue=queue)
    return client.submit(
        "A long tale", max_tokens=2000, min_tokens=2000, temperature=1.0, seed=seed
    )


@pytest.mark.e2e
def test_info_of_a_worker_with_levels_and_a_paused_row(redis_server, start_worker):
    tag = uuid.uuid4().hex[:6]
    chat, a, b, sweeps = (f"{q}-{tag}" for q in ("chat", "a", "b", "sweeps"))
    w = start_worker([chat, f"{a}:3,{b}:1", sweeps], max_batch=1, window_ms=0)
    r = redis.Redis.from_url(redis_server.url)

    def mine() -> dict[str, Any]:
        (entry,) = [e for e in collect(r)["workers"] if e["name"] == w.name]
        return entry

    low = _long(redis_server.url, sweeps, seed=0)
    wait_for(lambda: low.status() == "started", "the sweep's job to start")
    highs = [_long(redis_server.url, chat, seed=i) for i in range(1, 4)]
    wait_for(lambda: mine().get("paused") == 1, "a paused row")
    try:
        out = mlxq("info", url=redis_server.url)
        assert out.returncode == 0, out.stderr
        cells = _cells(out.stdout, w.name)
        assert cells[1] == f"{chat} > {a}:3,{b}:1 > {sweeps}"
        assert cells[4:6] == ["1/1", "1"], cells

        out = mlxq("info", "--json", url=redis_server.url)
        assert out.returncode == 0, out.stderr
        (entry,) = [e for e in json.loads(out.stdout)["workers"] if e["name"] == w.name]
        # Every key info --json had, each worker's stats among them ...
        for key in (
            "name",
            "state",
            "queue",
            "model",
            "alive",
            "decode_steps",
            "vectorized_steps",
            "tokens_generated",
            "sampler_calls",
            "running",
            "max_batch",
            "started_at",
            "tok_s_1m",
            "buffered",
            "jobs_finished",
        ):
            assert key in entry, key
        assert entry["queue"] == ",".join([chat, a, b, sweeps])  # rq's list, as before
        # ... and the levels and pauses.
        assert entry["queues"] == [chat, a, b, sweeps]
        assert entry["levels"] == [[[chat, 1]], [[a, 3], [b, 1]], [[sweeps, 1]]]
        assert entry["paused"] == 1 and entry["preemptions"] >= 1
        assert entry["resumes"] == 0 and entry["resume_tokens_recomputed"] == 0
    finally:
        for job in [*reversed(highs), low]:
            job.cancel()


def test_at_80_columns_each_row_stays_one_line_and_long_names_are_cut_whole():
    counts = dict(queued=123456, started=64, finished=9999999, failed=12, canceled=3)
    doc = {
        "queues": {"chat": counts, "sweeps-nightly-with-a-rather-long-name": counts},
        "workers": [
            _worker(
                "worker-gpu-node-17-8f3a2b1c",
                queue="chat,team-a,team-b,sweeps",
                levels=LEVELS,
                model="/models/mlx-community/Qwen2.5-0.5B-Instruct-4bit",
                paused=2,
                running=31,
                max_batch=64,
                tokens_generated=123456789,
            ),
            _worker("w2", alive=False),
        ],
    }
    out = io.StringIO()
    Console(width=80, file=out).print(render(doc))
    lines = out.getvalue().splitlines()
    assert max(cell_len(line) for line in lines) <= 80, out.getvalue()
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == 4, out.getvalue()  # two queues, two workers: a line each
    assert any("worker-" in line and "…" in line for line in body)
    assert any(line.startswith("│ w2 ") and "(no lease)" in line for line in body)
    # Wide enough, everything shows whole.
    wide = _text(doc)
    assert "worker-gpu-node-17-8f3a2b1c" in wide and "chat > team-a:3,team-b:1 > sweeps" in wide
    assert "sweeps-nightly-with-a-rather-long-name" in wide and "123456789" in wide


# -- thousands of queue names: rq never forgets one -------------------------------------------


class CountingRedis(redis.Redis):
    """A client that counts its round trips: single commands and pipelines."""

    trips = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        CountingRedis.trips += 1
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        p = super().pipeline(transaction, shard_hint)
        execute = p.execute

        def counted(*args: Any, **kwargs: Any) -> Any:
            CountingRedis.trips += 1
            return execute(*args, **kwargs)

        p.execute = counted  # type: ignore[method-assign]
        return p


def test_thousands_of_stale_queue_names_cost_a_few_round_trips(redis_server):
    r = CountingRedis.from_url(redis_server.url)
    tag = uuid.uuid4().hex[:6]
    held, served = f"held-{tag}", f"served-{tag}"
    stale = [keys.queue_key(f"stale-{tag}-{i}") for i in range(5000)]
    r.sadd(keys.RQ_QUEUES, *stale)
    job = Client(redis_server.url, queue=held).submit("nobody serves me", max_tokens=2)
    # A worker rq lists (its lease long lapsed) still shows the queue it serves.
    worker = keys.rq_worker_key(f"w-{tag}")
    r.hset(worker, mapping={"state": "idle", "queues": served})
    r.sadd(keys.RQ_WORKERS, worker)
    try:
        for n_stale in (10, 5000):
            if n_stale < len(stale):
                r.srem(keys.RQ_QUEUES, *stale[n_stale:])
            CountingRedis.trips = 0
            t0 = time.perf_counter()
            doc = collect(r)
            took = time.perf_counter() - t0
            trips = CountingRedis.trips
            assert doc["queues"][held]["queued"] == 1
            assert doc["queues"][served] == dict.fromkeys(
                ("queued", "started", "finished", "failed", "canceled", "buffered"), 0
            )
            assert not [q for q in doc["queues"] if q.startswith(f"stale-{tag}")]
            print(f"\ncollect() over {n_stale} stale queues: {trips} round trips, {took:.3f} s")
            if n_stale == 10:
                few = trips
            r.sadd(keys.RQ_QUEUES, *stale)
        assert trips == few  # the same round trips, whatever the number of queues
        for status in (None, "queued"):
            CountingRedis.trips = 0
            jobs = recent_jobs(r, status=status)
            assert [j["id"] for j in jobs if j["queue"] == held] == [job.id]
            assert CountingRedis.trips <= 5  # one more where a failed job's reason is read
        t0 = time.perf_counter()
        out = mlxq("info", url=redis_server.url)
        took = time.perf_counter() - t0
        assert out.returncode == 0, out.stderr
        assert held in out.stdout and served in out.stdout and "stale-" not in out.stdout
        print(f"mlxq info over 5000 stale queues: {took:.2f} s (a process start included)")
    finally:
        job.cancel()
        r.srem(keys.RQ_QUEUES, *stale)
        r.srem(keys.RQ_WORKERS, worker)
        r.delete(worker)


def test_a_worker_whose_jobs_ended_reads_idle_everywhere(redis_server, start_worker, queue_name):
    """rq's record of the worker has one owner, its counters: jobs that start and end
    between two of their writes leave no "busy" behind (in mlxq info or rq info)."""
    from rq import Worker

    w = start_worker()
    client = Client(redis_server.url, queue=queue_name)
    r = redis.Redis.from_url(redis_server.url)
    for i in range(6):  # short jobs, one at a time: each starts and ends within a second
        client.submit(f"short {i}", max_tokens=1).result(timeout=60)

    def state() -> tuple[str, str]:
        (mine,) = [e for e in collect(r)["workers"] if e["name"] == w.name]
        rq_state = Worker.find_by_key(keys.rq_worker_key(w.name), connection=r).state
        return str(mine["state"]), str(rq_state)

    wait_for(lambda: state() == ("idle", "idle"), "the worker to read idle in mlxq and in rq")
    out = mlxq("info", "--json", url=redis_server.url)
    (mine,) = [e for e in json.loads(out.stdout)["workers"] if e["name"] == w.name]
    assert (mine["state"], mine["running"]) == ("idle", 0)


def test_watch_keeps_the_workers_on_screen_however_many_queues_redis_holds():
    counts = dict(queued=0, started=0, finished=3, failed=0, canceled=0)
    queues = {f"old-{i:03d}": dict(counts) for i in range(120)}
    queues["old-117"] = {**counts, "queued": 5}  # busy: shown first
    doc = {"queues": {**queues, "default": dict(counts)}, "workers": [_worker("w-live")]}
    out = io.StringIO()
    Console(width=200, height=40, file=out).print(render(doc, fit_height=True))
    lines = out.getvalue().splitlines()
    assert len(lines) <= 40
    assert _cells(out.getvalue(), "w-live")[0] == "w-live"
    firsts = [c[0] for c in (_cells(line, "") for line in lines if line.startswith("│"))]
    assert firsts[:2] == ["old-117", "default"]  # the busy queue and the served one first
    (more,) = [line for line in lines if "more" in line]
    shown = sum(1 for line in lines if " old-" in line)
    assert f"... {121 - shown - 1} more" in more  # less the old ones and default
    # Printed once (no --watch), every queue is listed.
    assert sum(" old-" in line for line in _text(doc).splitlines()) == 120
