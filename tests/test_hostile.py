"""Whatever one key, id, message or entry in Redis holds, the worker fails or drops that
one thing with a reason and serves on; frozen and dead workers end every job once."""

from __future__ import annotations

import random
import signal
import threading
import time
import zlib

import pytest
import redis
from listener import Listener
from test_faults import _attempts, _long_jobs, _wait_running

from mlxq.producer import Client, JobFailed, MlxqError, keys

pytestmark = pytest.mark.e2e


def _results(r: redis.Redis, job_id: str) -> int:
    return int(r.xlen(keys.results_key(job_id)))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _stats(r: redis.Redis, name: str) -> dict:
    from mlxq.producer.codec import MsgpackSerializer

    raw = r.hget(keys.worker_stats_key(name), "stats")
    return MsgpackSerializer.loads(raw) if raw else {}


def test_poisoned_records_fail_alone_and_bombs_are_refused(
    redis_server, queue_name, start_worker, r
):
    client = Client(redis_server.url, queue=queue_name)
    jobs = {
        k: client.submit(f"job {k}", max_tokens=4)
        for k in ("attempt", "stream", "nodata", "junk", "bomb", "excbomb", "good")
    }
    jk = {k: keys.job_key(j.id) for k, j in jobs.items()}
    r.hset(jk["attempt"], "mlxq_attempt", "notanint")
    r.set(keys.stream_key(jobs["stream"].id), "x")  # a log key of the wrong type
    r.hdel(jk["nodata"], "data")
    r.hset(jk["junk"], "data", b"\x00\xc1junk")
    r.hset(jk["bomb"], "data", zlib.compress(b"\0" * (64 << 20)))  # 64 MiB inflated
    r.hset(jk["excbomb"], "exc_info", zlib.compress(b"\0" * (256 << 20)))
    w = start_worker()  # only now: every rogue record is in place first
    reasons = {}
    for k in ("attempt", "nodata", "junk", "bomb"):
        with pytest.raises(JobFailed) as e:
            jobs[k].result(timeout=60)
        reasons[k] = e.value.reason
    assert "mlxq_attempt=notanint" in reasons["attempt"]
    assert "no job data" in reasons["nodata"]
    assert "msgpack" in reasons["junk"]
    assert "inflates past" in reasons["bomb"]
    for k in ("stream", "excbomb", "good"):
        res = jobs[k].result(timeout=60)
        assert "".join(c.text for c in jobs[k].stream(timeout=10)) == res.text
    assert _rss_mb(w.proc.pid) < 500, "nothing was inflated"
    assert client.submit("still serving", max_tokens=3).result(timeout=60).token_ids


