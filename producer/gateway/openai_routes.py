"""``/v1``: OpenAI's models, completions and chat completions over mlxq queues.

``model`` names the queue, unless the request's ``service_tier`` is one ``mlxq serve
--service-tier`` sends to a queue of its own. Every answer, and every streamed chunk, names
the tier it was served at: the mapped tier, else ``default`` (``auto`` resolves to it, as
OpenAI's does). A completion is one job; streamed, its chunks are relayed as
server-sent events as the worker makes them. A client that goes away cancels its job,
streamed or not. A failed job answers by its cause (:class:`~mlxq.producer.outcome.Failure`):
400 for input the model cannot take (``context_length_exceeded``, ``invalid_request_error``:
clients do not retry those), 504 past its deadline, 500 for anything else. Mid-stream
failures end the stream with an error event of the same code and ``data: [DONE]``, since
the 200 status has been sent. A worker lost mid-job makes
mlxq run the job again from the start; text already streamed cannot be taken back, so
the stream ends with such an error event then and the job is canceled (the client may
retry); a non-streamed request just waits for the new attempt's result.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxq.producer import AsyncJob, JobFailed, NotReplicated, PayloadError, QueueFull, Result
from mlxq.producer.errors import InvalidRequest
from mlxq.producer.gateway.auth import require_key
from mlxq.producer.gateway.errors import APIError
from mlxq.producer.gateway.resume import Resume, Void
from mlxq.producer.gateway.state import Gateway
from mlxq.producer.openai_api import (
    CHAT,
    COMPLETIONS,
    SSE_DONE,
    ChunkFormatter,
    OpenAIRequest,
    completion_body,
    error_body,
    parse_request,
    sse,
)
from mlxq.producer.openai_api.tool_calls import AUTO, auto_needs_format
from mlxq.producer.outcome import Failure

#: Largest request body read; mlxq's own prompt cap is a million characters.
MAX_BODY_BYTES = 16 * 1024 * 1024
#: Most JSON values (array items, object fields) a body may hold: OpenAI's shapes need a
#: few thousand at most (1,024 messages, 300 logit_bias entries, 64 KB of metadata);
#: this many decode in well under 0.1 s.
MAX_BODY_VALUES = 100_000
#: A status for requests whose client left before the answer (nginx's convention).
CLIENT_GONE = 499

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _model_entry(queue: str, workers: list[dict[str, Any]]) -> dict[str, Any]:
    models = sorted({str(w.get("model", "")) for w in workers} - {""})
    births = [w["started_at"] for w in workers if w.get("started_at")]
    return {
        "id": queue,
        "object": "model",
        "created": int(min(births)) if births else 0,
        "owned_by": "mlxq",
        "root": ",".join(models),
        "workers": len(workers),
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The queues that have a live worker; ``root`` is the model path they serve."""
    snap = await _gateway(request).snapshot(max_age=1.0)
    return {"object": "list", "data": [_model_entry(q, ws) for q, ws in snap.served().items()]}


@router.get("/models/{model:path}")
async def get_model(request: Request, model: str) -> dict[str, Any]:
    gw = _gateway(request)
    await gw.client_for(model)  # 404 / 503 as for a completion
    snap = await gw.snapshot(max_age=1.0)
    return _model_entry(model, snap.serving(model))


def _values_over(raw: bytes, cap: int) -> int | None:
    """How many JSON values (array items, object fields) ``raw`` holds at least, when
    that is over ``cap``; None when it is ``cap`` or fewer.

    Decoding is the one step the gateway cannot interrupt (it holds the interpreter, so
    every other request waits), and its time grows with the number of values: a 16 MB
    body of half a million fields takes half a second. So the values are bounded first,
    from byte counts alone: the separators and brackets bound them from above (those
    inside strings count too, so a long prompt of commas gets a closer look), the quotes
    from below (every string is a value or a key).
    """
    separators = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if separators <= cap:
        return None
    # Take escaped backslashes, then escaped quotes, out: every quote left opens or closes
    # a string.
    bare = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    strings = bare.count(b'"') // 2
    if strings > cap:
        return strings
    # Few strings: split them out (cheap, few parts) and count what is outside them.
    outside = b"".join(bare.split(b'"')[0::2])
    n = outside.count(b",") + outside.count(b"[") + outside.count(b"{")
    return n if n > cap else None


async def _json_body(request: Request) -> Any:
    """The request's body, decoded.

    Raises:
        APIError: 413 over :data:`MAX_BODY_BYTES`; 400 when it is not JSON, holds over
            :data:`MAX_BODY_VALUES` values or nests deeper than the decoder goes.
    """
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        parts.append(part)
    raw = b"".join(parts)
    if (n := _values_over(raw, MAX_BODY_VALUES)) is not None:
        raise APIError(
            400, f"the request body holds {n} JSON values or more (at most {MAX_BODY_VALUES})"
        )
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _submit(gw: Gateway, req: OpenAIRequest) -> tuple[AsyncJob, str, str]:
    """The request's job, on the queue its model or service tier picks, that tier, and
    the tool-call format of the queue's model.

    Raises:
        APIError: 400 for ``tool_choice="auto"`` on a model of no format mlxq reads.
    """
    client, tier = await gw.route(req.model, req.service_tier)
    _within_limits(req.submit, *await gw.limits(client.queue_name))
    tool_format = await gw.tool_format(client.queue_name)
    if req.tool_calls == AUTO and (why := auto_needs_format(tool_format)):
        raise APIError(400, why, param="tool_choice")
    try:
        return await client.submit(**req.submit), tier, tool_format
    except QueueFull as e:
        raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
    except NotReplicated as e:  # --wait-replicas: the replicas lag or are gone
        raise APIError(503, str(e), code="not_replicated", headers={"Retry-After": "1"}) from None
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param) from None
    except PayloadError as e:  # the gateway's own client caps (max_tokens_cap)
        raise APIError(400, str(e)) from None


