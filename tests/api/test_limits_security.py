"""Request size and time limits, API key sources, probe auth, CORS."""

import time

from tests.api.conftest import make_client, wait_ready
from tests.api.test_endpoints import CHAT, sse_events


def test_oversized_body_is_413_announced_or_chunked(tiny):
    with make_client(tiny, served_model_name="tiny", max_request_bytes=2048) as c:
        wait_ready(c)
        big = CHAT | {"messages": [{"role": "user", "content": "x" * 4000}]}
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        r = c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2}).status_code == 200


def test_request_timeout_ends_request_and_frees_kv(tiny):
    with make_client(tiny, served_model_name="tiny", request_timeout=0.3, max_model_len=256) as c:
        wait_ready(c)
        engine = c.app.state.engine
        real_step = engine.core.step

        def slow_step():
            time.sleep(0.05)
            return real_step()

        engine.core.step = slow_step  # 250 tokens cannot finish in 0.3 s at <= 20 steps/s
        body = CHAT | {"max_tokens": 200, "ignore_eos": True}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        for _ in range(100):
            if engine.stats().kv_cache_usage == 0 and engine.stats().num_running == 0:
                break
            time.sleep(0.02)
        assert engine.stats().kv_cache_usage == 0


def test_api_key_file_and_probe_auth(tiny, tmp_path):
    key = tmp_path / "key"
    key.write_text("from-a-file\n")
    with make_client(tiny, served_model_name="tiny", api_key_file=str(key), auth_probes=True) as c:
        time.sleep(0.1)
        assert c.get("/health").status_code == 401 and c.get("/metrics").status_code == 401
        auth = {"Authorization": "Bearer from-a-file"}
        for _ in range(600):
            if c.get("/health", headers=auth).status_code == 200:
                break
            time.sleep(0.05)
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.get("/metrics", headers=auth).status_code == 200


def test_cors_off_by_default_and_configurable(client, tiny):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in client.options("/v1/chat/completions", headers=preflight).headers
    with make_client(tiny, served_model_name="tiny", cors_allow_origins="https://app.example") as c:
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
