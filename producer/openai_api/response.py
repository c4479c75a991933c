"""mlxq results and chunks -> OpenAI's completion, chunk and error objects.

Log-probabilities are read as the worker reports them: per token ``{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`` (OpenAI chat's own shape), on
``Result.choices[i].logprobs`` and ``Chunk.logprobs``; completions get them reshaped into
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlxq.producer.codec import Chunk
from mlxq.producer.openai_api.request import OpenAIRequest
from mlxq.producer.openai_api.tool_calls import DeltaReader, finish_reason, message, reader
from mlxq.producer.result import Result


def completion_id(req: OpenAIRequest, job_id: str) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{job_id}"


def usage_body(usage: Mapping[str, int] | None) -> dict[str, int] | None:
    if usage is None:
        return None
    p, c = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _token_entry(e: Mapping[str, Any]) -> dict[str, Any]:
    token = str(e.get("token", ""))
    raw = e.get("bytes")
    return {
        "token": token,
        "logprob": float(e.get("logprob", 0.0)),
        "bytes": list(raw) if raw is not None else list(token.encode("utf-8")),
    }


def _chat_logprobs(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_token_entry(e),
                "top_logprobs": [_token_entry(t) for t in e.get("top_logprobs", ())],
            }
            for e in entries
        ],
        "refusal": None,
    }


def _completion_logprobs(
    entries: Sequence[Mapping[str, Any]], offset: int, top: int
) -> dict[str, Any]:
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(str(e.get("token", "")))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [float(e.get("logprob", 0.0)) for e in entries],
        "top_logprobs": [
            {
                str(t.get("token", "")): float(t.get("logprob", 0.0))
                for t in e.get("top_logprobs", ())
            }
            for e in entries
        ]
        if top
        else None,
        "text_offset": offsets,
    }


def logprobs_body(
    req: OpenAIRequest, entries: Sequence[Mapping[str, Any]] | None, offset: int = 0
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in the endpoint's shape.

    Args:
        entries: One map per token as the worker reports them: ``{"token", "logprob",
            "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`` (OpenAI chat's shape).
        offset: Characters of this choice already sent (completions' ``text_offset``).
    """
    if not req.logprobs or entries is None:
        return None
    if req.chat:
        return _chat_logprobs(entries)
    return _completion_logprobs(entries, offset, req.top_logprobs)


def _choices(result: Result) -> list[Any]:
    choices = getattr(result, "choices", None)
    return list(choices) if choices else [result]


def completion_body(
    req: OpenAIRequest,
    job_id: str,
    result: Result,
    created: int,
    service_tier: str | None = None,
    tool_format: str = "",
) -> dict[str, Any]:
    """The ``chat.completion`` or ``text_completion`` object for a finished job.

    Args:
        service_tier: The tier the job was served at, echoed as OpenAI does; None: no
            ``service_tier`` field.
        tool_format: The tool-call format of the model that answered (its worker's
            published one), for a ``tool_choice="auto"`` answer's calls.
    """
    choices = []
    fmt = reader(req.tool_calls, tool_format)
    for i, c in enumerate(_choices(result)):
        lp = logprobs_body(req, getattr(c, "logprobs", None))
        entry: dict[str, Any] = {"index": getattr(c, "index", i)}
        reason = c.finish_reason
        if req.chat:
            entry["message"], reason = message(c.text, reason, fmt)
        else:
            entry["text"] = c.text
        entry.update(logprobs=lp, finish_reason=reason)
        choices.append(entry)
    body: dict[str, Any] = {
        "id": completion_id(req, job_id),
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage_body(result.usage),
    }
    if service_tier is not None:
        body["service_tier"] = service_tier
    return body


class ChunkFormatter:
    """One job's stream as OpenAI chunk objects, in order.

    Args:
        req: The request.
        job_id: The job's id (chunk ids are ``chatcmpl-<id>`` / ``cmpl-<id>``).
        created: Unix seconds, the same on every chunk.
        service_tier: The tier the job is served at, on every chunk as OpenAI does; None:
            no ``service_tier`` field.
        tool_format: As for :func:`completion_body`.
    """

    def __init__(
        self,
        req: OpenAIRequest,
        job_id: str,
        created: int,
        service_tier: str | None = None,
        tool_format: str = "",
    ) -> None:
        self.req, self.created, self.service_tier = req, created, service_tier
        self.id = completion_id(req, job_id)
        self._sent: dict[int, int] = {}  # characters sent per choice (text_offset)
        self._fmt = reader(req.tool_calls, tool_format) if req.chat else None
        self._readers: dict[int, DeltaReader] = {}  # per choice, when calls are read

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.req.chat else "text_completion"
        out: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if self.service_tier is not None:
            out["service_tier"] = self.service_tier
        if self.req.include_usage:
            out["usage"] = None
        return out

    def head(self) -> list[dict[str, Any]]:
        """What to send before any text: chat's assistant-role delta per choice."""
        if not self.req.chat:
            return []
        return [
            self._envelope(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in range(self.req.n)
        ]

    def chunk(self, c: Chunk) -> list[dict[str, Any]]:
        """The chunk objects for one ``tokens`` chunk (none for an empty one)."""
        entries = getattr(c, "logprobs", None)
        if not c.text and c.finish_reason is None and not entries:
            return []
        index = int(getattr(c, "index", 0) or 0)
        if self._fmt is not None:
            return self._tool_chunks(c, index, entries, self._fmt)
        offset = self._sent.get(index, 0)
        self._sent[index] = offset + len(c.text)
        choice: dict[str, Any] = {"index": index}
        if self.req.chat:
            choice["delta"] = {"content": c.text} if c.text else {}
        else:
            choice["text"] = c.text
        choice.update(
            logprobs=logprobs_body(self.req, entries, offset), finish_reason=c.finish_reason
        )
        return [self._envelope([choice])]

    def _tool_chunks(self, c: Chunk, index: int, entries: Any, fmt: str) -> list[dict[str, Any]]:
        """A chat chunk's objects when its answer is read for calls (in ``fmt``): its
        content and calls as they complete, its log-probs as they come, and the finish
        on a chunk of its own."""
        r = self._readers.setdefault(index, DeltaReader(fmt))
        deltas = r.feed(c.text)
        if c.finish_reason is not None:
            deltas += [*r.finish(), {}]
        elif not deltas and entries:
            deltas = [{}]
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            reason = finish_reason(c.finish_reason, r.calls) if last and c.finish_reason else None
            lp = logprobs_body(self.req, entries) if k == 0 else None
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            out.append(self._envelope([choice]))
        return out

    def usage(self, usage: Mapping[str, int] | None) -> list[dict[str, Any]]:
        """The closing usage chunk, when ``stream_options.include_usage`` asked for it."""
        if not self.req.include_usage:
            return []
        return [{**self._envelope([]), "usage": usage_body(usage or {})}]


def sse(obj: Mapping[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
