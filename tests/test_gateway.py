"""``mlxq serve`` end to end: the official ``openai`` client against a real gateway process
and real workers on the tiny model. Nothing is mocked.

Most tests share one worker and one gateway (module-scoped: starting them is most of the
cost); the tests that need a worker or gateway configured their own way start theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
from conftest import GatewayProcess, RedisServer, WorkerProcess
from healthwatch import HealthWatch
from opshelp import mlxq as mlxq_cli
from opshelp import wait_for
from rq import Queue

from mlxq.producer import Client, JobFailed, keys
from mlxq.producer.info import collect
from mlxq.producer.listing import job_details, recent_jobs
from mlxq.producer.shared import REGISTRIES

pytestmark = pytest.mark.e2e

# Seeded, so the random tiny model never ends it early: it runs for seconds.
LONG = dict(max_tokens=2000, temperature=1.0, seed=5)


def _job_id(completion_id: str) -> str:
    return completion_id.split("-", 1)[1]


def _wait_terminal(client: Client, job_id: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (st := client.job(job_id).status()) not in ("finished", "failed", "canceled"):
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {st} after {timeout} s")
        time.sleep(0.02)
    return st


# -- shared worker and gateways -----------------------------------------------------------


@pytest.fixture(scope="module")
def queue() -> str:
    return f"gw-{uuid.uuid4().hex[:8]}"


def _served_worker(redis_url: str, tiny_model: Path, queue: str, log: Path) -> WorkerProcess:
    """A worker on ``queue``, once it is ready and has published its model."""
    name = f"gw-{uuid.uuid4().hex[:8]}"
    args = ["--model", str(tiny_model), "--redis-url", redis_url, "--queue", queue]
    w = WorkerProcess([*args, "--name", name], log, redis_url, queue, name)
    w.wait_ready()
    # Ready for rq at once; its counters (and so its model) follow within a second.
    deadline = time.monotonic() + 30
    while not any(x["name"] == name and x["model"] for x in collect(w.redis)["workers"]):
        assert time.monotonic() < deadline, "the worker never published its model"
        time.sleep(0.05)
    return w


@pytest.fixture(scope="module")
def worker(
    redis_server: RedisServer,
    tiny_model: Path,
    queue: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("gw-worker") / "worker.log"
    w = _served_worker(redis_server.url, tiny_model, queue, log)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateways(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, worker: WorkerProcess
) -> Iterator[dict[str, GatewayProcess]]:
    """One open gateway, and one that needs an API key."""
    logs = tmp_path_factory.mktemp("gw")
    started = {
        "open": GatewayProcess(redis_server.url, logs / "open.log"),
        "keyed": GatewayProcess(redis_server.url, logs / "keyed.log", api_key="k-123"),
    }
    try:
        yield {k: g.wait_ready() for k, g in started.items()}
    finally:
        for g in started.values():
            g.stop()


@pytest.fixture(scope="module")
def gw(gateways: dict[str, GatewayProcess]) -> GatewayProcess:
    return gateways["open"]


@pytest.fixture(scope="module")
def oai(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def mlxq(redis_server: RedisServer, queue: str) -> Client:
    return Client(redis_server.url, queue=queue)


# -- models, completions, chat --------------------------------------------------------------


def test_models_lists_each_served_queue_with_its_model(oai, queue, tiny_model):
    models = {m.id: m for m in oai.models.list()}
    assert models[queue].root == str(tiny_model)
    assert models[queue].owned_by == "mlxq" and models[queue].workers == 1
    assert oai.models.retrieve(queue).id == queue
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(f"no-such-{uuid.uuid4().hex[:6]}")


def test_completion_is_the_jobs_greedy_text(oai, mlxq, queue):
    expected = mlxq.submit("The cat sat", max_tokens=10).result(timeout=60)
    res = oai.completions.create(model=queue, prompt="The cat sat", max_tokens=10, temperature=0)
    assert res.object == "text_completion" and res.id.startswith("cmpl-")
    assert res.model == queue
    assert res.choices[0].text == expected.text
    assert res.choices[0].finish_reason == expected.finish_reason
    assert res.usage.completion_tokens == expected.usage["completion_tokens"]
    assert res.usage.prompt_tokens == expected.usage["prompt_tokens"]
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    assert mlxq.job(_job_id(res.id)).result().text == expected.text


def test_chat_is_the_jobs_greedy_text(oai, mlxq, queue):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = mlxq.submit(messages=messages, max_tokens=10).result(timeout=60)
    res = oai.chat.completions.create(model=queue, messages=messages, max_tokens=10, temperature=0)
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-")
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected.text
    assert res.usage.completion_tokens == expected.usage["completion_tokens"]
    # Text parts are joined, as OpenAI's content arrays allow.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert (
        oai.chat.completions.create(model=queue, messages=parts, max_tokens=6, temperature=0)
        .choices[0]
        .message.content
    )


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_text_equals_the_non_streamed_greedy_text(oai, queue, endpoint):
    def call(**kw: Any) -> Any:
        if endpoint == "chat":
            return oai.chat.completions.create(
                model=queue,
                messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=24,
                temperature=0,
                **kw,
            )
        return oai.completions.create(
            model=queue, prompt="Once upon a time", max_tokens=24, temperature=0, **kw
        )

    whole = call()
    chunks = list(call(stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    if endpoint == "chat":
        assert pieces[0].delta.role == "assistant"
        text = "".join(p.delta.content or "" for p in pieces)
        want = whole.choices[0].message.content
    else:
        text, want = "".join(p.text for p in pieces), whole.choices[0].text
    assert text == want
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert len({c.id for c in chunks}) == 1
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunks[0].usage.prompt_tokens == whole.usage.prompt_tokens


def test_usage_is_streamed_only_when_asked(oai, queue):
    chunks = list(
        oai.completions.create(
            model=queue, prompt="Hello", max_tokens=5, temperature=0, stream=True
        )
    )
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_stop_seed_and_sampling_fields_reach_the_job(oai, queue):
    kw: dict[str, Any] = dict(model=queue, prompt="A list of things:", max_tokens=16)
    seeded = [
        oai.completions.create(
            **kw, temperature=1.0, top_p=0.9, seed=42, extra_body={"top_k": 40, "min_p": 0.05}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    full = oai.completions.create(**kw, temperature=0).choices[0]
    assert full.finish_reason == "length" and len(full.text) > 4
    stop = full.text[len(full.text) // 2 :][:2]
    cut = oai.completions.create(**kw, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    # max_completion_tokens wins over max_tokens, as OpenAI documents.
    res = oai.chat.completions.create(
        model=queue,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=9,
        max_completion_tokens=3,
        temperature=0,
    )
    assert res.usage.completion_tokens <= 3


# -- the fields that need worker support -----------------------------------------------------


def test_logprobs_chat_and_completions(oai, queue):
    chat = oai.chat.completions.create(
        model=queue,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.logprob == pytest.approx(max(a.logprob for a in t.top_logprobs))  # greedy
    comp = oai.completions.create(model=queue, prompt="x", max_tokens=6, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text
    streamed = [
        c.choices[0].logprobs
        for c in oai.chat.completions.create(
            model=queue,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=6,
            temperature=0,
            logprobs=True,
            stream=True,
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert [t.token for s in streamed for t in s.content] == [t.token for t in content]


def test_n_choices(oai, queue):
    res = oai.completions.create(
        model=queue, prompt="Say", max_tokens=8, temperature=1.0, seed=3, n=3
    )
    assert sorted(c.index for c in res.choices) == [0, 1, 2]
    chunks = list(
        oai.completions.create(
            model=queue, prompt="Say", max_tokens=8, temperature=1.0, seed=3, n=3, stream=True
        )
    )
    for i in range(3):
        text = "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
        assert text == next(c.text for c in res.choices if c.index == i)


def test_penalties_and_logit_bias(oai, queue):
    kw: dict[str, Any] = dict(model=queue, max_tokens=8, temperature=0)
    forced = [
        oai.completions.create(**kw, prompt=p, logit_bias={"7": 100}).choices[0].text
        for p in ("one prompt", "another prompt")
    ]
    assert forced[0] == forced[1]  # token 7 every step, whatever the prompt
    plain = oai.completions.create(**kw, prompt="la la la").choices[0].text
    penal = (
        oai.completions.create(
            **kw,
            prompt="la la la",
            presence_penalty=2.0,
            frequency_penalty=2.0,
            extra_body={"repetition_penalty": 2.0},
        )
        .choices[0]
        .text
    )
    assert isinstance(plain, str) and isinstance(penal, str)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(extra_body={"stop": 5}), "stop"),
        (dict(seed=-2), "seed"),
        (dict(n=0), "n"),
        (dict(presence_penalty=5), "presence_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(extra_body={"top_k": "many"}), "top_k"),
        (dict(extra_body={"min_p": 2}), "min_p"),
        (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
        (dict(extra_body={"metadata": "not a map"}), "metadata"),
        (
            dict(stream=False, extra_body={"stream_options": {"include_usage": True}}),
            "stream_options",
        ),
        (dict(prompt=["two", "prompts"]), "prompt"),
        (dict(prompt=""), "prompt"),
        (dict(extra_body={"service_tier": "turbo"}), "service_tier"),
        (dict(extra_body={"service_tier": 1}), "service_tier"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(oai, queue, kw, param):
    args = dict(model=queue, prompt="hi", max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.param == param and param in e.value.message
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].type",
        ),
    ],
)
def test_invalid_messages_are_400_naming_the_field(oai, queue, messages, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=queue, messages=messages, max_tokens=4)
    assert e.value.param == param


def test_bad_json_and_missing_fields_are_400(gw, queue):
    for body, param in (
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": queue}).encode(), "messages"),
        (json.dumps({"messages": []}).encode(), "model"),
    ):
        req = urllib.request.Request(f"{gw.url}/v1/chat/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param


def test_unknown_fields_are_ignored_with_one_warning(oai, gw, queue):
    for _ in range(2):
        oai.completions.create(
            model=queue, prompt="hi", max_tokens=2, extra_body={"frobnicate_level": 3}
        )
    assert gw.output().count("'frobnicate_level'") == 1


def test_unknown_model_is_404_and_unserved_queue_is_503(oai, redis_server):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model=f"no-such-{uuid.uuid4().hex[:6]}", prompt="x")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    unserved = f"unserved-{uuid.uuid4().hex[:6]}"
    waiting = Client(redis_server.url, queue=unserved).submit("nobody serves me", max_tokens=2)
    try:
        with pytest.raises(openai.InternalServerError) as e:
            oai.completions.create(model=unserved, prompt="x")
        assert e.value.status_code == 503 and e.value.code == "model_unavailable"
    finally:
        waiting.cancel()


def test_api_key(gateways, queue):
    url = f"{gateways['keyed'].url}/v1"
    for key in ("wrong", "k-12", "k-1234", "K-123"):
        bad = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=queue, prompt="x", max_tokens=2)
    good = openai.OpenAI(base_url=url, api_key="k-123", max_retries=0)
    assert good.completions.create(model=queue, prompt="x", max_tokens=2).choices
    for path in ("/dashboard/api/state", "/v1/models"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{gateways['keyed'].url}{path}", timeout=30)
        assert e.value.code == 401
    for path in ("/health", "/metrics", "/"):  # no secrets there
        assert urllib.request.urlopen(f"{gateways['keyed'].url}{path}", timeout=30).status == 200


# -- the dashboard's buttons: POST /dashboard/api/jobs/<id>/cancel and .../retry ----------------


def _post(url: str, key: str | None = None, json_body: bool = True) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} if json_body else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=b"{}", method="POST", headers=headers)
    if not json_body:
        req.remove_header("Content-type")  # urllib adds a form's type to a body otherwise
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_dashboards_actions_need_the_key_and_json(gateways, mlxq):
    job = mlxq.submit("stays queued", max_tokens=2, queue=f"idle-{uuid.uuid4().hex[:8]}")
    keyed = f"{gateways['keyed'].url}/dashboard/api/jobs"
    try:
        for action in ("cancel", "retry"):
            status, body = _post(f"{keyed}/{job.id}/{action}")
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            status, body = _post(f"{keyed}/{job.id}/{action}", key="k-123", json_body=False)
            assert status == 415 and "application/json" in body["error"]["message"]
            for bad in ("no-such-job", "not%20an%20id", "x" * 300):
                status, body = _post(f"{keyed}/{bad}/{action}", key="k-123")
                assert status == 404 and body["error"]["code"] == "job_not_found", bad
        assert job.status() == "queued"  # nothing above touched it
        status, body = _post(f"{keyed}/{job.id}/retry", key="k-123")
        assert status == 409 and body["error"]["code"] == "job_not_ended"
        status, body = _post(f"{keyed}/{job.id}/cancel", key="k-123")
        assert (status, body["result"]) == (200, "canceled") and job.status() == "canceled"
    finally:
        job.cancel()


def test_retry_runs_a_canceled_job_again_with_its_request(gw, mlxq, queue, r):
    url = f"{gw.url}/dashboard/api/jobs"
    canceled = keys.canceled_registry(queue)
    job = mlxq.submit("A long tale", **LONG)
    next(iter(job.stream(timeout=60)))  # it runs: its stream has begun
    status, body = _post(f"{url}/{job.id}/cancel")
    assert status == 200 and body["result"] in ("canceled", "cancel_requested")
    with pytest.raises(JobFailed, match="canceled"):
        job.result(timeout=60)
    status, body = _post(f"{url}/{job.id}/cancel")
    assert status == 409 and body["error"]["code"] == "job_ended"

    assert r.zscore(canceled, job.id) is not None and r.ttl(keys.job_key(job.id)) > 0
    status, body = _post(f"{url}/{job.id}/retry")
    assert (status, body["result"]) == (200, "requeued")
    # Out of the canceled registry; its record kept as long as it waits (and runs).
    assert r.zscore(canceled, job.id) is None and r.ttl(keys.job_key(job.id)) == -1
    status, body = _post(f"{url}/{job.id}/retry")  # once: it is queued (or running) now
    assert status == 409 and body["error"]["code"] == "job_not_ended"
    # The new attempt streams from its start, never the canceled run's end, and runs the
    # request it was submitted with: the text a fresh submit of it makes.
    streamed = "".join(c.text for c in job.stream(timeout=120))
    result = job.result(timeout=60)
    assert streamed == result.text
    assert result.text == mlxq.submit("A long tale", **LONG).result(timeout=120).text
    details = job_details(r, job.id)
    assert details is not None and details["attempts"] == 2 and details["failure_reason"] is None
    status, body = _post(f"{url}/{job.id}/retry")
    assert status == 409 and body["error"]["code"] == "job_finished"


def test_retry_of_a_failed_job_runs_it_again(gw, mlxq, queue, r):
    failed = keys.failed_registry(queue)
    job = mlxq.submit("Too long", max_tokens=4000)  # past the model's context: it fails
    with pytest.raises(JobFailed) as first:
        job.result(timeout=60)
    assert r.xlen(keys.results_key(job.id)) == 1
    status, body = _post(f"{gw.url}/dashboard/api/jobs/{job.id}/retry")
    assert (status, body["result"]) == (200, "requeued")
    # It ran again (and failed again, the same way): a second outcome in rq's result log.
    wait_for(lambda: r.xlen(keys.results_key(job.id)) == 2, "the retried job's end")
    with pytest.raises(JobFailed) as again:
        job.result(timeout=60)
    assert again.value.reason == first.value.reason and r.zscore(failed, job.id) is not None


# -- service tiers: --service-tier runs a tier on a queue of its own ----------------------------


@dataclass(frozen=True)
class Tiered:
    """A gateway sending ``priority`` to ``queue`` (served by ``worker`` alone) and
    ``flex`` to ``idle`` (served by nobody), and an openai client of it."""

    oai: openai.OpenAI
    queue: str
    idle: str
    worker: WorkerProcess


@pytest.fixture(scope="module")
def tiered(
    redis_server: RedisServer,
    tiny_model: Path,
    worker: WorkerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Tiered]:
    logs = tmp_path_factory.mktemp("tiers")
    chat, idle = f"chat-{uuid.uuid4().hex[:8]}", f"idle-{uuid.uuid4().hex[:8]}"
    w = _served_worker(redis_server.url, tiny_model, chat, logs / "worker.log")
    tiers = [f"priority={chat}", f"flex={idle}"]
    g = GatewayProcess(redis_server.url, logs / "gateway.log", service_tier=tiers)
    try:
        g.wait_ready()
        oai = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=60)
        yield Tiered(oai, chat, idle, w)
    finally:
        g.stop()
        w.stop()


def _ran_on(r: Any, completion_id: str) -> tuple[str, str]:
    """The queue a completion's job was submitted to, and the worker that ran it."""
    details = job_details(r, _job_id(completion_id))  # the worker is set when it starts
    assert details is not None
    return details["queue"], details["worker"]


