"""The dashboard: ``GET /`` (one HTML page, no build step) and the JSON it polls.

``/dashboard/api/state`` is queues (with the levels of workers that serve several),
workers (with tok/s and paused rows), recent jobs (newest first, a failed one with its
reason) and the tok/s history; ``/dashboard/api/jobs/<id>/stream`` relays one job's
chunks as server-sent events for the page to follow (a viewer: leaving does not cancel the
job); ``POST /dashboard/api/jobs/<id>/cancel`` and ``.../retry`` are the page's buttons.

``GET /`` carries its first state in the HTML when the gateway has no API key (with one,
the state is the key holder's to see: the page fetches it at once with the key it is
given), so its first paint shows the queues, workers and jobs, never "connecting...".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from functools import cache
from importlib import resources
from typing import Any

import redis
from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, StreamingResponse

from mlxq.producer import AsyncJob, JobFailed, NoSuchJob, shared
from mlxq.producer.gateway.auth import require_key
from mlxq.producer.gateway.errors import APIError
from mlxq.producer.gateway.state import Gateway, level_groups
from mlxq.producer.job import cancel_job, retry_job
from mlxq.producer.listing import failure_reasons, job_queue, recent_jobs
from mlxq.producer.openai_api import sse

#: Jobs the page lists.
JOBS_SHOWN = 50
_MAX_ID_CHARS = 128

page_router = APIRouter()
api_router = APIRouter(prefix="/dashboard/api", dependencies=[Depends(require_key)])


#: Where ``page.html`` takes its first state (JSON, or ``null``).
_SLOT = "/*INITIAL-STATE*/null"
#: What JSON text may hold that an HTML ``<script>`` element must not (it could close the
#: element): escaped as JSON's ``\uXXXX``, which reads back the same (``json.dumps``
#: escapes every other character past ASCII already).
_UNSAFE = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}


@cache
def _page() -> str:
    html = resources.files("mlxq.producer.gateway").joinpath("page.html").read_text("utf-8")
    if html.count(_SLOT) != 1:
        raise RuntimeError(f"page.html must hold {_SLOT!r} once")
    return html


def _by_age(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Newest first, by when each was (last) queued; jobs of unknown age last."""
    return sorted(jobs, key=lambda j: (j["enqueued_at"] is None, -(j["enqueued_at"] or 0.0)))


def _jobs(gw: Gateway) -> list[dict[str, Any]]:
    """The jobs the page lists, newest first, each failed one with its reason."""
    jobs = recent_jobs(gw.redis, None, None, JOBS_SHOWN, gw.warn)
    failed = [j["id"] for j in jobs if j["status"] == "failed"]
    reasons = failure_reasons(gw.redis, failed, gw.warn) if failed else {}
    for j in jobs:
        j["failure_reason"] = reasons.get(j["id"])
    return _by_age(jobs)


async def _state(gw: Gateway) -> dict[str, Any]:
    snap = await gw.snapshot(max_age=0.5)  # the page polls each second
    jobs = await asyncio.to_thread(_jobs, gw)
    return {
        "now": time.time(),
        "queues": snap.queues,
        "levels": level_groups(snap.workers),
        "workers": gw.workers_view(snap),
        "jobs": jobs,
        "rates": [[round(t, 3), round(r, 2)] for t, r in gw.rates.history],
        "history_s": gw.config.history_s,
    }


@page_router.get("/", include_in_schema=False)
async def page(request: Request) -> HTMLResponse:
    gw: Gateway = request.app.state.gateway
    first = "null"
    if gw.config.api_key is None:
        try:
            first = json.dumps(await _state(gw), allow_nan=False).translate(_UNSAFE)
        except (redis.RedisError, ValueError) as e:  # the page loads; its first poll says
            gw.warn(f"GET /: its first state could not be read: {type(e).__name__}: {e}")
    return HTMLResponse(_page().replace(_SLOT, first))


