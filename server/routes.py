"""HTTP routes, kept thin: parse (protocol), hand to serving/streaming, map errors (errors)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from specserve.engine.tokens import encode_prompt, encode_rendered
from specserve.server.auth import require_api_key
from specserve.server.errors import APIError
from specserve.server.metrics import CONTENT_TYPE
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
)
from specserve.server.request_log import log_finished
from specserve.server.responses import ResponseShell, final_response, response_stream
from specserve.server.responses_protocol import ResponsesRequest
from specserve.server.schema_base import UnsupportedFieldError
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
tokens = APIRouter(dependencies=[Depends(require_api_key)], responses=_ERRORS)  # vLLM's, outside /v1


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
    ctx = request.app.state.ctx
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": now(),
                                         "owned_by": "specserve", "max_model_len": ctx.engine.max_model_len}]}


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


def _chat_jobs(ctx, body: ChatCompletionRequest, request: Request):
    """A chat request's prompt, its token ids, the tool parsing of its output (or None) and its n engine jobs."""
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
    return prompt, ids, tools, jobs


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = _ready(request)
    check_model(ctx, body.model)
    prompt, ids, tools, jobs = _chat_jobs(ctx, body, request)
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


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


@v1.post("/responses")
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API on the chat path (server/responses_protocol.py): the same generation as the chat
    request of the same messages."""
    ctx = _ready(request)
    check_model(ctx, body.model)
    store = request.app.state.responses
    history = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    try:
        chat = body.to_chat(history)
    except UnsupportedFieldError as exc:
        raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    prompt, ids, tools, jobs = _chat_jobs(ctx, chat, request)
    rid = f"resp_{uuid.uuid4().hex}"
    streams = submit_all(ctx, jobs, rid, param="input")
    done = _logger(request, rid, "responses", len(ids), prompt, body)
    shell = ResponseShell(ctx, rid, body)
    conversation = history + body.input_messages()
    on_stored = (lambda resp, reply: store.put(resp, conversation + reply)) if body.store else None
    if body.stream:
        return response_stream(shell, streams, len(ids), tools, done, on_stored)
    outs = await _unless_disconnected(request, collect(streams, ctx.request_timeout))
    done(outs or [], "ok" if outs is not None else "disconnected")
    if outs is None:
        return Response(status_code=499)
    resp, message = final_response(shell, outs[0], len(ids), tools)
    if on_stored is not None:
        on_stored(resp, [message])
    return JSONResponse(resp)


@v1.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    stored = request.app.state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return stored.response


@v1.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not request.app.state.responses.delete(response_id):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


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


def _check_optional_model(ctx, model: str | None) -> None:
    if model is not None:
        check_model(ctx, model)


@tokens.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """vLLM's /tokenize: a prompt as /v1/completions encodes it, or messages as /v1/chat/completions renders them."""
    ctx = _ready(request)
    _check_optional_model(ctx, body.model)
    tok = ctx.tokenizer
    if body.messages is not None:
        chat = ChatCompletionRequest.model_construct(messages=body.messages, tools=None, tool_choice=None)
        text = render_chat_prompt(tok, chat, ctx.tool_parser)
        ids = tok(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"]
    else:
        ids = tok(body.prompt, add_special_tokens=body.add_special_tokens is not False)["input_ids"]
    out = {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


@tokens.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    ctx = _ready(request)
    _check_optional_model(ctx, body.model)
    size = len(ctx.tokenizer)
    bad = [i for i, t in enumerate(body.tokens) if not 0 <= t < size]
    if bad:
        raise APIError(400, f"tokens.{bad[0]}: token id {body.tokens[bad[0]]} is not in the vocabulary "
                       f"(0..{size - 1})", param=f"tokens.{bad[0]}", code="invalid_token_id")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


@router.get("/version")
async def version_info(request: Request):
    return {"version": request.app.version}


@router.get("/metrics", dependencies=[Depends(_probe_auth)])
async def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


router.include_router(v1)
router.include_router(tokens)
