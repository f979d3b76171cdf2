"""Chat and text completions: request body -> engine requests (n choices) -> OpenAI response or SSE chunks."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specserve.engine.client import EngineClient
from specserve.engine.request import RequestOutput, TokenLogprob
from specserve.server.errors import APIError
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.tools import PARSERS, chat_messages, message_with_calls, template_renders_tools


@dataclass
class ServingContext:
    engine: EngineClient
    model_name: str
    request_timeout: float | None = None
    tool_parser: object = None  # server/tools.py: how tool calls look in this model's output

    @property
    def tokenizer(self):
        return self.engine.tokenizer


def check_model(ctx: ServingContext, model: str) -> None:
    if model != ctx.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")


def render_chat_prompt(tokenizer, req: ChatCompletionRequest, parser=None) -> str:
    """The prompt through the model's chat template; tools and tool turns as server/tools.py renders them."""
    parser = parser or PARSERS["hermes"]
    native = template_renders_tools(tokenizer)
    messages, tools = chat_messages(req, parser, native)
    if getattr(tokenizer, "chat_template", None):
        if tools is not None:
            return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # fallback for models without a template: plain role-prefixed turns
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def submit_all(ctx: ServingContext, jobs: list[tuple[str | list[int], object]], request_id: str, param: str):
    """Submit every choice or none: on the first refusal, abort what was already queued."""
    streams = []
    try:
        for i, (prompt, params) in enumerate(jobs):
            streams.append(ctx.engine.submit(prompt, params, request_id=f"{request_id}-{i}"))
    except Exception as exc:
        for s in streams:
            asyncio.ensure_future(s.aclose())
        if getattr(exc, "code", None) == "context_length_exceeded" and getattr(exc, "param", None) != "max_tokens":
            exc.param = param
        raise
    return streams


async def merge(streams, timeout: float | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the choices' outputs as they arrive; closing the merge, or passing `timeout` seconds
    (TimeoutError), aborts unfinished choices."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # surfaced to the consumer below
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    try:
        done = 0
        while done < len(streams):
            async with asyncio.timeout_at(deadline):
                i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            elif item.finished and item.finish_reason == "error":  # this request failed alone in the engine
                raise APIError(500, f"generation failed: {item.error}", type="server_error", code="request_failed")
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def collect(streams, timeout: float | None = None) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for i, out in merge(streams, timeout):
        if out.finished:
            final[i] = out
    return [final[i] for i in range(len(streams))]


def speculation_sum(outs: list[RequestOutput]) -> dict:
    methods = {o.speculation.method for o in outs}
    return {"method": methods.pop() if len(methods) == 1 else "mixed",
            "num_draft_tokens": sum(o.speculation.num_draft_tokens for o in outs),
            "num_accepted_tokens": sum(o.speculation.num_accepted_tokens for o in outs),
            "num_steps": sum(o.speculation.num_steps for o in outs),
            "steps_by_k": {str(k): sum(o.speculation.steps_by_k.get(k, 0) for o in outs)
                           for k in sorted({k for o in outs for k in o.speculation.steps_by_k})}}


def usage(prompt_tokens: int, outs: list[RequestOutput] | dict[int, RequestOutput], n: int = 1) -> dict:
    """OpenAI's usage of a response: `outs` by choice index (a list, or the finished ones of a stream); choices
    i*n .. i*n + n - 1 share prompt i, which counts once (its first choice's cached tokens: prompt_tokens_details)."""
    by_index = outs if isinstance(outs, dict) else dict(enumerate(outs))
    completion = sum(len(o.output_token_ids) for o in by_index.values())
    cached = sum(o.num_cached_tokens for i, o in by_index.items() if i % n == 0)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    outs = list(by_index.values())
    predicted = [o.speculation for o in outs if o.speculation.accepted_prediction_tokens is not None]
    if predicted:  # Predicted Outputs: OpenAI's counts (rejected = prediction tokens absent from the completion)
        out["completion_tokens_details"] = {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in predicted),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in predicted)}
    return out


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None

    def entry(tid, lp):
        text = _token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps], "refusal": None}


def completion_logprobs(tokenizer, lps: list[TokenLogprob] | None, offset: int) -> dict | None:
    if lps is None:
        return None
    tokens = [_token_text(tokenizer, lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# -- non-streamed responses -------------------------------------------------------------------------------------

def chat_response(ctx: ServingContext, rid: str, num_prompt_tokens: int, outs: list[RequestOutput],
                  tools: tuple[object, bool] | None = None) -> dict:
    """tools: (parser, parallel_tool_calls) when the output is to be parsed for tool calls."""
    choices = []
    for i, o in enumerate(outs):
        message, called = ({"role": "assistant", "content": o.text, "refusal": None}, False) if tools is None else \
            message_with_calls(o.text, *tools)
        reason = "tool_calls" if called and finish_reason(o) == "stop" else finish_reason(o)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(ctx.tokenizer, o.logprobs),
                        "finish_reason": reason})
    return {"id": rid, "object": "chat.completion", "created": now(), "model": ctx.model_name,
            "service_tier": "default", "choices": choices,
            "usage": usage(num_prompt_tokens, outs, len(outs)), "speculation": speculation_sum(outs)}


def completion_response(ctx: ServingContext, rid: str, req: CompletionRequest, prompts: list[str],
                        num_prompt_tokens: int, outs: list[RequestOutput]) -> dict:
    choices = []
    for i, o in enumerate(outs):
        prefix = prompts[i // req.n] if req.echo else ""
        choices.append({"index": i, "text": prefix + o.text, "finish_reason": finish_reason(o),
                        "logprobs": completion_logprobs(ctx.tokenizer, o.logprobs, len(prefix))})
    return {"id": rid, "object": "text_completion", "created": now(), "model": ctx.model_name,
            "choices": choices, "usage": usage(num_prompt_tokens, outs, req.n),
            "speculation": speculation_sum(outs)}
