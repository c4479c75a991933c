"""The job listing behind the dashboard, on a real Redis."""

from __future__ import annotations

import pytest

from mlxq.producer import Client
from mlxq.producer.listing import job_queue, recent_jobs


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
