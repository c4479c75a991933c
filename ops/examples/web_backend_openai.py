"""The same web backend as ``web_backend.py``, through the ``openai`` client and ``mlxq serve``.

The backend needs no mlxq package at all: it speaks OpenAI's API to the gateway, which
queues the job (``model`` names the queue). ``GET /ask?prompt=...`` relays one chat
completion's deltas to the browser as server-sent events. OpenAI's API has no way to
re-attach to a completion, so there is one stream per job: when the browser leaves, the
backend closes its stream to the gateway, and the gateway cancels the job.

Run it (Redis, a worker, and ``mlxq serve --port 8000`` up):

    MLXQ_GATEWAY_URL=http://127.0.0.1:8000/v1 uvicorn --app-dir ops/examples \\
        web_backend_openai:app --port 8080

then open http://127.0.0.1:8080/. ``MLXQ_QUEUE`` picks the model (queue, default
``default``); ``MLXQ_API_KEY`` is sent when the gateway needs one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator

import openai
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, StreamingResponse

GATEWAY_URL = os.environ.get("MLXQ_GATEWAY_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("MLXQ_QUEUE", "default")


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.llm = openai.AsyncOpenAI(
        base_url=GATEWAY_URL, api_key=os.environ.get("MLXQ_API_KEY") or "none", max_retries=0
    )
    yield
    await app.state.llm.close()


app = FastAPI(lifespan=lifespan)


def _event(name: str, data: dict[str, object]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


@app.get("/ask")
async def ask(
    request: Request,
    prompt: str = Query(min_length=1),
    max_tokens: int = Query(default=128, ge=1, le=4096),
) -> StreamingResponse:
    llm: openai.AsyncOpenAI = request.app.state.llm
    try:
        completion = await llm.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
    except openai.RateLimitError:
        raise HTTPException(429, "busy: try again in a moment") from None
    except openai.APIStatusError as e:
        raise HTTPException(e.status_code, e.message) from None

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in completion:
                for choice in chunk.choices:
                    if choice.delta.content:
                        yield _event("text", {"text": choice.delta.content})
                    if choice.finish_reason:
                        yield _event("end", {"finish_reason": choice.finish_reason})
        except openai.APIError as e:  # the job failed mid-stream
            yield _event("failed", {"error": e.message})
        finally:
            await completion.close()  # a browser that left cancels its job

    return StreamingResponse(events(), media_type="text/event-stream")


PAGE = """<!doctype html><meta charset="utf-8"><title>mlxq example (openai)</title>
<form id="f"><input id="p" size="60" value="Tell me about the sea"> <button>Ask</button></form>
<pre id="out" style="white-space: pre-wrap"></pre><p id="end"></p>
<script>
document.getElementById("f").onsubmit = ev => {
  ev.preventDefault();
  const out = document.getElementById("out"), end = document.getElementById("end");
  out.textContent = ""; end.textContent = "";
  const prompt = document.getElementById("p").value;
  const src = new EventSource("ask?prompt=" + encodeURIComponent(prompt));
  src.addEventListener("text", e => { out.textContent += JSON.parse(e.data).text; });
  src.addEventListener("end", e => { end.textContent = e.data; src.close(); });
  src.addEventListener("failed", e => { end.textContent = e.data; src.close(); });
  src.onerror = () => src.close();  // a reconnect would ask again: a new job
};
</script>"""


@app.get("/", response_class=HTMLResponse)
async def page() -> str:
    return PAGE
