"""What an OpenAI request asks the model to continue: chat ``messages`` (text parts joined,
tool calls and tool answers kept) or a completion's ``prompt``, read into the shapes
:meth:`Client.submit` takes; the payload checks name anything else wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxq.producer.openai_api.bounds import unknown_fields
from mlxq.producer.validate import invalid


def _content(i: int, value: Any) -> Any:
    if value is None:
        return ""
    if not isinstance(value, list):
        return value  # a string, or something the payload check names
    texts: list[str] = []
    for j, part in enumerate(value):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else part
            raise invalid(f"messages[{i}].content[{j}].type", kind, "only text parts are supported")
        if not isinstance(text := part.get("text"), str):
            raise invalid(f"messages[{i}].content[{j}].text", text, "must be a string")
        texts.append(text)
    return "\n".join(texts)


#: A chat message's fields mlxq reads: its turn, and the calls it makes or answers.
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id")


def messages(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise invalid("messages", value, "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m:
            raise invalid(f"messages[{i}]", m, "must be an object with 'role' and 'content'")
        unknown_fields(m, _MESSAGE_FIELDS, "messages[].")
        msg = {"role": m["role"], "content": _content(i, m.get("content"))}
        msg.update((k, m[k]) for k in _MESSAGE_FIELDS[2:] if m.get(k) is not None)
        out.append(msg)
    return out


def prompt(value: Any) -> Any:
    if isinstance(value, list):
        if len(value) != 1:
            raise invalid("prompt", value, "send one prompt per request (a list of one string)")
        value = value[0]
    if not isinstance(value, str):
        raise invalid("prompt", value, "must be a string (token-id prompts are not supported)")
    return value
