"""Structured outputs through the API (tiny random models, speculation on): response_format json_schema and
json_object, vLLM's guided_* fields on both endpoints, streamed, and their bad-input 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.api.test_endpoints import CHAT, sse_events

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["n", "tag"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def content(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    r = client.post("/v1/chat/completions", json=CHAT | {"response_format": JSON_SCHEMA, "max_tokens": 64, "n": 3,
                                                         "temperature": temperature, "seed": 7})
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"


def test_response_format_json_object_and_guided_fields(client):
    obj = json.loads(content(client.post("/v1/chat/completions", json=CHAT | {
        "response_format": {"type": "json_object"}, "max_tokens": 128, "temperature": 0})) or "null")
    assert isinstance(obj, dict)
    choice = content(client.post("/v1/chat/completions", json=CHAT | {"guided_choice": ["yes", "no", "maybe"],
                                                                      "max_tokens": 8}))
    assert choice in ("yes", "no", "maybe")
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Order:", "max_tokens": 16,
                                             "guided_regex": r"#[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"#[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"])
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    text = content(client.post("/v1/chat/completions", json=CHAT | {"guided_grammar": grammar, "max_tokens": 24}))
    assert re.fullmatch(r"\([a-c](,[a-c])*\)", text), text
    r = client.post("/v1/chat/completions", json=CHAT | {"guided_json": json.dumps(SCHEMA), "max_tokens": 64})
    jsonschema.validate(json.loads(content(r)), SCHEMA)


def test_streamed_structured_output(client):
    body = CHAT | {"response_format": JSON_SCHEMA, "max_tokens": 64, "stream": True, "temperature": 1.0}
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        events = sse_events(s)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "contentEncoding": "base64", "if": {"minLength": 2}, "then": {"maxLength": 3}}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_structured_requests_are_400s_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json=CHAT | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_fields_that_do_not_change_generation_are_accepted(client):
    extra = {"metadata": {"app": "notes", "run": "7"}, "service_tier": "auto", "safety_identifier": "user-42",
             "user": "u", "max_tokens": 3}
    r = client.post("/v1/chat/completions", json=CHAT | extra)
    assert r.status_code == 200 and r.json()["service_tier"] == "default"
    with client.stream("POST", "/v1/chat/completions", json=CHAT | extra | {"stream": True}) as s:
        assert all(e["service_tier"] == "default" for e in sse_events(s)[:-1])
    for bad, param in (({"metadata": {"k": "v" * 513}}, "metadata"), ({"service_tier": "gold"}, "service_tier"),
                       ({"safety_identifier": "x" * 65}, "safety_identifier")):
        r = client.post("/v1/chat/completions", json=CHAT | bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_logit_bias(client):
    body = CHAT | {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = content(client.post("/v1/chat/completions", json=body))
    forced = client.post("/v1/chat/completions", json=body | {"logit_bias": {"65": 100}})
    assert content(forced) != plain and client.post("/v1/chat/completions", json=body | {
        "logit_bias": {"65": 100}, "num_speculative_tokens": 0}).json()["choices"][0]["message"]["content"] == \
        content(forced)
    for bad in ({"x": 1}, {"65": 101}, {"100000": 1}):
        r = client.post("/v1/chat/completions", json=body | {"logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
