"""The ASGI app of ``mlxq serve``: ``/v1`` (OpenAI), the dashboard, ``/health``, ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from mlxq.producer.connection import TRANSIENT
from mlxq.producer.gateway import dashboard, openai_routes
from mlxq.producer.gateway.config import GatewayConfig
from mlxq.producer.gateway.errors import APIError, api_error_handler, http_error_handler
from mlxq.producer.gateway.metrics import MetricsMiddleware
from mlxq.producer.gateway.state import Gateway
from mlxq.producer.throttle import cut


async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
    gw: Gateway = request.app.state.gateway
    gw.warn(f"Redis: {type(exc).__name__}: {exc}")
    if isinstance(exc, redis.ResponseError) and not isinstance(exc, TRANSIENT):
        # Redis answered, refusing this request (a key of another type): not an outage.
        return APIError(500, f"Redis refused the request: {exc}", code="redis_error").response()
    return APIError(503, f"Redis is unavailable: {exc}", code="redis_unavailable").response()


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback after this answer; the client gets OpenAI's shape.
    return APIError(500, f"internal error: {type(exc).__name__}").response()


#: Longest text a uvicorn log line quotes from a request (its method, its path).
MAX_LOGGED_CHARS = 200


class _CutArgs(logging.Filter):
    """Cuts what uvicorn's lines quote from a request: a client chooses it (a 15 KB
    method name, a 64 KB path), and the log is no place to grow without bound."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                cut(a, MAX_LOGGED_CHARS) if isinstance(a, str) else a for a in record.args
            )
        return True


_CUT_ARGS = _CutArgs()


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway app; run it with uvicorn (``mlxq serve`` does).

    Args:
        config: Where Redis is, the API key, the queue cap.
    """
    gw = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Here, not sooner: uvicorn configures its loggers after the app is made.
        for name in ("uvicorn.access", "uvicorn.error"):
            logging.getLogger(name).addFilter(_CUT_ARGS)  # once, however many apps
        sampler = asyncio.create_task(gw.sample_forever())
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await gw.aclose()

    app = FastAPI(title="mlxq", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    app.add_middleware(MetricsMiddleware, metrics=gw.metrics)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(redis.RedisError, _redis_down)
    app.add_exception_handler(Exception, _internal)
    app.include_router(openai_routes.router)
    app.include_router(dashboard.page_router)
    app.include_router(dashboard.api_router)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while Redis answers, with the live workers counted; 503 otherwise.

        Redis answering is all it depends on: when the worker view cannot be read (for
        whatever reason, told rate-limited to the log) ``live_workers`` is null.
        """
        try:
            await asyncio.to_thread(gw.redis.ping)
        except redis.RedisError as e:
            return JSONResponse({"status": "error", "redis": str(e)}, status_code=503)
        live = None
        try:
            snap = await gw.latest(max_age=1.0)
            live = sum(1 for w in snap.workers if w.get("alive", True))
        except Exception as e:
            gw.warn(f"/health: reading the workers failed: {type(e).__name__}: {e}")
        return JSONResponse({"status": "ok", "redis": "ok", "live_workers": live})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
