"""Response shapes validated against OpenAI's own OpenAPI schemas (skipped where ../shared is absent)."""

import json
from pathlib import Path

import pytest

from tests.api.test_endpoints import CHAT, sse_events

SPEC = Path(__file__).resolve().parents[3] / "shared" / "reference" / "openai-openapi.json"
pytestmark = pytest.mark.skipif(not SPEC.exists(), reason=f"OpenAI's OpenAPI document not found at {SPEC} "
                                                          "(it lives in the workplace's shared/, not in the repo)")


def _nullable_to_jsonschema(node):
    """OpenAPI 3.0's `nullable: true` (still used in parts of the document) -> JSON Schema's null type."""
    if isinstance(node, list):
        return [_nullable_to_jsonschema(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_to_jsonschema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        enum = node.get("enum")
        if enum is not None:
            node["enum"] = [*enum, None]
        return {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="module")
def validate():
    """A checker of instances against OpenAI's schemas; None where the document is absent (tests that only use it
    where it exists, as the tool tests do, then run without it)."""
    if not SPEC.exists():
        return None
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    doc = _nullable_to_jsonschema(json.loads(SPEC.read_text()))
    registry = Registry().with_resource("urn:openai", Resource.opaque(doc))

    def check(instance, schema_name):
        schema = {"$ref": f"urn:openai#/components/schemas/{schema_name}"}
        errors = list(Draft202012Validator(schema, registry=registry).iter_errors(instance))
        assert not errors, f"{schema_name}: {errors[0].message} at {list(errors[0].absolute_path)}"

    return check


def test_chat_completion_matches_schema(client, validate):
    r = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 5, "n": 2, "logprobs": True,
                                                         "top_logprobs": 2})
    validate(r.json(), "CreateChatCompletionResponse")


def test_chat_chunks_match_schema(client, validate):
    body = CHAT | {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    for chunk in events[:-1]:
        validate(chunk, "CreateChatCompletionStreamResponse")


def test_completion_and_chunks_match_schema(client, validate):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 4, "logprobs": 2})
    validate(r.json(), "CreateCompletionResponse")
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 4,
                                                        "stream": True}) as r:
        chunks = sse_events(r)[:-1]
    # the document reuses the non-streamed schema for completion chunks, whose finish_reason is never null;
    # intermediate chunks carry null there (as OpenAI's own stream does), so only the last one is checked
    validate(chunks[-1], "CreateCompletionResponse")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_models_and_errors_match_schema(client, validate):
    validate(client.get("/v1/models").json(), "ListModelsResponse")
    validate(client.post("/v1/chat/completions", json=CHAT | {"temperature": 9}).json(), "ErrorResponse")
    validate(client.post("/v1/chat/completions", json=CHAT | {"model": "x"}).json(), "ErrorResponse")
