"""Faults through the API: a request that fails alone, and a fatal engine-loop error (503, no hang)."""

from tests.api.conftest import make_client, wait_ready
from tests.api.test_endpoints import CHAT, sse_events


def test_fatal_engine_error_turns_health_503_and_ends_requests(tiny):
    with make_client(tiny, served_model_name="tiny") as c:
        wait_ready(c)

        def boom():
            raise RuntimeError("device lost")

        c.app.state.engine.core.step = boom
        r = c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 5})
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 503  # refused at once, no hang


def test_request_failing_alone_is_500_in_shape_or_stream_error(tiny):
    with make_client(tiny, served_model_name="tiny") as c:
        wait_ready(c)
        core = c.app.state.engine.core
        real = core.make_request

        def fragile(request_id, prompt, params, ids=None):
            req = real(request_id, prompt, params, ids)
            if params.max_tokens == 7:  # the marked request's detokenizer fails

                def broken(token_id):
                    raise RuntimeError("tokenizer exploded")

                req.detokenizer.append = broken
            return req

        core.make_request = fragile
        r = c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 7})
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
        with c.stream("POST", "/v1/chat/completions", json=CHAT | {"max_tokens": 7, "stream": True}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and "tokenizer exploded" in events[-2]["error"]["message"]
        ok = c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 6})
        assert ok.status_code == 200 and c.get("/health").status_code == 200