def test_a_mapped_tier_runs_on_its_queue_and_says_so(tiered, queue, r):
    there = (tiered.queue, tiered.worker.name)
    chat: dict[str, Any] = dict(model=queue, messages=[{"role": "user", "content": "Hi"}])
    for asked in ("priority", "fast"):  # fast is OpenAI's other name for priority
        res = tiered.oai.chat.completions.create(**chat, max_tokens=4, service_tier=asked)
        assert res.service_tier == "priority" and res.model == queue
        assert _ran_on(r, res.id) == there
    chunks = list(
        tiered.oai.chat.completions.create(
            **chat,
            max_tokens=4,
            service_tier="priority",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 2 and all(c.service_tier == "priority" for c in chunks)
    assert _ran_on(r, chunks[0].id) == there
    comp = tiered.oai.completions.create(
        model=queue, prompt="Hi", max_tokens=4, extra_body={"service_tier": "priority"}
    )
    assert (comp.model_extra or {})["service_tier"] == "priority"
    assert _ran_on(r, comp.id) == there
    with pytest.raises(openai.BadRequestError) as e:
        tiered.oai.chat.completions.create(**chat, service_tier="turbo")  # type: ignore[arg-type]
    assert e.value.param == "service_tier" and "'turbo'" in e.value.message


@pytest.mark.parametrize("tier", [None, "auto", "default", "scale"])
def test_other_tiers_run_on_the_models_queue_at_default(tiered, queue, worker, r, tier):
    extra = {} if tier is None else {"service_tier": tier}
    here = (queue, worker.name)
    res = tiered.oai.chat.completions.create(
        model=queue, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=extra
    )
    assert res.service_tier == "default" and _ran_on(r, res.id) == here
    chunks = list(
        tiered.oai.completions.create(
            model=queue, prompt="Hi", max_tokens=4, stream=True, extra_body=extra
        )
    )
    assert chunks and all((c.model_extra or {})["service_tier"] == "default" for c in chunks)
    assert _ran_on(r, chunks[0].id) == here


def test_a_mapped_tier_nobody_serves_is_503_and_its_model_must_exist(tiered, queue):
    flex = {"service_tier": "flex"}
    with pytest.raises(openai.InternalServerError) as e:
        tiered.oai.completions.create(model=queue, prompt="x", max_tokens=2, extra_body=flex)
    assert e.value.status_code == 503 and e.value.param == "service_tier"
    assert e.value.code == "service_tier_unavailable" and tiered.idle in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        tiered.oai.completions.create(
            model=f"no-such-{uuid.uuid4().hex[:6]}",
            prompt="x",
            extra_body={"service_tier": "priority"},
        )
    assert e.value.code == "model_not_found" and e.value.param == "model"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["turbo=chat"], "--service-tier 'turbo=chat': unknown tier 'turbo'"),
        (["priority="], "--service-tier 'priority=': the queue must be a name"),
        (["priority=a", "priority=b"], "--service-tier 'priority=b': the tier 'priority' is given"),
    ],
)
def test_serve_refuses_bad_service_tiers(options, says):
    argv = [sys.executable, "-m", "mlxq.producer.cli", "serve"]
    for o in options:
        argv += ["--service-tier", o]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1


