"""Operating mlxq from the shell, through the CLI and the public API, against one shared
worker (metrics on, JSON logs at DEBUG): job control, info, metrics, logs, rq suspend."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import WorkerProcess, _free_port
from opshelp import MLXQ, Reader, Terminal, env_for, json_lines, mlxq, mlxq_all, wait_for
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue
from rq.worker import SimpleWorker

from mlxq.producer import AsyncClient, Client, JobFailed, NoSuchJob
from mlxq.producer.client import Job
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.info import collect

pytestmark = pytest.mark.e2e

SECRET_PROMPT = "Zanzibar-prompt-marker-4711"


@dataclass
class Shared:
    worker: WorkerProcess
    queue: str
    name: str
    url: str
    metrics_url: str
    info_before_any_submit: dict[str, Any]
    _client: Client | None = None

    def client(self) -> Client:
        """One client for the module's tests (each client holds a pub/sub connection)."""
        if self._client is None:
            self._client = Client(self.url, queue=self.queue)
        return self._client


@pytest.fixture(scope="module")
def shared(redis_server, tiny_model, tmp_path_factory) -> Iterator[Shared]:
    queue, name = f"ops-{uuid.uuid4().hex[:8]}", f"shared-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    args = ["--model", str(tiny_model), "--redis-url", redis_server.url, "--queue", queue]
    args += ["--name", name, "--max-batch", "8", "--window-ms", "0"]
    args += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
    args += ["--log-format", "json", "--log-level", "DEBUG"]
    log = tmp_path_factory.mktemp("ops") / "shared-worker.log"
    w = WorkerProcess(args, log, redis_server.url, queue, name)
    try:
        w.wait_ready()
        r = redis.Redis.from_url(redis_server.url)
        wait_for(lambda: r.exists(f"mlxq:alive:{name}"), "the worker's lease")
        info = mlxq("info", "--json", url=redis_server.url)
        assert info.returncode == 0, info.stderr
        shared = Shared(
            w,
            queue,
            name,
            redis_server.url,
            f"http://127.0.0.1:{port}/metrics",
            json.loads(info.stdout),
        )
        yield shared
        shared.client().close()
    finally:
        assert w.stop() == 0, w.output()


def _long_job(client: Client, **kw: Any) -> Any:
    # Seed 0 runs to max_tokens on the tiny model (a few seconds alone).
    return client.submit("A long tale", max_tokens=2000, temperature=1.0, seed=0, **kw)


def _wait_started(job: Any) -> None:
    wait_for(lambda: job.status() == "started", f"job {job.id} to start")


# -- info ------------------------------------------------------------------------------


def test_info_lists_a_served_queue_before_any_submit(shared):
    doc = shared.info_before_any_submit
    assert doc["queues"][shared.queue] == dict.fromkeys(
        ("queued", "started", "finished", "failed", "canceled", "buffered"), 0
    )
    (w,) = [w for w in doc["workers"] if w["name"] == shared.name]
    assert w["alive"] is True and w["queue"] == shared.queue


def test_info_table_and_watch(shared):
    shared.client().submit("for the table", max_tokens=4).result(timeout=60)
    out = mlxq("info", url=shared.url)
    assert out.returncode == 0, out.stderr
    for text in (shared.queue, shared.name, "tok/s 1m", "vectorized", "uptime", "/8"):
        assert text in out.stdout, text
    term = Terminal([*MLXQ, "info", "--watch", "--interval", "0.1"], env_for(shared.url))
    wait_for(lambda: term.reader.data.count(shared.name.encode()) >= 3, "three refreshes")
    term.proc.send_signal(signal.SIGINT)
    screen = term.finish(timeout=30)
    assert term.proc.returncode == 0
    assert b"\x1b[" in term.reader.data  # it redrew in place ...
    assert sum(shared.name in row for row in screen) == 1  # ... so the table shows once


