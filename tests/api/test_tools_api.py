"""Tool calling through the API (tiny random models, speculation on): required and named tool_choice always parse
(a grammar forces the call), parallel_tool_calls, the history's assistant tool_calls and tool messages, streamed
tool-call deltas, both parsers, shapes against OpenAI's schemas, and the bad-input 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.conftest import make_client, wait_ready
from tests.api.test_endpoints import CHAT, sse_events
from tests.api.test_openapi_shapes import SPEC, validate  # noqa: F401  (the fixture)
from tests.tiny_models import save_llama

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def long_tiny(tiny, tmp_path_factory):
    """The tiny pair with a 2k context: a tool prompt in a byte-level 320-token vocabulary is ~700 tokens."""
    root = tmp_path_factory.mktemp("long")
    tok = tiny["llama"]
    return tiny | {"llama": save_llama(root / "t", tok, tiny["vocab"], seed=0, max_len=2048),
                   "llama_draft": save_llama(root / "d", tok, tiny["vocab"], layers=1, hidden=32, heads=2,
                                             kv_heads=1, seed=1, max_len=2048)}


@pytest.fixture(scope="module")
def client(long_tiny):
    with make_client(long_tiny, served_model_name="tiny") as c:
        wait_ready(c)
        yield c


def calls_of(r) -> list[dict]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_tool_choice_always_parse(client, temperature):
    body = CHAT | {"tools": TOOLS, "max_tokens": 96, "temperature": temperature, "seed": 3}
    assert calls_of(client.post("/v1/chat/completions", json=body | {"tool_choice": "required"}))
    named = {"type": "function", "function": {"name": "get_time"}}
    calls = calls_of(client.post("/v1/chat/completions", json=body | {"tool_choice": named}))
    assert {c["function"]["name"] for c in calls} == {"get_time"}
    one = calls_of(client.post("/v1/chat/completions", json=body | {"tool_choice": "required",
                                                                    "parallel_tool_calls": False}))
    assert len(one) == 1


def test_auto_and_none_answer_with_content_or_calls(client):
    for choice in ("auto", "none", None):
        body = CHAT | {"tools": TOOLS, "max_tokens": 8} | ({"tool_choice": choice} if choice else {})
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["role"] == "assistant" and (msg["content"] is not None or msg.get("tool_calls"))


def test_history_with_tool_calls_and_results(client, validate):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                  "max_tokens": 8})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                  "tool_choice": "required", "max_tokens": 96})
    calls_of(r)
    if SPEC.exists():
        validate(r.json(), "CreateChatCompletionResponse")


def test_streamed_tool_call_deltas(client, validate):
    body = CHAT | {"tools": TOOLS, "tool_choice": "required", "max_tokens": 96, "stream": True,
                   "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-2] if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls and all(json.loads(c["function"]["arguments"]) is not None for c in calls)
    assert [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"]][-1] == "tool_calls"
    if SPEC.exists():
        for e in events[:-1]:
            validate(e, "CreateChatCompletionStreamResponse")


def test_llama3_json_parser(long_tiny):
    with make_client(long_tiny, served_model_name="tiny", tool_call_parser="llama3_json") as c:
        wait_ready(c)
        calls = calls_of(c.post("/v1/chat/completions", json=CHAT | {"tools": TOOLS, "tool_choice": "required",
                                                                     "max_tokens": 96}))
        assert calls


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integr"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json=CHAT | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_openai_sdk_tools_and_streamed_tool_calls(client):
    import openai

    sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="x", http_client=client, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Lima for 3 days?"}]
    r = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                    max_tokens=96, parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    follow = messages + [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = sdk.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=8)
    assert again.choices[0].message.role == "assistant"
    stream = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=96,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         stream=True)
    chunks = list(stream)
    calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments)["city"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_call_arguments_keep_to_the_declared_properties(client):
    loose = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"enum": ["a", "b"]}}, "required": ["key"]}}}]  # no additionalProperties
    for seed in range(3):
        r = client.post("/v1/chat/completions", json=CHAT | {"tools": loose, "tool_choice": "required", "seed": seed,
                                                             "parallel_tool_calls": False,
                                                             "temperature": 1.0, "max_tokens": 64})
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
        for call in r.json()["choices"][0]["message"]["tool_calls"]:
            assert set(json.loads(call["function"]["arguments"])) == {"key"}