def test_rogue_entries_and_messages_while_a_job_runs(redis_server, queue_name, start_worker, r):
    w = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    (job,) = _long_jobs(client, 1, tokens=600)
    (other,) = _long_jobs(client, 1, tokens=2000)
    listener = Listener(job)
    _wait_running([job, other], 2)
    stream, chan = keys.stream_key(job.id), keys.channel(job.id)
    r.xadd(stream, {"c": b"\xc1 not a chunk"}, id="99999999-0")  # a forged, far-off entry
    r.publish(chan, b"\xff\xfe not msgpack")
    r.rpush(keys.queue_key(queue_name), job.id)  # the same id queued twice
    r.rpush(keys.queue_key(queue_name), b"\xc3\x28")  # an id that is not UTF-8
    cancel_chan = keys.cancel_channel(w.name)
    r.publish(cancel_chan, b"\xff\xfe")
    with r.pipeline(transaction=False) as p:
        for i in range(2000):
            p.publish(cancel_chan, f"forged-{i}")
        p.execute()
    res = job.result(timeout=120)
    listener.check()
    assert "".join(c.text for c in client.job(job.id).stream(timeout=10)) == res.text
    assert _attempts(r, job) == 1 and _results(r, job.id) == 1
    assert other.cancel() is True, "the cancel listener outlived the junk"
    assert [c.finish_reason for c in other.stream(timeout=60)][-1] == "canceled"
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    deadline = time.monotonic() + 10
    while r.llen(keys.wip_key(w.name)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.llen(keys.wip_key(w.name)) == 0, "no stray entry stays in the WIP list"
    # The worker writes its stats about once a second: wait for a write after the last id.
    deadline = time.monotonic() + 10
    while _stats(r, w.name).get("cancels_ignored", 0) < 2000 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _stats(r, w.name).get("cancels_ignored", 0) >= 2000


def test_a_log_key_made_the_wrong_type_fails_that_job_alone(
    redis_server, queue_name, start_worker, r
):
    start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    victim, bystander = _long_jobs(client, 2, tokens=1500)
    _wait_running([victim, bystander], 2)
    time.sleep(0.2)
    with r.pipeline() as p:
        p.delete(keys.stream_key(victim.id))
        p.set(keys.stream_key(victim.id), "x")
        p.execute()
    with pytest.raises(JobFailed, match="replay log"):
        victim.result(timeout=60)
    with pytest.raises(JobFailed):  # a listener gets the reason, not a raw Redis error
        list(victim.stream(timeout=10))
    assert bystander.result(timeout=120).finish_reason in ("stop", "length")
    assert r.ttl(keys.stream_key(victim.id)) > 0, "the rogue key expires like the log"


def test_a_frozen_worker_ends_every_job_exactly_once(redis_server, queue_name, start_worker, r):
    a = start_worker(max_batch=4, window_ms=0)
    client = Client(redis_server.url, queue=queue_name)
    long = _long_jobs(client, 4, tokens=2000)
    _wait_running(long, 4)
    b = start_worker(max_batch=8, window_ms=0)
    a.signal(signal.SIGSTOP)
    # Submitted while it is frozen: a blocked claim of the frozen worker may take them.
    short = client.submit_many([dict(prompt=f"short {i}", max_tokens=8) for i in range(6)])
    time.sleep(8)  # past its lease: the live worker reaps it
    a.signal(signal.SIGCONT)
    for j in [*long, *short]:
        assert j.result(timeout=120).finish_reason in ("stop", "length")
    time.sleep(2)  # the woken worker had time to write, had it still thought it owned them
    for j in [*long, *short]:
        assert j.status() == "finished", j.id
        assert _results(r, j.id) == 1, f"{j.id} ended more than once"
    assert all(_attempts(r, j) == 2 for j in long)
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    assert a.stop() == 0 and b.stop() == 0


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_cancel_of_a_job_whose_worker_died_or_froze(redis_server, queue_name, start_worker, r, how):
    a = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    (job,) = _long_jobs(client, 1, tokens=1900)
    _wait_running([job], 1)
    a.signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    assert job.cancel() is True
    start_worker(max_batch=4)
    chunks = list(job.stream(timeout=60))
    assert chunks[-1].finish_reason == "canceled"
    assert job.status() == "canceled" and _results(r, job.id) == 0
    if how == "freeze":
        a.signal(signal.SIGCONT)
        time.sleep(2)
        assert job.status() == "canceled"


def test_cancel_through_a_client_of_another_queue(redis_server, queue_name, start_worker):
    start_worker()
    client = Client(redis_server.url, queue=queue_name)
    queued = Client(redis_server.url, queue="somewhere-else")
    (running,) = _long_jobs(client, 1, tokens=1900)
    _wait_running([running], 1)
    assert queued.job(running.id).cancel() is True
    assert [c.finish_reason for c in running.stream(timeout=60)][-1] == "canceled"


def test_cancel_returns_true_only_when_the_job_ends_canceled(
    redis_server, queue_name, start_worker, r
):
    start_worker(max_batch=8, window_ms=0)
    client = Client(redis_server.url, queue=queue_name)
    rng = random.Random(7)
    verdicts = []
    for i in range(40):
        job = client.submit(f"race {i}", max_tokens=6, temperature=1.0, seed=i)
        next(iter(job.stream(timeout=60)))
        time.sleep(rng.uniform(0, 0.01))  # around the moment it ends
        verdicts.append((job, job.cancel()))
    # Both answers must occur whatever the machine's speed: a job far from its end and one
    # already ended. Whether each race lands before or after the end is up to timing; that
    # cancel() told the truth about it is not.
    (long,) = _long_jobs(client, 1, tokens=1900)
    _wait_running([long], 1)
    verdicts.append((long, long.cancel()))
    ended = client.submit("already ended", max_tokens=2, seed=1)
    ended.result(timeout=60)
    verdicts.append((ended, ended.cancel()))
    for job, said in verdicts:
        with pytest.raises(JobFailed) if said else _nothing():
            job.result(timeout=60)
        assert (job.status() == "canceled") is said, (job.id, said, job.status())
    assert verdicts[-2][1] is True and verdicts[-1][1] is False
    assert r.hget(keys.job_key(ended.id), "mlxq_cancel") is None, "an ended job is not flagged"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_clean_restarts_are_not_failed_attempts(redis_server, queue_name, start_worker, r):
    client = Client(redis_server.url, queue=queue_name)
    (job,) = _long_jobs(client, 1, tokens=1500)
    for _ in range(3):  # three clean restarts in the middle of one long job
        w = start_worker(grace_s=0)
        _wait_running([job], 1)
        time.sleep(0.3)
        w.signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0
    start_worker()
    assert job.result(timeout=120).finish_reason in ("stop", "length")
    assert _attempts(r, job) == 4 and int(r.hget(keys.job_key(job.id), "mlxq_clean")) == 3


def test_a_log_outlives_a_job_that_runs_past_its_ttl(redis_server, queue_name, start_worker, r):
    start_worker(stream_ttl=2, stream_interval_ms=0)
    client = Client(redis_server.url, queue=queue_name)
    (job,) = _long_jobs(client, 1, tokens=1200)
    _wait_running([job], 1)
    stream, ttls = keys.stream_key(job.id), []
    while job.status() == "started":
        ttls.append(r.ttl(stream))
        time.sleep(0.1)
    res = job.result(timeout=120)
    assert ttls and -1 not in ttls, "the log never lived without a TTL"
    assert -2 not in ttls[1:-1], "nor expired while its job ran"
    assert "".join(c.text for c in client.job(job.id).stream(timeout=10)) == res.text


def test_writes_refused_for_memory_are_retried_in_order(redis_server, queue_name, start_worker, r):
    w = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 2, tokens=1500)
    listeners = [Listener(j) for j in jobs]
    _wait_running(jobs, 2)
    refused = "writer: redis unavailable"
    assert refused not in w.output()
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)  # past it already: every write that adds is refused
        # Proof that the worker's writes were refused, not merely that memory was tight.
        _until(lambda: refused in (out := w.output()) and "memory" in out, timeout=30)
        assert all(j.status() == "started" for j in jobs), "refused while they ran"
    finally:
        r.config_set("maxmemory", 0)
    for lis in listeners:
        lis.check()  # no gap, no duplicate, text equal to the result
    assert all(_attempts(r, j) == 1 for j in jobs), "nobody reaped the worker meanwhile"
    assert "writer: redis back after" in w.output(), "the refused writes went through later"


