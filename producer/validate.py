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
#: The keys a chat message may carry: OpenAI's, less those needing tools or images.
MESSAGE_KEYS = frozenset({"role", "content", "name"})
#: Longest ``name`` of a chat message (OpenAI's limit).
MAX_NAME_CHARS = 64


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


def messages(value: Any) -> tuple[dict[str, str], ...]:
    """A chat: a non-empty list of ``{role, content[, name]}`` maps, each checked."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise bad("messages", value, "must be a non-empty list of {role, content} maps")
    if len(value) > MAX_MESSAGES:
        raise bad("messages", f"<{len(value)} messages>", f"at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m) <= MESSAGE_KEYS:
            raise bad(
                f"messages[{i}]", m, "must be a map with 'role' and 'content' (and optional 'name')"
            )
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            raise bad(f"messages[{i}].role", m["role"], f"must be one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _content(f"messages[{i}].content", m["content"])}
        if "name" in m:
            if not isinstance(m["name"], str) or not 0 < len(m["name"]) <= MAX_NAME_CHARS:
                raise bad(f"messages[{i}].name", m["name"], f"must be 1 to {MAX_NAME_CHARS} chars")
            msg["name"] = text(f"messages[{i}].name", m["name"])
        out.append(msg)
    return tuple(out)


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