# -- a worker of its own: one job at a time, and a template that refuses tool turns ----------


@pytest.fixture
def strict_model(tiny_model: Path, tmp_path: Path) -> Path:
    strict = tmp_path / "strict"
    shutil.copytree(tiny_model, strict)
    cfg_path = strict / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool turns are not supported') }}"
        "{% endif %}{% endfor %}" + cfg["chat_template"]
    )
    cfg_path.write_text(json.dumps(cfg))
    return strict


def test_full_queue_is_429_and_failed_jobs_are_answered_by_cause(
    start_worker, start_gateway, strict_model, queue_name, redis_server
):
    start_worker(model=strict_model, max_batch=1, window_ms=0)
    capped = start_gateway(max_queued=2)
    oai = openai.OpenAI(base_url=f"{capped.url}/v1", api_key="x", max_retries=0, timeout=60)
    client = Client(redis_server.url, queue=queue_name)
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]

    # Input the model cannot take is the request's fault: 400, which clients do not retry.
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=queue_name, messages=bad, max_tokens=4)
    assert e.value.status_code == 400 and "tool turns are not supported" in e.value.message
    assert e.value.code == "invalid_request_error"
    with pytest.raises(openai.APIError) as e:
        for _ in oai.chat.completions.create(
            model=queue_name, messages=bad, max_tokens=4, stream=True
        ):
            pass
    assert e.value.code == "invalid_request_error"
    assert "tool turns are not supported" in e.value.message

    # The worker decodes one job at a time and keeps one batch (one job) in reserve, so
    # while a long one runs, of four more at least two wait in the queue: at the cap of two.
    blocker = client.submit("runs a while", **LONG)
    next(iter(blocker.stream(timeout=60)))
    waiting = [client.submit("waits", max_tokens=2) for _ in range(4)]
    queued = Queue(queue_name, connection=client.redis)
    assert queued.count >= 2
    with pytest.raises(openai.RateLimitError) as e:
        oai.completions.create(model=queue_name, prompt="one too many", max_tokens=2)
    assert e.value.status_code == 429 and e.value.code == "queue_full"
    assert e.value.response.headers["retry-after"] == "1"
    assert blocker.status() == "started" and queued.count >= 2  # held throughout

    # A job canceled mid-stream by someone else ends the stream with an error event.
    for job in [*waiting, blocker]:
        job.cancel()
    stream = oai.completions.create(model=queue_name, prompt="long", stream=True, **LONG)
    first = next(iter(stream))
    client.job(_job_id(first.id)).cancel()
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert e.value.code == "job_canceled" and "canceled" in e.value.message