def test_a_redis_without_persistence_restarting_mid_job(tmp_path, queue_name, start_worker):
    from conftest import RedisServer

    server = RedisServer(tmp_path, persist=False)
    try:
        start_worker(max_batch=4, redis_url=server.url, stream_interval_ms=0)
        client = Client(server.url, queue=queue_name)
        (job,) = _long_jobs(client, 1, tokens=1900)
        seen: list[BaseException] = []
        chunks: list[str] = []

        def listen() -> None:
            try:
                for c in job.stream(timeout=120):
                    chunks.append(c.text)
            except BaseException as e:  # reported on the test thread
                seen.append(e)

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        _wait_running([job], 1)
        time.sleep(0.3)
        server.restart()  # the queue, the job and its log are gone
        t.join(120)
        assert seen and isinstance(seen[0], MlxqError), "an error, never silent wrong text"
        r = redis.Redis.from_url(server.url)
        for _ in range(100):  # the worker still runs the row: its log comes back, with a TTL
            if r.exists(keys.stream_key(job.id)):
                break
            time.sleep(0.05)
        if r.exists(keys.stream_key(job.id)):
            assert r.ttl(keys.stream_key(job.id)) > 0
        assert client.submit("after the restart", max_tokens=3).result(timeout=60).token_ids
    finally:
        server.stop()


