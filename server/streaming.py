"""SSE framing for streamed completions: `data: {json}` per chunk, `data: [DONE]` last; an error after the stream
started goes out as a `data: {"error": ...}` event. Client disconnect cancels the generator, which aborts the
engine requests (KV freed within a step)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse

from specserve.engine.request import RequestOutput
from specserve.server.errors import api_error
from specserve.server.serving import (
    ServingContext,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    merge,
    now,
    speculation_sum,
    usage,
)
from specserve.server.tools import message_with_calls

DONE = "[DONE]"
OnEnd = Callable[[list[RequestOutput], str], None]


def sse_response(events: AsyncIterator[str], headers: dict[str, str] | None = None) -> EventSourceResponse:
    return EventSourceResponse(events, sep="\n", ping=15, headers=headers)


def _data(obj) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}


async def _guarded(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    try:
        async for chunk in chunks:
            yield _data(chunk)
    except Exception as exc:  # the HTTP status is already sent: report in-band, then end the stream
        yield _data(api_error(exc).body())
    yield {"data": DONE}


def _chunk_maker(ctx: ServingContext, rid: str, obj: str):
    created = now()

    tier = {"service_tier": "default"} if obj == "chat.completion.chunk" else {}  # the tier actually served

    def chunk(choices, **extra):
        return {"id": rid, "object": obj, "created": created, "model": ctx.model_name, **tier, "choices": choices,
                **extra}

    return chunk


async def _deltas(streams, finals: dict[int, RequestOutput], timeout: float | None):
    """(choice index, output) for every output worth a chunk; finished outputs are kept for the usage chunk."""
    async for i, out in merge(streams, timeout):
        if out.finished:
            finals[i] = out
        if out.delta_text or out.finished or out.delta_logprobs:
            yield i, out


def _usage_chunk(chunk, finals: dict[int, RequestOutput], num_prompt_tokens: int, n: int) -> dict:
    outs = [finals[i] for i in sorted(finals)]
    return chunk([], usage=usage(num_prompt_tokens, finals, n), speculation=speculation_sum(outs))


async def _reported(chunks: AsyncIterator[dict], finals: dict[int, RequestOutput], on_end: OnEnd):
    """Pass chunks through; tell on_end how the stream ended: ok, error, or disconnected (cancelled)."""
    status = "disconnected"
    try:
        async for chunk in chunks:
            yield chunk
        status = "ok"
    except Exception:
        status = "error"
        raise
    finally:
        on_end([finals[i] for i in sorted(finals)], status)


def chat_stream(ctx: ServingContext, rid: str, streams, num_prompt_tokens: int, include_usage: bool,
                on_end: OnEnd, tools: tuple[object, bool] | None = None):
    """tools: (parser, parallel_tool_calls) when the output may hold tool calls: each choice's text is then held
    back and sent when it finishes, as a content delta (text before the calls, if any) and one tool_calls delta
    carrying every call whole (OpenAI's shape; not streamed piece by piece)."""
    if tools is not None:
        return _chat_stream_with_tools(ctx, rid, streams, num_prompt_tokens, include_usage, on_end, tools)
    finals: dict[int, RequestOutput] = {}

    async def chunks():
        chunk = _chunk_maker(ctx, rid, "chat.completion.chunk")
        for first in _role_chunks(chunk, len(streams)):
            yield first
        async for i, out in _deltas(streams, finals, ctx.request_timeout):
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            yield chunk([{"index": i, "delta": delta, "logprobs": chat_logprobs(ctx.tokenizer, out.delta_logprobs),
                          "finish_reason": finish_reason(out) if out.finished else None}])
        if include_usage:
            yield _usage_chunk(chunk, finals, num_prompt_tokens, len(streams))

    return sse_response(_guarded(_reported(chunks(), finals, on_end)))


def _role_chunks(chunk, n: int) -> list[dict]:
    """A chat stream's first chunk of each choice: the role."""
    return [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}]) for i in range(n)]


def _chat_stream_with_tools(ctx, rid, streams, num_prompt_tokens, include_usage, on_end, tools):
    finals: dict[int, RequestOutput] = {}

    async def chunks():
        chunk = _chunk_maker(ctx, rid, "chat.completion.chunk")
        for first in _role_chunks(chunk, len(streams)):
            yield first
        async for i, out in _deltas(streams, finals, ctx.request_timeout):
            if not out.finished:
                continue
            message, called = message_with_calls(out.text, *tools, delta=True)
            if message["content"]:
                yield chunk([{"index": i, "delta": {"content": message["content"]}, "logprobs": None,
                              "finish_reason": None}])
            if called:
                yield chunk([{"index": i, "delta": {"tool_calls": message["tool_calls"]}, "logprobs": None,
                              "finish_reason": None}])
            reason = "tool_calls" if called and finish_reason(out) == "stop" else finish_reason(out)
            yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])
        if include_usage:
            yield _usage_chunk(chunk, finals, num_prompt_tokens, len(streams))

    return sse_response(_guarded(_reported(chunks(), finals, on_end)))


def completion_stream(ctx: ServingContext, rid: str, streams, prompts: list[str], n: int, echo: bool,
                      num_prompt_tokens: int, include_usage: bool, on_end: OnEnd):
    finals: dict[int, RequestOutput] = {}

    async def chunks():
        chunk = _chunk_maker(ctx, rid, "text_completion")
        sent_chars = [len(prompts[i // n]) if echo else 0 for i in range(len(streams))]
        if echo:
            for i in range(len(streams)):
                yield chunk([{"index": i, "text": prompts[i // n], "logprobs": None, "finish_reason": None}])
        async for i, out in _deltas(streams, finals, ctx.request_timeout):
            lp = completion_logprobs(ctx.tokenizer, out.delta_logprobs, sent_chars[i])
            sent_chars[i] += len(out.delta_text)
            yield chunk([{"index": i, "text": out.delta_text, "logprobs": lp,
                          "finish_reason": finish_reason(out) if out.finished else None}])
        if include_usage:
            yield _usage_chunk(chunk, finals, num_prompt_tokens, n)

    return sse_response(_guarded(_reported(chunks(), finals, on_end)))
