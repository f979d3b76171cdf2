"""Endpoints, shapes, streaming framing, errors and status codes, against the real engine."""

import json

import pytest

from tests.api.conftest import make_client, wait_ready

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_models_health_version_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/version").json()["version"]
    text = client.get("/metrics").text
    for name in ("specserve_spec_decode_num_drafts_total", "specserve_spec_decode_num_draft_tokens_total",
                 "specserve_spec_decode_num_accepted_tokens_total", "specserve_num_requests_running",
                 "specserve_num_requests_waiting"):
        assert name in text


def test_chat_completion_with_n_seed_usage_and_speculation(client):
    body = CHAT | {"max_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion" and len(data["choices"]) == 3
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" and c["message"]["role"] == "assistant" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 24
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 24
    spec = data["speculation"]
    assert set(spec) == {"method", "num_draft_tokens", "num_accepted_tokens", "num_steps", "steps_by_k"}
    assert spec["method"] == "draft" and spec["num_draft_tokens"] > 0
    assert sum(int(k) * n for k, n in spec["steps_by_k"].items()) == spec["num_draft_tokens"]  # summed over choices
    assert sum(n for k, n in spec["steps_by_k"].items() if k != "0") == spec["num_steps"]
    again = client.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in data["choices"]]
    # choice i uses seed + i: choice 1 of seed 7 equals choice 0 of seed 8
    shifted = client.post("/v1/chat/completions", json=body | {"seed": 8, "n": 1}).json()
    assert shifted["choices"][0]["message"]["content"] == data["choices"][1]["message"]["content"]


def test_chat_stream_framing_and_usage(client):
    body = CHAT | {"max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks if c["choices"]]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert chunks[-1]["speculation"]["method"] == "draft"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    full = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 10, "temperature": 0,
                                                            "ignore_eos": True}).json()
    greedy_stream = body | {"temperature": 0}
    with client.stream("POST", "/v1/chat/completions", json=greedy_stream) as r:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in sse_events(r)[:-1] if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert isinstance(streamed, str)


def test_completions_prompts_echo_and_stream(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["café", "The quick"], "max_tokens": 4,
                                             "echo": True, "n": 2, "ignore_eos": True})
    data = r.json()
    assert r.status_code == 200 and data["object"] == "text_completion" and len(data["choices"]) == 4
    assert data["choices"][0]["text"].startswith("café") and data["choices"][3]["text"].startswith("The quick")
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3,
                                             "logprobs": 2, "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["top_logprobs"][0]) <= 2 and all(v <= 0 for v in lp["token_logprobs"])
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "café", "max_tokens": 5,
                                                        "stream": True, "ignore_eos": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 4, "logprobs": True, "top_logprobs": 3,
                                                         "temperature": 0, "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"] for c in content)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 129}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"max_tokens": 100000}, "max_tokens"),
])
def test_bad_chat_requests_are_400_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json=CHAT | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param), err


def test_context_length_and_malformed_json(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1] * 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", json=CHAT | {"model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key(tiny):
    with make_client(tiny, api_key="sekret", served_model_name="tiny") as c:
        wait_ready(c)
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200  # health and metrics stay open for probes and scrapers
        assert c.get("/v1/models").json()["error"]["code"] == "invalid_api_key"


def test_health_503_when_model_fails_to_load(tiny, tmp_path):
    with make_client(tiny, model=str(tmp_path / "missing"), draft_model=None) as c:
        r = c.get("/health")
        for _ in range(100):
            if r.json()["status"] != "loading":
                break
            r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "dead"
        r = c.post("/v1/chat/completions", json=CHAT | {"model": "missing"})
        assert r.status_code == 503


def test_greedy_api_output_equals_no_speculation(client):
    body = CHAT | {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    spec = client.post("/v1/chat/completions", json=body).json()
    plain = client.post("/v1/chat/completions", json=body | {"num_speculative_tokens": 0}).json()
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert spec["speculation"]["num_draft_tokens"] > 0 and plain["speculation"]["num_draft_tokens"] == 0
    assert plain["speculation"]["method"] == "none"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_output(client, stream):
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i]
    cut = clean[len(clean) // 2]
    body |= {"stop": [full[cut:cut + 2]], "stream": stream}
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as r:
            chunks = sse_events(r)[:-1]
        text, reason = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        text, reason = choice["text"], choice["finish_reason"]
    assert (text, reason) == (full[:cut], "stop")


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800 lone surrogate"}', "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [-1, 5]}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [10000000]}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["' + b"s" * 600 + b'"]}', "stop"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logprobs": 21}', "logprobs"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "echo": true, "logprobs": 1}', "echo"),
    ("/v1/chat/completions", b"[]", None),
])
def test_bad_bytes_and_values_are_400_never_5xx(client, path, raw, param):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
