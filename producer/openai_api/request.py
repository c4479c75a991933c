"""OpenAI completion request bodies -> checked :meth:`Client.submit` arguments.

Where OpenAI documents a default, it is used (``temperature`` 1, ``max_tokens`` 16 for
completions); chat's ``max_tokens`` defaults to mlxq's 256. ``max_completion_tokens`` wins
over ``max_tokens``; ``top_k=-1`` means "off", as in vLLM, whose ``stop_token_ids``,
``min_tokens`` and ``structured_outputs`` (or its older ``guided_*`` fields) are taken too
(the last, or OpenAI's ``response_format``, as one constraint:
:mod:`mlxq.producer.constraints`); ``user`` is kept
in the job's metadata. ``service_tier`` is checked and kept on the request for the front end
to route by (``mlxq serve --service-tier``); every other field maps onto a
:meth:`Client.submit` argument, and :func:`submit_supports` keeps that true by refusing, by
name, any field whose argument ``submit`` lacks. Unknown fields are ignored with a warning,
and a body past the bounds of :mod:`mlxq.producer.openai_api.bounds` is refused, naming where.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlxq.producer.client import build_request
from mlxq.producer.constraints import GUIDED, Constraint, from_body
from mlxq.producer.errors import InvalidRequest, PayloadError
from mlxq.producer.openai_api import inputs
from mlxq.producer.openai_api.bounds import cut, problem_in, unknown_fields
from mlxq.producer.openai_api.tool_calls import TOOL_FIELDS, mode, tool_fields
from mlxq.producer.params import MAX_TOKENS_CAP, SUBMIT_OPTIONS
from mlxq.producer.validate import integer_in, invalid, number_in

log = logging.getLogger("mlxq.openai")
T = TypeVar("T", int, float)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

DEFAULT_TEMPERATURE = 1.0
#: OpenAI's default for /v1/completions; chat has none, so mlxq's own applies.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_MODEL_CHARS = 128
#: Most ids in ``stop_token_ids``.
MAX_STOP_TOKEN_IDS = 64
#: OpenAI's ``service_tier`` values, as its client types them. ``fast`` is OpenAI's other
#: name for ``priority``: it is read as ``priority``, and answered as such, as OpenAI does.
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
#: The tier an answer names when the request ran on the queue ``model`` names (``auto``
#: resolves to it, as OpenAI's does for a project with no tier of its own).
DEFAULT_TIER = "default"

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_OTHER = ("model", "max_tokens", "max_completion_tokens", "n", "logprobs", "user", "metadata")
_ROUTING = ("service_tier",)
_VLLM = ("stop_token_ids", "min_tokens")
#: A constraint: OpenAI's field, vLLM's, and vLLM's older ones (one of them).
_FORMATS = frozenset(("response_format", "structured_outputs", *GUIDED))
_COMMON = _FORMATS | frozenset(
    (*_SAMPLING, *_PENALTIES, *_OTHER, *_VLLM, *_ROUTING, "stream", "stream_options")
)
_KNOWN = {
    CHAT: _COMMON | {"messages", "top_logprobs", *TOOL_FIELDS},
    COMPLETIONS: _COMMON | {"prompt"},
}
# "name=value: why", as mlxq's payload checks word their errors.
_PARAM_RE = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\]|\.\w+)*)=")


def submit_supports(name: str) -> bool:
    """Whether this version's :meth:`Client.submit` takes keyword ``name``."""
    return name in SUBMIT_OPTIONS


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One checked completion request.

    Attributes:
        endpoint: :data:`CHAT` or :data:`COMPLETIONS`.
        model: The queue that serves it.
        submit: Keyword arguments for :meth:`Client.submit` / :meth:`AsyncClient.submit`.
        stream: Answer with server-sent chunks.
        include_usage: Streamed: end with a chunk carrying ``usage``.
        n: Choices asked for.
        logprobs: Return each token's log-probability.
        top_logprobs: And this many alternatives per token.
        service_tier: The tier asked for (one of :data:`SERVICE_TIERS`, ``fast`` read as
            ``priority``); None when not given.
        tool_calls: How the answer holds tool calls
            (:func:`~mlxq.producer.openai_api.tool_calls.mode`): ``forced``, ``auto``
            (in the model's own format), or None.
    """

    endpoint: str
    model: str
    submit: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    service_tier: str | None = None
    tool_calls: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={self.endpoint!r}: must be one of {ENDPOINTS}")

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT


def _flag(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise invalid(name, v, "must be a boolean")
    return bool(v)


def _ranged(body: Mapping[str, Any], name: str, check: Callable[..., T], lo: T, hi: T) -> T | None:
    """The body's field ``name`` through ``check`` (an ``integer_in`` or ``number_in``
    answering in OpenAI's shape); None when absent."""
    v = body.get(name)
    return None if v is None else check(name, v, lo, hi, error=invalid)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping):
        raise invalid("logit_bias", value, "must be an object of token id -> bias")
    out = {}
    for k, b in value.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise invalid("logit_bias", k, "keys must be token ids (integers)") from None
        if tid < 0 or isinstance(b, bool) or not isinstance(b, (int, float)) or abs(b) > 100:
            raise invalid(f"logit_bias[{k}]", b, "must be a number in [-100, 100] for id >= 0")
        out[tid] = float(b)
    return out