@api_router.get("/state")
async def state(request: Request) -> dict[str, Any]:
    return await _state(request.app.state.gateway)


def _job_id(job_id: str) -> str:
    """The id of a job the page acts on, if it can be one (else 404: no such job)."""
    if not shared.JOB_ID.fullmatch(job_id):
        status, code, said = _NOSUCH
        raise APIError(
            status,
            said.replace("{id}", repr(job_id[:_MAX_ID_CHARS])),
            "invalid_request_error",
            "job_id",
            code,
        )
    return job_id


def _json_only(request: Request) -> None:
    """The page's actions are sent as JSON: a form on another site cannot send that
    without the browser asking this gateway first (CORS), so it cannot press the buttons
    of a gateway without an API key."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(
            415,
            f"Content-Type {kind or 'none'!r}: send application/json",
            code="unsupported_media_type",
        )


#: How the page's actions answer each verdict: (HTTP status, code, what it did or why not).
_NOSUCH = (404, "job_not_found", "no job {id} (never submitted, or its records expired)")
_CANCEL = {
    "canceled": (200, "canceled", "job {id} canceled"),
    "requested": (200, "cancel_requested", "job {id}: cancel requested, it ends at its next step"),
    "ended": (409, "job_ended", "job {id} has already ended: nothing to cancel"),
    "nosuch": _NOSUCH,
}
_RETRY = {
    "requeued": (200, "requeued", "job {id} queued again, as a new attempt"),
    "active": (409, "job_not_ended", "job {id} is queued or running: it has no end to retry"),
    "finished": (409, "job_finished", "job {id} finished: only failed or canceled jobs retry"),
    "noqueue": (409, "job_no_queue", "job {id} names no queue to go back to"),
    "oom": (503, "redis_oom", "job {id} not requeued: Redis is out of memory"),
    "nosuch": _NOSUCH,
}


async def _act(
    request: Request,
    job_id: str,
    verb: Callable[[redis.Redis, str], str],
    table: dict[str, tuple[int, str, str]],
) -> dict[str, str]:
    """One of the page's buttons: ``verb`` run on the job off the event loop, its verdict
    answered from ``table`` (an unknown verdict is a 500 naming it)."""
    _json_only(request)
    gw: Gateway = request.app.state.gateway
    verdict = await asyncio.to_thread(verb, gw.redis, _job_id(job_id))
    status, code, said = table.get(verdict, (500, "unknown_verdict", f"job {{id}}: {verdict!r}"))
    message = said.replace("{id}", job_id)
    if status != 200:
        raise APIError(status, message, param="job_id", code=code)
    return {"id": job_id, "result": code, "message": message}


@api_router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: str) -> dict[str, str]:
    return await _act(request, job_id, cancel_job, _CANCEL)


@api_router.post("/jobs/{job_id}/retry")
async def retry(request: Request, job_id: str) -> dict[str, str]:
    return await _act(request, job_id, retry_job, _RETRY)


async def _relay(job: AsyncJob) -> AsyncIterator[str]:
    try:
        async for c in job.stream():
            yield sse(
                {
                    "seq": c.seq,
                    "kind": c.kind,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "usage": c.usage,
                }
            )
    except JobFailed as e:
        yield sse({"kind": "error", "error": e.reason})


@api_router.get("/jobs/{job_id}/stream")
async def follow(request: Request, job_id: str) -> StreamingResponse:
    gw: Gateway = request.app.state.gateway
    queue = None
    if len(job_id) <= _MAX_ID_CHARS:
        queue = await asyncio.to_thread(job_queue, gw.redis, job_id)
    if queue is None:
        raise APIError(
            404, f"no job {job_id[:_MAX_ID_CHARS]!r}", param="job_id", code="job_not_found"
        )
    try:
        job = await gw.client(queue).job(job_id)
    except NoSuchJob:
        raise APIError(404, f"no job {job_id!r}", param="job_id", code="job_not_found") from None
    return StreamingResponse(
        _relay(job),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
