"""Several queues by priority on one worker (real Redis, real worker, tiny model): levels
in order, weights within a level, and rows paused for a higher level's job that go on
where they stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from itertools import pairwise
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job as RqJob

from mlxq.producer.client import Client, Job
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.info import collect
from mlxq.worker.config import WorkerConfig
from tests.listener import Listener
from tests.opshelp import mlxq, wait_for


def _queues() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"hi-{tag}", f"lo-{tag}"


def _long(client: Client, n: int, tokens: int, **kw: Any) -> list[Job]:
    """Jobs that make exactly ``tokens`` tokens (seeded; greedy for even ``i``)."""
    return client.submit_many(
        [
            dict(
                prompt=f"A long tale, part {i}",
                max_tokens=tokens,
                min_tokens=tokens,
                temperature=0.0 if i % 2 == 0 else 1.0,
                seed=i,
                **kw,
            )
            for i in range(n)
        ]
    )


def _worker(r: redis.Redis, name: str) -> dict[str, Any]:
    (w,) = [w for w in collect(r)["workers"] if w["name"] == name]
    return w


def _rq(r: redis.Redis, job: Job) -> RqJob:
    return RqJob.fetch(job.id, connection=r, serializer=MsgpackSerializer)


def _stats(r: redis.Redis, name: str, ok: Any) -> dict[str, Any]:
    """The worker's stats once ``ok`` holds of them (they are written once a second)."""

    def check() -> dict[str, Any] | None:
        s = _worker(r, name)
        return s if ok(s) else None

    return wait_for(check, "the worker's stats")


def _started(jobs: list[Job], n: int) -> None:
    wait_for(lambda: sum(j.status() == "started" for j in jobs) >= n, f"{n} job(s) started")


def _paused(r: redis.Redis, name: str, n: int) -> None:
    wait_for(lambda: _worker(r, name).get("paused", 0) >= n, f"{n} paused row(s)")


def _clean(r: redis.Redis, *queues: str) -> None:
    for q in queues:
        rq_queue = Queue(q, connection=r, serializer=MsgpackSerializer)
        assert rq_queue.started_job_registry.count == 0, q
        assert rq_queue.count == 0, q


def test_queue_values_parse_into_levels_with_clear_errors():
    c = WorkerConfig("m", queues=("chat", "team-a:3,team-b", "sweeps"))
    assert c.queue == "chat"
    assert c.levels.queues == ("chat", "team-a", "team-b", "sweeps")
    assert [[(s.queue, s.weight) for s in lv] for lv in c.levels.levels] == [
        [("chat", 1)],
        [("team-a", 3), ("team-b", 1)],
        [("sweeps", 1)],
    ]
    # One value with a comma is one level of two queues, not a queue named "a,b".
    assert len(WorkerConfig("m", queues=("a,b",)).levels.levels) == 1
    assert len(WorkerConfig("m", queues=("a", "b")).levels.levels) == 2
    for values, says in [
        (("a:0",), "weight '0' of 'a'"),
        (("a:x",), "weight 'x' of 'a'"),
        (("a", "b,a"), "queue 'a' is named twice"),
        (("a,",), "needs a name"),
    ]:
        with pytest.raises(ValueError, match=says):
            WorkerConfig("m", queues=values)
    with pytest.raises(ValueError, match="reserve_rows=4"):
        WorkerConfig("m", max_batch=4, reserve_rows=4)


def test_a_bad_queue_option_exits_2_naming_it(tiny_model, redis_server):
    out = mlxq("worker", "--model", str(tiny_model), "--queue", "chat", "--queue", "x:-1")
    assert out.returncode == 2, out.stderr
    assert "x:-1" in out.stderr and "weight" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("kv", ["kept", "dropped"])