def test_info_skips_a_corrupt_stats_hash_with_a_warning(shared, r):
    fakes = [f"fake-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    rq_workers = []
    for fake in fakes:
        rq_workers.append(
            SimpleWorker([Queue(shared.queue, connection=r)], connection=r, name=fake)
        )
        rq_workers[-1].register_birth()
    r.hset(f"mlxq:worker:{fakes[0]}", "stats", b"\xc1 not msgpack")
    r.hset(f"mlxq:worker:{fakes[1]}", "stats", MsgpackSerializer.dumps({"decode_steps": "x"}))
    r.set(f"mlxq:worker:{fakes[2]}", "not a hash")
    try:
        for args in (["info", "--json"], ["info"]):
            out = mlxq(*args, url=shared.url)
            assert out.returncode == 0, out.stderr
            for fake in fakes:
                assert f"worker {fake}" in out.stderr and "warning" in out.stderr
        doc = json.loads(mlxq("info", "--json", url=shared.url).stdout)
        names = {w["name"]: w for w in doc["workers"]}
        assert names[shared.name]["model"] and all(names[f]["decode_steps"] == 0 for f in fakes)
    finally:
        for w in rq_workers:
            w.register_death()
        r.delete(*(f"mlxq:worker:{f}" for f in fakes))


# -- job control from the shell --------------------------------------------------------


def test_submit_from_stdin_then_status_result_stream_jobs(shared):
    prompt = "The lighthouse keeper"
    sub = mlxq(
        "submit",
        "-",
        "--stream",
        "--max-tokens",
        "12",
        "--queue",
        shared.queue,
        url=shared.url,
        stdin=prompt + "\n",
    )
    assert sub.returncode == 0, sub.stderr
    first = sub.stderr.splitlines()[0]
    assert first.startswith("mlxq: job ") and "finish_reason=" in sub.stderr
    job_id = first.split()[2]
    text = sub.stdout[:-1]  # the printer ends the text with a newline
    same = shared.client().submit(prompt, max_tokens=12).result(timeout=60)  # greedy
    assert text == same.text, "stdin is the prompt, less its trailing newline"

    res, plain_res, replay, st, plain, listed, failed, table = mlxq_all(
        [
            ["result", job_id, "--json"],
            ["result", job_id],
            ["stream", job_id],
            ["status", job_id, "--json"],
            ["status", job_id],
            ["jobs", "--queue", shared.queue, "--json"],
            ["jobs", "--queue", shared.queue, "--status", "failed"],
            ["jobs", "--queue", shared.queue, "--limit", "50"],
        ],
        url=shared.url,
    )
    doc = json.loads(res.stdout)
    assert doc["text"] == text and doc["usage"] == same.usage
    assert plain_res.stdout == text + "\n"
    assert replay.stdout == text + "\n"  # replayed
    details = json.loads(st.stdout)
    assert details["status"] == "finished" and details["queue"] == shared.queue
    assert details["attempts"] == 1 and details["worker"] == shared.name
    assert details["queue_wait_s"] >= 0 and details["run_s"] >= 0
    assert details["failure_reason"] is None
    assert "finished" in plain.stdout and shared.name in plain.stdout
    assert "run time" in plain.stdout
    assert job_id in [j["id"] for j in json.loads(listed.stdout)]
    assert failed.returncode == 0 and job_id not in failed.stdout
    assert job_id in table.stdout and "finished" in table.stdout


def test_submit_timeout_is_the_jobs_limit_and_wait_is_the_clis(shared):
    out = mlxq(
        "submit",
        "runs too long",
        "--stream",
        "--max-tokens",
        "2000",
        "--temperature",
        "1",
        "--seed",
        "0",
        "--timeout",
        "0.2",
        "--queue",
        shared.queue,
        url=shared.url,
    )
    assert out.returncode == 1 and "timeout: ran longer than timeout=0.2 s" in out.stderr
    out = mlxq(
        "submit",
        "A long tale",
        "--stream",
        "--max-tokens",
        "2000",
        "--temperature",
        "1",
        "--seed",
        "0",
        "--wait",
        "0.3",
        "--queue",
        shared.queue,
        url=shared.url,
    )
    job_id = out.stderr.splitlines()[0].split()[2]
    assert out.returncode == 1 and "no end within --wait 0.3 s" in out.stderr
    assert f"job {job_id} goes on" in out.stderr
    job = shared.client().job(job_id)
    assert job.status() in ("queued", "started")
    job.cancel()


def test_ctrl_c_while_streaming_leaves_the_job_running_unless_asked(shared):
    client = shared.client()
    for cancel in (False, True):
        argv = [*MLXQ, "submit", "A long tale", "--stream", "--max-tokens", "2000"]
        argv += ["--temperature", "1", "--seed", "0", "--queue", shared.queue]
        argv += ["--cancel-on-exit"] if cancel else []
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(shared.url)
        )
        assert p.stderr is not None and p.stdout is not None
        job_id = p.stderr.readline().decode().split()[2]  # before any token
        out = Reader(p.stdout.fileno())
        wait_for(lambda out=out: out.data, "the first text")
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130
        said = p.stderr.read().decode()
        job = client.job(job_id)
        if cancel:
            assert f"job {job_id} canceled" in said
            wait_for(lambda job=job: job.status() == "canceled", "the cancel")
        else:
            assert f"job {job_id} goes on" in said and f"mlxq cancel {job_id}" in said
            assert job.status() == "started"
            # Stats are fresh while busy: the running job shows within about a second.
            wait_for(
                lambda: any(
                    w["name"] == shared.name and w["running"] >= 1
                    for w in collect(client.redis)["workers"]
                ),
                "stats showing the running job",
            )
            assert job.cancel() is True


