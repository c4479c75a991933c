"""The dashboard: ``GET /`` (one HTML page, no build step) and the JSON it polls.

``/dashboard/api/state`` is queues (with the levels of workers that serve several),
workers (with tok/s and paused rows), recent jobs and the tok/s history;
``/dashboard/api/jobs/<id>/stream`` relays one job's chunks as server-sent events for the
page to follow (a viewer: leaving does not cancel the job).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, StreamingResponse

from mlxq.producer import AsyncJob, JobFailed, NoSuchJob
from mlxq.producer.gateway.auth import require_key
from mlxq.producer.gateway.errors import APIError
from mlxq.producer.gateway.state import Gateway, level_groups
from mlxq.producer.listing import job_queue, recent_jobs
from mlxq.producer.openai_api import sse

#: Jobs the page lists.
JOBS_SHOWN = 50
_MAX_ID_CHARS = 128

page_router = APIRouter()
api_router = APIRouter(prefix="/dashboard/api", dependencies=[Depends(require_key)])


@cache
def _page() -> str:
    return resources.files("mlxq.producer.gateway").joinpath("page.html").read_text("utf-8")


@page_router.get("/", include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(_page())


@api_router.get("/state")
async def state(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    snap = await gw.snapshot(max_age=0.5)  # the page polls each second
    jobs = await asyncio.to_thread(recent_jobs, gw.redis, None, None, JOBS_SHOWN, gw.warn)
    return {
        "now": time.time(),
        "queues": snap.queues,
        "levels": level_groups(snap.workers),
        "workers": gw.workers_view(snap),
        "jobs": jobs,
        "rates": [[round(t, 3), round(r, 2)] for t, r in gw.rates.history],
        "history_s": gw.config.history_s,
    }


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
