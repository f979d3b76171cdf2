"""OpenAI's Responses API request (`POST /v1/responses`), validated like the chat endpoint, and its one conversion:
into the chat request the rest of the server already serves (the same template, tool parsing, forced calls,
structured outputs and sampling), so that a Responses call and a chat call of the same messages are the same
generation.

Input items: a string, or `message` items (roles system, developer, user, assistant; text parts), `function_call`
and `function_call_output` items, and `reasoning` items, which are accepted and dropped (this server's models emit
none: a client such as Codex sends back what it was given). Images, files, other tool types and item references
are 400s naming the item.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from specserve.server.protocol import ChatCompletionRequest
from specserve.server.schema_base import RequestModel, StrictModel, UnsupportedFieldError, metadata_limits

MESSAGE_ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# include[] values a client may send; logprobs are returned when asked, the others concern content this server's
# models do not produce
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
              "web_search_call.action.sources", "web_search_call.results")


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """`text.format`: text, json_object, or json_schema {name, schema, strict, description} (flat, unlike chat's
    response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    model_config = {**StrictModel.model_config, "populate_by_name": True}

    def response_format(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.name is None:
            raise UnsupportedFieldError("text.format.name", "text.format.name is required for json_schema")
        spec = {"name": self.name, "schema": self.schema_ or {}}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}

    def echo(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a small model has one verbosity


class ReasoningConfig(StrictModel):
    """Accepted and ignored: the served models do not reason separately (no reasoning items, 0 reasoning tokens)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # events here carry no obfuscation field either way


class ResponsesRequest(RequestModel):
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = False  # this server's default (OpenAI's is true): nothing is kept unless asked
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=256)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # declared so that using them is a 400 naming the field
    prompt: Any = None
    conversation: Any = None
    max_tool_calls: Any = None
    # extensions (vLLM's names, as on chat)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=0)
    speculative_method: str | None = None
    cache_salt: str | None = Field(None, max_length=256)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        return metadata_limits(v)

    @model_validator(mode="after")
    def _checks(self):
        for name in ("prompt", "conversation", "max_tool_calls"):
            if getattr(self, name) is not None:
                raise UnsupportedFieldError(name, f"{name} is not supported by this server")
        if self.background:
            raise UnsupportedFieldError("background", "background responses are not supported by this server")
        if self.truncation == "auto":
            raise UnsupportedFieldError("truncation", "truncation 'auto' is not supported: a conversation longer "
                                        "than the context is a 400 (truncation 'disabled')")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.input is None and self.previous_response_id is None:
            raise UnsupportedFieldError("input", "input is required")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise UnsupportedFieldError("input", "input must not be an empty list")
        for i, value in enumerate(self.include or []):
            if value not in INCLUDABLE:
                raise UnsupportedFieldError(f"include.{i}", f"include: unknown value {value!r}")
        self.function_tools()
        self.input_messages()
        return self

    # -- conversion -------------------------------------------------------------------------------------------------

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise UnsupportedFieldError(f"tools.{i}.type", f"tools.{i}: only function tools are supported "
                                            f"(got type {kind!r})")
            try:
                out.append(FunctionTool.model_validate(tool))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise UnsupportedFieldError(f"tools.{i}.{where}" if where else f"tools.{i}",
                                            f"tools.{i}: {err['msg']}") from None
        return out

    def input_messages(self) -> list[dict]:
        """The input items as chat messages (chat's ChatMessage shape): consecutive function_call items become one
        assistant message's tool_calls, joined to the assistant text right before them."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input, "input")

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request this Responses request is: `history` (a stored conversation being continued) and
        `instructions` first (a system message; not carried over from a previous response, as in OpenAI's API)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        messages += history + self.input_messages()
        if not messages:
            raise UnsupportedFieldError("input", "input is required")
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        body = {"model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                "tool_choice": choice, "metadata": self.metadata, "user": self.user,
                "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
                "seed": self.seed, "top_k": self.top_k, "min_p": self.min_p, "ignore_eos": self.ignore_eos,
                "num_speculative_tokens": self.num_speculative_tokens, "speculative_method": self.speculative_method,
                "cache_salt": self.cache_salt}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.function_tools()]
        forced = choice == "required" or isinstance(choice, dict)
        if self.text is not None and self.text.format is not None and not (self.tools and forced):
            # text.format shapes text output; a forced call has none (the Agents SDK sends both on a turn that
            # must call a tool), so there the call's grammar alone applies
            body["response_format"] = self.text.format.response_format()
        if self.wants_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # a field only the combination can break (the fields above were checked)
            err = exc.errors()[0]
            original = (err.get("ctx") or {}).get("error")
            if isinstance(original, UnsupportedFieldError):  # the chat model's own check names its field
                raise UnsupportedFieldError(_responses_param((original.param,)), str(original)) from None
            raise UnsupportedFieldError(_responses_param(err["loc"]), err["msg"].removeprefix("Value error, ")) \
                from None

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or []) or bool(self.top_logprobs)

    def echo_tools(self) -> list[dict]:
        return [t.model_dump() for t in self.function_tools()]

    def echo_tool_choice(self):
        choice = self.tool_choice or "auto"
        return choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice

    def echo_text(self) -> dict:
        fmt = self.text.format.echo() if self.text is not None and self.text.format is not None else {"type": "text"}
        out = {"format": fmt}
        if self.text is not None and self.text.verbosity is not None:
            out["verbosity"] = self.text.verbosity
        return out


def _responses_param(loc) -> str:
    parts = [str(p) for p in loc]
    names = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
    if parts and parts[0] in names:
        parts[0] = names[parts[0]]
    return ".".join(parts)


def _text_of(content, where: str) -> str:
    """A message item's content: a string, or text parts (input_text, output_text; refusal parts' refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UnsupportedFieldError(f"{where}.content", f"{where}.content: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise UnsupportedFieldError(f"{where}.content.{j}", f"{where}.content.{j}: only text parts are supported "
                                        f"(got type {kind!r})")
    return "".join(texts)


def _required_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise UnsupportedFieldError(f"{where}.{key}", f"{where}.{key}: a string is required")
    return value


def items_to_messages(items: list, field: str) -> list[dict]:
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"{field}.{i}"
        if not isinstance(item, dict):
            raise UnsupportedFieldError(where, f"{where}: an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise UnsupportedFieldError(f"{where}.role", f"{where}.role: one of {', '.join(MESSAGE_ROLES)}")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _required_str(item, "call_id", where), "type": "function",
                    "function": {"name": _required_str(item, "name", where),
                                 "arguments": _required_str(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where) if isinstance(output, list) else None
            if text is None:
                raise UnsupportedFieldError(f"{where}.output", f"{where}.output: a string or text parts")
            messages.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's item sent back; these models have none to use
        else:
            raise UnsupportedFieldError(f"{where}.type", f"{where}: input items of type {kind!r} are not supported "
                                        "(message, function_call, function_call_output, reasoning)")
    return messages
