"""Tool calls: what a forced call is held to, and the pieces a model's calls are read as.

A request's ``tool_choice`` decides how its answer holds calls:

- ``"required"`` or one named function (*forced*): the answer is constrained to the JSON
  of the call(s), :func:`call_schema`: ``{"name": ..., "arguments": {...}}``, or a list of
  one or more of them for ``required`` with ``parallel_tool_calls`` (the default). Any
  model can do this. The constraint is :func:`call_grammar`, that JSON with the name
  first (so the model picks the function, then its arguments) and each function's
  ``parameters`` schema in its own order, laid out compactly.
- ``"auto"`` (the default with tools): the model may call a tool in its own format, read
  by a per-family parser named in :data:`FORMATS`: ``hermes`` (Hermes, Qwen 2.5 / 3 and
  others: ``<tool_call>{"name", "arguments"}</tool_call>``, mlx-lm's ``json_tools``) and
  ``llama3_json`` (Llama 3.x: a reply that is ``{"name", "parameters"}`` JSON, after an
  optional ``<|python_tag|>``, several joined by ``;``). A worker publishes the format its
  model's tokenizer speaks (:func:`mlxq.worker.chat.tool_format`); a model with none
  cannot answer ``auto``.
- ``"none"``: the tools are rendered, the answer is text.

:class:`~mlxq.producer.tool_parsers.CallSplitter` reads an answer's text, whole or as it
streams, into content and calls, so a streamed answer never shows the call markup as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxq.producer.constraints import Constraint
from mlxq.producer.validate import bad

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
#: The formats ``tool_choice="auto"`` can read calls in.
FORMATS = (HERMES, LLAMA3_JSON)
#: What a forced choice is read as (no model format needed).
FORCED = "forced"


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


@dataclass(frozen=True, slots=True)
class CallHead:
    """A call begins: its function's name (its arguments follow as :class:`ArgsPart` s)."""

    name: str


@dataclass(frozen=True, slots=True)
class ArgsPart:
    """More of the arguments of the call last begun, as the model wrote them."""

    text: str


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


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def call_grammar(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, parallel: bool = True
) -> str | None:
    """The Lark grammar (llguidance's) a forced answer is held to: :func:`call_schema`'s
    JSON, compact, ``name`` before ``arguments``; None unless ``tool_choice`` forces one."""
    if not forced(tool_choice):
        return None
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, Mapping):
        functions = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
    rules = []
    for i, f in enumerate(functions):
        schema = dict(f.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
        head = _literal('{"name":' + json.dumps(f["name"]) + ',"arguments":')
        rules += [f'call_{i}: {head} args_{i} "}}"', f"args_{i}: %json {json.dumps(schema)}"]
    call = " | ".join(f"call_{i}" for i in range(len(functions)))
    many = tool_choice == "required" and parallel
    start = f'"[" ({call}) ("," ({call}))* "]"' if many else call
    return "\n".join([f"start: {start}", *rules])


def constrained(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    parallel: bool,
    constraint: Constraint | None,
) -> Constraint | None:
    """A request's constraint, its tool choice counted: a forced call's answer is held to
    the call (:func:`call_grammar`); a payload read back carries that same constraint.

    Raises:
        PayloadError: a forced call with another constraint, naming ``tool_choice``.
    """
    grammar = call_grammar(tools or (), tool_choice, parallel)
    if grammar is None:
        return constraint
    forced = Constraint.of_grammar(grammar, "tools")
    if constraint is not None and constraint != forced:
        raise bad(
            "tool_choice", tool_choice, "holds the answer to its call: give no other constraint"
        )
    return forced