# -- clients that go away -----------------------------------------------------------------------


def test_a_prompt_over_the_context_is_400_and_not_retried(gw, queue, r):
    """The official client retries 5xx: one request over the model's context must make one
    job, answered 400 ``context_length_exceeded``, streamed or not."""
    retrying = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=2, timeout=60)
    failed = Queue(queue, connection=r).failed_job_registry
    before = failed.count
    long_prompt = "the quick brown fox jumps over the lazy dog " * 400  # ~2,000+ tokens
    with pytest.raises(openai.BadRequestError) as e:
        retrying.completions.create(model=queue, prompt=long_prompt, max_tokens=200)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "context" in e.value.message
    with pytest.raises(openai.APIError) as e:
        for _ in retrying.completions.create(
            model=queue, prompt=long_prompt, max_tokens=200, stream=True
        ):
            pass
    assert e.value.code == "context_length_exceeded"
    assert failed.count == before + 2, "one job per request: the 400 was not retried"

    # What the model can never take, whatever the prompt, is refused before it is queued:
    # the worker publishes its context and vocabulary with its counters.
    q = Queue(queue, connection=r)
    jobs_before = len(r.keys("rq:job:*"))
    with pytest.raises(openai.BadRequestError) as e:
        retrying.completions.create(model=queue, prompt="hi", max_tokens=4096)
    assert e.value.code == "context_length_exceeded" and "2048" in e.value.message
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        retrying.completions.create(model=queue, prompt="hi", max_tokens=2, logit_bias={"99999": 1})
    assert e.value.code == "invalid_request_error" and e.value.param == "logit_bias"
    assert "99999" in e.value.message and "vocabulary" in e.value.message
    assert len(r.keys("rq:job:*")) == jobs_before and q.count == 0, "nothing was queued"


