"""``--wait-replicas``: a submit (and a worker's batch of ends) counts once replicas confirm
it (Redis WAIT), on a real primary with two replicas watched by sentinels."""

from __future__ import annotations

import pytest
from opshelp import mlxq as mlxq_cli
from opshelp import wait_for

from mlxq.producer import Client, JobIdInUse, NotReplicated
from mlxq.producer import keys as k


def _on_replicas(setup, key: str) -> list[dict[bytes, bytes]]:
    primary = setup.master_port()
    return [setup.client(p).hgetall(key) for p in setup.data_ports if p != primary]


def test_a_confirmed_submit_is_on_every_replica_it_asked_for(sentinel_redis, queue_name):
    client = Client(sentinel_redis.url, queue=queue_name, wait_replicas=2)
    job = client.submit("hi", max_tokens=3)
    copies = _on_replicas(sentinel_redis, k.job_key(job.id))
    assert len(copies) == 2 and all(c.get(b"status") == b"queued" for c in copies)


def test_a_short_wait_names_the_counts_and_a_retry_with_the_same_ids_is_safe(
    sentinel_redis, queue_name
):
    url = sentinel_redis.url
    jobs = [dict(prompt="one", max_tokens=3), dict(prompt="two", max_tokens=3)]
    greedy = Client(url, queue=queue_name, wait_replicas=3, wait_timeout=0.2)
    with pytest.raises(NotReplicated) as e:
        greedy.submit_many(jobs)
    assert (e.value.asked, e.value.reached, len(e.value.job_ids)) == (3, 2, 2)
    assert "only 2 of 3 replicas confirmed" in str(e.value) and "may still run" in str(e.value)
    again = Client(url, queue=queue_name, wait_replicas=2).submit_many(
        jobs, job_ids=e.value.job_ids
    )
    assert [j.id for j in again] == e.value.job_ids
    primary = sentinel_redis.client(sentinel_redis.master_port())
    assert primary.lrange(k.queue_key(queue_name), 0, -1) == [i.encode() for i in e.value.job_ids]
    assert primary.hget(k.job_key(e.value.job_ids[0]), "mlxq_resubmits") == b"1"
    with pytest.raises(JobIdInUse, match="still queued"):  # another request: refused
        Client(url, queue=queue_name).submit_many(
            [dict(prompt="other", max_tokens=3)], job_ids=e.value.job_ids[:1]
        )


def test_the_environment_and_the_command_line_ask_for_replicas(
    redis_server, queue_name, monkeypatch
):
    monkeypatch.setenv("MLXQ_WAIT_REPLICAS", "1")
    with pytest.raises(NotReplicated, match="only 0 of 1 replicas"):
        Client(redis_server.url, queue=queue_name, wait_timeout=0.1).submit("hi", max_tokens=2)
    monkeypatch.setenv("MLXQ_WAIT_REPLICAS", "some")
    with pytest.raises(ValueError, match="MLXQ_WAIT_REPLICAS='some'"):
        Client(redis_server.url, queue=queue_name)
    out = mlxq_cli(
        "submit", "hi", "--queue", queue_name, "--wait-replicas", "1", url=redis_server.url
    )
    assert out.returncode == 1 and "only 0 of 1 replicas confirmed" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    bad = mlxq_cli("submit", "hi", "--wait-replicas", "-1", url=redis_server.url)
    assert bad.returncode == 2 and "wait_replicas=-1" in bad.stderr, bad.stderr


@pytest.mark.e2e
def test_a_worker_frees_its_ends_only_once_replicas_have_them(
    sentinel_redis, queue_name, start_worker
):
    url = sentinel_redis.url
    w = start_worker(redis_url=url, wait_replicas=3, window_ms=0)
    client = Client(url, queue=queue_name)
    first = client.submit("The first", max_tokens=4)
    # Two replicas only: the end is written, but the worker waits for a third.
    wait_for(lambda: "only 2 of 3 replicas confirmed" in w.output(), "the worker to wait")
    sentinel_redis.add_replica()
    assert first.result(timeout=120).text is not None
    later = client.submit("The second", max_tokens=4).result(timeout=120)
    assert later.token_ids
    wait_for(lambda: "redis back after" in w.output(), "the worker's writes to go on")
