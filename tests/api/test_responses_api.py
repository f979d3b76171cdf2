"""POST /v1/responses (OpenAI's Responses API) in-process on the tiny pair: the same generation as the chat request of
the same messages (greedy, streamed and not), the typed SSE events in order and against OpenAI's schemas, tools
(function_call items, the history's function_call / function_call_output items), text.format, the response store
(previous_response_id, GET, DELETE, 404s, eviction), the 400s naming the field; and vLLM's /tokenize and
/detokenize."""

from __future__ import annotations

import json

import pytest

from specserve.server.response_store import ResponseStore
from tests.api.conftest import make_client, wait_ready
from tests.api.test_openapi_shapes import validate  # noqa: F401  (the fixture)
from tests.api.test_tools_api import TOOLS, long_tiny  # noqa: F401  (the fixture)

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def client(long_tiny):  # noqa: F811
    with make_client(long_tiny, served_model_name="tiny", responses_store_max_entries=3) as c:
        wait_ready(c)
        yield c


def sse_typed(response) -> list[tuple[str, dict]]:
    """(event name, data) of a Responses stream; every data line is JSON whose type is the event's name."""
    events, name = [], None
    for line in response.iter_lines():
        if not line:
            continue
        if line.startswith("event: "):
            name = line[len("event: "):]
            continue
        assert line.startswith("data: "), line
        data = json.loads(line[len("data: "):])
        assert data["type"] == name, (name, data)
        events.append((name, data))
    return events


def chat_text(client, messages, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "temperature": 0,
                                                   "max_completion_tokens": 12} | extra)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def output_text(resp: dict) -> str:
    return "".join(p["text"] for item in resp["output"] if item["type"] == "message" for p in item["content"])