def test_a_higher_level_job_pauses_lower_rows_that_go_on_unchanged(
    redis_server, start_worker, r, kv
):
    hi, lo = _queues()
    opts = {"paused_kv_bytes": 0} if kv == "dropped" else {}
    w = start_worker([hi, lo], max_batch=2, window_ms=0, **opts)
    low = Client(redis_server.url, queue=lo)
    sweep = _long(low, 2, 300)
    listeners = [Listener(j) for j in sweep]
    _started(sweep, 2)
    chat = Client(redis_server.url, queue=hi).submit_many(
        [dict(prompt=f"hello {i}", max_tokens=8) for i in range(2)]
    )
    for j in chat:
        assert j.result(timeout=120).token_ids
    results = [j.result(timeout=120) for j in sweep]
    for lis in listeners:
        lis.check()
        assert lis.resets == 0, "a paused job's stream goes on, it never starts again"
    stats = _stats(r, w.name, lambda s: s["preemptions"] >= 1 and s["resumes"] == s["preemptions"])
    assert stats["queues"] == [hi, lo]
    if kv == "dropped":
        assert stats["resume_tokens_recomputed"] > 0
    else:
        assert stats["resume_tokens_recomputed"] == 0
    # The chat jobs ran while the sweep's rows were paused.
    for c in chat:
        assert _rq(r, c).ended_at < max(_rq(r, s).ended_at for s in sweep)
    # The same jobs again on an idle worker, never paused: the very same tokens (greedy
    # and seeded alike).
    again = _long(low, 2, 300)
    assert [j.result(timeout=120).token_ids for j in again] == [x.token_ids for x in results]
    assert _worker(r, w.name)["preemptions"] == stats["preemptions"]
    assert [len(x.token_ids) for x in results] == [300, 300]
    _clean(r, hi, lo)


def test_levels_in_order_and_no_pause_when_told(redis_server, start_worker, r):
    hi, lo = _queues()
    low, high = Client(redis_server.url, queue=lo), Client(redis_server.url, queue=hi)
    waiting_low = _long(low, 3, 20)
    waiting_high = _long(high, 2, 20)
    w = start_worker([hi, lo], max_batch=1, window_ms=0, no_preempt=True)
    for j in waiting_high + waiting_low:
        j.result(timeout=120)
    starts = {j.id: _rq(r, j).started_at for j in waiting_high + waiting_low}
    assert max(starts[j.id] for j in waiting_high) < min(starts[j.id] for j in waiting_low)
    # A running low job is not paused with --no-preempt: the high one waits for its row.
    running = _long(low, 1, 200)
    _started(running, 1)
    late = _long(high, 1, 4)
    late[0].result(timeout=120)
    assert _rq(r, late[0]).started_at >= _rq(r, running[0]).ended_at
    stats = _stats(r, w.name, lambda s: s["jobs_finished"] == 7)
    assert stats["preemptions"] == 0
    # The three high jobs took their first token from the prefill that fed their last
    # prompt token; the four low ones from the next decode step (they ride): no job took
    # a pass of its own for it.
    assert stats["first_tokens_from_prefill"] == 3
    assert stats["first_token_passes"] == 0
    # The tiny model's decode steps run its rows as one sequence; one row at a time, no
    # new row ever started beside a busy batch to share its pass.
    assert stats["one_sequence"] is True and stats["fused_prefills"] == 0
    assert stats["fused_prefill"] is False  # auto: off on every backend
    _clean(r, hi, lo)


def test_reserved_rows_count_the_first_levels_own(redis_server, start_worker, r):
    # --reserve-rows 1 of 3: lower levels leave one row free for the first level, and
    # while the first level holds a row they use the other two (the reserve is in use:
    # nothing more to keep). Before, they kept a row free beside it and ran on one.
    hi, lo = _queues()
    (chat,) = _long(Client(redis_server.url, queue=hi), 1, 2000)
    sweep = _long(Client(redis_server.url, queue=lo), 6, 8)
    w = start_worker([hi, lo], max_batch=3, window_ms=0, reserve_rows=1)
    for j in sweep:
        j.result(timeout=120)
    assert chat.status() == "started", "the sweep ran beside the first level's job"
    spans = sorted((_rq(r, j).started_at, _rq(r, j).ended_at) for j in sweep)
    assert any(b[0] < a[1] for a, b in pairwise(spans)), f"one at a time: {spans}"
    assert chat.cancel()
    # No first-level job: the sweep keeps to two rows, and one that comes takes the
    # free row without pausing any.
    long_sweep = _long(Client(redis_server.url, queue=lo), 3, 2000)
    _started(long_sweep, 2)
    (late,) = _long(Client(redis_server.url, queue=hi), 1, 4)
    assert late.result(timeout=120).token_ids
    assert sum(j.status() == "started" for j in long_sweep) == 2
    assert _worker(r, w.name)["preemptions"] == 0
    for j in long_sweep:
        assert j.cancel()
    wait_for(lambda: all(j.status() == "canceled" for j in [chat, *long_sweep]), "cancels")
    _clean(r, hi, lo)