def test_disconnect_mid_stream_cancels_the_job(oai, mlxq, queue):
    stream = oai.completions.create(model=queue, prompt="a long one", stream=True, **LONG)
    chunks = iter(stream)
    first = next(chunks)
    job_id = _job_id(first.id)
    assert mlxq.job(job_id).status() == "started"
    stream.close()  # drops the connection
    assert _wait_terminal(mlxq, job_id) == "canceled"
    res = list(mlxq.job(job_id).stream(timeout=10))
    assert res[-1].finish_reason == "canceled"
    assert sum(len(c.token_ids) for c in res) < LONG["max_tokens"]


def test_disconnect_before_a_non_streamed_answer_cancels_the_job(gw, mlxq, queue, r):
    body = json.dumps({"model": queue, "prompt": "a long one", **LONG}).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    deadline = time.monotonic() + 30
    while not (running := recent_jobs(r, queue=queue, status="started")):
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.02)
    sock.close()
    assert _wait_terminal(mlxq, running[0]["id"]) == "canceled"


def test_worker_lost_mid_stream_goes_on_when_the_rerun_repeats_the_text(
    start_worker, start_gateway, queue_name, redis_server
):
    """A seeded job runs again to the same text: the stream skips what it sent and goes
    on (a text that differs voids it: tests/test_resume.py)."""
    first = start_worker(window_ms=0)
    g = start_gateway()
    oai = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=60)
    stream = oai.completions.create(model=queue_name, prompt="long", stream=True, **LONG)
    chunks = iter(stream)
    head = next(chunks)
    job_id = _job_id(head.id)
    first.proc.kill()  # no goodbye: its job is requeued by the next worker
    first.proc.wait()
    start_worker(window_ms=0)
    text = "".join(c.choices[0].text for c in [head, *chunks] if c.choices)
    result = Client(redis_server.url, queue=queue_name).job(job_id).result(timeout=120)
    assert text == result.text
    # rq still lists the killed worker; its lapsed lease keeps it out of the models.
    deadline = time.monotonic() + 30
    while oai.models.retrieve(queue_name).workers != 1:
        assert time.monotonic() < deadline, "the killed worker still counts as live"
        time.sleep(0.1)


