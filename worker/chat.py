"""A chat job's prompt: its messages (and tools) through the model's chat template.

Also which tool-call format the model speaks (:func:`tool_format`), published in the
worker's stats so that a gateway reads ``tool_choice="auto"`` answers
(:mod:`mlxq.producer.tools`) without a tokenizer of its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mlxq.producer.params import GenerationRequest
from mlxq.producer.tools import HERMES, LLAMA3_JSON

#: mlx-lm's tool parser modules whose format :mod:`mlxq.producer.tools` reads, by ours.
_MLX_LM_PARSERS = {"json_tools": HERMES}


def tool_format(tokenizer: Any) -> str:
    """The tool-call format of the model's answers (one of
    :data:`mlxq.producer.tools.FORMATS`), or "" when it is none mlxq reads.

    mlx-lm's tokenizer wrapper names a parser where it knows the template (Hermes/Qwen's
    ``<tool_call>`` JSON is its ``json_tools``); Llama 3.x's templates, which it does not
    name, ask for ``{"name", "parameters"}`` JSON after ``<|python_tag|>``.
    """
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    if (ours := _MLX_LM_PARSERS.get(module.rsplit(".", 1)[-1])) is not None:
        return ours
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|python_tag|>" in template and '"parameters"' in template:
        return LLAMA3_JSON
    return ""


def _arguments(value: str) -> Any:
    # Templates (Qwen's, Llama's) render a call's arguments from a map, as mlx-lm's
    # server hands them; OpenAI sends them as JSON text.
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, dict) else value


def _turn(m: Mapping[str, Any]) -> dict[str, Any]:
    calls = m.get("tool_calls")
    if not calls:
        return dict(m)
    return {
        **m,
        "tool_calls": [
            {
                **c,
                "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])},
            }
            for c in calls
        ],
    }


def render(tokenizer: Any, req: GenerationRequest) -> str:
    """The prompt text of a chat job: its turns, and its tools where it offers any."""
    kw: dict[str, Any] = {}
    if req.tools:
        kw["tools"] = [dict(t) for t in req.tools]
    return str(
        tokenizer.apply_chat_template(
            [_turn(m) for m in req.messages or ()], add_generation_prompt=True, tokenize=False, **kw
        )
    )
