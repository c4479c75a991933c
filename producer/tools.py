"""Tool calls: the JSON schema a forced call is held to, and calls read from a model's text.

A request's ``tool_choice`` decides how its answer holds calls:

- ``"required"`` or one named function (*forced*): the answer is constrained to the JSON
  of the call(s), :func:`call_schema`: ``{"name": ..., "arguments": {...}}``, or a list of
  one or more of them for ``required`` with ``parallel_tool_calls`` (the default). Any
  model can do this; :func:`forced_calls` reads the answer back.
- ``"auto"`` (the default with tools): the model may call a tool in its own format, read
  by a per-family parser named in :data:`FORMATS`: ``hermes`` (Hermes, Qwen 2.5 / 3 and
  others: ``<tool_call>{"name", "arguments"}</tool_call>``, mlx-lm's ``json_tools``) and
  ``llama3_json`` (Llama 3.x: a reply that is ``{"name", "parameters"}`` JSON, after an
  optional ``<|python_tag|>``, several joined by ``;``). A worker publishes the format its
  model's tokenizer speaks (:func:`mlxq.worker.chat.tool_format`); a model with none
  cannot answer ``auto``.
- ``"none"``: the tools are rendered, the answer is text.

:class:`CallSplitter` reads a stream of text pieces into content and whole calls, so a
streamed answer never shows the call markup as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
#: The formats ``tool_choice="auto"`` can read calls in.
FORMATS = (HERMES, LLAMA3_JSON)
#: What a forced choice is read as (no model format needed).
FORCED = "forced"

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: a function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_id() -> str:
    """A fresh id for a call, in OpenAI's ``call_...`` form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def forced(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` forces a call (``required`` or a named function)."""
    return tool_choice == "required" or isinstance(tool_choice, Mapping)


def _one_call(function: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [function["name"]]},
            "arguments": function.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_schema(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, parallel: bool = True
) -> dict[str, Any] | None:
    """The JSON schema a forced answer is held to; None unless ``tool_choice`` forces one.

    A named function: one call of it. ``required``: one call of any tool (each tool's
    name with its own parameters), or with ``parallel`` a list of one or more.
    """
    if not forced(tool_choice):
        return None
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        return _one_call(next(f for f in functions if f["name"] == name))
    calls = [_one_call(f) for f in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text (an object, or text that decodes to one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _calls_in(value: Any, *arg_keys: str) -> list[ToolCall] | None:
    """``value`` (an object or a list of them) as calls; None if it is not that."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in arg_keys if k in item), None)
        args = _arguments(item[key]) if key else "{}"
        if args is None:
            return None
        out.append(ToolCall(item["name"], args))
    return out or None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def forced_calls(text: str) -> list[ToolCall] | None:
    """The call(s) of a forced answer (:func:`call_schema`'s JSON); None if ``text`` is
    not that (cut short by ``max_tokens``)."""
    return _calls_in(_json(text), "arguments")


def _hermes_call(body: str) -> ToolCall | None:
    calls = _calls_in(_json(body.strip()), "arguments", "parameters")
    return calls[0] if calls and len(calls) == 1 else None


def _llama3_calls(text: str) -> list[ToolCall] | None:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        found = _calls_in(value, "parameters", "arguments")
        if found is None:
            return None
        calls += found
        rest = body[pos:].lstrip()
        pos = len(body) - len(rest)
        if rest.startswith(";"):
            pos += 1 + len(rest[1:]) - len(rest[1:].lstrip())
        elif rest:
            return None
    return calls


Piece = str | ToolCall


class CallSplitter:
    """A stream of text pieces -> content text and whole :class:`ToolCall` s, in order.

    Content is the text outside the calls with its ends stripped, as :func:`split`
    gives it whole: so the pieces :meth:`feed` and :meth:`finish` return, joined, equal
    :func:`split` of the whole text.

    Args:
        fmt: One of :data:`FORMATS`, or :data:`FORCED` (the whole answer is the call
            JSON; content only if it is not).
    """

    def __init__(self, fmt: str) -> None:
        if fmt not in (*FORMATS, FORCED):
            raise ValueError(f"fmt={fmt!r}: must be one of {(*FORMATS, FORCED)}")
        self.fmt = fmt
        self._buf = ""  # text not yet told: held for a marker, or a call's body
        self._in_call = False
        self._pending = ""  # whitespace held: told only if more content follows
        self._told = False  # any content told yet
        self.calls = 0

    def _content(self, text: str) -> list[Piece]:
        text = self._pending + text
        if not text.strip():
            self._pending = text
            return []
        stripped = text.rstrip()
        self._pending = text[len(stripped) :]
        if not self._told:
            stripped = stripped.lstrip()
        self._told = True
        return [stripped]

    def _call(self, calls: list[ToolCall] | None, raw: str) -> list[Piece]:
        if calls is None:
            return self._content(raw)
        self.calls += len(calls)
        return list(calls)

    def feed(self, text: str) -> list[Piece]:
        """The content and calls ``text`` completes."""
        self._buf += text
        if self.fmt == HERMES:
            return self._hermes(final=False)
        if self.fmt == LLAMA3_JSON and not self._told and not self._in_call:
            head = self._buf.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._in_call = True  # the whole reply is read at the end
                return []
            if not head or _PYTHON_TAG.startswith(head):
                return []  # too soon to tell
            return self._flush()
        return [] if self._in_call or self.fmt == FORCED else self._flush()

    def _flush(self) -> list[Piece]:
        out, self._buf = self._buf, ""
        return self._content(out)

    def finish(self) -> list[Piece]:
        """What is left once the text has ended."""
        if self.fmt == HERMES:
            return self._hermes(final=True)
        text, self._buf = self._buf, ""
        if self.fmt == FORCED:
            return self._call(forced_calls(text), text)
        if self._in_call:
            return self._call(_llama3_calls(text), text)
        return self._content(text)

    def _hermes(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._buf.find(_HERMES_END)
                if end < 0:
                    if final:  # a call the reply ended without closing
                        body, self._buf = self._buf, ""
                        out += self._call(_hermes_calls(body), _HERMES_START + body)
                    return out
                body = self._buf[:end]
                self._buf = self._buf[end + len(_HERMES_END) :]
                out += self._call(_hermes_calls(body), _HERMES_START + body + _HERMES_END)
                self._in_call = False
                continue
            start = self._buf.find(_HERMES_START)
            if start < 0:
                keep = 0 if final else _marker_prefix(self._buf, _HERMES_START)
                told, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
                return out + self._content(told)
            out += self._content(self._buf[:start])
            self._buf = self._buf[start + len(_HERMES_START) :]
            self._in_call = True


def _hermes_calls(body: str) -> list[ToolCall] | None:
    call = _hermes_call(body)
    return None if call is None else [call]


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: the
    marker may be completing)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when there is none) and calls, read in ``fmt``."""
    splitter = CallSplitter(fmt)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, ToolCall)]
