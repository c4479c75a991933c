"""Fault injection against real processes: crashes, stops, Redis restarts, poison, deadlines."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import redis
from listener import Listener
from rq import Queue

from mlxq.producer import Client, JobFailed
from mlxq.producer.client import Job
from mlxq.producer.codec import MsgpackSerializer

pytestmark = pytest.mark.e2e


def _wait_running(jobs: list[Job], n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(j.status() == "started" for j in jobs) < n:
        assert time.monotonic() < deadline, [j.status() for j in jobs]
        time.sleep(0.02)


def _long_jobs(client: Client, n: int, tokens: int = 1500) -> list[Job]:
    # Seeded, so whether a random model happens to stop early is the same on every run.
    return client.submit_many(
        [
            dict(prompt=f"A long tale, part {i}", max_tokens=tokens, temperature=1.0, seed=i)
            for i in range(n)
        ]
    )


def _assert_registries_clean(r: redis.Redis, queue: str) -> None:
    q = Queue(queue, connection=r, serializer=MsgpackSerializer)
    assert q.started_job_registry.count == 0
    assert q.failed_job_registry.count == 0


def _attempts(r: redis.Redis, job: Job) -> int:
    return int(r.hget(f"rq:job:{job.id}", "mlxq_attempt") or 0)


def test_kill9_mid_batch_requeues_and_restart_finishes(redis_server, queue_name, start_worker, r):
    w = start_worker(max_batch=8)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 6)
    listeners = [Listener(j) for j in jobs]
    _wait_running(jobs, 6)
    time.sleep(0.3)
    w.signal(signal.SIGKILL)
    w.proc.wait(10)
    held = [j for j in jobs if j.status() == "started"]  # a random model may stop early
    assert held
    start_worker(max_batch=8)  # same host: the dead pid is seen at once
    for j in jobs:
        assert j.result(timeout=120).finish_reason in ("stop", "length")
    for lis in listeners:
        lis.check()
    assert all(_attempts(r, j) == 2 for j in held)
    assert any(lis.resets for lis in listeners), "listeners that saw text were told to reset"
    _assert_registries_clean(r, queue_name)


def test_a_frozen_worker_is_reaped_by_another_and_drops_its_jobs(
    redis_server, queue_name, start_worker, r
):
    a = start_worker(max_batch=4)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 4, tokens=2000)
    _wait_running(jobs, 4)
    a.signal(signal.SIGSTOP)  # alive but silent: its heartbeat key expires after 5 s
    time.sleep(0.2)
    held = [j for j in jobs if j.status() == "started"]  # a random model may stop early
    start_worker(max_batch=4)
    t0 = time.monotonic()
    while any(_attempts(r, j) < 2 for j in held):
        assert time.monotonic() - t0 < 20, "the live worker should requeue within ~5 s"
        time.sleep(0.1)
    a.signal(signal.SIGCONT)  # it learns it was declared dead and drops the jobs
    for j in jobs:
        j.result(timeout=120)
    assert all(_attempts(r, j) == 2 for j in held), "no job ran a third time"
    _assert_registries_clean(r, queue_name)
    assert a.stop() == 0


def test_sigterm_finishes_or_requeues_and_exits_0(redis_server, queue_name, start_worker, r):
    w = start_worker(max_batch=8, grace_s=0.5)
    client = Client(redis_server.url, queue=queue_name)
    short = client.submit("short one", max_tokens=3)
    short.result(timeout=60)
    jobs = _long_jobs(client, 3, tokens=2000)
    _wait_running(jobs, 3)
    w.signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0
    assert [j.status() for j in jobs] == ["queued"] * 3
    assert Queue(queue_name, connection=r).count == 3
    _assert_registries_clean(r, queue_name)
    start_worker(max_batch=8)
    for j in jobs:
        assert j.result(timeout=120).finish_reason in ("stop", "length")


def test_sigterm_lets_short_jobs_finish(redis_server, queue_name, start_worker):
    w = start_worker(max_batch=8, grace_s=30)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 4, tokens=300)
    _wait_running(jobs, 4)
    w.signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0
    assert [j.status() for j in jobs] == ["finished"] * 4


def test_redis_restart_mid_stream(persistent_redis, queue_name, start_worker):
    start_worker(max_batch=8, redis_url=persistent_redis.url)
    client = Client(persistent_redis.url, queue=queue_name)
    jobs = _long_jobs(client, 4, tokens=1200)
    listeners = [Listener(j) for j in jobs]
    _wait_running(jobs, 4)
    persistent_redis.restart()
    late = client.submit("submitted after the restart", max_tokens=5)
    for j in [*jobs, late]:
        assert j.result(timeout=120).finish_reason in ("stop", "length")
    for lis in listeners:
        lis.check()


def test_dropped_connections(redis_server, queue_name, start_worker, r):
    start_worker(max_batch=8)
    client = Client(redis_server.url, queue=queue_name)
    jobs = _long_jobs(client, 4, tokens=1200)
    listeners = [Listener(j) for j in jobs]
    _wait_running(jobs, 4)
    for kind in ("pubsub", "normal"):
        r.client_kill_filter(_type=kind, skipme=True)
        time.sleep(0.2)
    for lis in listeners:
        lis.check()
    assert all(_attempts(r, j) == 1 for j in jobs), "dropped connections rerun nothing"


def test_two_workers_share_a_queue_and_run_no_job_twice(redis_server, queue_name, start_worker, r):
    start_worker(max_batch=4, window_ms=0)
    start_worker(max_batch=4, window_ms=0)
    client = Client(redis_server.url, queue=queue_name)
    jobs = client.submit_many(
        [dict(prompt=f"job {i}", max_tokens=200, temperature=0.9) for i in range(24)]
    )
    for j in jobs:
        j.result(timeout=120)
    assert all(_attempts(r, j) == 1 for j in jobs)
    workers = {r.hget(f"rq:job:{j.id}", "worker_name") for j in jobs}
    assert len(workers) == 2, "both workers took jobs"


def test_deadlines_fail_with_a_reason_that_says_which(redis_server, queue_name, start_worker):
    client = Client(redis_server.url, queue=queue_name)
    stale = client.submit("waits too long", max_tokens=4, ttl=0.3)
    time.sleep(0.6)
    start_worker()
    slow = client.submit("runs too long", max_tokens=2000, temperature=1.0, seed=3, timeout=0.5)
    with pytest.raises(JobFailed, match="ttl expired"):
        stale.result(timeout=60)
    with pytest.raises(JobFailed, match="timeout"):
        slow.result(timeout=60)
    assert client.submit("fine", max_tokens=3).result(timeout=60).token_ids


POISON_LAUNCHER = """
import sys
from mlx_lm import load
from mlxq.worker.engine import Engine
from mlxq.worker.config import WorkerConfig
from mlxq.worker.process import Worker

