"""Structured outputs end to end: the producer API, ``mlxq submit``, ``mlxq run-batch`` and
the official openai client against ``mlxq serve``, on a real worker and the tiny random
model (whose free text is noise: each answer holds its shape only by its constraint)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from typing import Any

import jsonschema
import openai
import pytest
from rq import Queue

from mlxq.producer import AsyncClient, Client
from mlxq.producer.codec import MsgpackSerializer
from mlxq.producer.errors import JobFailed
from mlxq.producer.info import collect

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "year", "rain"],
    "additionalProperties": False,
}
CHOICES = ["A", "B", "C", "D"]
REGEX = r"[0-9]{2}:[0-9]{2} (am|pm)"


def _valid(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)  # raises if not
    return True


def _mlxq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _worker_stats(client: Client, name: str, counter: str, least: int) -> dict[str, Any]:
    """Worker ``name``'s stats once ``counter`` reached ``least`` (stats follow within a
    second; other tests' workers may still be listed on the session's Redis)."""
    deadline = time.monotonic() + 30
    while True:
        (w,) = [w for w in collect(client.redis)["workers"] if w["name"] == name]
        if w.get(counter, 0) >= least or time.monotonic() > deadline:
            return w
        time.sleep(0.1)


def test_the_producer_api_and_the_cli(redis_server, queue_name, start_worker, tmp_path):
    worker = start_worker(max_batch=16)
    client = Client(redis_server.url, queue=queue_name)
    jobs = [client.submit(f"Weather {i}:", json_schema=SCHEMA, max_tokens=80) for i in range(6)]
    jobs += [
        client.submit("Sampled:", json_schema=SCHEMA, max_tokens=80, temperature=1.0, n=3),
        client.submit(
            "Any object:",
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
            max_tokens=80,
        ),
    ]
    choice = client.submit("Answer:", choice=CHOICES, max_tokens=5, temperature=1.0, n=4)
    regex = client.submit("Time:", regex=REGEX, max_tokens=20, temperature=0.7, stop=["zz"])
    free = client.submit("Free text", max_tokens=12)
    for job in jobs:
        for c in job.result(timeout=120).choices:
            _valid(c.text)
            assert c.finish_reason == "stop"
    assert all(c.text in CHOICES for c in choice.result(timeout=60).choices)
    streamed = "".join(c.text for c in client.job(regex.id).stream(timeout=60))
    assert re.fullmatch(REGEX, streamed) and streamed == regex.result(timeout=60).text
    assert free.result(timeout=60).finish_reason == "length"

    async def via_async() -> str:
        async with AsyncClient(redis_server.url, queue=queue_name) as ac:
            job = await ac.submit("Async:", grammar='start: "x" ("y" | "z")+', max_tokens=6)
            return (await job.result(timeout=60)).text

    assert re.fullmatch("x[yz]+", asyncio.run(via_async()))

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for flags, check in (
        (["--json-schema", f"@{schema_file}"], _valid),
        (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
        (["--regex", REGEX], lambda t: re.fullmatch(REGEX, t)),
        (
            [
                "--response-format",
                json.dumps({"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
            ],
            _valid,
        ),
    ):
        done = _mlxq(
            "submit",
            "Go:",
            "--queue",
            queue_name,
            "--redis-url",
            redis_server.url,
            "--max-tokens",
            "200",
            *flags,
        )
        assert done.returncode == 0, done.stderr
        assert check(client.job(done.stdout.strip()).result(timeout=60).text)
    refused = _mlxq(
        "submit", "Go:", "--queue", queue_name, "--redis-url", redis_server.url, "--regex", "[a-"
    )
    assert refused.returncode != 0 and "regex=" in refused.stderr
    assert "Traceback" not in refused.stderr

    w = _worker_stats(client, worker.name, "constrained_rows", 10 + 4 + 1 + 1 + 4)
    assert w["constraint_compiles"] == 5  # SCHEMA, CHOICES, REGEX, the grammar, yes/no: once
    assert w["vectorized_steps"] == w["decode_steps"] > 0
    assert w["mask_ms"] > 0
    info = json.loads(_mlxq("info", "--json", "--redis-url", redis_server.url).stdout)
    (mine,) = [x for x in info["workers"] if x["name"] == worker.name]
    assert mine["constrained_rows"] >= 19


def test_a_bad_constraint_written_to_redis_fails_only_its_job(
    redis_server, queue_name, start_worker, r
):
    mq = Queue(queue_name, connection=r, serializer=MsgpackSerializer)
    base = {"v": 1, "prompt": "x", "max_tokens": 8}
    unparsed = mq.enqueue(
        "mlxq.worker.generate", {**base, "constraint": {"kind": "regex", "value": "(("}}
    )
    # Compiles without a tokenizer; names a token past the tiny model's vocabulary.
    uncompiled = mq.enqueue(
        "mlxq.worker.generate",
        {**base, "constraint": {"kind": "grammar", "value": "start: <[5000]>"}},
    )
    start_worker()
    client = Client(redis_server.url, queue=queue_name)
    good = client.submit("fine", choice=["ok"], max_tokens=4)
    for rj, why in ((unparsed, "constraint="), (uncompiled, "does not compile for this model")):
        with pytest.raises(JobFailed) as e:
            client.job(rj.id).result(timeout=60)
        assert why in e.value.reason
    assert good.result(timeout=60).text == "ok"


def _line(cid: str, body: dict[str, Any]) -> str:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def test_run_batch(redis_server, queue_name, start_worker, tmp_path):
    start_worker(max_batch=16)
    msgs = [{"role": "user", "content": "Go"}]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    lines = [
        _line(f"s{i}", {"model": queue_name, "messages": msgs, "response_format": rf})
        for i in range(6)
    ]
    lines += [
        _line(
            f"c{i}",
            {"model": queue_name, "messages": msgs, "structured_outputs": {"choice": CHOICES}},
        )
        for i in range(6)
    ]
    lines += [
        _line("r", {"model": queue_name, "messages": msgs, "structured_outputs": {"regex": REGEX}})
    ]
    lines += [
        _line(
            "bad", {"model": queue_name, "messages": msgs, "structured_outputs": {"regex": "[a-"}}
        )
    ]
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    done = _mlxq(
        "run-batch",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--errors",
        str(err),
        "--redis-url",
        redis_server.url,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr
    got = {}
    for path in (out, err):
        for rec in map(json.loads, path.read_text().splitlines()):
            got[rec["custom_id"]] = rec
    for cid, rec in got.items():
        if cid == "bad":
            assert "structured_outputs.regex" in json.dumps(rec["error"] or rec["response"])
            continue
        text = rec["response"]["body"]["choices"][0]["message"]["content"]
        if cid.startswith("s"):
            _valid(text)
        elif cid.startswith("c"):
            assert text in CHOICES
        else:
            assert re.fullmatch(REGEX, text)
    assert len(got) == len(lines)


def test_the_openai_client_against_serve(redis_server, queue_name, start_worker, start_gateway):
    start_worker(max_batch=16)
    gw = start_gateway()
    oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Weather?"}]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    res = oai.chat.completions.create(
        model=queue_name, messages=msgs, response_format=rf, n=2, temperature=1.0
    )
    for c in res.choices:
        _valid(c.message.content)
        assert c.finish_reason == "stop"
    streamed = oai.chat.completions.create(
        model=queue_name, messages=msgs, response_format=rf, stream=True
    )
    _valid("".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices))
    obj = oai.chat.completions.create(
        model=queue_name, messages=msgs, response_format={"type": "json_object"}, max_tokens=300
    )
    assert obj.choices[0].finish_reason == "length" or isinstance(
        json.loads(obj.choices[0].message.content), dict
    )
    choice = oai.chat.completions.create(
        model=queue_name, messages=msgs, extra_body={"structured_outputs": {"choice": CHOICES}}
    )
    assert choice.choices[0].message.content in CHOICES
    comp = oai.completions.create(
        model=queue_name,
        prompt="At",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert re.fullmatch(REGEX, comp.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=queue_name,
            messages=msgs,
            extra_body={"structured_outputs": {"grammar": "start: nope"}},
        )
    assert e.value.param == "structured_outputs.grammar"
    bad_rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=queue_name, messages=msgs, response_format=bad_rf)
    assert e.value.param == "response_format.json_schema.schema"