def test_cancel_and_unknown_ids(shared):
    client = shared.client()
    job = _long_job(client)
    _wait_started(job)
    out = mlxq("cancel", job.id, "no-such-id", url=shared.url)
    assert out.returncode == 1
    assert f"{job.id} cancel requested" in out.stdout and "no job 'no-such-id'" in out.stderr
    with pytest.raises(JobFailed, match="canceled"):
        job.result(timeout=60)
    st = mlxq("status", job.id, url=shared.url).stdout
    assert "canceled" in st and "reason" in st
    again = mlxq("cancel", job.id, url=shared.url)
    assert again.returncode == 0 and "had already ended" in again.stdout
    for cmd in (["status"], ["result"], ["stream"]):
        gone = mlxq(*cmd, "no-such-id", url=shared.url)
        assert gone.returncode == 1 and "no job 'no-such-id'" in gone.stderr
        assert "Traceback" not in gone.stderr


# -- the public API ---------------------------------------------------------------------


def test_api_metadata_context_managers_chat_parts_and_no_such_job(shared, tiny_model):
    from mlx_lm import load

    meta = {"user": "u-1", "tags": ["a", "b"], "n": 3}
    msgs = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "name": "ann", "content": "Hello!"},
    ]
    with Client(shared.url, queue=shared.queue) as client:
        job = client.submit(messages=msgs, max_tokens=6, metadata=meta)
        res = job.result(timeout=60)
        assert job.metadata() == meta
        assert client.submit("no metadata", max_tokens=1).metadata() is None
        for read in (lambda j: list(j.stream(timeout=10)), Job.result, Job.metadata):
            with pytest.raises(NoSuchJob, match="no job 'nope'"):
                read(Job(client, "nope"))
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.type='image_url'"):
            client.submit(
                messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]
            )
        # A producer writing the payload itself goes through the worker's same checks.
        q = Queue(shared.queue, connection=client.redis, serializer=MsgpackSerializer)
        rogue_ok = q.enqueue("mlxq.worker.generate", {"v": 1, "messages": msgs, "max_tokens": 6})
        rogue_bad = q.enqueue(
            "mlxq.worker.generate",
            {"v": 1, "messages": [{"role": "user", "content": [{"type": "x", "text": "y"}]}]},
        )
        assert client.job(rogue_ok.id).result(timeout=60).text == res.text
        with pytest.raises(JobFailed, match=r"messages\[0\]\.content\[0\]\.type='x'"):
            client.job(rogue_bad.id).result(timeout=60)
    _, tok = load(str(tiny_model))
    flat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "name": "ann", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert res.usage["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))

    async def go() -> tuple[Any, str]:
        async with AsyncClient(shared.url, queue=shared.queue) as ac:
            j = await ac.submit(
                "A long tale",
                max_tokens=2000,
                temperature=1.0,
                seed=0,
                timeout=0.2,
                metadata={"k": 1},
            )
            got = await j.metadata()
            with pytest.raises(JobFailed):
                await j.result(timeout=60)
            with pytest.raises(NoSuchJob):
                await ac.job("nope")
            return got, await j.failure_reason()

    got, reason = asyncio.run(go())
    assert got == {"k": 1} and reason.startswith("timeout")


# -- metrics and logs ------------------------------------------------------------------


def _scrape(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as res:
        text = res.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(families: dict[str, Any], name: str, default: float | None = None, **labels: str):
    for family in families.values():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    if default is not None:
        return default
    raise AssertionError(f"no sample {name} {labels}")


def test_metrics_endpoint(shared):
    length = dict(finished_reason="length")
    fin0 = _sample(_scrape(shared.metrics_url), "mlxq_request_success_total", 0.0, **length)
    jobs = shared.client().submit_many([dict(prompt=f"metric {i}", max_tokens=8) for i in range(4)])
    results = [j.result(timeout=60) for j in jobs]
    assert all(r.finish_reason == "length" for r in results)
    wait_for(
        lambda: (
            _sample(_scrape(shared.metrics_url), "mlxq_request_success_total", 0.0, **length)
            >= fin0 + 4
        ),
        "the four jobs counted",
    )
    m = _scrape(shared.metrics_url)
    for name in (
        "mlxq_num_requests_running",
        "mlxq_num_requests_waiting",
        "mlxq_prompt_tokens",
        "mlxq_generation_tokens",
        "mlxq_request_success",
        "mlxq_time_to_first_token_seconds",
        "mlxq_inter_token_latency_seconds",
        "mlxq_e2e_request_latency_seconds",
        "mlxq_request_queue_time_seconds",
        "mlxq_iteration_tokens_total",
        "mlxq_decode_steps",
        "mlxq_vectorized_steps",
        "mlxq_constrained_rows",
        "mlxq_constraint_compiles",
        "mlxq_mask_ms",
        "mlxq_loop_seconds",
        "mlxq_jobs",
        "mlxq_batch_size",
    ):
        assert name in m, name
    for name in (
        "mlxq_time_to_first_token_seconds",
        "mlxq_e2e_request_latency_seconds",
        "mlxq_request_queue_time_seconds",
        "mlxq_inter_token_latency_seconds",
    ):
        assert m[name].type == "histogram"
    # The decode thread's time by stage: the jobs above were prefilled and decoded.
    for stage in ("decode", "prefill", "first_token", "post"):
        assert _sample(m, "mlxq_loop_seconds_total", stage=stage) > 0, stage
        assert _sample(m, f"{name}_count") >= 4
    steps = _sample(m, "mlxq_decode_steps_total")
    assert steps > 0 and _sample(m, "mlxq_vectorized_steps_total") == steps
    assert _sample(m, "mlxq_batch_size_count") == steps
    assert _sample(m, "mlxq_generation_tokens_total") >= 32
    assert _sample(m, "mlxq_jobs_total", outcome="finished") >= 4
    # The dashboard charts only what the worker exports.
    dash = json.loads((Path(__file__).parents[1] / "ops" / "grafana-mlxq.json").read_text())
    exported = {s.name for f in m.values() for s in f.samples}
    labels = {k for f in m.values() for s in f.samples for k in s.labels}
    for var in dash["templating"]["list"]:
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"]).groups()
        # Prometheus adds ``instance`` when it scrapes; any other label is the worker's.
        assert metric in exported and label in {*labels, "instance"}, var["name"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for used in re.findall(r"mlxq_[a-z0-9_]+", target["expr"]):
                assert used in exported, (panel["title"], used)
            # A panel by queue reads a metric labelled with the queue.
            if "by (queue" in target["expr"]:
                (used,) = set(re.findall(r"mlxq_[a-z0-9_]+", target["expr"]))
                assert any(
                    s.name == used and s.labels.get("queue") == shared.queue
                    for f in m.values()
                    for s in f.samples
                ), (panel["title"], used)


def test_json_log_lines_for_each_job_event(shared):
    client = shared.client()
    ok = client.submit(SECRET_PROMPT, max_tokens=5)
    ok.result(timeout=60)
    slow = _long_job(client, timeout=0.2)
    with pytest.raises(JobFailed, match="timeout"):
        slow.result(timeout=60)
    canceled = _long_job(client)
    _wait_started(canceled)
    canceled.cancel()
    with pytest.raises(JobFailed):
        canceled.result(timeout=60)
    bad = Queue(shared.queue, connection=client.redis, serializer=MsgpackSerializer).enqueue(
        "mlxq.worker.generate", {"v": 1, "prompt": 42}
    )
    with pytest.raises(JobFailed):
        client.job(bad.id).result(timeout=60)

    def events(job_id: str) -> dict[str, dict[str, Any]]:
        docs = json_lines(shared.worker.log)  # every line is JSON
        return {d["event"]: d for d in docs if d.get("job_id") == job_id}

    wait_for(lambda: "finished" in events(ok.id), "the finished line")
    ev = events(ok.id)
    assert {"queued_wait", "started", "finished"} <= set(ev)
    fin = ev["finished"]
    assert fin["queue"] == shared.queue and fin["attempt"] == 1 and fin["tokens"] == 5
    assert fin["finish_reason"] == "length" and fin["level"] == "INFO"
    for k in ("run_s", "ttft_s", "e2e_s", "prompt_tokens", "ts", "message"):
        assert k in fin, k
    assert ok.id in fin["message"] and "tokens=5" in fin["message"]
    assert wait_for(lambda: events(slow.id).get("timed_out"), "timed_out")["reason"].startswith(
        "timeout"
    )
    assert wait_for(lambda: events(canceled.id).get("canceled"), "canceled")
    assert "prompt=42" in wait_for(lambda: events(bad.id).get("failed"), "failed")["reason"]
    text = shared.worker.log.read_text()
    assert SECRET_PROMPT not in text, "no log line carries a prompt"


# -- rq suspend -------------------------------------------------------------------------


def test_rq_suspend_admits_nothing_until_resume(shared, r):
    client = shared.client()
    rq = [sys.executable, "-m", "rq.cli"]
    try:
        subprocess.run([*rq, "suspend", "--url", shared.url], check=True, timeout=60)
        wait_for(
            lambda: any(
                w["name"] == shared.name and w.get("suspended")
                for w in collect(client.redis)["workers"]
            ),
            "the worker to see the suspension",
        )
        job = client.submit("waits for resume", max_tokens=4)
        # A working worker starts a job within milliseconds; a suspended one never does.
        time.sleep(1.0)
        doc = json.loads(mlxq("info", "--json", url=shared.url).stdout)
        (w,) = [w for w in doc["workers"] if w["name"] == shared.name]
        assert w["state"] == "suspended"
        assert job.status() == "queued", "a suspended worker admits nothing"
        assert Queue(shared.queue, connection=r).count == 1
    finally:
        subprocess.run([*rq, "resume", "--url", shared.url], check=True, timeout=60)
    assert job.result(timeout=60).token_ids