model_path, url, queue, fused = sys.argv[1:5]
model, tok = load(model_path)[:2]
poison = tok.encode("POISON", add_special_tokens=False)[0]


class FaultyModel:
    # The real model, but an MLX-level error whenever a prefill carries the poison token:
    # what a job that breaks the forward pass looks like to the worker. (Decode steps are
    # spared: a random model may well generate that token itself.) Its body too, which a
    # prefill that feeds its rows' last tokens runs apart from the head.
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, inputs, *a, **kw):
        if inputs.shape[1] > 1 and poison in inputs.flatten().tolist():
            raise RuntimeError("injected MLX error")
        return self.inner(inputs, *a, **kw)

    def __getattr__(self, name):
        got = getattr(self.inner, name)
        return FaultyModel(got) if name == "model" else got


class FaultyFused:
    # The same error where a new row's prompt runs in the batch's decode pass
    # (mlxq.worker.fused_pass), which calls the model's layers, not the model.
    def __init__(self, inner):
        self.inner = inner

    def decode(self, *a, **kw):
        return self.inner.decode(*a, **kw)

    def __call__(self, tokens, caches, prompt, *a, **kw):
        if poison in prompt:
            raise RuntimeError("injected MLX error")
        return self.inner(tokens, caches, prompt, *a, **kw)


engine = Engine(FaultyModel(model), tok, max_batch=8, fused_prefill=fused == "fused")
if engine.fused is not None:
    engine.fused = FaultyFused(engine.fused)
    engine.reset()
sys.exit(Worker(WorkerConfig(model=model_path, redis_url=url, queue=queue,
                             window_ms=0), engine=engine).run())
"""


@pytest.mark.parametrize("fused", ["fused", "own-pass"])
def test_poison_job_fails_alone_and_the_batch_goes_on(
    redis_server, queue_name, tiny_model, tmp_path: Path, r, fused
):
    """A job whose prefill breaks the forward pass fails alone, the others go on: whether
    its prompt runs in a pass of its own or in the busy batch's decode pass."""
    import subprocess

    from conftest import WorkerProcess

    script = tmp_path / "poison_worker.py"
    script.write_text(POISON_LAUNCHER)
    w = WorkerProcess([], tmp_path / "poison.log", redis_server.url, queue_name)
    w.proc.kill()
    w.proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model), redis_server.url, queue_name, fused],
        stdout=w.log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        w.wait_ready()
        client = Client(redis_server.url, queue=queue_name)
        good = _long_jobs(client, 3, tokens=400)
        _wait_running(good, 3)
        bad = client.submit("POISON pill", max_tokens=10)
        ctx = client.submit("x " * 5000, max_tokens=10)  # longer than the model's context
        with pytest.raises(JobFailed, match="injected MLX error"):
            bad.result(timeout=60)
        with pytest.raises(JobFailed, match="context"):
            ctx.result(timeout=60)
        for j in good:
            assert j.result(timeout=120).finish_reason in ("stop", "length")
        assert client.submit("after", max_tokens=3).result(timeout=60).token_ids
    finally:
        assert w.stop() == 0, w.output()


def test_a_chat_template_error_fails_that_job_alone(
    redis_server, queue_name, start_worker, tiny_model, tmp_path: Path
):
    import json
    import shutil

    strict = tmp_path / "strict-model"
    shutil.copytree(tiny_model, strict)
    cfg_path = strict / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # Many real templates refuse some conversations; this one refuses tool turns.
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool turns are not supported') }}"
        "{% endif %}{% endfor %}" + cfg["chat_template"]
    )
    cfg_path.write_text(json.dumps(cfg))
    start_worker(model=strict)
    client = Client(redis_server.url, queue=queue_name)
    good = client.submit(messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    bad = client.submit(
        messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}],
        max_tokens=8,
    )
    with pytest.raises(JobFailed, match="tool turns are not supported"):
        bad.result(timeout=60)
    assert good.result(timeout=60).token_ids
    assert client.submit("still serving", max_tokens=3).result(timeout=60).token_ids
