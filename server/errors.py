"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status for each failure."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLongError,
)
from specserve.server.schema_base import UnsupportedFieldError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: Exception) -> APIError:
    """Map an engine exception to the HTTP error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTooLongError):
        return APIError(400, exc.message, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable", code="engine_unavailable")
    if isinstance(exc, TimeoutError):
        return APIError(504, "the request ran past the server's request timeout", type="timeout_error",
                        code="request_timeout")
    return APIError(500, f"internal error: {exc!r}", type="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    original = (err.get("ctx") or {}).get("error")
    if isinstance(original, UnsupportedFieldError):
        return APIError(400, str(original), param=original.param, code="unsupported_parameter")
    # drop "body" and the union-branch names pydantic inserts (e.g. "str", "list[int]") from the location
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_name(str(x))]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('msg')}", code="invalid_json")
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


_FAILURE_REASON = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 413: "too_large",
                   429: "queue_full", 503: "unavailable", 504: "timeout"}


class BodyLimitMiddleware:
    """Refuse request bodies over max_bytes with 413, whether announced by Content-Length or streamed chunked."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, send)
        body, more = [], True
        while more:  # read (at most max_bytes of) the body up front, then replay it to the app
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_bytes:
                return await self._refuse(scope, send)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(body), "more_body": False}],
                                      receive), send)

    async def _refuse(self, scope, send):
        err = APIError(413, f"the request body exceeds max_request_bytes ({self.max_bytes} bytes)",
                       code="request_too_large")
        await err.response()(scope, _replay([], None), send)


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def _respond(request: Request, err: APIError) -> JSONResponse:
    """Answer in OpenAI's shape and count refused /v1 requests in specserve_request_failure_total{reason}."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and request.url.path.startswith("/v1/"):
        metrics.record_failure(_FAILURE_REASON.get(err.status, "error"))
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return _respond(request, _validation_error(exc))

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError):
        return _respond(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _respond(request, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(EngineError)
    async def _on_engine_error(request: Request, exc: EngineError):
        return _respond(request, api_error(exc))

    @app.exception_handler(TimeoutError)
    async def _on_timeout(request: Request, exc: TimeoutError):
        return _respond(request, api_error(exc))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):  # a bug: still answer in OpenAI's shape
        return _respond(request, api_error(exc))
