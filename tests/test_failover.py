"""A primary killed with SIGKILL mid-sweep (real replicas, sentinels, worker, listeners):
every job ends exactly once, and every listener ends with the full text, in order."""

from __future__ import annotations

import threading

import pytest
from listener import Listener
from opshelp import wait_for

from mlxq.producer import Client
from mlxq.producer import keys as k
from mlxq.worker.resync import MasterWatch

pytestmark = pytest.mark.e2e


def _sweep(client: Client, n: int, tokens: int) -> list:
    return client.submit_many(
        [dict(prompt=f"Tale {i}:", max_tokens=tokens, temperature=0.9) for i in range(n)]
    )


def _ended_once(setup, jobs) -> None:
    """Each job's result log (rq's, one entry per run that ended) holds exactly one run."""
    r = setup.client(setup.master_port())
    ends = {j.id: r.xlen(k.results_key(j.id)) for j in jobs}
    assert set(ends.values()) == {1}, {
        i: (n, {f: v[:60] for f, v in r.hgetall(k.job_key(i)).items()})
        for i, n in ends.items()
        if n != 1
    }


def _kill_and_follow(setup) -> int:
    old = setup.kill_master()
    setup.wait_failover(old)
    return old


def _long(client: Client, n: int, tokens: int = 2000) -> list:
    # Seeded, so whether a random model happens to stop early is the same on every run.
    return client.submit_many(
        [
            dict(prompt=f"A long tale, part {i}", max_tokens=tokens, temperature=1.0, seed=i)
            for i in range(n)
        ]
    )


def test_a_primary_killed_mid_stream_loses_no_job_and_no_chunk(
    sentinel_redis, queue_name, start_worker
):
    """Running jobs go on under a new run on the new primary: each listener gets a reset
    and the full text (its log there may lack the old primary's last chunks)."""
    url = sentinel_redis.url
    w = start_worker(redis_url=url, max_batch=8, window_ms=0, wait_replicas=1)
    client = Client(url, queue=queue_name, wait_replicas=1)
    jobs = _long(client, 4) + _sweep(client, 8, 40)
    listeners = [Listener(j) for j in jobs]
    wait_for(lambda: all(lis.text for lis in listeners[:4]), "the long jobs to stream")
    old = _kill_and_follow(sentinel_redis)
    more = _sweep(client, 4, 40)  # submits go to the new primary
    for j in [*jobs, *more]:
        assert j.result(timeout=300).finish_reason in ("stop", "length")
    for lis in listeners:
        lis.check()
    _ended_once(sentinel_redis, [*jobs, *more])
    assert "redis master changed" in w.output()
    assert any(lis.resets for lis in listeners[:4]), "a running job restreamed its text"
    # And back: the old primary returns as a replica, the new one is killed in turn.
    sentinel_redis.restart(old)
    sentinel_redis.wait_primary_replicas(2)
    sentinel_redis.wait_healthy()
    sentinel_redis.wait_failover_gap()
    last = _long(client, 2) + _sweep(client, 6, 40)
    late = [Listener(j) for j in last]
    wait_for(lambda: all(lis.text for lis in late[:2]), "the second sweep to stream")
    _kill_and_follow(sentinel_redis)
    for j in last:
        assert j.result(timeout=300).finish_reason in ("stop", "length")
    for lis in late:
        lis.check()
    _ended_once(sentinel_redis, last)


def test_a_writer_back_from_an_outage_waits_for_a_master_check_begun_after_it():
    """The writer, back from an outage, writes nothing until the heartbeat has checked the
    master: a check already under way when it came back may have read the old master (a
    failover unseen, jobs ending past a gap in their log), so only one begun after counts."""
    watch = MasterWatch()
    under_way = watch.begin()
    pokes: list[int] = []
    got: list[bool] = []
    waiter = threading.Thread(
        target=lambda: got.append(watch.wait_fresh(30, lambda: pokes.append(1)))
    )
    waiter.start()
    wait_for(lambda: pokes, "the writer to ask for a check")
    watch.done(under_way)
    waiter.join(0.3)
    assert waiter.is_alive() and not got, "a check begun before the wait satisfied it"
    watch.done(watch.begin())
    waiter.join(30)
    assert got == [True]
    assert watch.wait_fresh(0.05, lambda: None) is False  # no check since: it says so


def test_a_failover_while_a_batch_of_ends_commits(sentinel_redis, queue_name, start_worker):
    """Short jobs end in batches all the time: the kill lands amid commits of ends."""
    url = sentinel_redis.url
    start_worker(redis_url=url, max_batch=16, window_ms=0, wait_replicas=1)
    client = Client(url, queue=queue_name, wait_replicas=1)
    jobs = _sweep(client, 64, 6)
    listeners = [Listener(j) for j in jobs[::8]]
    wait_for(lambda: sum(j.status() == "finished" for j in jobs) >= 8, "ends to commit")
    _kill_and_follow(sentinel_redis)
    for j in jobs:
        assert j.result(timeout=180).finish_reason in ("stop", "length")
    for lis in listeners:
        lis.check()
    _ended_once(sentinel_redis, jobs)


