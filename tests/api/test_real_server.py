"""A real `specserve serve` process on 127.0.0.1: the OpenAI SDK, client disconnects, graceful SIGTERM."""

from __future__ import annotations

import json
import signal
import time
import typing
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pydantic
import pytest

from tests.api.server_process import Server


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, "--api-key", "k", "--max-num-seqs", "4")
    yield s
    s.stop()


def test_openai_sdk_chat_and_completions(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
    # a seeded sample is reproducible for a fixed k (the default k adapts to what the engine measured: README)
    fixed = {"num_speculative_tokens": 2}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, n=2, seed=3, temperature=0.9, extra_body=fixed)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 12
    assert chat.model_extra["speculation"]["method"] == "draft"
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, n=2, seed=3, temperature=0.9, extra_body=fixed)
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    comp = client.completions.create(model="tiny", prompt="The quick", max_tokens=5)
    assert comp.choices[0].finish_reason in ("stop", "length")
    streamed = list(client.completions.create(model="tiny", prompt="The quick", max_tokens=5, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


class Reading(pydantic.BaseModel):
    """What the SDK's parse() sends as response_format json_schema (strict), bounded so that output ends."""

    level: int = pydantic.Field(ge=0, le=9)
    unit: typing.Literal["kg", "m", "s"]
    ok: bool


def test_openai_sdk_parse_with_a_pydantic_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    for temperature in (0.0, 1.0):
        parsed = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a reading?"}],
                                               response_format=Reading, max_tokens=48, temperature=temperature,
                                               metadata={"app": "test"}, service_tier="auto",
                                               safety_identifier="user-1", user="u")
        assert parsed.service_tier == "default"
        reading = parsed.choices[0].message.parsed
        assert isinstance(reading, Reading) and parsed.choices[0].finish_reason == "stop"
        assert parsed.usage.prompt_tokens_details.cached_tokens >= 0


def test_openai_sdk_error_mapping(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer k"}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # hang up after the first token
    deadline = time.monotonic() + 10
    while server.metric("specserve_num_requests_running") != 0:
        assert time.monotonic() < deadline, "request kept running after the client hung up"
        time.sleep(0.05)


def test_queue_full_is_429_with_retry_after(tiny):
    s = Server(tiny, "--max-num-seqs", "1", "--max-queue-len", "1")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)

    def call(_):
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=200, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as exc:
            return exc

    try:
        with ThreadPoolExecutor(8) as pool:  # 8 at once against 1 running slot + 1 waiting place
            results = list(pool.map(call, range(8)))
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert refused and "ok" in results, results
        assert refused[0].response.headers["retry-after"] == "1"
        assert refused[0].body["type"] == "rate_limit_error"
    finally:
        assert s.stop() == 0


def _stream_and_sigterm(s: Server, max_tokens: int) -> list[str]:
    """Stream a completion and send SIGTERM once the first token has arrived; return the data lines."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 1:
                    s.proc.send_signal(signal.SIGTERM)
    return events


def test_sigterm_lets_inflight_stream_finish_then_exits_0(tiny):
    s = Server(tiny, "--shutdown-timeout", "30")
    events = _stream_and_sigterm(s, 120)
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]  # the stream ran to its end, not cut at SIGTERM
    assert s.proc.wait(timeout=60) == 0


def test_sigterm_deadline_ends_streams_with_error(tiny):
    # a 10 ms deadline cannot cover the ~250 tokens still to come: the stream must end with an error event
    s = Server(tiny, "--shutdown-timeout", "0.01", "--num-speculative-tokens", "1")
    events = _stream_and_sigterm(s, 250)
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "shutting down" in events[-2]
    assert s.proc.wait(timeout=60) == 0


def test_json_request_log_and_request_id(tiny):
    s = Server(tiny, "--log-format", "json", "--log-level", "info")
    secret = "a private prompt 12345"
    r = httpx.post(s.url + "/v1/completions", headers={"X-Request-Id": "trace-42"}, timeout=60,
                   json={"model": "tiny", "prompt": secret, "max_tokens": 4, "ignore_eos": True})
    assert r.headers["x-request-id"] == "trace-42"
    generated = httpx.get(s.url + "/v1/models").headers["x-request-id"]
    assert len(generated) >= 16
    assert s.stop() == 0
    lines = [json.loads(line) for line in s.proc.stdout.read().splitlines() if line.startswith("{")]
    finished = [x for x in lines if x.get("message") == "request finished"]
    assert len(finished) == 1, lines
    entry = finished[0]
    assert entry["request_id"] == "trace-42" and entry["completion_tokens"] == 4 and entry["status"] == "ok"
    assert {"prompt_tokens", "cached_tokens", "draft_tokens", "accepted_tokens", "acceptance_rate",
            "latency_s"} <= set(entry)
    assert all(secret not in json.dumps(x) for x in lines)


def test_prompt_text_in_logs_only_when_asked(tiny):
    s = Server(tiny, "--log-format", "json", "--log-level", "info", "--log-prompts")
    httpx.post(s.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "visible prompt",
                                                            "max_tokens": 3, "ignore_eos": True})
    assert s.stop() == 0
    lines = [json.loads(line) for line in s.proc.stdout.read().splitlines() if line.startswith("{")]
    entry = next(x for x in lines if x.get("message") == "request finished")
    assert entry["prompt"] == ["visible prompt"] and len(entry["completions"]) == 1


@pytest.fixture(scope="module")
def lookup_server(tiny):
    """The draft model and ngram loaded together through vLLM's --speculative-config (draft is the default)."""
    cfg = json.dumps([{"method": "draft", "model": str(tiny["llama_draft"]), "num_speculative_tokens": 3},
                      {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}])
    s = Server(tiny, "--speculative-config", cfg, "--max-num-seqs", "4")
    yield s
    s.stop()


def test_openai_sdk_predicted_outputs_and_per_request_method(lookup_server):
    client = openai.OpenAI(base_url=lookup_server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Rewrite: the quick brown fox"}]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True, "speculative_method": "none"})
    assert plain.model_extra["speculation"]["method"] == "none"
    text = plain.choices[0].message.content
    right = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                           prediction={"type": "content", "content": text},
                                           extra_body={"ignore_eos": True})
    assert right.choices[0].message.content == text  # a prediction never changes the output
    spec = right.model_extra["speculation"]
    assert spec["method"] == "prediction" and spec["num_accepted_tokens"] > 0
    # a random model's tokens are not what its text re-tokenises to, so only part of the prediction matches here
    # (tests/engine/test_proposers.py: token-exact predictions are all accepted; the demo test: real text)
    accepted = right.usage.completion_tokens_details.accepted_prediction_tokens
    wrong = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                           prediction={"type": "content", "content": "zzzz " * 20},
                                           extra_body={"ignore_eos": True})
    assert wrong.choices[0].message.content == text
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens < accepted
    ngram = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True, "speculative_method": "ngram"})
    assert ngram.choices[0].message.content == text and ngram.model_extra["speculation"]["method"] == "ngram"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=msgs, extra_body={"speculative_method": "medusa"})
    assert err.value.body["param"] == "speculative_method"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=msgs, prediction={"type": "text", "content": "x"})
    assert err.value.body["param"].startswith("prediction")
    assert lookup_server.metric('specserve_spec_decode_num_draft_tokens_total{method="ngram",model="tiny"}') >= 0
