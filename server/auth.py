"""API-key check for /v1/*: `Authorization: Bearer KEY` when the server was started with --api-key."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from the flag/env, or the first line of api_key_file."""
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise ValueError(f"api_key_file: cannot read {api_key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"api_key_file: {api_key_file} is empty")
        return key
    return api_key or None


async def require_api_key(request: Request) -> None:
    key = request.app.state.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
