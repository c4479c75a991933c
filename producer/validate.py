"""The field checks every layer shares: each names the field and the bad value.

Every message reads ``name=value: why``. Three kinds of error carry it:
:func:`bad` (a job payload's :class:`~mlxq.producer.errors.PayloadError`, the value
shown bounded), :func:`invalid` (an OpenAI body's
:class:`~mlxq.producer.errors.InvalidRequest`, which also names the field for the
answer's ``param``) and :func:`value_error` (a plain ``ValueError``, for settings and
:class:`~mlxq.producer.logits_params.LogitsParams`). The range checks take one of the
three as ``error``.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from mlxq.producer.errors import InvalidRequest, PayloadError

#: How a check builds its error from (field, value, why).
Bad = Callable[[str, Any, str], Exception]

#: How much of a bad payload value an error shows (any depth, any size: bounded).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 80, 80, 40
#: Longest repr of a bad OpenAI body value an error shows.
_MAX_SHOWN = 200


def bad(name: str, value: Any, why: str) -> PayloadError:
    """A payload's error, its value shown bounded at any depth and size."""
    return PayloadError(f"{name}={_SHORT.repr(value)}: {why}")


def invalid(name: str, value: Any, why: str) -> InvalidRequest:
    """An OpenAI request body's error, naming ``name`` as its ``param``."""
    text = repr(value)
    shown = text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}..."
    return InvalidRequest(f"{name}={shown}: {why}", name)


def value_error(name: str, value: Any, why: str) -> ValueError:
    """A plain ``ValueError``, the value shown whole."""
    return ValueError(f"{name}={value!r}: {why}")


def number(name: str, value: Any) -> float:
    """A payload's finite number, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, value, "must be a number")
    try:
        f = float(value)
    except OverflowError:
        raise bad(name, value, "too large") from None
    if not math.isfinite(f):
        raise bad(name, value, "must be finite")
    return f


def integer(name: str, value: Any) -> int:
    """A payload's integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, value, "must be an integer")
    return value


def text(name: str, value: Any) -> str:
    """A payload's string that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        raise bad(name, value, "must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(name, value, f"not valid Unicode text ({e.reason})") from None
    return value


def number_in(name: str, value: Any, lo: float, hi: float, *, error: Bad = value_error) -> float:
    """A number in ``[lo, hi]`` (NaN never is), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise error(name, value, f"must be a number in [{lo:g}, {hi:g}]")
    return float(value)


def integer_in(
    name: str, value: Any, lo: int, hi: int, *, error: Bad = value_error, note: str = ""
) -> int:
    """An integer (not a bool) in ``[lo, hi]``; ``note`` follows the range in the message."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise error(name, value, f"must be an integer in [{lo}, {hi}]{note}")
    return value


def at_least(name: str, value: Any, lowest: int) -> int:
    """An integer (not a bool) ``>= lowest``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise value_error(name, value, f"must be an integer >= {lowest}")
    return value


def logit_number(name: str, value: Any, lo: float, hi: float) -> float:
    """A logits setting's finite number in ``[lo, hi]``, -0.0 read as 0.0 (so equal
    settings compare equal)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise value_error(name, value, "must be a number")
    f = float(value)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise value_error(name, value, f"must be in [{lo}, {hi}]")
    return f + 0.0


def token_id(name: str, value: Any) -> int:
    """A token id >= 0 (a decimal string is read as one)."""
    # OpenAI's JSON bodies key logit_bias by decimal strings.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    return integer_in(name, value, 0, 2**31 - 1)


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1_024
#: Largest metadata map, msgpack-encoded.
MAX_METADATA_BYTES = 64 * 1024
ROLES = ("system", "user", "assistant", "tool", "developer")
#: The keys a chat message may carry: OpenAI's, less those needing images.
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
#: Longest ``name`` of a chat message (OpenAI's limit).
MAX_NAME_CHARS = 64
#: Most tools a request may offer (OpenAI's limit), and their definitions' size, packed.
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024
#: Most calls one assistant message may carry, and the longest id of one.
MAX_TOOL_CALLS = 64
MAX_TOOL_ID_CHARS = 256
#: What OpenAI allows in a function's name.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


def metadata(value: Any) -> dict[str, Any]:
    """A job's ``metadata``: a map with string keys, at most :data:`MAX_METADATA_BYTES` packed."""
    # Checked by a msgpack round trip: what passes here is exactly what the worker reads back.
    if not isinstance(value, Mapping):
        raise bad("metadata", value, "must be a map with string keys")
    try:
        packed = msgpack.packb(dict(value), use_bin_type=True)
        out = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise bad("metadata", value, f"must be msgpack data with string keys ({e})") from None
    if len(packed) > MAX_METADATA_BYTES:
        raise bad("metadata", f"<{len(packed)} bytes>", f"at most {MAX_METADATA_BYTES} bytes")
    return dict(out)


