"""API-key check for /v1/*: `Authorization: Bearer KEY` when the server was started with --api-key or
--api-key-file (one key per line: one tenant per key). The key that matched names the request's tenant, which
salts its prefix-cache blocks (engine/sched/prefix_hash.py) unless the operator shares the cache between keys."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from specserve.server.errors import APIError


def resolve_api_keys(api_key: str | None, api_key_file: str | None) -> tuple[str, ...]:
    """The key from the flag/env, or every non-empty line of api_key_file (lines starting with # are comments)."""
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                keys = tuple(k for k in (line.strip() for line in f) if k and not k.startswith("#"))
        except OSError as exc:
            raise ValueError(f"api_key_file: cannot read {api_key_file}: {exc.strerror}") from None
        if not keys:
            raise ValueError(f"api_key_file: {api_key_file} holds no key")
        return keys
    return (api_key,) if api_key else ()


def tenant_of(key: str) -> str:
    """A stable name for a key that does not reveal it (logs, cache salts)."""
    return hashlib.sha256(b"specserve-tenant\0" + key.encode()).hexdigest()[:16]


async def require_api_key(request: Request) -> None:
    keys = request.app.state.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    matched = [k for k in keys if hmac.compare_digest(given, k.encode())]  # every key compared: no early exit
    if scheme.lower() != "bearer" or not matched:
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    request.state.tenant = tenant_of(matched[0])