def _stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        raise invalid(
            "stop_token_ids", value, f"must be a list of at most {MAX_STOP_TOKEN_IDS} ids"
        )
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise invalid(f"stop_token_ids[{i}]", t, "must be a token id (an integer >= 0)")
    return list(value)


def _logprobs(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """Chat's ``logprobs`` (bool) + ``top_logprobs``, or completions' integer ``logprobs``."""
    if chat:
        top = _ranged(body, "top_logprobs", integer_in, 0, MAX_TOP_LOGPROBS)
        if not _flag(body, "logprobs"):
            if top:
                raise invalid("top_logprobs", top, "needs logprobs=true")
            return {}
    else:
        top = _ranged(body, "logprobs", integer_in, 0, MAX_TOP_LOGPROBS)
        if top is None:
            return {}
    return {"logprobs": True, "top_logprobs": top} if top else {"logprobs": True}


def _extras(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The fields that need worker support, at non-neutral values only.

    Raises:
        InvalidRequest: one is set but this version's ``submit`` lacks it.
    """
    n = _ranged(body, "n", integer_in, 1, MAX_N) or 1
    extra: dict[str, Any] = {"n": n} if n != 1 else {}
    extra.update(_logprobs(body, chat))
    for name in ("presence_penalty", "frequency_penalty"):
        if (v := _ranged(body, name, number_in, -2.0, 2.0)) not in (None, 0.0):
            extra[name] = v
    if (rep := _ranged(body, "repetition_penalty", number_in, 0.0, 10.0)) not in (None, 1.0):
        if rep == 0.0:
            raise invalid("repetition_penalty", rep, "must be > 0")
        extra["repetition_penalty"] = rep
    if (bias := _logit_bias(body.get("logit_bias"))) is not None:
        extra["logit_bias"] = bias
    if min_tokens := _ranged(body, "min_tokens", integer_in, 0, MAX_TOKENS_CAP):
        extra["min_tokens"] = min_tokens
    if stop_ids := _stop_token_ids(body.get("stop_token_ids")):
        extra["stop_token_ids"] = stop_ids
    if (constraint := _constraint(body)) is not None:
        extra["constraint"] = constraint
    for name, v in extra.items():
        if not submit_supports(name):
            why = "not supported by this mlxq version (needs worker support)"
            raise invalid(name, body.get(name, v), why)
    return extra


def _constraint(body: Mapping[str, Any]) -> Constraint | None:
    """The body's constraint (:func:`~mlxq.producer.constraints.from_body`), its error in
    OpenAI's shape naming the field (``response_format.json_schema.schema``, ...)."""
    try:
        return from_body(body)
    except PayloadError as e:
        m = _PARAM_RE.match(str(e))
        raise InvalidRequest(str(e), m.group(1) if m else None) from None


def _metadata(body: Mapping[str, Any]) -> Any:
    metadata, user = body.get("metadata"), body.get("user")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise invalid("metadata", metadata, "must be an object")
    if user is None:
        return metadata
    if not isinstance(user, str):
        raise invalid("user", user, "must be a string")
    if metadata is None:
        return {"user": user}
    return metadata if "user" in metadata else {**metadata, "user": user}


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise invalid("stream_options", opts, "only allowed when stream is true")
    if not isinstance(opts, Mapping):
        raise invalid("stream_options", opts, "must be an object")
    unknown_fields(opts, ("include_usage",), "stream_options.")
    return _flag(opts, "include_usage")


def _max_tokens(body: Mapping[str, Any], chat: bool) -> tuple[str, int]:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return name, body[name]
    return "max_tokens", DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS


def _service_tier(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in SERVICE_TIERS:
        raise invalid("service_tier", value, f"must be one of {', '.join(SERVICE_TIERS)}")
    return "priority" if value == "fast" else value


def _stop(value: Any) -> Any:
    if value is None:
        return ()
    if not isinstance(value, (str, list)):
        raise invalid("stop", value, "must be a string or a list of strings")
    return value


def _value(body: Mapping[str, Any], name: str, default: Any) -> Any:
    v = body.get(name)
    return default if v is None else v


def _model(body: Any, endpoint: str) -> str:
    """The body's ``model`` (the queue that serves it), once the body is an object; its
    unknown fields are ignored (with a warning)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint={endpoint!r}: must be one of {ENDPOINTS}")
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    unknown_fields(body, _KNOWN[endpoint], "")
    if problem := problem_in(body):
        path, why = problem
        shown = cut(path.encode("utf-8", "backslashreplace").decode(), 80)
        raise InvalidRequest(f"{shown}: {why}", shown)
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS:
        raise invalid(
            "model", model, f"must name a queue: a string of 1 to {MAX_MODEL_CHARS} chars"
        )
    return model


def _source(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """Chat's ``messages`` or completions' ``prompt``, as submit's argument."""
    if chat:
        if "messages" not in body:
            raise InvalidRequest("messages: required", "messages")
        return {"messages": inputs.messages(body["messages"])}
    if "prompt" not in body:
        raise InvalidRequest("prompt: required", "prompt")
    return {"prompt": inputs.prompt(body["prompt"])}


def _submit(body: Mapping[str, Any], chat: bool) -> tuple[str, dict[str, Any]]:
    """The submit arguments every request carries, and the name its token limit was
    given under (``max_completion_tokens`` or ``max_tokens``)."""
    source = _source(body, chat)
    tokens_name, max_tokens = _max_tokens(body, chat)
    top_k = _value(body, "top_k", 0)
    submit = {
        **source,
        "max_tokens": max_tokens,
        "temperature": _value(body, "temperature", DEFAULT_TEMPERATURE),
        "top_p": _value(body, "top_p", 1.0),
        "top_k": 0 if top_k == -1 else top_k,
        "min_p": _value(body, "min_p", 0.0),
        "stop": _stop(body.get("stop")),
        "seed": body.get("seed"),
        "metadata": _metadata(body),
    }
    if chat:
        submit.update(tool_fields(body))
    return tokens_name, submit


def _check(submit: Mapping[str, Any], tokens_name: str) -> None:
    """Run submit's own checks, their errors in OpenAI's shape under the body's names.

    Raises:
        InvalidRequest: naming the field the body gave.
    """
    try:
        build_request(**submit)
    except PayloadError as e:
        m = _PARAM_RE.match(str(e))
        param = m.group(1) if m else None
        if param == "max_tokens" and tokens_name != param:
            message = str(e).replace("max_tokens", tokens_name, 1)
            raise InvalidRequest(message, tokens_name) from None
        raise InvalidRequest(str(e), param) from None
    except (TypeError, ValueError) as e:  # a shape the checks above did not foresee
        raise InvalidRequest(f"invalid request: {e}") from None


def parse_request(body: Any, endpoint: str) -> OpenAIRequest:
    """Check an OpenAI completion body and map it onto mlxq's submit arguments.

    Args:
        body: The decoded JSON body.
        endpoint: :data:`CHAT` or :data:`COMPLETIONS`.

    Returns:
        The request; its ``submit`` map passes :meth:`Client.submit`'s checks.

    Raises:
        InvalidRequest: (a ``ValueError``) naming the field (``.param``) and what is wrong.
    """
    model = _model(body, endpoint)
    chat = endpoint == CHAT
    tokens_name, submit = _submit(body, chat)
    stream = _flag(body, "stream")
    include_usage = _stream_options(body, stream)
    extra = _extras(body, chat)
    _check(submit, tokens_name)
    return OpenAIRequest(
        endpoint,
        model,
        {**submit, **extra},
        stream,
        include_usage,
        n=extra.get("n", 1),
        logprobs="logprobs" in extra,
        top_logprobs=extra.get("top_logprobs", 0),
        service_tier=_service_tier(body.get("service_tier")),
        tool_calls=mode(submit),
    )
