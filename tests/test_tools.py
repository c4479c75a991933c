"""Tool calls without a server: request checks, the call schema, and calls read from the
formats models write them in (texts as Qwen 3 / Hermes and Llama 3.x write them), whole
and streamed in any pieces."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.producer import Chunk, PayloadError, Result
from mlxq.producer.errors import InvalidRequest
from mlxq.producer.openai_api import CHAT, ChunkFormatter, completion_body, parse_request
from mlxq.producer.openai_api.tool_calls import auto_needs_format
from mlxq.producer.params import GenerationRequest
from mlxq.producer.tool_parsers import CallSplitter, calls_of, split
from mlxq.producer.tools import (
    FORCED,
    HERMES,
    LLAMA3_JSON,
    ArgsPart,
    CallHead,
    ToolCall,
    call_grammar,
    call_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
CHAT_MSG = [{"role": "user", "content": "Weather in Paris?"}]

# What Qwen 3 writes (its chat template's own format), thinking and text around calls.
QWEN_TEXT = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)
# What Llama 3.1 / 3.2 write for a JSON-format call (the <|python_tag|> is a special
# token the worker's text leaves out, but a text may carry it).
LLAMA_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}',
]


def test_hermes_calls_and_text_are_split():
    content, calls = split(QWEN_TEXT, HERMES)
    assert content == "I'll check both."
    assert calls == [
        ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'),
        ToolCall("get_time", "{}"),
    ]


def test_hermes_text_without_calls_is_content():
    assert split("Just text, no <tool_ here.", HERMES) == ("Just text, no <tool_ here.", [])
    # A call whose JSON is broken is the model's text, told as it wrote it.
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert split(broken, HERMES) == (broken, [])
    # A call the answer ended inside (no closing tag) is read when whole.
    assert split('<tool_call>{"name": "get_time", "arguments": {}}', HERMES)[1] == [
        ToolCall("get_time", "{}")
    ]


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_llama3_json_calls(text):
    content, calls = split(text, LLAMA3_JSON)
    assert content is None and calls[0] == ToolCall("get_weather", '{"city": "Paris"}')
    assert len(calls) == text.count('"name"')


def test_llama3_text_is_content():
    assert split("The weather is {unknown}.", LLAMA3_JSON) == ("The weather is {unknown}.", [])
    assert split('{"not": "a call"}', LLAMA3_JSON) == ('{"not": "a call"}', [])


# What a forced answer looks like (call_grammar's layout), braces and quotes in strings.
FORCED_TEXT = (
    '[{"name":"get_weather","arguments":{"city":"P{a]r\\"is","unit":"c"}},'
    '{"name":"get_time","arguments":{"at":{"tz":[1,{"x":"}"}]}}}]'
)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(
        [(QWEN_TEXT, HERMES), (FORCED_TEXT, FORCED), *((t, LLAMA3_JSON) for t in LLAMA_TEXTS)]
    ),
    st.lists(st.integers(1, 400), max_size=12),
)
def test_streamed_pieces_read_as_the_whole(case, cuts):
    text, fmt = case
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    splitter = CallSplitter(fmt)
    out = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    content = "".join(p for p in out if isinstance(p, str)) or None
    assert (content, calls_of(out)) == split(text, fmt)
    # No markup is ever told as content.
    assert not any(isinstance(p, str) and ("<tool_call" in p or '"name"' in p) for p in out)


def _valid(schema: dict[str, Any], value: Any) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_call_schema_holds_calls_to_the_tools():
    named = call_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named is not None
    assert _valid(named, {"name": "get_weather", "arguments": {"city": "Paris"}})
    assert not _valid(named, {"name": "get_time", "arguments": {}})
    assert not _valid(named, {"name": "get_weather", "arguments": {}})  # city required
    required = call_schema(TOOLS, "required")
    assert required is not None
    assert _valid(required, [{"name": "get_time", "arguments": {}}])
    assert not _valid(required, [])
    one = call_schema(TOOLS, "required", parallel=False)
    assert one is not None and _valid(one, {"name": "get_time", "arguments": {"x": 1}})
    assert call_schema(TOOLS, "auto") is None and call_schema(TOOLS, "none") is None


def test_forced_answers_read_as_calls():
    content, calls = split(FORCED_TEXT, FORCED)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": 'P{a]r"is', "unit": "c"}
    assert json.loads(calls[1].arguments) == {"at": {"tz": [1, {"x": "}"}]}}
    assert split('{"name":"get_time","arguments":{}}', FORCED) == (
        None,
        [ToolCall("get_time", "{}")],
    )
    # Cut short by max_tokens: the calls begun, the last one's arguments as written (as
    # OpenAI answers then); before any call's name, the text.
    assert split('[{"name":"get_weather","arguments":{"ci', FORCED) == (
        None,
        [ToolCall("get_weather", '{"ci')],
    )
    assert split('[{"name":"get_', FORCED) == ('[{"name":"get_', [])
    # A head is told as soon as the name is whole.
    splitter = CallSplitter(FORCED)
    assert splitter.feed('[{"name":"get_time"') == []
    assert splitter.feed(',"arguments":{') == [CallHead("get_time"), ArgsPart("{")]
    # Not the forced shape at all (a worker that did not hold the answer to it): text.
    assert split("noise {", FORCED) == ("noise {", [])


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_the_call_grammar_compiles_and_holds_the_schema_shape(choice, parallel):
    from llguidance import LLMatcher, grammar_from

    grammar = call_grammar(TOOLS, choice, parallel)
    assert grammar is not None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar_from("grammar", grammar))
    assert not failed, messages
    # The name comes first, so a model picks the function before its arguments.
    assert '"{\\"name\\":\\"get_weather\\",\\"arguments\\":"' in grammar
    assert grammar.startswith('start: "["') == (choice == "required" and parallel)


# -- the request ---------------------------------------------------------------------


def _request(**kw: Any) -> GenerationRequest:
    return GenerationRequest.from_arguments({"messages": CHAT_MSG, **kw})


def test_a_forced_choice_is_a_json_schema_constraint_that_round_trips():
    req = _request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert req.constraint is not None and req.constraint.kind == "grammar"
    assert req.constraint.value == call_grammar(TOOLS, "required", parallel=False)
    assert GenerationRequest.from_payload(req.to_payload()) == req
    auto = _request(tools=TOOLS)
    assert auto.constraint is None and "tool_choice" not in auto.to_payload()
    assert GenerationRequest.from_payload(auto.to_payload()) == auto


TOOL_TURNS = [
    *CHAT_MSG,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_a_tool_conversation_is_a_chat():
    req = GenerationRequest.from_arguments({"messages": TOOL_TURNS, "tools": TOOLS})
    assert req.messages is not None and req.messages[1]["content"] == ""
    assert req.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert GenerationRequest.from_payload(req.to_payload()) == req


def _call(**fn: Any) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", **fn}}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tools": []}, "tools="),
        ({"tools": [{"type": "function"}]}, "tools[0]="),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type="),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name="),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name="),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters=",
        ),
        ({"tool_choice": "auto"}, "tool_choice="),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice="),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name=",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "tool_choice="),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls="),
        (
            {"messages": [{"role": "user", "content": "", "tool_calls": [_call()]}]},
            "messages[0].tool_calls=",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [_call(x=1)]}]},
            "messages[0].tool_calls[0].function=",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": ["x"]}]},
            "messages[0].tool_calls[0]=",
        ),
        (
            {"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]},
            "messages[0].tool_call_id=",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content="),
    ],
)
def test_bad_tool_shapes_name_the_field(kw, field):
    with pytest.raises(PayloadError) as e:
        _request(**kw)
    assert str(e.value).startswith(field), str(e.value)


# -- OpenAI shapes -------------------------------------------------------------------


def test_openai_body_maps_tools():
    req = parse_request(
        {"model": "q", "messages": TOOL_TURNS, "tools": TOOLS, "tool_choice": "required"}, CHAT
    )
    assert req.tool_calls == FORCED and req.submit["tools"] == TOOLS
    assert req.submit["messages"][1]["tool_calls"] == TOOL_TURNS[1]["tool_calls"]
    assert (
        parse_request({"model": "q", "messages": CHAT_MSG, "tools": TOOLS}, CHAT).tool_calls
        == "auto"
    )
    none = parse_request(
        {"model": "q", "messages": CHAT_MSG, "tools": TOOLS, "tool_choice": "none"}, CHAT
    )
    assert none.tool_calls is None and none.submit["tool_choice"] == "none"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_openai_tool_fields_name_the_param(extra, param):
    with pytest.raises(InvalidRequest) as e:
        parse_request({"model": "q", "messages": CHAT_MSG, **extra}, CHAT)
    assert e.value.param == param, str(e.value)


def test_auto_without_a_known_format_says_what_works():
    why = auto_needs_format("")
    assert why is not None and "required" in why and "named function" in why
    assert auto_needs_format(HERMES) is None and auto_needs_format(LLAMA3_JSON) is None


def test_answers_with_calls_in_openai_shape():
    req = parse_request({"model": "q", "messages": CHAT_MSG, "tools": TOOLS}, CHAT)
    result = Result(QWEN_TEXT, [1, 2], "stop", {"prompt_tokens": 3, "completion_tokens": 2})
    choice = completion_body(req, "j", result, 0, tool_format=HERMES)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "I'll check both."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris",
        "unit": "c",
    }
    # Plain text under auto stays content, finishing as it did.
    plain = Result("Sunny.", [1], "stop", {})
    choice = completion_body(req, "j", plain, 0, tool_format=HERMES)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Sunny."}
    assert choice["finish_reason"] == "stop"


def test_streamed_calls_in_openai_delta_shape():
    req = parse_request({"model": "q", "messages": CHAT_MSG, "tools": TOOLS, "stream": True}, CHAT)
    fmt = ChunkFormatter(req, "j", 0, tool_format=HERMES)
    pieces = [QWEN_TEXT[i : i + 7] for i in range(0, len(QWEN_TEXT), 7)]
    chunks = [Chunk(seq=i + 1, text=t) for i, t in enumerate(pieces)]
    chunks.append(Chunk(seq=len(chunks) + 1, finish_reason="stop"))
    choices = [obj["choices"][0] for c in chunks for obj in fmt.chunk(c)]
    content = "".join(ch["delta"].get("content", "") for ch in choices)
    assert content == "I'll check both."
    calls: dict[int, dict[str, Any]] = {}
    for ch in choices:
        for d in ch["delta"].get("tool_calls", ()):
            if "id" in d:
                assert d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["tool_calls"]
    assert choices[-1]["finish_reason"] == "tool_calls" and choices[-1]["delta"] == {}


def test_a_payload_read_back_is_checked_the_same():
    # What the worker reads from Redis goes through the same checks: a rogue write of
    # tools, or of a constraint other than the forced call's, fails that job by name.
    good = _request(tools=TOOLS, tool_choice="required").to_payload()
    with pytest.raises(PayloadError, match=r"^tools\[0\]\.type="):
        GenerationRequest.from_payload({**good, "tools": [{**WEATHER, "type": "code"}]})
    other = _request(regex="a+").to_payload()["constraint"]
    with pytest.raises(PayloadError, match=r"^tool_choice='required': holds the answer"):
        GenerationRequest.from_payload({**good, "constraint": other})
    # Without its constraint, the forced call's is derived again.
    bare = {k: v for k, v in good.items() if k != "constraint"}
    assert GenerationRequest.from_payload(bare) == GenerationRequest.from_payload(good)
    with pytest.raises(PayloadError, match=r"^tools="):
        GenerationRequest.from_arguments({"prompt": "hi", "tools": TOOLS})


def test_the_worker_names_the_format_its_tokenizer_speaks():
    from types import SimpleNamespace

    import mlx_lm.tool_parsers.json_tools as json_tools
    import mlx_lm.tool_parsers.mistral as mistral

    from mlxq.worker.chat import tool_format

    # Where mlx-lm's tokenizer wrapper knows the template, its parser names the format.
    assert tool_format(SimpleNamespace(tool_parser=json_tools.parse_tool_call)) == HERMES
    # Llama 3.x templates ask for {"name", "parameters"} JSON, after <|python_tag|>.
    llama = 'Respond in the format {"name": function name, "parameters": ...}<|python_tag|>'
    assert tool_format(SimpleNamespace(tool_parser=None, chat_template=llama)) == LLAMA3_JSON
    # A format mlxq does not read, or none: "" (auto is refused).
    assert tool_format(SimpleNamespace(tool_parser=mistral.parse_tool_call)) == ""
    assert tool_format(SimpleNamespace(tool_parser=None, chat_template="{{ messages }}")) == ""