# -- load -----------------------------------------------------------------------------------------


def test_200_concurrent_streams_all_finish_with_nothing_lost(gw, mlxq, queue):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, str | None, int]:
        stream = await client.chat.completions.create(
            model=queue,
            messages=[{"role": "user", "content": f"Count to {i}"}],
            max_tokens=4,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, reason, used, cid = "", None, -1, ""
        async for c in stream:
            cid = c.id
            if c.choices:
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
            if c.usage:
                used = c.usage.completion_tokens
        return cid, text, reason, used

    async def run() -> list[tuple[str, str, str | None, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run())
    assert len({cid for cid, *_ in results}) == 200
    for cid, text, reason, used in results:
        job = mlxq.job(_job_id(cid)).result(timeout=10)
        assert text == job.text and reason == job.finish_reason
        assert used == job.usage["completion_tokens"] > 0


# -- one bad key in shared state: skipped with a warning, the rest answered ---------------------


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=60) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:500]


def _plant_bad_entries(r: Any, tag: str, queue: str) -> dict[str, Any]:
    """Every kind of bad entry in rq's queue and worker sets, registries and records (and
    an mlxq stats map) that a reader meets; names tagged, so they can be found and removed.
    """
    bad_queues = {s: f"bad-{s}-{tag}" for s in ("queued", *REGISTRIES)}
    for state, q in bad_queues.items():
        key = keys.queue_key(q) if state == "queued" else REGISTRIES[state](q)
        r.sadd(keys.RQ_QUEUES, keys.queue_key(q))
        if state == "queued":
            r.hset(key, "junk", "x")  # a hash, not a list
        else:
            r.set(key, "junk")  # a string, not a sorted set
    r.sadd(
        keys.RQ_QUEUES,
        f"garbage-{tag}",
        b"rq:queue:\xff\xfe" + tag.encode(),
        keys.queue_key("x" * 300 + tag),
    )
    w = {k: f"{k}-{tag}" for k in ("pid", "wrongtype", "nan", "inf", "shape", "gone", "born")}
    r.sadd(keys.RQ_WORKERS, *(keys.rq_worker_key(n) for n in w.values()))
    r.sadd(keys.RQ_WORKERS, f"junk-{tag}", b"rq:worker:\xff" + tag.encode())
    r.hset(keys.rq_worker_key(w["pid"]), mapping={"pid": "abc", "birth": "not a date"})
    r.hset(keys.rq_worker_key(w["pid"]), mapping={"state": "busy", "queues": queue})
    r.set(keys.rq_worker_key(w["wrongtype"]), "junk")
    stats = {
        "nan": {"model": "m", "tokens_generated": float("nan")},
        "inf": {"model": "m", "whatever": float("inf")},
        "shape": {"model": "m", "queues": 5, "levels": "chat"},
        "born": {"model": "m", "tokens_generated": 7, "blob": b"\x00"},
    }
    for k, st in stats.items():
        r.hset(keys.rq_worker_key(w[k]), mapping={"state": "idle", "queues": f"{queue},x"})
        r.hset(keys.worker_stats_key(w[k]), "stats", msgpack.packb(st, use_bin_type=True))
    r.hset(keys.rq_worker_key(w["born"]), "birth", "1999-12-31T23:59:59.000000Z")
    return {"queues": bad_queues, "workers": w}


