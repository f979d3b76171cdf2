"""The OpenAI API schemas specserve speaks (chat completions, completions, models, errors), with OpenAI's limits,
and the one conversion of a request body into engine SamplingParams."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from specserve.engine.sample.grammar import GrammarSpec
from specserve.engine.sampling_params import SamplingParams
from specserve.server.schema_base import RequestModel, StrictModel, UnsupportedFieldError, metadata_limits
from specserve.server.tool_schemas import NamedToolChoice, ToolCallIn, ToolDef, response_format_spec

MAX_STOP_CHARS = 512


# -- requests --------------------------------------------------------------------------------------------------------

class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only: the call they answer
    # what the SDK's own response message carries when a client passes it back into the history
    refusal: str | None = None
    annotations: list | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # the SDK may send it; SSE here is not obfuscated either way


class _SamplingFields(RequestModel):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=0)
    speculative_method: str | None = None  # one of the methods the server loaded, or "none"
    cache_salt: str | None = Field(None, max_length=256)  # only requests with the same salt share cached KV
    # OpenAI's routing hint for its prompt cache; here it salts the cache like cache_salt
    prompt_cache_key: str | None = Field(None, max_length=256)
    # structured outputs, vLLM's extension names (at most one of them, or response_format on chat)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id -> bias, on p and on a draft model's q alike
    # accepted only with the one value that means "nothing to do"; anything else is a 400 naming the field
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "best_of other than n is not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options is only allowed when stream is true")
        self.grammar_spec()  # response_format's shape; at most one structured-output field
        biases = self.token_biases() or {}
        if len(biases) > 300 or any(t < 0 or not -100 <= b <= 100 for t, b in biases.items()):
            raise UnsupportedFieldError("logit_bias", "logit_bias: at most 300 token ids, biases in [-100, 100]")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, choice: int,
                        prediction: list[int] | None = None, tenant: str | None = None,
                        structured: GrammarSpec | None = None) -> SamplingParams:
        """The single conversion to engine params. Choice i of n uses seed + i (documented). `structured`: a
        grammar the server made (a forced tool call) instead of the request's own structured-output field."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=None if self.seed is None else (self.seed + choice) % (2 ** 63),
            max_tokens=max_tokens, stop=self.stop_list(), ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            num_speculative_tokens=self.num_speculative_tokens, speculative_method=self.speculative_method,
            prediction=prediction, cache_salt=self.prefix_cache_salt(tenant),
            structured=structured or self.grammar_spec(), logit_bias=self.token_biases())

    def token_biases(self) -> dict[int, float] | None:
        """OpenAI's logit_bias (token id strings -> bias): the engine checks ids against the vocabulary."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): float(v) for k, v in self.logit_bias.items()}
        except ValueError:
            raise UnsupportedFieldError("logit_bias", "logit_bias: keys must be token ids (integers)") from None

    def grammar_spec(self) -> GrammarSpec | None:
        """The one grammar the request asks for (guided_* here; chat adds response_format), or None."""
        specs = [s for s in self._grammar_specs() if s is not None]
        if len(specs) > 1:
            names = ", ".join(s.field for s in specs)
            raise UnsupportedFieldError(specs[1].field, f"give at most one structured-output field (got {names})")
        return specs[0] if specs else None

    def _grammar_specs(self) -> list[GrammarSpec | None]:
        guided_json = self.guided_json
        if isinstance(guided_json, str):
            try:
                guided_json = json.loads(guided_json)
            except ValueError:
                raise UnsupportedFieldError("guided_json", "guided_json: not a JSON Schema (invalid JSON)") from None
        return [None if guided_json is None else GrammarSpec("json_schema", json.dumps(guided_json), "guided_json"),
                None if self.guided_regex is None else GrammarSpec("regex", self.guided_regex, "guided_regex"),
                None if self.guided_choice is None else GrammarSpec("choice", json.dumps(self.guided_choice),
                                                                     "guided_choice"),
                None if self.guided_grammar is None else GrammarSpec("grammar", self.guided_grammar,
                                                                      "guided_grammar")]

    def prefix_cache_salt(self, tenant: str | None) -> str | None:
        """What separates this request's cached KV blocks from others': the tenant (API key), OpenAI's
        prompt_cache_key and vLLM's cache_salt; None when none is set (everyone shares)."""
        parts = (tenant, self.prompt_cache_key, self.cache_salt)
        return None if all(p is None for p in parts) else json.dumps(parts)


_CHAT_UNSUPPORTED = ("functions", "function_call", "audio",
                     "reasoning_effort", "web_search_options", "verbosity")


class PredictionContent(StrictModel):
    """OpenAI's Predicted Outputs: text the completion is expected to (mostly) repeat."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # declared so that a request using them gets a 400 that names the field (not an "extra field" message)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: PredictionContent | None = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # accepted and never change generation (OpenAI's limits); the request log keeps safety_identifier and user
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None  # served: "default"
    safety_identifier: str | None = Field(None, max_length=64)
    verbosity: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        return metadata_limits(v)

    @model_validator(mode="after")
    def _chat_unsupported(self):
        for name in _CHAT_UNSUPPORTED:
            if getattr(self, name) is not None:
                raise UnsupportedFieldError(name, f"{name} is not supported by this server")
        if self.modalities is not None and self.modalities != ["text"]:
            raise UnsupportedFieldError("modalities", "only the text modality is supported")
        if self.store:
            raise UnsupportedFieldError("store", "stored completions are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        self._check_tools()
        return self

    def _grammar_specs(self) -> list[GrammarSpec | None]:
        return [response_format_spec(self.response_format), *super()._grammar_specs()]

    def _check_tools(self) -> None:
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise UnsupportedFieldError(f"messages.{i}.tool_call_id", "a tool message needs tool_call_id")
            if m.tool_calls is not None and m.role != "assistant":
                raise UnsupportedFieldError(f"messages.{i}.tool_calls", "only assistant messages carry tool_calls")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise UnsupportedFieldError("tools", "tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise UnsupportedFieldError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise UnsupportedFieldError("tool_choice", f"tool_choice: no tool named {choice.function.name!r}")
        if self.forced_tool_call and self.grammar_spec() is not None:
            raise UnsupportedFieldError("tool_choice", "tool_choice required or a named function cannot be combined "
                                        "with another structured-output field")

    @property
    def tools_active(self) -> bool:
        """The tools are rendered and the output is parsed for calls (tool_choice none: neither)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_dicts(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix (insertion) is not supported")
        if self.echo and self.logprobs is not None:
            raise UnsupportedFieldError("echo", "echo together with logprobs (prompt log-probs) is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# -- responses (shapes follow OpenAI's OpenAPI document; `speculation` is our extension) -------------------------

class Speculation(BaseModel):
    method: str
    num_draft_tokens: int
    num_accepted_tokens: int
    num_steps: int
    steps_by_k: dict[str, int] = {}  # token-emitting steps by the draft tokens they verified ("0" = none)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int | None = None  # vLLM's field: longest prompt + output in tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's tokenizer endpoints ------------------------------------------------------------------------------------

class TokenizeRequest(RequestModel):
    """`POST /tokenize`: a prompt (raw text, the tokenizer's special tokens added unless add_special_tokens is
    false) or chat messages (rendered by the chat template, as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedFieldError("prompt", "give exactly one of prompt and messages")
        if self.messages is not None and not self.add_generation_prompt:
            raise UnsupportedFieldError("add_generation_prompt", "add_generation_prompt false is not supported")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)
