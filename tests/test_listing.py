"""The job listing behind the dashboard, on a real Redis."""

from __future__ import annotations

import pytest
from rq.job import JobStatus

from mlxq.producer import Client
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