def test_a_replica_promoted_without_the_last_writes_strands_nothing(
    sentinel_redis, queue_name, start_worker
):
    """The replicas stop taking the primary's writes while jobs run and end; then the
    primary dies. The replica promoted has those jobs started, in the worker's WIP list:
    the worker requeues the ones it let go (their end was lost: they run again, seeded, to
    the same text), claims again the ones it started there unseen (queued on the replica)
    and restreams the text of all it runs."""
    url = sentinel_redis.url
    w = start_worker(redis_url=url, max_batch=8, window_ms=0)
    client = Client(url, queue=queue_name)
    jobs = _long(client, 2, 1500) + _long(client, 6, 400)
    behind = _long(client, 2, 1500)  # queued, until rows free while the replicas see nothing
    listeners = [Listener(j) for j in jobs + behind]
    replicas = [sentinel_redis.client(p) for p in sentinel_redis.data_ports[1:]]

    def started_everywhere() -> bool:
        return all(r.hget(k.job_key(j.id), "status") == b"started" for r in replicas for j in jobs)

    wait_for(started_everywhere, "every job to start, on the replicas too")
    frozen = sentinel_redis.freeze_replicas()
    try:
        unseen = sum(j.status() == "started" for j in jobs[2:])  # their ends: unseen
        wait_for(lambda: all(j.status() == "finished" for j in jobs[2:]), "ends unseen")
        wait_for(lambda: all(lis.text for lis in listeners[-2:]), "starts unseen")
        old = sentinel_redis.kill_master()
    finally:
        sentinel_redis.thaw(frozen)
    sentinel_redis.wait_failover(old)
    for j in jobs + behind:
        assert j.result(timeout=300).finish_reason in ("stop", "length")
    for lis in listeners:
        lis.check()
    _ended_once(sentinel_redis, jobs + behind)
    log = w.output().splitlines()
    said = [line for line in log if "redis master changed" in line]
    assert said and " 0 recorded as started again" not in said[0], w.output()
    # The jobs whose end was lost go back to the queue once: by the resync, or (whichever
    # looks first) by the prefetcher, which claims its WIP list again after the outage.
    by_resync = int(said[0].split(" whose end was lost")[0].rsplit(" ", 1)[1])
    by_prefetch = sum("which no longer runs it: requeued" in line for line in log)
    assert by_resync + by_prefetch >= unseen > 0, w.output()


def test_the_gateway_streams_across_a_failover(
    sentinel_redis, queue_name, start_worker, start_gateway
):
    """OpenAI streams open through ``mlxq serve`` when the primary dies: each goes on where
    its client is (the worker restreams the same text) and ends with the job's text."""
    import openai

    url = sentinel_redis.url
    start_worker(redis_url=url, max_batch=8, window_ms=0, wait_replicas=1)
    g = start_gateway(redis_url=url)
    oai = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(max_tokens=1500, temperature=1.0, seed=3)
    streams = [
        iter(oai.completions.create(model=queue_name, prompt=f"Tale {i}", stream=True, **kw))
        for i in range(3)
    ]
    heads = [next(s) for s in streams]
    _kill_and_follow(sentinel_redis)
    client = Client(url, queue=queue_name)
    for head, rest in zip(heads, streams, strict=True):
        text = "".join(c.choices[0].text for c in [head, *rest] if c.choices)
        job_id = head.id.removeprefix("cmpl-")
        assert text == client.job(job_id).result(timeout=120).text


def test_run_batch_finishes_a_sweep_across_a_failover(
    sentinel_redis, queue_name, start_worker, tmp_path
):
    """``mlxq run-batch`` rides out a primary's death: every line answered once, 200."""
    from test_run_batch import RunBatch, assert_once_each, comp, write_batch

    url = sentinel_redis.url
    start_worker(redis_url=url, max_batch=8, window_ms=0, wait_replicas=1)
    cids = {f"line-{i}" for i in range(24)}
    lines = [comp(c, f"Tale {c}", queue_name, max_tokens=300, seed=1) for c in sorted(cids)]
    inp, out = write_batch(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run = RunBatch(tmp_path, url, inp, out, "--wait-replicas", "1")
    wait_for(lambda: out.exists() and out.stat().st_size > 0, "the first answers")
    _kill_and_follow(sentinel_redis)
    assert run.wait(300) == 0, run.stderr()
    assert_once_each(out, cids)