def test_greedy_output_equals_chat_completions(client, validate):  # noqa: F811
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]
    r = client.post("/v1/responses", json=GREEDY | {"instructions": "You are terse.", "input": items})
    assert r.status_code == 200, r.text
    resp = r.json()
    choice = chat_text(client, [{"role": "system", "content": "You are terse."},
                                {"role": "developer", "content": "Answer briefly."},
                                {"role": "user", "content": "Name a colour."}])
    assert output_text(resp) == choice["message"]["content"] and resp["object"] == "response"
    assert resp["status"] == ("incomplete" if choice["finish_reason"] == "length" else "completed")
    assert resp["usage"]["output_tokens"] >= 1 and resp["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 0} and resp["speculation"]["method"]
    if validate:
        validate(resp, "Response")
    # a plain string input is one user message
    r = client.post("/v1/responses", json=GREEDY | {"input": "Name a colour."})
    assert output_text(r.json()) == chat_text(client, [{"role": "user", "content": "Name a colour."}])["message"][
        "content"]


def test_stream_events_in_order_and_same_text(client, validate):  # noqa: F811
    body = GREEDY | {"input": "Tell me a story.", "stream": True, "max_output_tokens": 10}
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = sse_typed(r)
    names = [n for n, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 10 tokens with ignore-free greedy: cut by max_output_tokens
    assert set(names[4:-4]) <= {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert deltas == events[-4][1]["text"] == output_text(final)
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["usage"]["output_tokens"] == 10
    item_ids = {d.get("item_id") or d.get("item", {}).get("id") for n, d in events[2:-1]}
    assert len(item_ids) == 1  # every event of the message names the same item
    plain = client.post("/v1/responses", json={k: v for k, v in body.items() if k != "stream"}).json()
    assert output_text(plain) == deltas
    if validate:
        schemas = {"response.created": "ResponseCreatedEvent", "response.in_progress": "ResponseInProgressEvent",
                   "response.output_item.added": "ResponseOutputItemAddedEvent",
                   "response.content_part.added": "ResponseContentPartAddedEvent",
                   "response.output_text.delta": "ResponseTextDeltaEvent",
                   "response.output_text.done": "ResponseTextDoneEvent",
                   "response.content_part.done": "ResponseContentPartDoneEvent",
                   "response.output_item.done": "ResponseOutputItemDoneEvent",
                   "response.incomplete": "ResponseIncompleteEvent"}
        for name, data in events:
            validate(data, schemas[name])


def test_required_tool_choice_gives_function_call_items(client, validate):  # noqa: F811
    body = GREEDY | {"input": "Weather in Oslo?", "tools": FLAT_TOOLS, "tool_choice": "required",
                     "max_output_tokens": 80, "parallel_tool_calls": False}
    resp = client.post("/v1/responses", json=body).json()
    calls = [i for i in resp["output"] if i["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] in ("get_weather", "get_time"), resp
    assert calls[0]["call_id"].startswith("call_") and json.loads(calls[0]["arguments"]) is not None
    if validate:
        validate(resp, "Response")
    named = client.post("/v1/responses", json=body | {"tool_choice": {"type": "function", "name": "get_time"}})
    assert [i["name"] for i in named.json()["output"] if i["type"] == "function_call"] == ["get_time"]
    with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as r:
        events = sse_typed(r)
    names = [n for n, _ in events]
    assert "response.function_call_arguments.delta" in names and names[-1] == "response.completed"
    done = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0]["arguments"]) is not None
    # the call and its output sent back as history: the same generation as chat's tool_calls + tool message
    call = calls[0]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                "arguments": call["arguments"]},
               {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 12 C"}]
    follow = client.post("/v1/responses", json=GREEDY | {"input": history, "tools": FLAT_TOOLS,
                                                         "tool_choice": "none"}).json()
    chat = chat_text(client, [{"role": "user", "content": "Weather in Oslo?"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": call["call_id"], "type": "function",
                                   "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                              {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny, 12 C"}],
                     tools=TOOLS, tool_choice="none")
    assert output_text(follow) == chat["message"]["content"]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = GREEDY | {"input": "Is it ok?", "max_output_tokens": 30,
                     "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}
    resp = client.post("/v1/responses", json=body).json()
    assert isinstance(json.loads(output_text(resp))["ok"], bool)
    assert resp["text"]["format"]["type"] == "json_schema" and resp["text"]["format"]["name"] == "answer"


def test_store_previous_response_get_delete(client):
    first = client.post("/v1/responses", json=GREEDY | {"input": "Say hi.", "store": True}).json()
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    second = client.post("/v1/responses", json=GREEDY | {"input": "And again.", "store": True,
                                                         "previous_response_id": first["id"]}).json()
    assert second["previous_response_id"] == first["id"]
    chat = chat_text(client, [{"role": "user", "content": "Say hi."},
                              {"role": "assistant", "content": output_text(first)},
                              {"role": "user", "content": "And again."}])
    assert output_text(second) == chat["message"]["content"]
    deleted = client.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    for r in (client.get(f"/v1/responses/{first['id']}"), client.delete(f"/v1/responses/{first['id']}"),
              client.post("/v1/responses", json=GREEDY | {"input": "x", "previous_response_id": first["id"]})):
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    unstored = client.post("/v1/responses", json=GREEDY | {"input": "Say hi."}).json()
    assert unstored["store"] is False and client.get(f"/v1/responses/{unstored['id']}").status_code == 404
    # the store holds 3 (responses_store_max_entries): the oldest goes first
    ids = [client.post("/v1/responses", json=GREEDY | {"input": f"n{i}", "store": True,
                                                       "max_output_tokens": 2}).json()["id"] for i in range(4)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert all(client.get(f"/v1/responses/{i}").status_code == 200 for i in ids[1:])


def test_stored_stream_is_continued_like_a_stored_response(client):
    with client.stream("POST", "/v1/responses", json=GREEDY | {"input": "Say hi.", "store": True,
                                                                "stream": True}) as r:
        final = sse_typed(r)[-1][1]["response"]
    assert client.get(f"/v1/responses/{final['id']}").json()["output"] == final["output"]


def test_response_store_ages_out_and_evicts():
    now = [0.0]
    store = ResponseStore(2, 10.0, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    now[0] = 10.5
    store.put({"id": "r3"}, [])
    assert store.get("r1") is None and store.get("r2") is None and store.get("r3") is not None
    assert not store.delete("r1") and store.delete("r3") and len(store) == 0
    assert len(ResponseStore(0, 1.0)) == 0


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"include": ["nope"]}, "include.0"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"nonsense": 1}, "nonsense"),
])
def test_bad_input_is_a_400_naming_the_field(client, extra, param):
    r = client.post("/v1/responses", json={k: v for k, v in ({"model": "tiny", "input": "x"} | extra).items()
                                           if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_unknown_model_and_context_overflow(client):
    r = client.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/v1/responses", json={"model": "tiny", "input": "word " * 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"


def test_tokenize_detokenize_and_model_card(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 2048
    r = client.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"].endswith("Hello there")
    chat = client.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).json()
    served = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                               "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens.0"),
                              ("/detokenize", {"tokens": [1], "model": "nope"}, "model")):
        r = client.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
