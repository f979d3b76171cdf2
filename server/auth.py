"""API-key check for /v1/*: `Authorization: Bearer KEY` when the server was started with --api-key."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError


async def require_api_key(request: Request) -> None:
    key = request.app.state.config.server.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
