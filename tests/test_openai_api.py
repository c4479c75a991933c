"""The OpenAI request mapping and response shapes, checked without a server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from mlxq.producer import Chunk, Result
from mlxq.producer.errors import InvalidRequest
from mlxq.producer.gateway.config import GatewayConfig, parse_service_tiers
from mlxq.producer.openai_api import (
    CHAT,
    COMPLETIONS,
    SERVICE_TIERS,
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
        ({"model": "q", "messages": MSG, "service_tier": "turbo"}, "service_tier"),
        ({"model": "q", "messages": MSG, "service_tier": ["priority"]}, "service_tier"),
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


# -- service tiers ---------------------------------------------------------------------------


def test_service_tier_is_checked_and_kept_off_the_job():
    # The Literal of the official client's ChatCompletion.service_tier, value for value.
    from typing import get_args

    from openai.types.chat import ChatCompletion

    literal = get_args(ChatCompletion.model_fields["service_tier"].annotation)[0]
    assert set(get_args(literal)) == set(SERVICE_TIERS)
    for tier in SERVICE_TIERS:
        req = parse_request({"model": "q", "prompt": "x", "service_tier": tier}, COMPLETIONS)
        assert req.service_tier == ("priority" if tier == "fast" else tier)
        assert "service_tier" not in req.submit
    assert parse_request({"model": "q", "messages": MSG}, CHAT).service_tier is None
    assert (
        parse_request({"model": "q", "messages": MSG, "service_tier": None}, CHAT).service_tier
        is None
    )
    with pytest.raises(InvalidRequest) as e:
        parse_request({"model": "q", "prompt": "x", "service_tier": "Priority"}, COMPLETIONS)
    assert e.value.param == "service_tier" and "'Priority'" in str(e.value)


def test_service_tier_options_and_routes():
    tiers = parse_service_tiers(["priority=chat", " flex = sweeps "])
    assert tiers == {"priority": "chat", "flex": "sweeps"}
    cfg = GatewayConfig(service_tiers=tiers)
    assert cfg.route("m", "priority") == ("chat", "priority")
    assert cfg.route("m", "flex") == ("sweeps", "flex")
    for unrouted in (None, "auto", "default", "scale"):
        assert cfg.route("m", unrouted) == ("m", "default")
    assert GatewayConfig().route("m", "priority") == ("m", "default")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["turbo=chat"], "unknown tier 'turbo'"),
        (["priority="], "the queue must be a name"),
        (["priority"], "must be TIER=QUEUE"),
        (["=chat"], "unknown tier ''"),
        (["auto=chat"], "always runs on the queue the request's model names"),
        (["default=chat"], "always runs on the queue the request's model names"),
        (["fast=chat"], "map priority"),
        (["priority=" + "q" * 129], "1 to 128 characters"),
        (["priority=a", "flex=b", "priority=c"], "given twice (first as priority=a)"),
    ],
)
def test_bad_service_tier_options_name_the_value(options, says):
    with pytest.raises(ValueError) as e:
        parse_service_tiers(options)
    assert str(e.value).startswith(f"--service-tier {options[-1]!r}: ") and says in str(e.value)


def test_gateway_config_checks_its_tiers():
    for tiers in ({"turbo": "q"}, {"priority": ""}, {"default": "q"}, ["priority=q"]):
        with pytest.raises(ValueError, match="service_tiers"):
            GatewayConfig(service_tiers=tiers)  # type: ignore[arg-type]


def test_the_tier_served_at_is_echoed_when_given():
    res = Result("hi", [1], "stop", {"prompt_tokens": 1, "completion_tokens": 1})
    req = parse_request({"model": "q", "messages": MSG, "service_tier": "auto"}, CHAT)
    assert completion_body(req, "j", res, 9, "default")["service_tier"] == "default"
    assert "service_tier" not in completion_body(req, "j", res, 9)  # run-batch's answers
    streamed = parse_request(
        {"model": "q", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}},
        CHAT,
    )
    fmt = ChunkFormatter(streamed, "j", 5, "priority")
    chunks = [*fmt.head(), *fmt.chunk(Chunk(seq=1, text="h", finish_reason="stop"))]
    chunks += fmt.usage({"prompt_tokens": 1, "completion_tokens": 1})
    assert len(chunks) == 3 and all(c["service_tier"] == "priority" for c in chunks)
    (plain,) = ChunkFormatter(streamed, "j", 5).chunk(Chunk(seq=1, text="h"))
    assert "service_tier" not in plain


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
