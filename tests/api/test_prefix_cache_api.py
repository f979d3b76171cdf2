"""Prefix caching through the API: usage.prompt_tokens_details.cached_tokens (responses and the stream's usage
chunk), prompt_cache_key and cache_salt, per-API-key salting, the hit metrics."""

from __future__ import annotations

from tests.api.conftest import make_client, wait_ready
from tests.api.test_endpoints import sse_events

SYSTEM = "You answer questions about the attached notes. " * 4  # ~150 tokens: the tiny models hold 256


def chat(question: str, **extra) -> dict:
    return {"model": "tiny", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]} | extra


def cached(response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_repeated_prefix_reports_cached_tokens_and_metrics(client):
    before = client.get("/metrics").text
    first = client.post("/v1/chat/completions", json=chat("first question?", prompt_cache_key="docs-a"))
    second = client.post("/v1/chat/completions", json=chat("second question?", prompt_cache_key="docs-a"))
    assert cached(first) == 0
    prompt_tokens = second.json()["usage"]["prompt_tokens"]
    assert 0 < cached(second) < prompt_tokens
    with client.stream("POST", "/v1/chat/completions", json=chat("third question?", prompt_cache_key="docs-a") |
                       {"stream": True, "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached(second)
    after = client.get("/metrics").text
    hits = _metric(after, "specserve_prefix_cache_hits_total") - _metric(before, "specserve_prefix_cache_hits_total")
    queries = (_metric(after, "specserve_prefix_cache_queries_total")
               - _metric(before, "specserve_prefix_cache_queries_total"))
    assert hits == 2 * cached(second) and queries >= 3 * prompt_tokens - 2


def test_cache_keys_and_salts_separate_requests(client):
    assert cached(client.post("/v1/chat/completions", json=chat("q1?", prompt_cache_key="k1"))) == 0
    assert cached(client.post("/v1/chat/completions", json=chat("q2?", prompt_cache_key="k2"))) == 0
    assert cached(client.post("/v1/chat/completions", json=chat("q3?", cache_salt="s1"))) == 0
    assert cached(client.post("/v1/chat/completions", json=chat("q4?", cache_salt="s1"))) > 0
    completion = {"model": "tiny", "prompt": SYSTEM + "x", "max_tokens": 2, "prompt_cache_key": "c", "n": 2}
    client.post("/v1/completions", json=completion)
    again = client.post("/v1/completions", json=completion | {"prompt": [SYSTEM + "y", SYSTEM + "z"]})
    usage = again.json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]  # each prompt once


def test_bad_cache_fields_are_400s_naming_the_field(client):
    for field, value in (("prompt_cache_key", 5), ("cache_salt", ["x"]), ("prompt_cache_key", "k" * 300)):
        r = client.post("/v1/chat/completions", json=chat("q?") | {field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_each_api_key_has_its_own_cache_unless_shared(tiny, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-a\nkey-b\n")
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    with make_client(tiny, served_model_name="tiny", api_key_file=str(keys)) as c:
        wait_ready(c)
        assert cached(c.post("/v1/chat/completions", json=chat("q1?"), headers=a)) == 0
        assert cached(c.post("/v1/chat/completions", json=chat("q2?"), headers=b)) == 0  # another tenant
        assert cached(c.post("/v1/chat/completions", json=chat("q3?"), headers=a)) > 0
    with make_client(tiny, served_model_name="tiny", api_key_file=str(keys), prefix_caching_per_key=False) as c:
        wait_ready(c)
        assert cached(c.post("/v1/chat/completions", json=chat("q1?"), headers=a)) == 0
        assert cached(c.post("/v1/chat/completions", json=chat("q2?"), headers=b)) > 0


def test_caching_off_reports_zero(tiny):
    with make_client(tiny, served_model_name="tiny", enable_prefix_caching=False) as c:
        wait_ready(c)
        for q in ("q1?", "q2?"):
            assert cached(c.post("/v1/chat/completions", json=chat(q))) == 0