def test_weights_split_a_level_by_decoded_tokens(redis_server, start_worker, r):
    tag = uuid.uuid4().hex[:8]
    a, b = f"a-{tag}", f"b-{tag}"
    jobs = {
        q: Client(redis_server.url, queue=q).submit_many(
            [dict(prompt=f"{q} {i}", max_tokens=12, min_tokens=12) for i in range(40)]
        )
        for q in (a, b)
    }
    w = start_worker([f"{a}:3,{b}:1"], max_batch=4, window_ms=0)

    def done(q: str) -> int:
        return Queue(q, connection=r, serializer=MsgpackSerializer).finished_job_registry.count

    wait_for(lambda: done(a) + done(b) >= 32, "32 jobs finished")
    assert 2.0 <= done(a) / max(1, done(b)) <= 4.5, (done(a), done(b))
    for j in jobs[a] + jobs[b]:
        j.result(timeout=120)
    _stats(r, w.name, lambda s: s["tokens_by_queue"] == {a: 480, b: 480})


def test_cancel_and_timeout_while_paused(redis_server, start_worker, r):
    hi, lo = _queues()
    w = start_worker([hi, lo], max_batch=2, window_ms=0)
    low = Client(redis_server.url, queue=lo)
    (victim,) = _long(low, 1, 1500)
    (timed,) = _long(low, 1, 1500, timeout=1.5)
    lis = Listener(victim)
    _started([victim, timed], 2)
    blockers = _long(Client(redis_server.url, queue=hi), 2, 2000)
    _paused(r, w.name, 2)
    assert victim.status() == "started"
    assert victim.cancel()
    wait_for(lambda: victim.status() == "canceled", "the paused job to end canceled")
    lis.thread.join(60)
    assert lis.error is None and len(lis.seqs) == len(set(lis.seqs))
    # A paused job's timeout counts wall time: it fails while paused.
    wait_for(lambda: timed.status() == "failed", "the paused job to time out", timeout=90)
    with pytest.raises(Exception, match="timeout"):
        timed.result(timeout=10)
    assert all(b.status() == "started" for b in blockers), "it timed out while paused"
    for b in blockers:
        assert b.cancel()
    _stats(r, w.name, lambda s: s["paused"] == 0 and s["preemptions"] == 2)
    _clean(r, hi, lo)


def test_a_worker_killed_with_a_paused_job_gives_it_back_once(redis_server, start_worker, r):
    hi, lo = _queues()
    w = start_worker([hi, lo], max_batch=1, window_ms=0)
    (paused,) = _long(Client(redis_server.url, queue=lo), 1, 400)
    lis = Listener(paused)
    _started([paused], 1)
    (blocker,) = _long(Client(redis_server.url, queue=hi), 1, 2000)
    _paused(r, w.name, 1)
    w.signal(signal.SIGKILL)
    w.proc.wait(10)
    start_worker([hi, lo], max_batch=2, window_ms=0)  # same host: the dead pid is seen at once
    assert len(paused.result(timeout=180).token_ids) == 400
    blocker.result(timeout=180)
    lis.check()
    assert int(r.hget(f"rq:job:{paused.id}", "mlxq_attempt") or 0) == 2
    assert paused.status() == "finished"
    _clean(r, hi, lo)