def _remove_planted(r: Any, tag: str) -> None:
    for set_key in (keys.RQ_QUEUES, keys.RQ_WORKERS):
        if r.type(set_key) == b"set":
            r.srem(set_key, *[m for m in r.smembers(set_key) if tag.encode() in m] or [b"-"])
    for key in r.scan_iter(match=f"*{tag}*", count=1000):
        r.delete(key)


def _info_json(url: str) -> tuple[dict[str, Any], str]:
    out = mlxq_cli("info", "--json", url=url)
    assert out.returncode == 0, out.stderr
    table = mlxq_cli("info", url=url)
    assert table.returncode == 0, table.stderr
    return json.loads(out.stdout), out.stderr


def test_one_bad_entry_in_shared_state_is_skipped_and_the_rest_answered(
    gw, oai, worker, queue, r, redis_server
):
    tag, t0 = uuid.uuid4().hex[:8], time.monotonic()
    _, state = _get(f"{gw.url}/dashboard/api/state")
    last_sample = state["rates"][-1][0] if state["rates"] else 0.0
    try:
        planted = _plant_bad_entries(r, tag, queue)
        w = planted["workers"]
        with HealthWatch(gw.url, "bad entries in every shared set and record") as hw:
            assert queue in {m.id for m in oai.models.list()}
            assert oai.completions.create(model=queue, prompt="x", max_tokens=2).choices
            # The tok/s sampler lives on: two more rounds since the keys were planted.
            two_rounds = wait_for(
                lambda: (
                    (s := _get(f"{gw.url}/dashboard/api/state")[1])["rates"]
                    and len([t for t, _ in s["rates"] if t > last_sample]) >= 2
                    and s
                ),
                "two rounds of the tok/s sampler",
            )
        hw.check(live_workers=1)
        names = {x["name"] for x in two_rounds["workers"]}
        assert worker.name in names and w["pid"] in names and w["nan"] in names
        assert w["wrongtype"] not in names and w["gone"] not in names
        assert queue in two_rounds["queues"]
        assert not [q for q in two_rounds["queues"] if tag in q]
        (born,) = [x for x in two_rounds["workers"] if x["name"] == w["born"]]
        assert born["uptime_s"] > 20 * 365 * 86400 and born["tokens_generated"] == 0

        doc, warned = _info_json(redis_server.url)
        assert queue in doc["queues"] and not [q for q in doc["queues"] if tag in q]
        listed = {x["name"]: x for x in doc["workers"]}
        assert worker.name in listed and w["wrongtype"] not in listed
        assert listed[w["pid"]]["birth"] is None and listed[w["nan"]]["tokens_generated"] == 0
        assert listed[w["born"]]["birth"] == 946684799.0
        for what in (
            *(f"queue 'bad-{s}-{tag}'" for s in planted["queues"]),
            keys.rq_worker_key(w["wrongtype"]),
            "birth=b'not a date'",
            *(f"stats of worker {w[k]} " for k in ("nan", "inf", "shape", "born")),
            f"garbage-{tag}",
            f"junk-{tag}",
        ):
            assert what in warned, what
            assert what in gw.output(), what
        # Rate-limited: the gateway read these entries many times, and told each once (a
        # minute).
        told = gw.output().count(f"skipped queue 'bad-failed-{tag}'")
        assert 1 <= told <= 1 + (time.monotonic() - t0) // 60
    finally:
        _remove_planted(r, tag)


def test_rq_sets_of_another_type_leave_the_gateway_answering(gw, oai, queue, r, redis_server):
    tag = uuid.uuid4().hex[:8]
    aside = {k: f"{k}:aside-{tag}" for k in (keys.RQ_QUEUES, keys.RQ_WORKERS)}
    for key, kept in aside.items():
        r.rename(key, kept)
        r.set(key, "junk")
    try:
        with HealthWatch(gw.url, "rq:queues and rq:workers of another type") as hw:
            time.sleep(1.1)  # past the cached view
            assert _get(f"{gw.url}/v1/models") == (200, {"object": "list", "data": []})
            status, state = _get(f"{gw.url}/dashboard/api/state")
            assert status == 200 and state["workers"] == []
            _, warned = _info_json(redis_server.url)
        hw.check()
        for key in aside:
            assert f"skipped {key}: WRONGTYPE" in warned and f"skipped {key}" in gw.output()
    finally:
        for key, kept in aside.items():
            r.delete(key)
            r.rename(kept, key)
    wait_for(lambda: queue in {m.id for m in oai.models.list()}, "the queue to be served again")


