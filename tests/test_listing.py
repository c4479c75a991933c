"""The job listing behind the dashboard and ``mlxq jobs``, on a real Redis; jobs a worker
claimed ahead of a free row (buffered) listed and counted as queued, through the CLI."""

from __future__ import annotations

import json
import re
import signal
import uuid
from typing import Any

import pytest
from opshelp import mlxq_all, settled, wait_for
from rq.job import JobStatus

from mlxq.producer import Client, keys
from mlxq.producer.info import collect
from mlxq.producer.listing import STATUSES, job_queue, recent_jobs
from mlxq.producer.outcome import STATUS_OF_RQ, job_status


def test_rq_statuses_read_in_mlxq_words():
    # The one map the client, the listing and run-batch read rq's statuses through.
    words = {
        JobStatus.QUEUED: "queued",
        JobStatus.DEFERRED: "queued",
        JobStatus.SCHEDULED: "queued",
        JobStatus.CREATED: "queued",
        JobStatus.STARTED: "started",
        JobStatus.FINISHED: "finished",
        JobStatus.FAILED: "failed",
        JobStatus.CANCELED: "canceled",
        JobStatus.STOPPED: "canceled",
    }
    assert dict(STATUS_OF_RQ) == {s.value: w for s, w in words.items()}
    assert set(STATUS_OF_RQ.values()) == set(STATUSES)
    assert job_status(None) is None and job_status(b"stopped") == "canceled"
    assert type(job_status("finished")) is str and job_status(b"rate_limited") == "queued"


def test_recent_jobs_lists_states_newest_first(r, redis_server, queue_name):
    client = Client(redis_server.url, queue=queue_name)  # no worker: jobs stay queued
    jobs = [client.submit(f"job {i}", max_tokens=2) for i in range(4)]
    jobs[1].cancel()
    listed = recent_jobs(r, queue=queue_name)
    assert [j["id"] for j in listed if j["status"] == "queued"] == [
        jobs[3].id,
        jobs[2].id,
        jobs[0].id,
    ]
    assert {j["id"]: j["status"] for j in listed}[jobs[1].id] == "canceled"
    assert all(j["queue"] == queue_name and j["age_s"] >= 0 for j in listed)
    assert [j["id"] for j in recent_jobs(r, queue=queue_name, status="canceled")] == [jobs[1].id]
    assert len(recent_jobs(r, queue=queue_name, status="queued", limit=2)) == 2
    assert job_queue(r, jobs[0].id) == queue_name and job_queue(r, "nope") is None
    with pytest.raises(ValueError, match="status"):
        recent_jobs(r, status="done")
    for j in jobs:
        j.cancel()


def _frozen_with_buffered_jobs(worker: Any, jobs: list[Any]) -> tuple[set[str], set[str]]:
    """Freeze ``worker`` (SIGSTOP) while it holds jobs it claimed and has not started;
    the ids of those, and of every job queued (as each job's own status says)."""
    wip = keys.wip_key(worker.name)

    def read() -> tuple[dict[str, Any], set[str]]:
        held = {x.decode() for x in worker.redis.lrange(wip, 0, -1)}
        return {j.id: j.status() for j in jobs}, held

    while True:
        wait_for(lambda: worker.redis.llen(wip) >= 2, "the worker to claim jobs ahead")
        worker.freeze()  # frozen: what it holds stays held
        statuses, held = settled(read)
        queued = {i for i, st in statuses.items() if st == "queued"}
        if queued & held and queued - held:  # some buffered, some still in the queue's list
            return queued & held, queued
        worker.signal(signal.SIGCONT)


def test_jobs_a_worker_claimed_but_not_started_are_listed_and_counted_as_queued(
    start_worker, redis_server, queue_name
):
    # One row and long jobs: the worker runs one and claims more ahead of its free row.
    worker = start_worker(max_batch=1)
    client = Client(redis_server.url, queue=queue_name)
    jobs = [
        client.submit("A long tale", max_tokens=2000, min_tokens=2000, temperature=1.0, seed=i)
        for i in range(12)
    ]
    try:
        buffered, queued = _frozen_with_buffered_jobs(worker, jobs)
        started = {j.id for j in jobs if j.status() == "started"}
        listed, info, table, status = mlxq_all(
            [
                ["jobs", "--queue", queue_name, "--status", "queued", "--json", "--limit", "50"],
                ["info", "--json"],
                ["jobs", "--queue", queue_name, "--limit", "50"],
                ["status", min(buffered)],
            ],
            url=redis_server.url,
        )
        for out in (listed, info, table, status):
            assert out.returncode == 0, out.stderr
        assert {j["id"] for j in json.loads(listed.stdout)} == queued
        counts = json.loads(info.stdout)["queues"][queue_name]
        assert counts["queued"] == len(queued) and counts["buffered"] == len(buffered)
        assert counts["started"] == len(started)
        rows = {line.split()[0]: line.split()[2] for line in table.stdout.splitlines()[1:]}
        assert {i for i, st in rows.items() if st == "queued"} == queued
        assert re.search(r"^status\s+queued$", status.stdout, re.M)
    finally:
        worker.signal(signal.SIGCONT)
        for j in jobs:
            j.cancel()


def test_bad_rolls_and_wip_lists_are_skipped_with_a_warning(r, redis_server):
    tag = uuid.uuid4().hex[:8]
    good, junk = f"good-{tag}", f"junk-{tag}"
    jobs = [Client(redis_server.url, queue=good).submit("x", max_tokens=2) for _ in range(3)]
    # Worker a claimed the first job (as claim.lua leaves it: out of the queue's list, in its
    # WIP list, still queued); its list also holds junk and a job whose record is no hash.
    a, b = f"a-{tag}", f"b-{tag}"
    r.lrem(keys.queue_key(good), 1, jobs[0].id)
    r.hset(keys.job_key(jobs[0].id), "mlxq_owner", a)
    r.set(keys.job_key(f"rogue-{tag}"), "junk")
    r.rpush(keys.wip_key(a), "not an id!", jobs[0].id, f"rogue-{tag}")
    r.hset(keys.wip_key(b), "x", "y")  # worker b's WIP list is a hash
    r.sadd(keys.workers_key(good), a, b, b"\xff" + tag.encode())
    r.set(keys.workers_key(junk), "junk")  # a roll of another type
    r.sadd(keys.RQ_QUEUES, keys.queue_key(junk))
    try:
        warned: list[str] = []
        counts = collect(r, warned.append)["queues"][good]
        assert counts["queued"] == 3 and counts["buffered"] == 1
        listed = recent_jobs(r, queue=good, status="queued", warn=warned.append)
        assert {j["id"] for j in listed} == {j.id for j in jobs}
        everywhere = recent_jobs(r, status="queued", limit=1000, warn=warned.append)
        assert {j.id for j in jobs} <= {j["id"] for j in everywhere}
        for what in (
            keys.wip_key(b),
            keys.workers_key(junk),
            f"{keys.workers_key(good)} that are no worker name",
            f"entries of {keys.wip_key(a)} that are no job id (one: b'not an id!')",
            keys.job_key(f"rogue-{tag}"),
        ):
            assert any(what in w for w in warned), what
    finally:
        r.srem(keys.RQ_QUEUES, keys.queue_key(junk))
        for key in r.scan_iter(match=f"*{tag}*", count=1000):
            r.delete(key)
        for j in jobs:
            r.delete(keys.job_key(j.id))