def test_workers_with_different_queue_lists_requeue_each_job_to_its_own_queue(
    redis_server, start_worker, r
):
    tag = uuid.uuid4().hex[:8]
    x, y = f"x-{tag}", f"y-{tag}"
    start_worker([x], max_batch=2, window_ms=0)
    xs = _long(Client(redis_server.url, queue=x), 4, 20)
    for j in xs:  # before the other starts: a full worker keeps jobs ready for its rows
        j.result(timeout=120)
    both = start_worker([y, x], max_batch=2, window_ms=0)
    ys = _long(Client(redis_server.url, queue=y), 2, 2000)
    _started(ys, 2)
    both.signal(signal.SIGKILL)
    both.proc.wait(10)
    # The worker serving only x reaps the dead one (both were on x's roll): its y jobs
    # go back to y, not to x.
    wait_for(
        lambda: Queue(y, connection=r, serializer=MsgpackSerializer).count == 2,
        "y's jobs back in y",
    )
    assert Queue(x, connection=r, serializer=MsgpackSerializer).count == 0
    start_worker([y], max_batch=2, window_ms=0)
    for j in ys:
        assert len(j.result(timeout=180).token_ids) == 2000
    _clean(r, x, y)
    x_finished = Queue(x, connection=r, serializer=MsgpackSerializer).finished_job_registry
    y_finished = Queue(y, connection=r, serializer=MsgpackSerializer).finished_job_registry
    assert (x_finished.count, y_finished.count) == (4, 2)


def test_rq_suspend_gives_waiting_jobs_back_to_their_own_queues(redis_server, start_worker, r):
    hi, lo = _queues()
    w = start_worker([hi, lo], max_batch=1, window_ms=0)
    low, high = Client(redis_server.url, queue=lo), Client(redis_server.url, queue=hi)
    rq = [sys.executable, "-m", "rq.cli"]
    for _ in range(5):
        # The tiny model's 2,000 tokens (near its 2,048 positions) may all be made before
        # the worker's next beat sees the suspension: such a try has no running job to
        # check, and is made again.
        (running,) = _long(low, 1, 2000)
        _started([running], 1)
        subprocess.run([*rq, "suspend", "--url", redis_server.url], check=True, timeout=60)
        wait_for(lambda: _worker(r, w.name).get("suspended"), "the worker to see the suspension")
        if running.status() == "started":
            break
        subprocess.run([*rq, "resume", "--url", redis_server.url], check=True, timeout=60)
        wait_for(lambda: not _worker(r, w.name).get("suspended"), "the worker to see the resume")
    else:
        pytest.fail("in 5 tries the running job ended before the worker saw the suspension")
    try:
        later = _long(low, 2, 4) + _long(high, 1, 4)
        assert running.status() == "started"
        wait_for(
            lambda: (
                (
                    Queue(hi, connection=r).count,
                    Queue(lo, connection=r).count,
                )
                == (1, 2)
            ),
            "waiting jobs in their own queues",
        )
        assert running.cancel()  # before the resume's own start-up lets it end
    finally:
        subprocess.run([*rq, "resume", "--url", redis_server.url], check=True, timeout=60)
    for j in later:
        j.result(timeout=120)
    _clean(r, hi, lo)


def test_rogue_entries_on_another_queue_change_no_jobs_queue(redis_server, start_worker, r):
    hi, lo = _queues()
    w = start_worker([hi, lo], max_batch=2, window_ms=0)
    (running,) = _long(Client(redis_server.url, queue=hi), 1, 1500)
    _started([running], 1)
    # A second entry for the running job on the other queue, and an id with no record.
    r.rpush(f"rq:queue:{lo}", running.id, "no-such-job")
    wait_for(lambda: r.llen(f"rq:queue:{lo}") == 0, "the rogue entries claimed and dropped")
    assert r.hget(f"rq:job:{running.id}", "origin") == hi.encode()
    assert not r.exists("rq:job:no-such-job"), "a dropped entry leaves no record behind"
    assert running.cancel()
    wait_for(lambda: running.status() == "canceled", "the job to end")
    assert r.zcard(f"rq:canceled:{hi}") == 1 and r.zcard(f"rq:canceled:{lo}") == 0
    _stats(r, w.name, lambda s: s["running"] == 0)
    _clean(r, hi, lo)