def _content(name: str, value: Any) -> str:
    """A message's content: a string, or OpenAI's list of text parts, joined as mlx-lm's
    server joins them (no separator)."""
    if isinstance(value, str):
        return text(name, value)
    if not isinstance(value, Sequence) or isinstance(value, bytes) or not value:
        raise bad(name, value, "must be a string or a non-empty list of text parts")
    if len(value) > MAX_MESSAGES:
        raise bad(name, f"<{len(value)} parts>", f"at most {MAX_MESSAGES}")
    texts = []
    for j, part in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(part, Mapping) or set(part) != {"type", "text"}:
            raise bad(where, part, "must be a map with exactly 'type' and 'text'")
        if part["type"] != "text":
            raise bad(f"{where}.type", part["type"], "only 'text' parts are supported")
        texts.append(text(f"{where}.text", part["text"]))
    return "".join(texts)


def _packed_size(name: str, value: Any) -> int:
    """Bytes ``value`` takes msgpack-encoded (what the worker reads back is the same)."""
    try:
        return len(msgpack.packb(value, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:
        raise bad(name, value, f"must be JSON-like data ({e})") from None


def function_name(name: str, value: Any) -> str:
    """A function's name as OpenAI allows it: 1 to 64 of ``A-Z a-z 0-9 _ -``."""
    if not isinstance(value, str) or not _FUNCTION_NAME.match(value):
        raise bad(name, value, "must be 1 to 64 letters, digits, '_' or '-'")
    return value


def _tool_call(name: str, value: Any) -> dict[str, Any]:
    """An assistant message's call: ``{id, type: "function", function: {name, arguments}}``
    (``arguments`` the JSON text of an object, as OpenAI sends it back)."""
    if not isinstance(value, Mapping) or set(value) != {"id", "type", "function"}:
        raise bad(name, value, "must be a map with exactly 'id', 'type' and 'function'")
    if not isinstance(value["id"], str) or not 0 < len(value["id"]) <= MAX_TOOL_ID_CHARS:
        raise bad(f"{name}.id", value["id"], f"must be 1 to {MAX_TOOL_ID_CHARS} chars")
    if value["type"] != "function":
        raise bad(f"{name}.type", value["type"], "must be 'function'")
    fn = value["function"]
    if not isinstance(fn, Mapping) or set(fn) != {"name", "arguments"}:
        raise bad(f"{name}.function", fn, "must be a map with exactly 'name' and 'arguments'")
    arguments = text(f"{name}.function.arguments", fn["arguments"])
    function = {"name": function_name(f"{name}.function.name", fn["name"]), "arguments": arguments}
    return {"id": text(f"{name}.id", value["id"]), "type": "function", "function": function}


def _tool_parts(where: str, m: Mapping[str, Any], msg: dict[str, Any]) -> None:
    """A message's ``tool_calls`` (an assistant's) and ``tool_call_id`` (a tool's), into
    ``msg``."""
    if "tool_calls" in m:
        calls = m["tool_calls"]
        if m["role"] != "assistant":
            raise bad(f"{where}.tool_calls", calls, "only an assistant message makes calls")
        if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
            raise bad(f"{where}.tool_calls", calls, "must be a list of calls")
        if not 0 < len(calls) <= MAX_TOOL_CALLS:
            raise bad(f"{where}.tool_calls", f"<{len(calls)} calls>", f"1 to {MAX_TOOL_CALLS}")
        msg["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if "tool_call_id" in m:
        tid = m["tool_call_id"]
        if m["role"] != "tool":
            raise bad(f"{where}.tool_call_id", tid, "only a tool message answers a call")
        if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TOOL_ID_CHARS:
            raise bad(f"{where}.tool_call_id", tid, f"must be 1 to {MAX_TOOL_ID_CHARS} chars")
        msg["tool_call_id"] = text(f"{where}.tool_call_id", tid)


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping) or not {"role", "content"} <= set(m) <= MESSAGE_KEYS:
        raise bad(
            where,
            m,
            "must be a map with 'role' and 'content' (and optional 'name', "
            "'tool_calls' for an assistant, 'tool_call_id' for a tool)",
        )
    if not isinstance(m["role"], str) or m["role"] not in ROLES:
        raise bad(f"{where}.role", m["role"], f"must be one of {', '.join(ROLES)}")
    content = m["content"]
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        content = ""  # OpenAI's null content of a message that only calls tools
    msg: dict[str, Any] = {"role": m["role"], "content": _content(f"{where}.content", content)}
    if "name" in m:
        if not isinstance(m["name"], str) or not 0 < len(m["name"]) <= MAX_NAME_CHARS:
            raise bad(f"{where}.name", m["name"], f"must be 1 to {MAX_NAME_CHARS} chars")
        msg["name"] = text(f"{where}.name", m["name"])
    _tool_parts(where, m, msg)
    return msg


def messages(value: Any) -> tuple[dict[str, Any], ...]:
    """A chat: a non-empty list of ``{role, content[, name][, tool_calls][, tool_call_id]}``
    maps, each checked (an assistant's ``content`` may be None when it makes calls, and
    reads as "")."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise bad("messages", value, "must be a non-empty list of {role, content} maps")
    if len(value) > MAX_MESSAGES:
        raise bad("messages", f"<{len(value)} messages>", f"at most {MAX_MESSAGES}")
    return tuple(_message(i, m) for i, m in enumerate(value))


def message_chars(value: Sequence[Mapping[str, Any]]) -> int:
    """Characters a chat carries: its contents and its calls' arguments."""
    return sum(
        len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
        for m in value
    )


def _function(name: str, value: Any) -> dict[str, Any]:
    """A tool's ``function``: ``{name[, description][, parameters][, strict]}``."""
    keys = {"name", "description", "parameters", "strict"}
    if not isinstance(value, Mapping) or "name" not in value or not set(value) <= keys:
        raise bad(
            name,
            value,
            "must be a map with 'name' (and optional 'description', 'parameters', 'strict')",
        )
    out: dict[str, Any] = {"name": function_name(f"{name}.name", value["name"])}
    if value.get("description") is not None:
        out["description"] = text(f"{name}.description", value["description"])
    if value.get("parameters") is not None:
        params = value["parameters"]
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise bad(f"{name}.parameters", params, "must be a JSON schema of an object")
        out["parameters"] = dict(params)
    if value.get("strict") is not None:
        if not isinstance(value["strict"], bool):
            raise bad(f"{name}.strict", value["strict"], "must be true or false")
        out["strict"] = value["strict"]
    return out


def tools(value: Any) -> tuple[dict[str, Any], ...]:
    """``tools``: 1 to :data:`MAX_TOOLS` ``{"type": "function", "function": {...}}`` maps,
    their names distinct, at most :data:`MAX_TOOLS_BYTES` packed."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise bad("tools", value, "must be a non-empty list of {type, function} maps")
    if len(value) > MAX_TOOLS:
        raise bad("tools", f"<{len(value)} tools>", f"at most {MAX_TOOLS}")
    out, seen = [], set()
    for i, t in enumerate(value):
        if not isinstance(t, Mapping) or set(t) != {"type", "function"}:
            raise bad(f"tools[{i}]", t, "must be a map with exactly 'type' and 'function'")
        if t["type"] != "function":
            raise bad(f"tools[{i}].type", t["type"], "must be 'function'")
        fn = _function(f"tools[{i}].function", t["function"])
        if fn["name"] in seen:
            raise bad(f"tools[{i}].function.name", fn["name"], "names a function twice")
        seen.add(fn["name"])
        out.append({"type": "function", "function": fn})
    if (size := _packed_size("tools", out)) > MAX_TOOLS_BYTES:
        raise bad("tools", f"<{size} bytes>", f"at most {MAX_TOOLS_BYTES} bytes")
    return tuple(out)


def tool_choice(value: Any, offered: Sequence[Mapping[str, Any]] | None) -> str | dict[str, Any]:
    """``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function",
    "function": {"name"}}`` naming one of the ``offered`` tools (which it needs)."""
    if not offered:
        raise bad("tool_choice", value, "needs tools")
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise bad(
                "tool_choice",
                value,
                f"must be one of {', '.join(TOOL_CHOICES)} "
                "or {'type': 'function', 'function': {'name': ...}}",
            )
        return value
    if not isinstance(value, Mapping) or set(value) != {"type", "function"}:
        raise bad("tool_choice", value, "must be a string or a map with 'type' and 'function'")
    if value["type"] != "function":
        raise bad("tool_choice.type", value["type"], "must be 'function'")
    fn = value["function"]
    if not isinstance(fn, Mapping) or set(fn) != {"name"}:
        raise bad("tool_choice.function", fn, "must be a map with exactly 'name'")
    name = function_name("tool_choice.function.name", fn["name"])
    if name not in {t["function"]["name"] for t in offered}:
        raise bad("tool_choice.function.name", name, "names no function of tools")
    return {"type": "function", "function": {"name": name}}


def stop_strings(value: Any) -> tuple[str, ...]:
    """``stop``: one string or a list of them, each 1 to :data:`MAX_STOP_CHARS` characters."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise bad("stop", value, "must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise bad("stop", value, f"at most {MAX_STOP_STRINGS} stop strings")
    for s in value:
        if not isinstance(s, str) or not 0 < len(text("stop", s)) <= MAX_STOP_CHARS:
            raise bad("stop", s, f"each stop string must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(value)
