"""Responses API output: a finished generation as OpenAI's Response object (output items `message` with
`output_text`, `function_call`), and a streamed one as its typed SSE events (`event: <type>` + `data: {...}`, each
with `type` and `sequence_number`; no `[DONE]`, as OpenAI ends these streams).

Streaming order: response.created, response.in_progress, then per output item: output_item.added,
(content_part.added, output_text.delta ..., output_text.done, content_part.done) or
(function_call_arguments.delta, function_call_arguments.done), output_item.done; then response.completed (or
response.incomplete when max_output_tokens cut it). An error after the stream began: `error`, then response.failed.
With tools the text is held back until the generation ends (the calls are parsed from the whole output, as on the
chat endpoint), then sent as items.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable

from specserve.engine.request import RequestOutput
from specserve.server.errors import api_error
from specserve.server.responses_protocol import ResponsesRequest
from specserve.server.serving import ServingContext, chat_logprobs, merge, now, speculation_sum, usage
from specserve.server.streaming import OnEnd, sse_response
from specserve.server.tools import message_with_calls

OnStored = Callable[[dict, list[dict]], None]  # (response, the conversation's chat messages incl. the output)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(num_prompt_tokens: int, outs: list[RequestOutput]) -> dict:
    u = usage(num_prompt_tokens, outs)
    # cache_write_tokens: OpenAI's field for explicitly written cache entries; prefix caching here has none
    details = {"cache_write_tokens": 0} | u["prompt_tokens_details"]
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class ResponseShell:
    """The fields of one Response that do not depend on how the generation went."""

    def __init__(self, ctx: ServingContext, rid: str, body: ResponsesRequest):
        self.ctx, self.rid, self.body, self.created = ctx, rid, body, now()

    def make(self, status: str, output: list[dict], outs: list[RequestOutput] | None = None,
             num_prompt_tokens: int = 0, error: dict | None = None) -> dict:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        resp = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error, "incomplete_details": incomplete, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "max_tool_calls": None, "model": self.ctx.model_name,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id,
                "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
                "service_tier": "default", "store": b.store,
                "temperature": 1.0 if b.temperature is None else b.temperature, "text": b.echo_text(),
                "tool_choice": b.echo_tool_choice(), "tools": b.echo_tools(),
                "top_logprobs": b.top_logprobs or 0, "top_p": 1.0 if b.top_p is None else b.top_p,
                "truncation": b.truncation or "disabled",
                "safety_identifier": b.safety_identifier, "prompt_cache_key": b.prompt_cache_key,
                "metadata": b.metadata or {}}
        if b.user is not None:  # a plain string in OpenAI's schema (deprecated), never null
            resp["user"] = b.user
        if outs:  # usage is an object or absent in OpenAI's schema, never null
            resp["usage"] = response_usage(num_prompt_tokens, outs)
            resp["speculation"] = speculation_sum(outs)
        return resp


def _message_item(text: str, status: str, logprobs: list | None) -> dict:
    return {"id": _item_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(call: dict) -> dict:
    return {"id": _item_id("fc"), "type": "function_call", "status": "completed", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def output_items(ctx: ServingContext, out: RequestOutput, tools: tuple[object, bool] | None,
                 logprobs: bool) -> tuple[list[dict], dict]:
    """A finished generation -> (output items, the assistant's chat message for a stored conversation)."""
    status = "incomplete" if out.finish_reason == "length" else "completed"
    lps = chat_logprobs(ctx.tokenizer, out.logprobs)["content"] if logprobs and out.logprobs is not None else None
    if tools is None:
        return [_message_item(out.text, status, lps)], {"role": "assistant", "content": out.text}
    message, called = message_with_calls(out.text, *tools)
    if not called:
        return [_message_item(out.text, status, lps)], {"role": "assistant", "content": out.text}
    items = [_message_item(message["content"], status, None)] if message["content"] else []
    items += [_call_item(c) for c in message["tool_calls"]]
    return items, {"role": "assistant", "content": message["content"] or "", "tool_calls": message["tool_calls"]}


def response_status(out: RequestOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def final_response(shell: ResponseShell, out: RequestOutput, num_prompt_tokens: int,
                   tools: tuple[object, bool] | None) -> tuple[dict, dict]:
    """(the Response, the assistant's chat message)."""
    items, message = output_items(shell.ctx, out, tools, shell.body.wants_logprobs)
    return shell.make(response_status(out), items, [out], num_prompt_tokens), message


# -- streaming ---------------------------------------------------------------------------------------------------

def _event(seq: list[int], kind: str, **fields) -> dict:
    seq[0] += 1
    return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq[0] - 1, **fields},
                                              ensure_ascii=False, separators=(",", ":"))}


