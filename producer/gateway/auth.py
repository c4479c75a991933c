"""The API key check: ``Authorization: Bearer KEY``, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from mlxq.producer.gateway.errors import APIError


async def require_key(request: Request) -> None:
    """A FastAPI dependency: passes when no key is configured or the right one is sent.

    Raises:
        APIError: 401 otherwise.
    """
    key: str | None = request.app.state.gateway.config.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest's time depends only on the lengths, never on where the bytes differ.
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return
    raise APIError(
        401,
        "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
