"""Logging setup (text or JSON lines), X-Request-Id handling, and the one log line per finished request
(ids, token counts, acceptance, latency — never the prompt or the output text)."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from specserve.engine.request import RequestOutput

log = logging.getLogger("specserve.requests")
_SAFE_ID = re.compile(r"[^A-Za-z0-9._:\-]")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage()} | getattr(record, "fields", {})
        return json.dumps(line, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        return f"{self.formatTime(record)} {record.levelname} {record.name}: {record.getMessage()} {fields}".rstrip()


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel("DEBUG" if level == "trace" else level.upper())


class RequestIdMiddleware:
    """Honour a client's X-Request-Id (sanitised, ≤ 128 chars) or make one; echo it on every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = _SAFE_ID.sub("", given)[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def log_finished(request_id: str, response_id: str, endpoint: str, started: float, num_prompt_tokens: int,
                 outs: list[RequestOutput], status: str = "ok", prompt: str | list | None = None,
                 who: dict | None = None) -> None:
    """`prompt` is given only when the operator asked for text in logs (--log-prompts); `who`: the client's own
    end-user ids (OpenAI's `user`, `safety_identifier`), when it sent them."""
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    accepted = sum(o.speculation.num_accepted_tokens for o in outs)
    ttfts = [o.first_token_time - o.arrival_time for o in outs if o.first_token_time is not None]
    fields = {"request_id": request_id, "id": response_id, "endpoint": endpoint, "status": status,
              "choices": len(outs), "prompt_tokens": num_prompt_tokens,
              "completion_tokens": sum(len(o.output_token_ids) for o in outs),
              "finish_reasons": ",".join(str(o.finish_reason) for o in outs),
              "cached_tokens": sum(o.num_cached_tokens for o in outs),  # over choices, like the other counts
              "draft_tokens": drafted, "accepted_tokens": accepted,
              "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
              "ttft_s": round(min(ttfts), 4) if ttfts else None, "latency_s": round(time.monotonic() - started, 4)}
    fields |= who or {}
    if prompt is not None:
        fields |= {"prompt": prompt, "completions": [o.text for o in outs]}
    log.info("request finished", extra={"fields": fields})