def _item_events(seq: list[int], index: int, item: dict) -> list[dict]:
    """All the events of one output item known whole (a held-back message, a parsed function call)."""
    added = {k: v for k, v in item.items()} | {"status": "in_progress"}
    if item["type"] == "message":
        added["content"] = []
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [_event(seq, "response.output_item.added", output_index=index, item=added),
                _event(seq, "response.content_part.added", **ids, part=_text_part("", None)),
                _event(seq, "response.output_text.delta", **ids, delta=part["text"], logprobs=part["logprobs"]),
                _event(seq, "response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"]),
                _event(seq, "response.content_part.done", **ids, part=part),
                _event(seq, "response.output_item.done", output_index=index, item=item)]
    added["arguments"] = ""
    ids = {"item_id": item["id"], "output_index": index}
    return [_event(seq, "response.output_item.added", output_index=index, item=added),
            _event(seq, "response.function_call_arguments.delta", **ids, delta=item["arguments"]),
            _event(seq, "response.function_call_arguments.done", **ids, name=item["name"],
                   arguments=item["arguments"]),
            _event(seq, "response.output_item.done", output_index=index, item=item)]


def response_stream(shell: ResponseShell, streams, num_prompt_tokens: int, tools: tuple[object, bool] | None,
                    on_end: OnEnd, on_stored: OnStored | None):
    """The SSE response of a streamed Responses request (one generation: `streams` holds one stream)."""
    ctx, finals = shell.ctx, {}
    logprobs = shell.body.wants_logprobs

    async def events() -> AsyncIterator[dict]:
        seq = [0]
        yield _event(seq, "response.created", response=shell.make("in_progress", []))
        yield _event(seq, "response.in_progress", response=shell.make("in_progress", []))
        msg = None  # the streamed message item (no tools): its id once opened
        status = "disconnected"
        try:
            async for _, out in merge(streams, ctx.request_timeout):
                if out.finished:
                    finals[0] = out
                if tools is not None:
                    continue
                if msg is None:
                    msg = _message_item("", "in_progress", None)
                    added = dict(msg, content=[])
                    yield _event(seq, "response.output_item.added", output_index=0, item=added)
                    yield _event(seq, "response.content_part.added", item_id=msg["id"], output_index=0,
                                 content_index=0, part=_text_part("", None))
                lps = chat_logprobs(ctx.tokenizer, out.delta_logprobs)["content"] \
                    if logprobs and out.delta_logprobs else []
                if out.delta_text or lps:
                    yield _event(seq, "response.output_text.delta", item_id=msg["id"], output_index=0,
                                 content_index=0, delta=out.delta_text, logprobs=lps)
            out = finals[0]
            items, message = output_items(ctx, out, tools, logprobs)
            if msg is not None:  # the message streamed above: close it under the id it was opened with
                item = dict(items[0], id=msg["id"])
                part = item["content"][0]
                ids = {"item_id": msg["id"], "output_index": 0, "content_index": 0}
                yield _event(seq, "response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"])
                yield _event(seq, "response.content_part.done", **ids, part=part)
                yield _event(seq, "response.output_item.done", output_index=0, item=item)
                items = [item]
            else:
                for i, item in enumerate(items):
                    for e in _item_events(seq, i, item):
                        yield e
            final = shell.make(response_status(out), items, [out], num_prompt_tokens)
            if on_stored is not None:
                on_stored(final, [message])
            status = "ok"
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield _event(seq, kind, response=final)
        except Exception as exc:  # the HTTP status is already sent: report in-band, then end the stream
            status = "error"
            err = api_error(exc)
            yield _event(seq, "error", code=err.code or err.type, message=err.message, param=err.param)
            yield _event(seq, "response.failed", response=shell.make(
                "failed", [], error={"code": err.code or "server_error", "message": err.message}))
        finally:
            on_end([finals[i] for i in sorted(finals)], status)

    return sse_response(events())
