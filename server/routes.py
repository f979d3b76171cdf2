"""HTTP routes, kept thin: parse (protocol), hand to serving/streaming, map errors (errors)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from specserve.engine.tokens import encode_prompt, encode_rendered
from specserve.server.auth import require_api_key
from specserve.server.errors import APIError
from specserve.server.metrics import CONTENT_TYPE
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelList
from specserve.server.request_log import log_finished
from specserve.server.serving import (
    chat_response,
    check_model,
    collect,
    completion_response,
    new_id,
    now,
    render_chat_prompt,
    submit_all,
)
from specserve.server.streaming import chat_stream, completion_stream
from specserve.server.tools import forced_call_grammar

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=_ERRORS)


def _ready(request: Request):
    app = request.app
    if app.state.draining:
        raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
    health = app.state.engine.health()
    if not health.ready:
        raise APIError(503, health.error or f"the engine is {health.state}", type="service_unavailable",
                       code="engine_unavailable")
    return app.state.ctx


async def _unless_disconnected(request: Request, coro):
    """Non-streamed requests: a client that hangs up aborts its engine requests."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


@v1.get("/models", response_model=ModelList)
async def list_models(request: Request):
    return {"object": "list", "data": [{"id": request.app.state.ctx.model_name, "object": "model",
                                         "created": now(), "owned_by": "specserve"}]}


def _logger(request: Request, rid: str, endpoint: str, num_prompt_tokens: int, prompt, body=None):
    started, request_id = time.monotonic(), request.state.request_id
    prompt = prompt if request.app.state.config.server.log_prompts else None
    who = {k: getattr(body, k, None) for k in ("user", "safety_identifier") if getattr(body, k, None) is not None}
    return lambda outs, status: log_finished(request_id, rid, endpoint, started, num_prompt_tokens, outs, status,
                                             prompt, who)


def _tenant(request: Request) -> str | None:
    """The API key's tenant, which salts the prefix cache (unless the operator shares it between keys)."""
    per_key = request.app.state.config.server.prefix_caching_per_key
    return getattr(request.state, "tenant", None) if per_key else None


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = _ready(request)
    check_model(ctx, body.model)
    parser = ctx.tool_parser
    prompt = render_chat_prompt(ctx.tokenizer, body, parser)
    forced = forced_call_grammar(body.tool_dicts(), body.forced_function, body.parallel_tool_calls is not False,
                                 parser) if body.forced_tool_call else None
    tools = (parser, body.parallel_tool_calls is not False) if body.tools_active else None
    ids = encode_rendered(ctx.tokenizer, prompt)
    predicted = None
    if body.prediction is not None:  # tokenised here like the prompt (the engine thread keeps its own tokenizer)
        predicted = encode_rendered(ctx.tokenizer, body.prediction.text())
    tenant = _tenant(request)
    jobs = [(ids, body.sampling_params(body.requested_max_tokens, body.num_logprobs, i, predicted, tenant, forced))
            for i in range(body.n)]
    rid = new_id("chatcmpl")
    streams = submit_all(ctx, jobs, rid, param="messages")
    done = _logger(request, rid, "chat", len(ids), prompt, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return chat_stream(ctx, rid, streams, len(ids), include_usage, done, tools)
    outs = await _unless_disconnected(request, collect(streams, ctx.request_timeout))
    done(outs or [], "ok" if outs is not None else "disconnected")
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(chat_response(ctx, rid, len(ids), outs, tools))


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = _ready(request)
    check_model(ctx, body.model)
    prompts = body.prompts()
    ids = [encode_prompt(ctx.tokenizer, p) if isinstance(p, str) else p for p in prompts]
    tenant = _tenant(request)
    jobs = [(p, body.sampling_params(body.max_tokens if body.max_tokens is not None else 16, body.logprobs, i,
                                     tenant=tenant))
            for p in ids for i in range(body.n)]
    rid = new_id("cmpl")
    streams = submit_all(ctx, jobs, rid, param="prompt")  # range-checks token ids: a bad id is a 400
    texts = [p if isinstance(p, str) else ctx.tokenizer.decode(p) if body.echo else "" for p in prompts]
    num_prompt_tokens = sum(len(p) for p in ids)
    done = _logger(request, rid, "completions", num_prompt_tokens, prompts, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return completion_stream(ctx, rid, streams, texts, body.n, body.echo, num_prompt_tokens, include_usage,
                                 done)
    outs = await _unless_disconnected(request, collect(streams, ctx.request_timeout))
    done(outs or [], "ok" if outs is not None else "disconnected")
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(completion_response(ctx, rid, body, texts, num_prompt_tokens, outs))


async def _probe_auth(request: Request) -> None:
    if request.app.state.config.server.auth_probes:
        await require_api_key(request)


@router.get("/health", dependencies=[Depends(_probe_auth)])
async def health(request: Request):
    h = request.app.state.engine.health()
    if h.ready and not request.app.state.draining:
        return {"status": "ok"}
    state = "draining" if request.app.state.draining else h.state
    return JSONResponse({"status": state, "error": h.error}, status_code=503)


@router.get("/version")
async def version_info(request: Request):
    return {"version": request.app.version}


@router.get("/metrics", dependencies=[Depends(_probe_auth)])
async def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


router.include_router(v1)
