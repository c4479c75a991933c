"""The Lua scripts' copies of Python's lists, held equal to them, and their wrappers."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from mlxq.producer import keys
from mlxq.producer.outcome import RQ_TERMINAL


def _lua(package: str, name: str) -> str:
    return resources.files(package).joinpath("lua", name).read_text("utf-8")


def test_lua_terminal_set_is_the_outcomes_one():
    (table,) = re.findall(r"^local TERMINAL = \{(.*)\}$", _lua("mlxq.producer", "lib.lua"), re.M)
    names = {k for k, v in re.findall(r"(\w+) = (\w+)", table) if v == "true"}
    assert names == set(RQ_TERMINAL)


def test_every_script_has_one_wrapper_and_is_installed():
    from mlxq.producer import scripts
    from mlxq.worker import commit
    from mlxq.worker import scripts as worker_scripts

    for package, names in (
        ("mlxq.worker", set(worker_scripts.NAMES)),
        (
            "mlxq.producer",
            {
                scripts.CANCEL.name,
                scripts.RETRY.name,
                scripts.PURGE.name,
                scripts.SUBMIT.name,
                "lib",
            },
        ),
    ):
        files = {f.name for f in resources.files(package).joinpath("lua").iterdir()}
        assert files == {f"{n}.lua" for n in names}
    for name in worker_scripts.NAMES:  # the writer's beside its one caller, the others here
        assert callable(getattr(worker_scripts, name, None) or getattr(commit, name))


# -- every key a script writes, made another type, never stops it midway ------------------


def _bridge(redis_server, queue_name: str, tmp_path, name: str | None = None):
    from mlxq.worker.bridge import Bridge
    from mlxq.worker.config import WorkerConfig

    bridge = Bridge(
        WorkerConfig(str(tmp_path), redis_url=redis_server.url, queue=queue_name, name=name)
    )
    bridge.register()
    return bridge


def _make_string(r, key: str) -> None:
    with r.pipeline() as p:  # one step: a script never sees the key missing
        p.delete(key)
        p.set(key, "junk")
        p.execute()


#: The keys, by what they are to a job of queue q run by worker w, that the start, end,
#: release and reap scripts write besides the job's own (the issue-8 tests hold those).
SHARED = {
    "started registry": lambda q, w: keys.started_registry(q),
    "finished registry": lambda q, w: keys.finished_registry(q),
    "failed registry": lambda q, w: keys.failed_registry(q),
    "canceled registry": lambda q, w: keys.canceled_registry(q),
    "worker executions": lambda q, w: keys.rq_worker_executions(w),
    "rq worker": lambda q, w: keys.rq_worker_key(w),
    "WIP list": lambda q, w: keys.wip_key(w),
    "queue": lambda q, w: keys.queue_key(q),
}


def _drop_junk(r, *keys_: str) -> None:
    """Delete what a test left a string: other tests' readers of every queue (``mlxq
    info``) share this Redis."""
    for key in keys_:
        if r.type(key) == b"string":
            r.delete(key)


def _claimed(bridge, client):
    job = client.submit("a job", max_tokens=4)
    (c,) = bridge.claim(1)
    assert c.verdict == "ok" and c.id.decode() == job.id
    return job


def _start(bridge, job_id: str, exec_id: str = "e1"):
    from mlxq.worker.commit import commit
    from mlxq.worker.writes import Flush, StartWrite

    return commit(bridge, Flush(starts=[StartWrite(job_id, 0, exec_id)])).started[job_id]


def _end(bridge, job_id: str, outcome, exec_id: str = "e1"):
    from mlxq.producer.codec import Chunk
    from mlxq.worker.commit import commit
    from mlxq.worker.writes import End, Flush

    final = Chunk(1, "hi", [5], "stop", done=True)
    canceled = Chunk(1, "hi", [5], "canceled", done=True)
    result = {"text": "hi", "token_ids": [5], "finish_reason": "stop", "usage": {}}
    end = End(job_id, outcome, exec_id, 0.0, final, canceled, result, reason="it broke")
    return commit(bridge, Flush(ends=[end])).ended[job_id]


@pytest.mark.parametrize("what", sorted(set(SHARED) - {"queue"}))  # neither writes it
def test_a_start_and_end_land_whole_whatever_type_their_keys_hold(
    what, redis_server, queue_name, tmp_path, r
):
    from mlxq.producer import Client
    from mlxq.producer.outcome import Outcome

    bridge = _bridge(redis_server, queue_name, tmp_path)
    client = Client(redis_server.url, queue=queue_name)
    key = SHARED[what](queue_name, bridge.name)
    try:
        for outcome in (Outcome.FINISHED, Outcome.FAILED):
            job = _claimed(bridge, client)
            _make_string(r, key)
            assert _start(bridge, job.id) == "ok"
            assert job.status() == "started" and r.ttl(keys.job_key(job.id)) == -1
            _make_string(r, key)
            assert _end(bridge, job.id, outcome) == outcome
            assert job.status() == str(outcome)
            assert r.ttl(keys.job_key(job.id)) > 0, "it ended with its TTL"
            assert r.xlen(keys.results_key(job.id)) == 1
            assert r.ttl(keys.stream_key(job.id)) > 0
            (last,) = client.job(job.id).stream(timeout=5) if outcome == "finished" else [None]
            if last is not None:
                assert last.finish_reason == "stop", "and its last chunk"
            assert r.zscore(keys.started_registry(queue_name), f"{job.id}:e1") is None
    finally:
        bridge.unregister(settled=True)
        _drop_junk(r, key)


@pytest.mark.parametrize("what", sorted(SHARED))
def test_a_job_given_back_or_reaped_goes_back_whole_whatever_type_its_keys_hold(
    what, redis_server, queue_name, tmp_path, r
):
    from mlxq.producer import Client
    from mlxq.worker.commit import commit
    from mlxq.worker.writes import Flush, Release, ReleaseMode

    client = Client(redis_server.url, queue=queue_name)
    dead = _bridge(redis_server, queue_name, tmp_path)
    reaper = _bridge(redis_server, queue_name, tmp_path)
    key = SHARED[what](queue_name, dead.name)
    try:
        given, reaped = _claimed(dead, client), _claimed(dead, client)
        assert _start(dead, given.id, "g") == "ok" and _start(dead, reaped.id, "r") == "ok"
        _make_string(r, key)
        released = Flush(releases=[Release(ReleaseMode.REQUEUE, (given.id,))])
        assert commit(dead, released).settled == {given.id: "requeued"}
        assert given.status() == "queued"
        assert r.hget(keys.job_key(given.id), "mlxq_owner") is None
        assert r.lrange(keys.queue_key(queue_name), 0, -1) == [given.id.encode()]
        if what == "WIP list":
            return  # a dead worker's list replaced lists nothing: issue 8's known loss
        _make_string(r, key)
        _make_string(r, keys.workers_key(queue_name))
        r.delete(keys.alive_key(dead.name))  # its lease lapsed: dead
        assert reaper.reap(dead.name, None) == [reaped.id]
        assert reaped.status() == "queued"
        assert r.hget(keys.job_key(reaped.id), "mlxq_owner") is None
        assert r.lrange(keys.queue_key(queue_name), 0, 0) == [reaped.id.encode()]
    finally:
        reaper.unregister(settled=True)
        dead.undo_register()  # nothing of it left for rq's readers in other tests
        _drop_junk(r, key, keys.workers_key(queue_name))


# -- submit and cancel: checked before they write ------------------------------------------


def test_a_live_jobs_id_is_refused_at_submit_and_nothing_is_queued(redis_server, queue_name, r):
    from mlxq.producer import Client, JobIdInUse
    from mlxq.producer.client import SUBMIT_SLICE

    client = Client(redis_server.url, queue=queue_name)
    live = f"{queue_name}-live"
    client.submit_many([dict(prompt="first", max_tokens=3)], job_ids=[live])
    record = r.hgetall(keys.job_key(live))
    ids = [f"{queue_name}-new-{i}" for i in range(SUBMIT_SLICE + 9)] + [live]
    # In the last slice: the first one checks every id, so none is queued.
    with pytest.raises(JobIdInUse, match=rf"job_ids\[{len(ids) - 1}\]='{live}'.*still queued"):
        client.submit_many([dict(prompt="again", max_tokens=3)] * len(ids), job_ids=ids)
    assert r.llen(keys.queue_key(queue_name)) == 1 and not r.exists(keys.job_key(ids[0]))
    r.hset(keys.job_key(live), "status", "started")  # as a worker runs it
    with pytest.raises(JobIdInUse, match="still started"):
        client.submit_many([dict(prompt="again", max_tokens=3)], job_ids=[live])
    assert r.hgetall(keys.job_key(live)) == {**record, b"status": b"started"}, "untouched"
    taken = f"{queue_name}-taken"
    _make_string(r, keys.job_key(taken))  # no job record: no id to reuse either
    with pytest.raises(JobIdInUse, match=f"rq:job:{taken} holds a string"):
        client.submit_many([dict(prompt="x", max_tokens=3)], job_ids=[taken])
    assert r.llen(keys.queue_key(queue_name)) == 1
    _drop_junk(r, keys.job_key(taken))


def test_an_ended_jobs_id_starts_a_new_job_in_its_place(redis_server, queue_name, start_worker, r):
    from mlxq.producer import Client

    client = Client(redis_server.url, queue=queue_name)
    again = f"{queue_name}-again"
    first = start_worker()
    (job,) = client.submit_many([dict(prompt="one", max_tokens=3)], job_ids=[again])
    job.result(timeout=60)
    assert first.stop() == 0
    start_worker()  # another worker: the old record named the first as its owner
    (job,) = client.submit_many([dict(prompt="two two", max_tokens=5)], job_ids=[again])
    res = job.result(timeout=60)
    assert "".join(c.text for c in job.stream(timeout=10)) == res.text
    assert r.xlen(keys.results_key(again)) == 1, "the old result went with the old job"
    assert r.hget(keys.job_key(again), "mlxq_attempt") == b"1"


def test_a_queue_of_another_type_is_refused_at_submit_by_name(redis_server, queue_name, r):
    from mlxq.producer import Client, QueueBroken

    client = Client(redis_server.url, queue=queue_name)
    job_id = f"{queue_name}-q"
    _make_string(r, keys.queue_key(queue_name))
    with pytest.raises(QueueBroken, match=f"rq:queue:{queue_name} holds a string"):
        client.submit_many([dict(prompt="x", max_tokens=3)], job_ids=[job_id])
    assert not r.exists(keys.job_key(job_id)), "no record without its queue entry"
    r.delete(keys.queue_key(queue_name))
    client.submit_many([dict(prompt="x", max_tokens=3)], job_ids=[job_id])
    assert r.lrange(keys.queue_key(queue_name), 0, -1) == [job_id.encode()]


def test_a_cancel_lands_whole_whatever_type_its_keys_hold(redis_server, queue_name, r):
    from mlxq.producer import Client

    client = Client(redis_server.url, queue=queue_name)
    queued, stranded = (client.submit(f"job {i}", max_tokens=3) for i in range(2))
    _make_string(r, keys.canceled_registry(queue_name))
    assert queued.cancel() is True
    assert queued.status() == "canceled" and r.ttl(keys.job_key(queued.id)) > 0
    assert r.zscore(keys.canceled_registry(queue_name), queued.id) is not None
    _make_string(r, keys.queue_key(queue_name))  # it held the other: that entry is gone
    assert stranded.cancel() is True  # a cancel request: whoever holds it ends it canceled
    assert r.hget(keys.job_key(stranded.id), "mlxq_cancel") == b"1"
    _drop_junk(r, keys.queue_key(queue_name))


def test_a_started_job_found_in_its_own_workers_list_is_named_the_workers_own(
    redis_server, queue_name, r, tmp_path
):
    """After a failover the new master may hold a job as started by this worker, in its WIP
    list, though the worker let it go (the end was lost): the claim of that entry says
    ``mine``, not ``dup``, so the worker, which knows it runs no such job, gives it back;
    any other worker's entry for it stays a ``dup``."""
    from mlxq.producer import Client

    bridge = _bridge(redis_server, queue_name, tmp_path)
    client = Client(redis_server.url, queue=queue_name)
    job = _claimed(bridge, client)
    assert _start(bridge, job.id) == "ok"
    (mine,) = bridge.claim(0, [job.id.encode()])  # its WIP entry, found by reconcile
    assert (mine.verdict, mine.detail) == ("mine", "started")
    other = _bridge(redis_server, queue_name, tmp_path)
    r.rpush(keys.queue_key(queue_name), job.id)
    (dup,) = other.claim(1)
    assert (dup.verdict, dup.detail) == ("dup", "started")
    client.close()