def test_thousands_of_stale_queue_names_are_skipped(gw, oai, queue, r):
    tag = uuid.uuid4().hex[:8]
    stale = [keys.queue_key(f"stale-{tag}-{i}") for i in range(5000)]
    r.sadd(keys.RQ_QUEUES, *stale)
    try:
        with HealthWatch(gw.url, "5,000 stale queue names") as hw:
            time.sleep(1.1)  # past the cached view
            t0 = time.perf_counter()
            assert queue in {m.id for m in oai.models.list()}
            models_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert queue in collect(r)["queues"]  # what the gateway reads every 2 s
            read_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            status, state = _get(f"{gw.url}/dashboard/api/state")
            state_s = time.perf_counter() - t0
        hw.check(live_workers=1)
        assert status == 200 and not [q for q in state["queues"] if tag in q]
        print(
            f"\n5,000 stale queues: the gateway's read {read_s:.3f} s, /v1/models "
            f"{models_s:.3f} s, dashboard state {state_s:.3f} s"
        )
    finally:
        r.srem(keys.RQ_QUEUES, *stale)


# -- the examples in ops/examples ---------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "ops" / "examples"


@contextlib.contextmanager
def _example(module: str, log: Path, **env: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(EXAMPLES),
            f"{module}:app",
            "--port",
            str(port),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **env),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(f"{url}/", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _sse_events(url: str, data: bytes | None = None) -> list[tuple[str, dict[str, Any]]]:
    with urllib.request.urlopen(url, data=data, timeout=60) as res:
        body = res.read().decode()
    out = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event", "message"), json.loads(fields["data"])))
    return out


def test_example_backend_relays_a_job_to_the_browser(redis_server, worker, queue, mlxq, tmp_path):
    with _example(
        "web_backend", tmp_path / "ex.log", MLXQ_REDIS_URL=redis_server.url, MLXQ_QUEUE=queue
    ) as url:
        req = urllib.request.Request(
            f"{url}/jobs",
            method="POST",
            data=json.dumps({"prompt": "hi", "max_tokens": 12}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as res:
            job_id = json.loads(res.read())["job_id"]
        events = _sse_events(f"{url}/jobs/{job_id}/stream")
        again = _sse_events(f"{url}/jobs/{job_id}/stream")  # replayed after the end
    result = mlxq.job(job_id).result(timeout=10)
    assert "".join(d["text"] for e, d in events if e == "text") == result.text
    assert events[-1] == ("end", {"finish_reason": result.finish_reason, "usage": result.usage})
    assert again == events


def test_example_openai_backend_relays_through_the_gateway(gw, queue, tmp_path):
    with _example(
        "web_backend_openai", tmp_path / "ex.log", MLXQ_GATEWAY_URL=f"{gw.url}/v1", MLXQ_QUEUE=queue
    ) as url:
        events = _sse_events(f"{url}/ask?prompt=hello&max_tokens=12")
    assert [e for e, _ in events if e != "text"] == ["end"]
    assert events[-1][1]["finish_reason"] in ("stop", "length")
    assert "".join(d["text"] for e, d in events if e == "text")


# -- health and metrics ---------------------------------------------------------------------------


def test_health_and_metrics(gw, oai, queue):
    with urllib.request.urlopen(f"{gw.url}/health", timeout=30) as res:
        health = json.loads(res.read())
    assert health["status"] == "ok" and health["redis"] == "ok" and health["live_workers"] >= 1
    oai.completions.create(model=queue, prompt="m", max_tokens=2)
    list(oai.completions.create(model=queue, prompt="m", max_tokens=2, stream=True))
    with urllib.request.urlopen(f"{gw.url}/metrics", timeout=30) as res:
        text = res.read().decode()
    assert 'mlxq_gateway_requests_total{method="POST",route="/v1/completions",status="200"}' in text
    for name in (
        "mlxq_gateway_request_duration_seconds_bucket",
        "mlxq_gateway_time_to_first_token_seconds_count",
        "mlxq_gateway_e2e_request_latency_seconds_count",
        "mlxq_gateway_generation_tokens_total",
        "mlxq_gateway_streams_open",
    ):
        assert name in text


def test_health_is_503_without_redis(tmp_path):
    dead = RedisServer(tmp_path)
    g = GatewayProcess(dead.url, tmp_path / "g.log")
    try:
        g.wait_ready()
        dead.stop()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{g.url}/health", timeout=30)
        assert e.value.code == 503
    finally:
        g.stop()
        dead.stop()


def test_serve_refuses_a_bad_cap():
    out = subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", "serve", "--max-queued", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "max_queued=0" in out.stderr