def _hwm_mb(pid: int) -> float:
    """The process's peak resident memory so far."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _until(what, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)
    return value


def _make_string(r: redis.Redis, key: str) -> None:
    with r.pipeline() as p:  # one step: a worker never sees the key missing
        p.delete(key)
        p.set(key, "x")
        p.execute()


def test_keys_of_running_jobs_made_the_wrong_type_end_those_jobs_alone(
    redis_server, queue_name, start_worker, r
):
    w = start_worker(max_batch=8)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 5, tokens=800)
    results, execs, record, *bystanders = jobs
    listeners = [Listener(j) for j in bystanders]
    _wait_running(jobs, 5)
    _make_string(r, keys.results_key(results.id))
    _make_string(r, keys.executions_key(execs.id))
    _make_string(r, keys.job_key(record.id))
    for lis in listeners:
        lis.check()  # every write of theirs landed: no gap, text equal to the result
    for j in (results, execs):
        assert j.result(timeout=120).finish_reason in ("stop", "length")
        assert "".join(c.text for c in j.stream(timeout=10)) == j.result().text
    # Its record was rebuilt by its worker: it ends with the result it made.
    _until(lambda: r.type(keys.job_key(record.id)) == b"hash")
    res = record.result(timeout=60)
    assert res.finish_reason in ("stop", "length")
    out = w.output()
    for j in (results, execs, record):
        assert f"job {j.id}: replaced a key of the wrong type" in out, "said, with the key"
    assert all(_attempts(r, j) == 1 for j in bystanders)
    assert client.submit("still serving", max_tokens=3).result(timeout=60).token_ids


def test_a_record_made_the_wrong_type_while_queued_fails_that_job_alone(
    redis_server, queue_name, start_worker, r
):
    client = Client(redis_server.url, queue=queue_name)
    record, junk, good = (client.submit(f"job {k}", max_tokens=4) for k in range(3))
    _make_string(r, keys.job_key(record.id))
    r.hset(keys.job_key(junk.id), "data", b"\x00\xc1junk")  # it fails before it starts...
    _make_string(r, keys.results_key(junk.id))  # ...and its failure record is a string
    start_worker()
    assert good.result(timeout=60).token_ids
    with pytest.raises(JobFailed, match="msgpack"):
        junk.result(timeout=60)
    _until(lambda: r.type(keys.job_key(record.id)) == b"hash" and record.status() == "failed")
    with pytest.raises(JobFailed, match="was a string"):
        record.result(timeout=10)
    assert client.submit("still serving", max_tokens=3).result(timeout=60).token_ids


def test_a_dead_workers_rogue_records_never_stop_its_reaping(
    redis_server, queue_name, start_worker, r
):
    a = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 3, tokens=1900)
    record, execs, bystander = jobs
    _wait_running(jobs, 3)
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    _make_string(r, keys.job_key(record.id))
    _make_string(r, keys.executions_key(execs.id))
    start_worker(max_batch=4)
    for j in (execs, bystander):
        assert j.result(timeout=120).finish_reason in ("stop", "length")
    _until(lambda: r.type(keys.job_key(record.id)) == b"hash" and record.status() == "failed")
    with pytest.raises(JobFailed, match="no job data"):
        record.result(timeout=10)
    assert r.llen(keys.wip_key(a.name)) == 0


def test_a_claimed_job_canceled_before_it_fails_to_start_ends_canceled(
    redis_server, queue_name, tmp_path
):
    # The worker's own writer, driven step by step: claimed, canceled, then failed before
    # it starts (its ttl ran out, or it was invalid): cancel() said True, so it ends so.
    from mlxq.worker.bridge import Bridge
    from mlxq.worker.commit import commit
    from mlxq.worker.config import WorkerConfig
    from mlxq.worker.jobs import unstarted_error
    from mlxq.worker.writes import FailWrite, Flush

    client = Client(redis_server.url, queue=queue_name)
    job = client.submit("never runs", max_tokens=4, ttl=60)
    bridge = Bridge(WorkerConfig(str(tmp_path), redis_url=redis_server.url, queue=queue_name))
    bridge.register()
    try:
        (claimed,) = bridge.claim(1)
        assert claimed.verdict == "ok" and claimed.id.decode() == job.id
        assert job.cancel() is True
        why = "ttl expired: waited too long"
        reply = commit(bridge, Flush(fails=[FailWrite(job.id, why, unstarted_error(0, why))]))
        assert reply.settled == {job.id: "canceled"}
        assert job.status() == "canceled"
        assert [c.finish_reason for c in job.stream(timeout=10)][-1] == "canceled"
        assert not bridge.wip()
    finally:
        bridge.unregister(settled=True)


def test_the_registry_sweep_never_inflates_a_bomb(redis_server, queue_name, start_worker, r):
    client = Client(redis_server.url, queue=queue_name)
    (bomb,) = _long_jobs(client, 1, tokens=3)
    r.lrem(keys.queue_key(queue_name), 0, bomb.id)  # as if a vanished worker ran it
    r.hset(
        keys.job_key(bomb.id),
        mapping={"status": "started", "exc_info": zlib.compress(b"\0" * (512 << 20))},
    )
    started = keys.started_registry(queue_name)
    r.zadd(started, {f"{bomb.id}:deadbeef": 1})  # expired long ago: the sweep's to clean
    w = start_worker()  # its first heartbeat sweeps
    _until(lambda: r.zcard(started) == 0)
    assert _hwm_mb(w.proc.pid) < 500, "nothing was inflated"
    assert f"sweep: skipped job {bomb.id}" in w.output()
    assert client.submit("still serving", max_tokens=3).result(timeout=60).token_ids


def test_prompts_past_the_workers_cap_fail_by_reason_while_a_job_decodes(
    redis_server, queue_name, start_worker
):
    from mlxq.producer.params import MAX_PROMPT_CHARS

    start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    with pytest.raises(ValueError, match="prompt"):
        client.submit("x" * (MAX_PROMPT_CHARS + 1), max_tokens=3)
    (running,) = _long_jobs(client, 1, tokens=1900)
    listener = Listener(running)
    _wait_running([running], 1)
    # Under the client's cap, far over what the tiny model's context (2048 tokens) can hold.
    huge = [client.submit("y" * 300_000 + str(i), max_tokens=3) for i in range(3)]
    for j in huge:
        with pytest.raises(JobFailed, match="characters, more than this model's context"):
            j.result(timeout=60)
    assert running.status() == "started", "it kept decoding meanwhile"
    assert running.result(timeout=120).finish_reason in ("stop", "length")
    listener.check()


def test_a_workers_own_lists_made_the_wrong_type_never_stop_it(
    redis_server, queue_name, start_worker, r
):
    # A worker's WIP list and handed set are keys like any other: made strings while it
    # idles, while a job runs, and after it died, each costs what it listed, never the worker.
    w = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    for k in (keys.wip_key(w.name), keys.handed_key(w.name)):
        _make_string(r, k)
        assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    (running,) = _long_jobs(client, 1, tokens=300)
    _wait_running([running], 1)
    _make_string(r, keys.wip_key(w.name))
    assert running.result(timeout=120).finish_reason in ("stop", "length")
    assert w.proc.poll() is None and "Traceback" not in w.output()
    assert "WIP list" in w.output()
    w.signal(signal.SIGKILL)
    w.proc.wait(10)
    _make_string(r, keys.wip_key(w.name))
    r.delete(keys.alive_key(w.name))  # its lease ran out: a live worker reaps it at once
    v = start_worker(max_batch=4)
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    _until(lambda: not r.sismember(keys.workers_key(queue_name), w.name))
    assert "Traceback" not in v.output()


# -- issue 23: queue-wide keys ---------------------------------------------------------


def test_a_workers_lease_made_another_type_is_rewritten_and_it_serves_on(
    redis_server, queue_name, start_worker, r
):
    w = start_worker(max_batch=8)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 40, tokens=300)
    _wait_running(jobs, 8)
    alive = keys.alive_key(w.name)
    with r.pipeline() as p:  # mid-burst, in one step
        p.delete(alive)
        p.hset(alive, "x", "y")
        p.execute()
    for j in jobs:
        assert j.result(timeout=120).finish_reason in ("stop", "length")
        assert _results(r, j.id) == 1 and _attempts(r, j) == 1, "it kept its jobs"
    assert r.type(alive) == b"string"
    out = w.output()
    assert f"{alive} was a hash" in out and "Traceback" not in out
    assert out.count(alive) == 1, "said once, not once a turn"
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids


def test_an_unreadable_lease_reads_as_expired_and_its_worker_writes_nothing(
    redis_server, queue_name, start_worker, r
):
    from mlxq.producer.batch.jobs import served

    a = start_worker(max_batch=4, window_ms=0)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 4, tokens=2000)
    _wait_running(jobs, 4)
    a.signal(signal.SIGSTOP)
    time.sleep(0.2)
    held = [j for j in jobs if j.status() == "started"]  # a random model may stop early
    alive = keys.alive_key(a.name)
    with r.pipeline() as p:  # no TTL: it would never lapse on its own
        p.delete(alive)
        p.hset(alive, "x", "y")
        p.execute()
    assert not served(r, queue_name), "a lease nobody can read holds nothing"
    b = start_worker(max_batch=8, window_ms=0)  # reaps it: its lease reads as expired
    for j in jobs:
        assert j.result(timeout=120).finish_reason in ("stop", "length")
    a.signal(signal.SIGCONT)
    time.sleep(2)  # the woken worker had time to write, had it still thought it owned them
    for j in jobs:
        assert j.status() == "finished" and _results(r, j.id) == 1, j.id
    assert held and all(_attempts(r, j) == 2 for j in held)
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    assert a.stop() == 0 and b.stop() == 0


def test_a_roll_of_another_type_never_stops_requeuing(redis_server, queue_name, start_worker, r):
    a = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 4, tokens=1900)
    _wait_running(jobs, 4)
    b = start_worker(max_batch=4)
    roll = keys.workers_key(queue_name)
    stop = threading.Event()

    def keep_it_junk() -> None:  # unreadable the whole time a dies and its jobs are found
        while not stop.is_set():
            _make_string(r, roll)
            stop.wait(0.01)

    rogue = threading.Thread(target=keep_it_junk, daemon=True)
    rogue.start()
    try:
        a.signal(signal.SIGKILL)
        a.proc.wait(10)
        held = [j for j in jobs if j.status() == "started"]  # a random model may stop early
        for j in jobs:
            assert j.result(timeout=120).finish_reason in ("stop", "length")
    finally:
        stop.set()
        rogue.join(10)
    assert held and all(_attempts(r, j) == 2 for j in held)
    # Healed by the live worker's beats, so a later death is found through it again.
    _until(lambda: r.type(roll) == b"set" and r.sismember(roll, b.name))
    c = start_worker(max_batch=4)
    # More than b holds (4 rows and 4 in reserve), so c gets some whichever claims first;
    # none stops early (min_tokens), or b could drain the queue before c claims.
    more = client.submit_many(
        [
            dict(prompt=f"A later tale, part {i}", max_tokens=600, min_tokens=600, seed=i)
            for i in range(12)
        ]
    )
    _until(lambda: r.llen(keys.wip_key(c.name)) > 0)
    c.signal(signal.SIGKILL)
    c.proc.wait(10)
    for j in more:
        assert j.result(timeout=180).finish_reason in ("stop", "length")
    assert "Traceback" not in b.output()


def test_shared_keys_of_another_type_never_leave_a_job_half_written(
    redis_server, queue_name, start_worker, r
):
    w = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    for key in (
        keys.started_registry(queue_name),
        keys.rq_worker_executions(w.name),
        keys.finished_registry(queue_name),
        keys.rq_worker_key(w.name),
    ):
        _make_string(r, key)
        job = client.submit("after a rogue write", max_tokens=4)
        res = job.result(timeout=60)
        assert job.status() == "finished" and r.ttl(keys.job_key(job.id)) > 0, key
        assert "".join(c.text for c in job.stream(timeout=10)) == res.text
    _make_string(r, keys.failed_registry(queue_name))
    job = client.submit("y" * 300_000, max_tokens=3)  # fails before it starts
    with pytest.raises(JobFailed, match="context"):
        job.result(timeout=60)
    assert job.status() == "failed" and r.ttl(keys.job_key(job.id)) > 0
    _make_string(r, keys.canceled_registry(queue_name))
    (long,) = _long_jobs(client, 1, tokens=1900)
    _wait_running([long], 1)
    assert long.cancel() is True
    assert [c.finish_reason for c in long.stream(timeout=60)][-1] == "canceled"
    assert long.status() == "canceled" and r.ttl(keys.job_key(long.id)) > 0
    out = w.output()
    assert w.proc.poll() is None and "Traceback" not in out and "was a string" in out


def test_a_queue_of_another_type_leaves_idle_workers_quiet(
    redis_server, queue_name, start_worker, r
):
    from mlxq.producer import QueueBroken

    w = start_worker()
    client = Client(redis_server.url, queue=queue_name)
    queue = keys.queue_key(queue_name)
    _make_string(r, queue)
    with pytest.raises(QueueBroken, match=f"{queue} holds a string"):
        client.submit("refused", max_tokens=3)
    said = f"queue {queue} is a string"
    _until(lambda: said in w.output())
    first = _until(lambda: _stats(r, w.name) or None)
    last = _until(lambda: (s := _stats(r, w.name))["updated_at"] >= first["updated_at"] + 3 and s)
    claims = last["claim_calls"] - first["claim_calls"]
    per_s = claims / (last["updated_at"] - first["updated_at"])
    assert per_s < 20, f"{per_s:.0f} claims a second: it spins"  # a spin makes thousands
    assert w.output().count(said) == 1, "said once"
    r.delete(queue)
    r.rpush(queue, b"")  # an empty id is an entry like any other: dropped as no id
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    assert "dropped queue entry b''" in w.output() and "Traceback" not in w.output()


def test_a_failed_start_leaves_the_name_free_and_a_dead_ones_is_taken_over(
    redis_server, queue_name, start_worker, r
):
    import socket

    name = f"named-{queue_name}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        failed = start_worker(name=name, ready=False, metrics_port=port)
        assert failed.proc.wait(60) == 1
    assert "cannot serve metrics" in failed.output() and "Traceback" not in failed.output()
    assert not r.exists(keys.rq_worker_key(name)) and not r.exists(keys.alive_key(name))
    w = start_worker(name=name, max_batch=4)  # at once, under the same name
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 2, tokens=1900)
    _wait_running(jobs, 2)
    twin = start_worker(name=name, ready=False)
    assert twin.proc.wait(60) == 1 and f"worker name {name!r} is taken" in twin.output()
    w.signal(signal.SIGKILL)
    w.proc.wait(10)
    held = [j for j in jobs if j.status() == "started"]  # a random model may stop early
    assert held
    again = start_worker(name=name, max_batch=4)  # no other worker: it takes back the jobs
    for j in jobs:
        assert j.result(timeout=120).finish_reason in ("stop", "length")
    assert all(_attempts(r, j) == 2 for j in held)
    assert "a previous worker of this name left" in again.output()
