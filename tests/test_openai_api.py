"""The OpenAI request mapping and response shapes, checked without a server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from mlxq.producer import Chunk, Result
from mlxq.producer.errors import InvalidRequest
from mlxq.producer.openai_api import (
    CHAT,
    COMPLETIONS,
    SSE_DONE,
    ChunkFormatter,
    OpenAIRequest,
    completion_body,
    logprobs_body,
    parse_request,
    sse,
    submit_supports,
)

MSG = [{"role": "user", "content": "hi"}]


def test_gateway_imports_no_mlx():
    code = (
        "import sys, mlxq.producer.gateway.app, mlxq.producer.openai_api, mlxq.producer.listing; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_without_fastapi_says_what_to_install():
    code = (
        "import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
        "from mlxq.producer.cli import main; sys.exit(main(['serve']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pip install 'mlxq[serve]'" in out.stderr


def test_chat_body_maps_onto_submit():
    req = parse_request(
        {
            "model": "q",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "min_p": 0.1,
            "stop": "END",
            "seed": 3,
            "user": "u1",
            "metadata": {"run": "r7"},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        CHAT,
    )
    assert req.model == "q" and req.chat and req.stream and req.include_usage
    assert req.submit == {
        "messages": [{"role": "user", "content": "a\nb"}],
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.1,
        "stop": "END",
        "seed": 3,
        "metadata": {"run": "r7", "user": "u1"},
    }
    assert all(submit_supports(p) for p in req.submit)


def test_openai_defaults_and_nulls():
    comp = parse_request({"model": "q", "prompt": ["one"], "temperature": None}, COMPLETIONS)
    assert comp.submit["prompt"] == "one" and comp.submit["max_tokens"] == 16
    assert comp.submit["temperature"] == 1.0 and comp.submit["stop"] == ()
    chat = parse_request({"model": "q", "messages": MSG}, CHAT)
    assert chat.submit["max_tokens"] == 256 and not chat.stream and chat.n == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG}, "model"),
        ({"model": "", "messages": MSG}, "model"),
        ({"model": "q"}, "messages"),
        ({"model": "q", "messages": "hi"}, "messages"),
        ({"model": "q", "messages": [{"content": "x"}]}, "messages[0]"),
        (
            {"model": "q", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        ({"model": "q", "messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": "q", "messages": MSG, "temperature": "warm"}, "temperature"),
        ({"model": "q", "messages": MSG, "stream": "yes"}, "stream"),
        ({"model": "q", "messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "q", "messages": MSG, "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
        ({"model": "q", "messages": MSG, "logit_bias": {"1": 500}}, "logit_bias[1]"),
        ({"model": "q", "messages": MSG, "user": 5}, "user"),
        ({"model": "q", "messages": MSG, "stream": True, "stream_options": 1}, "stream_options"),
        ({"model": "q", "messages": MSG, "stop": {"a": 1}}, "stop"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, CHAT)
    assert e.value.param == param and str(e.value).startswith(param)


def test_neutral_generation_fields_are_dropped_and_others_reach_submit():
    neutral = {
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
        "logprobs": False,
    }
    assert parse_request({"model": "q", "messages": MSG, **neutral}, CHAT).submit.keys() == {
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "metadata",
    }
    for field, value in [
        ("n", 2),
        ("logprobs", True),
        ("presence_penalty", 1.0),
        ("repetition_penalty", 1.2),
        ("logit_bias", {"5": 3}),
    ]:
        body = {"model": "q", "messages": MSG, field: value}
        assert field in parse_request(body, CHAT).submit


def test_unknown_fields_warn_once_per_name(caplog):
    with caplog.at_level(logging.WARNING, logger="mlxq.openai"):
        for _ in range(3):
            parse_request({"model": "q", "prompt": "x", "best_of_unit": 2}, COMPLETIONS)
    assert sum("best_of_unit" in r.getMessage() for r in caplog.records) == 1


def test_completion_bodies():
    res = Result("hello", [1, 2], "length", {"prompt_tokens": 3, "completion_tokens": 2})
    chat = completion_body(parse_request({"model": "q", "messages": MSG}, CHAT), "j1", res, 9)
    assert chat == {
        "id": "chatcmpl-j1",
        "object": "chat.completion",
        "created": 9,
        "model": "q",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    comp = completion_body(parse_request({"model": "q", "prompt": "x"}, COMPLETIONS), "j2", res, 9)
    assert comp["object"] == "text_completion" and comp["id"] == "cmpl-j2"
    assert comp["choices"] == [
        {"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}
    ]


def test_chunks_and_sse_framing():
    req = parse_request(
        {"model": "q", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}},
        CHAT,
    )
    fmt = ChunkFormatter(req, "j", 5)
    head = fmt.head()
    assert head[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert head[0]["usage"] is None and head[0]["object"] == "chat.completion.chunk"
    assert fmt.chunk(Chunk(seq=1, token_ids=[4])) == []  # no text yet: nothing to send
    (mid,) = fmt.chunk(Chunk(seq=2, text="he", token_ids=[5]))
    assert mid["choices"] == [
        {"index": 0, "delta": {"content": "he"}, "logprobs": None, "finish_reason": None}
    ]
    (end,) = fmt.chunk(Chunk(seq=3, finish_reason="stop"))
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    (usage,) = fmt.usage({"prompt_tokens": 2, "completion_tokens": 2})
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 4
    framed = sse(mid)
    assert framed.startswith("data: ") and framed.endswith("\n\n")
    assert json.loads(framed[6:]) == mid and SSE_DONE == "data: [DONE]\n\n"
    comp = ChunkFormatter(
        parse_request({"model": "q", "prompt": "x", "stream": True}, COMPLETIONS), "j", 5
    )
    assert comp.head() == [] and comp.usage(None) == []
    (c,) = comp.chunk(Chunk(seq=1, text="t"))
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t"
    assert "usage" not in c


ENTRIES = [
    {
        "token": "He",
        "logprob": -0.5,
        "top_logprobs": [{"token": "He", "logprob": -0.5}, {"token": "A", "logprob": -1.5}],
    },
    {
        "token": "llo",
        "logprob": -0.1,
        "bytes": [108, 108, 111],
        "top_logprobs": [{"token": "llo", "logprob": -0.1}, {"token": "y", "logprob": -3.0}],
    },
]


def test_logprobs_in_both_shapes():
    chat = OpenAIRequest(CHAT, "q", logprobs=True, top_logprobs=2)
    out = logprobs_body(chat, ENTRIES)
    assert out is not None and out["content"][0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "A", "logprob": -1.5, "bytes": [65]},
        ],
    }
    comp = OpenAIRequest(COMPLETIONS, "q", logprobs=True, top_logprobs=2)
    assert logprobs_body(comp, ENTRIES, offset=10) == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -0.1],
        "top_logprobs": [{"He": -0.5, "A": -1.5}, {"llo": -0.1, "y": -3.0}],
        "text_offset": [10, 12],
    }
    assert logprobs_body(OpenAIRequest(CHAT, "q"), ENTRIES) is None  # not asked for
