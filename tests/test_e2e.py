"""End to end: a real worker process on the tiny model, driven only through the contract."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import redis
from rq import Queue
from rq.job import Job as RqJob

from mlxq.producer import AsyncClient, Client, JobFailed
from mlxq.producer.codec import MsgpackSerializer

pytestmark = pytest.mark.e2e


def _client(redis_server, queue_name, **kw) -> Client:
    return Client(redis_server.url, queue=queue_name, **kw)


def test_stream_live_equals_result(redis_server, queue_name, start_worker):
    start_worker()
    job = _client(redis_server, queue_name).submit(
        "The quick brown fox", max_tokens=24, temperature=0.8, top_p=0.9
    )
    chunks = list(job.stream(timeout=60))
    res = job.result(timeout=10)
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == res.finish_reason
    assert "".join(c.text for c in chunks) == res.text
    assert [t for c in chunks for t in c.token_ids] == res.token_ids
    assert res.finish_reason in ("stop", "length")
    assert res.usage["completion_tokens"] >= len(res.token_ids) > 0
    assert res.usage["prompt_tokens"] > 0
    assert job.status() == "finished"


def test_late_and_concurrent_listeners_see_every_chunk_once(redis_server, queue_name, start_worker):
    start_worker()
    client = _client(redis_server, queue_name)
    job = client.submit("Once upon a time", max_tokens=40, temperature=1.0)
    seen: list[list[tuple[int, str]]] = [[], []]

    def listen(i: int) -> None:
        seen[i] = [(c.seq, c.text) for c in client.job(job.id).stream(timeout=60)]

    threads = [threading.Thread(target=listen, args=(i,)) for i in range(2)]
    threads[0].start()
    time.sleep(0.05)  # the second listener joins mid-stream
    threads[1].start()
    for t in threads:
        t.join(60)
    res = job.result(timeout=10)
    late = [(c.seq, c.text) for c in client.job(job.id).stream(timeout=10)]  # after the end
    assert seen[0] == seen[1] == late
    assert "".join(t for _, t in late) == res.text


def test_greedy_is_deterministic_and_matches_mlx_lm(
    redis_server, queue_name, start_worker, tiny_model
):
    from mlx_lm import generate, load

    start_worker()
    client = _client(redis_server, queue_name)
    prompt = "In the morning the travellers"
    jobs = client.submit_many([dict(prompt=prompt, max_tokens=16)] * 3)
    results = [j.result(timeout=60) for j in jobs]
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids
    model, tok = load(str(tiny_model))
    expected = generate(model, tok, prompt=prompt, max_tokens=16)
    assert results[0].text == expected


def test_chat_messages_use_the_template(redis_server, queue_name, start_worker, tiny_model):
    from mlx_lm import load

    start_worker()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    res = _client(redis_server, queue_name).submit(messages=msgs, max_tokens=8).result(timeout=60)
    _, tok = load(str(tiny_model))
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert res.usage["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt="x", temperature=-0.1), "temperature=-0.1"),
        (dict(prompt="x", top_p=0.0), "top_p=0.0"),
        (dict(prompt="x", top_p=1.5), "top_p=1.5"),
        (dict(prompt="x", top_k=-1), "top_k=-1"),
        (dict(prompt="x", min_p=2.0), "min_p=2.0"),
        (dict(prompt="x", max_tokens=0), "max_tokens=0"),
        (dict(prompt="x", max_tokens=10**9), "max_tokens=1000000000"),
        (dict(prompt=""), "prompt=''"),
        (dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "prompt='x'"),
        (dict(), "prompt=None"),
        (dict(messages=[{"role": "robot", "content": "y"}]), "messages[0].role='robot'"),
        (dict(prompt="x", seed=-3), "seed=-3"),
        (dict(prompt="x", stop=[""]), "stop=''"),
    ],
)
def test_submit_refuses_bad_values_before_redis(redis_server, queue_name, kwargs, field):
    client = _client(redis_server, queue_name)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("(", r"\(")):
        client.submit(**kwargs)
    assert Queue(queue_name, connection=client.redis).count == 0


def test_rq_registries_stay_true_while_batching(redis_server, queue_name, start_worker, r):
    start_worker(max_batch=4)
    client = _client(redis_server, queue_name)
    jobs = client.submit_many(
        [dict(prompt=f"Job number {i}", max_tokens=48, temperature=0.7) for i in range(10)]
    )
    q = Queue(queue_name, connection=r, serializer=MsgpackSerializer)
    peak_started = 0
    while any(j.status() not in ("finished", "failed") for j in jobs):
        started = q.started_job_registry.count
        assert started <= 4
        peak_started = max(peak_started, started)
        time.sleep(0.005)
    assert peak_started >= 2, "several jobs should have run at once"
    assert q.finished_job_registry.count == 10
    assert q.started_job_registry.count == 0 and q.count == 0
    for j in jobs:
        rj = RqJob.fetch(j.id, connection=r, serializer=MsgpackSerializer)
        assert rj.get_status() == "finished"
        assert rj.return_value()["text"] == j.result().text
    out = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", redis_server.url, queue_name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert queue_name in out.stdout and "1 workers" in out.stdout, out.stdout + out.stderr


def test_window_puts_a_burst_into_one_prefill(redis_server, queue_name, start_worker):
    start_worker(window_ms=500, max_batch=8)
    client = _client(redis_server, queue_name)
    jobs = client.submit_many([dict(prompt=f"burst {i}", max_tokens=4) for i in range(6)])
    for j in jobs:
        j.result(timeout=60)
    stats = _worker_stats(redis_server, queue_name)
    assert stats["batch_sizes"].get("6", 0) >= 1, stats["batch_sizes"]
    # How they went in: one window took the six, one prefill pass ran them (6 rows is a
    # bucket too), and the prefetcher's claims brought them.
    assert stats["window_sizes"].get("6", 0) >= 1, stats["window_sizes"]
    assert stats["prefill_batch_sizes"].get("6", 0) >= 1, stats["prefill_batch_sizes"]
    assert stats["prefill_shapes"] >= 1
    assert stats["jobs_claimed"] >= 6 and stats["claim_calls"] >= 1


def test_a_worker_claims_no_more_than_its_rows_and_one_batch_in_reserve(
    redis_server, queue_name, start_worker, r
):
    from mlxq.producer import keys

    w = start_worker(window_ms=300, max_batch=2)
    client = _client(redis_server, queue_name)
    jobs = client.submit_many(
        [dict(prompt=f"backlog {i}", max_tokens=1900, min_tokens=1900, seed=i) for i in range(12)]
    )
    # The window takes what the prefetcher made ready before the loop plans again: those
    # jobs must count as held meanwhile, or the prefetcher claims their number once more
    # (a second worker on the queue would then find nothing to claim).
    most, deadline = 0, time.monotonic() + 1  # none of the first two ends meanwhile
    while time.monotonic() < deadline and not any(j.status() == "finished" for j in jobs):
        most = max(most, r.llen(keys.wip_key(w.name)))
        time.sleep(0.01)
    assert 0 < most <= 2 * 2, f"held {most} jobs with 2 rows"
    for j in jobs:
        j.cancel()


def test_jobs_join_a_running_batch(redis_server, queue_name, start_worker):
    start_worker(window_ms=0, max_batch=8)
    client = _client(redis_server, queue_name)
    # Seeded: whether a random model stops early is then the same on every run.
    long = client.submit("A long story", max_tokens=400, temperature=1.0, seed=11)
    it = long.stream(timeout=60)
    next(it)  # the long job is decoding
    short = client.submit("short", max_tokens=4).result(timeout=60)
    assert long.status() == "started", "the short job finished while the long one still ran"
    list(it)
    assert short.finish_reason in ("stop", "length")


def test_mixed_params_keep_every_step_vectorized(redis_server, queue_name, start_worker):
    start_worker(max_batch=16, window_ms=200)
    client = _client(redis_server, queue_name)
    groups = [
        dict(),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.2, min_p=0.1),
        dict(temperature=0.8, seed=7),
    ]
    jobs = client.submit_many(
        [dict(prompt=f"mix {i}", max_tokens=12, **groups[i % 5]) for i in range(30)]
    )
    for j in jobs:
        j.result(timeout=60)
    stats = _worker_stats(redis_server, queue_name)
    assert stats["decode_steps"] > 0
    assert stats["vectorized_steps"] == stats["decode_steps"]
    assert stats["sampler_calls"] == stats["decode_steps"]


def test_rogue_payloads_fail_with_a_reason_and_the_worker_goes_on(
    redis_server, queue_name, start_worker, r
):
    import pickle

    q = Queue(queue_name, connection=r)  # rq's default serializer: pickle
    pickled = q.enqueue("mlxq.worker.generate", {"v": 1, "prompt": "hi"})
    mq = Queue(queue_name, connection=r, serializer=MsgpackSerializer)
    wrong_type = mq.enqueue("mlxq.worker.generate", {"v": 1, "prompt": 42})
    bad_value = mq.enqueue("mlxq.worker.generate", {"v": 1, "prompt": "x", "top_p": 7})
    other_func = mq.enqueue("os.system", {"v": 1, "prompt": "x"})
    garbage = mq.enqueue("mlxq.worker.generate", {"v": 1, "prompt": "x"})
    r.hset(f"rq:job:{garbage.id}", "data", b"\xc1\xff\x00garbage" + pickle.dumps(object))
    start_worker()  # only now: every rogue job is in place before anyone dequeues
    client = _client(redis_server, queue_name)
    reasons = {}
    for rj in (pickled, wrong_type, bad_value, other_func, garbage):
        job = client.job(rj.id)
        with pytest.raises(JobFailed) as e:
            job.result(timeout=60)
        reasons[rj.id] = e.value.reason
        assert job.status() == "failed"
    assert "prompt=42" in reasons[wrong_type.id]
    assert "top_p=7" in reasons[bad_value.id]
    assert "os.system" in reasons[other_func.id]
    assert "msgpack" in reasons[pickled.id] and "msgpack" in reasons[garbage.id]
    assert client.submit("still serving", max_tokens=4).result(timeout=60).token_ids


def test_cancel_queued_and_running(redis_server, queue_name, start_worker):
    client = _client(redis_server, queue_name)
    queued = client.submit("never runs", max_tokens=4)
    assert queued.cancel() is True
    assert queued.status() == "canceled"
    start_worker(window_ms=0)
    running = client.submit("runs a while", max_tokens=2000, temperature=1.0, seed=5)
    it = running.stream(timeout=60)
    next(it)
    assert running.cancel() is True
    rest = list(it)
    assert rest[-1].finish_reason == "canceled"
    assert running.status() == "canceled"
    with pytest.raises(JobFailed, match="canceled"):
        running.result(timeout=10)
    assert [c.finish_reason for c in queued.stream(timeout=10)] == ["canceled"]
    assert client.submit("after", max_tokens=3).result(timeout=60).token_ids


def test_async_client(redis_server, queue_name, start_worker):
    start_worker()

    async def go() -> tuple[str, str, str]:
        client = AsyncClient(redis_server.url, queue=queue_name)
        job = await client.submit("async hello", max_tokens=12, temperature=0.5)
        text = "".join([c.text async for c in job.stream(timeout=60)])
        res = await job.result(timeout=10)
        status = await job.status()
        await client.aclose()
        return text, res.text, status

    text, result_text, status = asyncio.run(go())
    assert text == result_text and status == "finished"


def test_a_submit_may_name_its_own_queue(redis_server, queue_name, start_worker, r):
    from mlxq.producer.listing import job_queue

    other = f"{queue_name}-other"
    start_worker(queue=other)  # nobody serves the client's own queue
    client = _client(redis_server, queue_name)
    jobs = [
        client.submit("One", max_tokens=4, queue=other),
        *client.submit_many([dict(prompt="Two", max_tokens=4)] * 2, queue=other),
    ]

    async def run() -> list[str]:
        async with AsyncClient(redis_server.url, queue=queue_name) as aclient:
            one = await aclient.submit("Three", max_tokens=4, queue=other)
            many = await aclient.submit_many([dict(prompt="Four", max_tokens=4)], queue=other)
            for j in (one, *many):
                await j.result(timeout=60)
            return [one.id, *(j.id for j in many)]

    for j in jobs:
        j.result(timeout=60)  # ended: only the worker on the other queue could have run it
    ids = [j.id for j in jobs] + asyncio.run(run())
    assert len(ids) == 5 and {job_queue(r, i) for i in ids} == {other}
    assert Queue(queue_name, connection=r).count == 0


def test_info_json_contract(redis_server, queue_name, start_worker):
    start_worker()
    _client(redis_server, queue_name).submit("info", max_tokens=4).result(timeout=60)
    time.sleep(1.5)  # stats are published about once a second
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxq.producer.cli",
            "info",
            "--json",
            "--redis-url",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    doc = json.loads(out.stdout)
    counts = ("queued", "started", "finished", "failed", "canceled", "buffered")
    assert set(doc["queues"][queue_name]) == set(counts)
    assert doc["queues"][queue_name]["finished"] == 1
    (w,) = [w for w in doc["workers"] if w["queue"] == queue_name]
    for k, t in (
        ("name", str),
        ("state", str),
        ("queue", str),
        ("model", str),
        ("decode_steps", int),
        ("vectorized_steps", int),
        ("tokens_generated", int),
    ):
        assert isinstance(w[k], t), k
    assert w["tokens_generated"] > 0


def test_cli_submit_streams(redis_server, queue_name, start_worker):
    start_worker()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxq.producer.cli",
            "submit",
            "Hello",
            "--max-tokens",
            "8",
            "--stream",
            "--redis-url",
            redis_server.url,
            "--queue",
            queue_name,
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    assert "finish_reason=" in out.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxq.producer.cli",
            "submit",
            "x",
            "--top-p",
            "3",
            "--redis-url",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "top_p=3.0" in bad.stderr


def _worker_stats(redis_server, queue_name) -> dict:
    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for key in r.scan_iter("mlxq:worker:*"):
            stats = msgpack.unpackb(r.hget(key, "stats"))
            if stats["queue"] == queue_name and stats["running"] == 0 and stats["decode_steps"]:
                return stats
        time.sleep(0.2)
    raise AssertionError("no stats from the worker")


def test_mixed_param_groups_each_follow_their_own_distribution(
    redis_server, queue_name, start_worker, tiny_model
):
    """A few hundred one-token jobs, five param groups at once: each group's first tokens
    follow mlx-lm's distribution for its params, and every decode step was one call."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from test_sampler import MIXED, assert_fits, reference

    start_worker(max_batch=64, window_ms=300)
    prompt, per_group = "The weather today", 80
    client = Client(redis_server.url, queue=queue_name)
    # Interleaved, so batches mix the groups.
    specs = [
        dict(
            prompt=prompt,
            max_tokens=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
        )
        for _ in range(per_group)
        for p in MIXED
    ]
    jobs = client.submit_many(specs)
    model, tok = load(str(tiny_model))
    eos = min(tok.eos_token_ids)
    first = [(res.token_ids or [eos])[0] for res in (j.result(timeout=120) for j in jobs)]
    logits = model(mx.array([tok.encode(prompt)]))[0, -1]
    logprobs = np.array(logits - mx.logsumexp(logits), dtype=np.float32)
    for g, params in enumerate(MIXED):
        counts = np.bincount(first[g :: len(MIXED)], minlength=logprobs.shape[-1])
        assert_fits(counts, reference(logprobs, params))
    stats = _worker_stats(redis_server, queue_name)
    assert stats["vectorized_steps"] == stats["decode_steps"] > 0