def _within_limits(submit: dict[str, Any], context: int, vocab: int) -> None:
    """Refuse, before it is queued, what the queue's model cannot take whatever the prompt:
    ``max_tokens`` that leave no room for a prompt in its context, token ids past its
    vocabulary (the worker would fail the job with the same reason).

    Raises:
        APIError: 400, ``context_length_exceeded`` or ``invalid_request_error``.
    """
    max_tokens = submit.get("max_tokens")
    if context and isinstance(max_tokens, int) and max_tokens >= context:
        raise APIError(
            400,
            f"max_tokens={max_tokens}: the model's context is {context} tokens, prompt included",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if not vocab:
        return
    for name in ("logit_bias", "stop_token_ids"):
        ids = submit.get(name) or ()
        if past := sorted(int(t) for t in ids if int(t) >= vocab):
            raise APIError(
                400,
                f"{name}: token id {past[0]} is past the vocabulary ({vocab} tokens)",
                param=name,
                code="invalid_request_error",
            )


@router.post("/completions")
async def completions(request: Request) -> Response:
    return await _complete(request, COMPLETIONS)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _complete(request, CHAT)


async def _complete(request: Request, endpoint: str) -> Response:
    gw = _gateway(request)
    try:
        req = parse_request(await _json_body(request), endpoint)
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param) from None
    job, tier, tools = await _submit(gw, req)
    submitted, created = time.perf_counter(), int(time.time())
    if req.stream:
        fmt = ChunkFormatter(req, job.id, created, tier, tool_format=tools)
        return StreamingResponse(
            _events(gw, req, job, fmt, submitted),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    result = await _result_unless_gone(request, gw, job)
    if result is None:
        return Response(status_code=CLIENT_GONE)
    gw.metrics.e2e.labels(endpoint).observe(time.perf_counter() - submitted)
    gw.metrics.completed(req.model, result.finish_reason, result.usage)
    return JSONResponse(completion_body(req, job.id, result, created, tier, tool_format=tools))


async def _until_disconnect(request: Request) -> None:
    # The body has been read, so the next message uvicorn delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _result_unless_gone(request: Request, gw: Gateway, job: AsyncJob) -> Result | None:
    """The job's result, or None (the job canceled) when the client left first.

    Raises:
        APIError: the job failed: its status and code by cause (``Failure``).
    """
    result = asyncio.ensure_future(job.result())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (result, gone):
            if not t.done():
                t.cancel()
    if not result.done() or result.cancelled():
        await job.cancel()
        gw.metrics.canceled.labels("client_disconnected").inc()
        return None
    try:
        return result.result()
    except JobFailed as e:
        kind = Failure(e.reason)
        raise APIError(kind.status, str(e), kind.type, code=kind.code) from None


def _stream_error(message: str, reason: str = "", code: str | None = None) -> str:
    kind = Failure(reason)
    return sse(error_body(message, kind.type, None, code or kind.code))


async def _events(
    gw: Gateway, req: OpenAIRequest, job: AsyncJob, fmt: ChunkFormatter, submitted: float
) -> AsyncIterator[str]:
    """The SSE body of one streamed completion, its chunks shaped by ``fmt``."""
    endpoint = req.endpoint
    ended, first, cut = False, True, "client_disconnected"
    gw.metrics.streams.inc()
    try:
        for obj in fmt.head():
            yield sse(obj)
        resume = Resume()
        async for c in job.stream():
            if c.kind == "reset":  # a restart: kept while it repeats what was sent
                resume.reset()
                continue
            try:
                c = resume.admit(c)
            except Void:
                cut = "restarted"
                yield _stream_error(
                    f"job {job.id} was restarted after its worker was lost; "
                    "the text streamed so far is void: retry the request",
                    code="job_restarted",
                )
                break
            if c.final and c.finish_reason not in ("stop", "length"):
                ended = True
                yield _stream_error(f"job {job.id} ended: {c.finish_reason}", str(c.finish_reason))
                break
            if first and c.text:
                first = False
                gw.metrics.ttft.labels(endpoint).observe(time.perf_counter() - submitted)
            for obj in fmt.chunk(c):
                yield sse(obj)
            if c.final:
                ended = True
                gw.metrics.e2e.labels(endpoint).observe(time.perf_counter() - submitted)
                gw.metrics.completed(req.model, str(c.finish_reason), c.usage)
                for obj in fmt.usage(c.usage):
                    yield sse(obj)
    except JobFailed as e:
        ended = True
        yield _stream_error(str(e), e.reason)
    finally:
        gw.metrics.streams.dec()
        if not ended:
            # Cut off (the client left, or a restart voided the stream): nobody will read
            # the rest. Shielded, as a disconnect arrives as this task's cancellation.
            with anyio.CancelScope(shield=True):
                await job.cancel()
            gw.metrics.canceled.labels(cut).inc()
    yield SSE_DONE
