"""A web backend that queues chat jobs through mlxq and relays their tokens to a browser.

It talks to Redis directly with :class:`mlxq.producer.AsyncClient` (no gateway):
``POST /jobs`` queues a job and returns its id; ``GET /jobs/<id>/stream`` relays the
job's chunks as server-sent events. mlxq keeps every job's chunks in a replay log, so
the stream can be opened before, during or after the job runs: a browser that
reconnects (``EventSource`` does so by itself) clears its text and gets the whole of it
again, never a gap or a repeat. Leaving the page does not cancel the job;
``POST /jobs/<id>/cancel`` does.

Run it (Redis up, and a worker: ``mlxq worker --model PATH --queue default``):

    MLXQ_REDIS_URL=redis://localhost:6379/0 uvicorn --app-dir ops/examples web_backend:app

then open http://127.0.0.1:8000/. ``MLXQ_QUEUE`` picks the queue (default ``default``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel, Field

from mlxq.producer import AsyncClient, AsyncJob, JobFailed, NoSuchJob, QueueFull

REDIS_URL = os.environ.get("MLXQ_REDIS_URL", "redis://localhost:6379/0")
QUEUE = os.environ.get("MLXQ_QUEUE", "default")


class Ask(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=128, ge=1, le=4096)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # One client for the whole app: it holds the Redis connections every request shares.
    app.state.mlxq = AsyncClient(REDIS_URL, queue=QUEUE, max_queued=1000)
    yield
    await app.state.mlxq.aclose()


app = FastAPI(lifespan=lifespan)


async def _job(request: Request, job_id: str) -> AsyncJob:
    try:
        job: AsyncJob = await request.app.state.mlxq.job(job_id)
    except NoSuchJob:
        raise HTTPException(404, f"no job {job_id}") from None
    return job


@app.post("/jobs")
async def create(ask: Ask, request: Request) -> dict[str, str]:
    try:
        job = await request.app.state.mlxq.submit(
            messages=[{"role": "user", "content": ask.prompt}], max_tokens=ask.max_tokens
        )
    except QueueFull:
        raise HTTPException(429, "busy: try again in a moment") from None
    except ValueError as e:  # mlxq names the field and the value it refused
        raise HTTPException(400, str(e)) from None
    return {"job_id": job.id}


def _event(name: str, data: dict[str, object]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


@app.get("/jobs/{job_id}/stream")
async def stream(job_id: str, request: Request) -> StreamingResponse:
    job = await _job(request, job_id)

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in job.stream(timeout=600):
                if chunk.kind == "reset":  # the job restarted (its worker was lost)
                    yield _event("reset", {})
                elif chunk.text:
                    yield _event("text", {"text": chunk.text})
                if chunk.finish_reason:
                    yield _event(
                        "end", {"finish_reason": chunk.finish_reason, "usage": chunk.usage}
                    )
        except JobFailed as e:
            yield _event("failed", {"error": e.reason})

    return StreamingResponse(events(), media_type="text/event-stream")


@app.post("/jobs/{job_id}/cancel")
async def cancel(job_id: str, request: Request) -> dict[str, bool]:
    return {"canceled": await (await _job(request, job_id)).cancel()}


PAGE = """<!doctype html><meta charset="utf-8"><title>mlxq example</title>
<form id="f"><input id="p" size="60" value="Tell me about the sea"> <button>Ask</button></form>
<pre id="out" style="white-space: pre-wrap"></pre><p id="end"></p>
<script>
document.getElementById("f").onsubmit = async ev => {
  ev.preventDefault();
  const out = document.getElementById("out"), end = document.getElementById("end");
  out.textContent = ""; end.textContent = "";
  const prompt = document.getElementById("p").value;
  const res = await fetch("jobs", {method: "POST", body: JSON.stringify({prompt}),
                                   headers: {"Content-Type": "application/json"}});
  if (!res.ok) { end.textContent = "refused: " + (await res.text()); return; }
  const {job_id} = await res.json();
  const src = new EventSource("jobs/" + job_id + "/stream");
  src.onopen = () => { out.textContent = ""; };  // each (re)connection replays it all
  src.addEventListener("text", e => { out.textContent += JSON.parse(e.data).text; });
  src.addEventListener("reset", () => { out.textContent = ""; });
  src.addEventListener("end", e => { end.textContent = e.data; src.close(); });
  src.addEventListener("failed", e => { end.textContent = e.data; src.close(); });
};
</script>"""


@app.get("/", response_class=HTMLResponse)
async def page() -> str:
    return PAGE
