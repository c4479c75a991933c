"""OpenAI's ``tools`` / ``tool_choice`` in requests, and ``tool_calls`` in answers.

A chat body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` go to
:meth:`Client.submit` as they are (checked there, :mod:`mlxq.producer.validate`); the
request remembers how its answer holds calls (:func:`mode`). An answer with calls has
``message.tool_calls`` (``id`` ``call_...``, ``type`` ``function``, ``function: {name,
arguments}``, arguments as JSON text), ``content`` None unless the model also wrote text,
and ``finish_reason`` ``tool_calls``. Streamed, each call is a ``delta.tool_calls`` entry
with its ``index``: a first chunk with ``id``, ``type``, ``function.name`` and empty
arguments, then its arguments (a forced call's as they are written; a call in the model's
own format once whole); text around calls streams as content, the call markup never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxq.producer.tool_parsers import CallSplitter, Piece, split
from mlxq.producer.tools import FORCED, FORMATS, ArgsPart, ToolCall, call_id, forced
from mlxq.producer.validate import invalid

#: The chat body's fields about tools.
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
#: How an ``auto`` answer's calls are read: in the format the model speaks (a worker
#: publishes it), one of :data:`mlxq.producer.tools.FORMATS`.
AUTO = "auto"


def tool_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's tool fields, as :meth:`Client.submit` arguments (absent ones left out).

    Raises:
        InvalidRequest: ``parallel_tool_calls`` is not a boolean.
    """
    out = {name: body[name] for name in TOOL_FIELDS if body.get(name) is not None}
    parallel = out.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", parallel, "must be a boolean")
    if parallel:
        out.pop("parallel_tool_calls", None)  # the default: sparse in the payload
    return out


def mode(submit: Mapping[str, Any]) -> str | None:
    """How the answer of checked ``submit`` arguments holds calls: :data:`FORCED`
    (``required`` or a named function), :data:`AUTO` (tools, ``auto`` or no choice), or
    None (no tools, or ``none``)."""
    if not submit.get("tools"):
        return None
    choice = submit.get("tool_choice")
    if forced(choice):
        return FORCED
    return AUTO if choice in (None, "auto") else None


def auto_needs_format(tool_format: str) -> str | None:
    """Why ``tool_choice="auto"`` cannot be served by a model speaking ``tool_format``
    (a worker's published one; "" for none), or None when it can."""
    if tool_format in FORMATS:
        return None
    said = f"its tool-call format {tool_format!r}" if tool_format else "no tool-call format"
    return (
        f"tool_choice='auto' needs a model whose tool-call format mlxq reads "
        f"({', '.join(FORMATS)}); this queue's model has {said}. "
        "tool_choice='required' or a named function works with any model"
    )


def reader(call_mode: str | None, tool_format: str) -> str | None:
    """The :class:`CallSplitter` format an answer is read in; None: read as plain text."""
    if call_mode == FORCED:
        return FORCED
    if call_mode == AUTO and tool_format in FORMATS:
        return tool_format
    return None


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's ``tool_calls`` for an answer that ended on its own with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def message(text: str, reason: str, fmt: str | None) -> tuple[dict[str, Any], str]:
    """A whole answer's chat ``message`` and its ``finish_reason``, its calls read in
    ``fmt`` (None: no calls, the text is the content)."""
    if fmt is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = split(text, fmt)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.openai(call_id()) for c in calls]
    elif content is None:
        msg["content"] = ""
    return msg, finish_reason(reason, len(calls))


class DeltaReader:
    """One choice's streamed text -> chat ``delta`` objects, its calls in OpenAI's shape.

    Args:
        fmt: The :class:`CallSplitter` format the answer is read in.
    """

    def __init__(self, fmt: str) -> None:
        self._splitter = CallSplitter(fmt)
        self.calls = 0

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in pieces:
            if isinstance(p, str):
                out.append({"content": p})
            elif isinstance(p, ArgsPart):
                if p.text:
                    out.append(self._args(p.text))
            else:
                self.calls += 1
                head = {
                    "index": self.calls - 1,
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": p.name, "arguments": ""},
                }
                out.append({"tool_calls": [head]})
                if isinstance(p, ToolCall):
                    out.append(self._args(p.arguments))
        return out

    def _args(self, text: str) -> dict[str, Any]:
        """The delta of more arguments of the call last begun."""
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]}

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` completes (none while a call or a marker is being read)."""
        return self._deltas(self._splitter.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left once the choice has ended."""
        return self._deltas(self._splitter.finish())
