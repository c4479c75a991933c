"""Calls read from a model's text, whole or as it streams, in the formats of
:mod:`mlxq.producer.tools`: a forced answer's JSON, Hermes' ``<tool_call>`` JSON, Llama 3's
JSON reply.

:class:`CallSplitter` turns text pieces into content, :class:`~mlxq.producer.tools.ToolCall` s
(Hermes, Llama 3: a call is told once whole) and, for a forced answer, each call's
:class:`~mlxq.producer.tools.CallHead` as soon as its name is read and its arguments as
:class:`~mlxq.producer.tools.ArgsPart` s as they come. :func:`split` reads a whole answer
through the same splitter, so a stream's pieces always add up to the whole answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxq.producer.tools import (
    FORCED,
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    ArgsPart,
    CallHead,
    ToolCall,
)

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
#: How a forced call begins (:func:`~mlxq.producer.tools.call_grammar`'s layout).
_HEAD_OPEN, _HEAD_CLOSE = '{"name":"', '","arguments":'
_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')
_NAME = re.compile(r"[A-Za-z0-9_-]*")

Piece = str | ToolCall | CallHead | ArgsPart


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


def _could_open(text: str) -> bool:
    """Whether ``text`` may still grow into a forced call's head."""
    if len(text) <= len(_HEAD_OPEN):
        return _HEAD_OPEN.startswith(text)
    if not text.startswith(_HEAD_OPEN):
        return False
    name = _NAME.match(text, len(_HEAD_OPEN))
    end = name.end() if name else len(_HEAD_OPEN)
    return end - len(_HEAD_OPEN) <= 64 and _HEAD_CLOSE.startswith(text[end:])


class _ForcedReader:
    """A forced answer (:func:`~mlxq.producer.tools.call_grammar`'s JSON: one call, or a
    list of them) read as it streams: each call's head once its name is read, then its
    arguments as written. Text of any other shape is told whole at the end, as content."""

    def __init__(self) -> None:
        self.raw = ""  # every character fed
        self._buf = ""  # not yet read
        self._state = "start"
        self._array = False
        self._depth, self._in_str, self._escaped = 0, False, False
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.raw += text
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._state not in ("done", "failed"):
            before = (self._state, len(self._buf))
            out += self._step()
            if (self._state, len(self._buf)) == before:
                break  # needs more text
        return out

    def _step(self) -> list[Piece]:
        buf, state = self._buf, self._state
        if state in ("start", "after"):
            c = buf[0]
            if state == "start" and c in "[{":
                self._array = c == "["
                self._buf = buf[1:] if self._array else buf
                self._state = "head"
            elif state == "after" and c in ",]":
                self._buf, self._state = buf[1:], "head" if c == "," else "done"
            else:
                self._state = "failed"
            return []
        if state == "head":
            if m := _HEAD.match(buf):
                self._buf, self._state = buf[m.end() :], "args"
                self.calls += 1
                return [CallHead(m.group(1))]
            if not _could_open(buf):
                self._state = "failed"
            return []
        if state == "close":
            ok = buf[0] == "}"
            self._buf = buf[1:] if ok else buf
            self._state = ("after" if self._array else "done") if ok else "failed"
            return []
        return self._args()

    def _args(self) -> list[Piece]:
        """The arguments object's text, up to its closing brace."""
        buf = self._buf
        for i, c in enumerate(buf):
            if self._in_str:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._buf, self._state = buf[i + 1 :], "close"
                    return [ArgsPart(buf[: i + 1])]
        self._buf = ""
        return [ArgsPart(buf)]

    def finish(self) -> str:
        """The text to tell as content: all of it if no call was read, else what is
        left past the calls (if anything)."""
        if not self.calls:
            return self.raw
        return self._buf if self._state == "failed" else ""


class CallSplitter:
    """A stream of text pieces -> content and calls, in order (see the module docstring).

    Content is the text outside the calls with its ends stripped, as :func:`split`
    gives it whole: so the pieces :meth:`feed` and :meth:`finish` return, joined, equal
    :func:`split` of the whole text.

    Args:
        fmt: One of :data:`~mlxq.producer.tools.FORMATS`, or
            :data:`~mlxq.producer.tools.FORCED` (the answer is the calls' JSON; content
            only if it is not).
    """

    def __init__(self, fmt: str) -> None:
        if fmt not in (*FORMATS, FORCED):
            raise ValueError(f"fmt={fmt!r}: must be one of {(*FORMATS, FORCED)}")
        self.fmt = fmt
        self._buf = ""  # text not yet told: held for a marker, or a call's body
        self._in_call = False
        self._pending = ""  # whitespace held: told only if more content follows
        self._told = False  # any content told yet
        self._forced = _ForcedReader() if fmt == FORCED else None
        self._calls = 0

    @property
    def calls(self) -> int:
        """Calls begun so far."""
        return self._forced.calls if self._forced is not None else self._calls

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
        self._calls += len(calls)
        return list(calls)

    def feed(self, text: str) -> list[Piece]:
        """The content and calls ``text`` completes."""
        if self._forced is not None:
            return self._forced.feed(text)
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
        return [] if self._in_call else self._flush()

    def _flush(self) -> list[Piece]:
        out, self._buf = self._buf, ""
        return self._content(out)

    def finish(self) -> list[Piece]:
        """What is left once the text has ended."""
        if self.fmt == HERMES:
            return self._hermes(final=True)
        if self._forced is not None:
            return self._content(self._forced.finish())
        text, self._buf = self._buf, ""
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


def calls_of(pieces: list[Piece]) -> list[ToolCall]:
    """The calls ``pieces`` hold, each forced call's head and arguments put together."""
    calls: list[ToolCall] = []
    for p in pieces:
        if isinstance(p, ToolCall):
            calls.append(p)
        elif isinstance(p, CallHead):
            calls.append(ToolCall(p.name, ""))
        elif isinstance(p, ArgsPart):
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + p.text)
    return calls


def split(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when there is none) and calls, read in ``fmt``.

    A forced answer cut short (by ``max_tokens``) keeps the calls begun, the last one's
    arguments as far as they were written, as OpenAI answers then."""
    splitter = CallSplitter(fmt)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, calls_of(pieces)
