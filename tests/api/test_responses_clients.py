"""The clients built on /v1/responses against a real `specserve serve` process (tiny models, 2k context): the OpenAI
SDK's responses.create / .stream / .parse, the OpenAI Agents SDK (an Agent with a function tool, Runner.run and
the streamed run, tracing off) and a Codex-shaped request replayed from a fixture written from Codex's public wire
format (tests/api/fixtures/codex_responses_request.json)."""

from __future__ import annotations

import asyncio
import json
import time
import typing
from pathlib import Path

import httpx
import openai
import pydantic
import pytest

from tests.api.server_process import Server
from tests.api.test_tools_api import long_tiny  # noqa: F401  (the fixture)

FIXTURE = Path(__file__).parent / "fixtures" / "codex_responses_request.json"


@pytest.fixture(scope="module")
def server(long_tiny):  # noqa: F811
    s = Server(long_tiny, "--api-key", "k", "--max-num-seqs", "4")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def test_sdk_create_equals_chat_and_stream_equals_create(client):
    resp = client.responses.create(model="tiny", instructions="Be brief.", input="Name a fruit.", temperature=0,
                                   max_output_tokens=10)
    chat = client.chat.completions.create(model="tiny", temperature=0, max_completion_tokens=10, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == chat.usage.completion_tokens and resp.model_extra["speculation"]
    with client.responses.stream(model="tiny", instructions="Be brief.", input="Name a fruit.", temperature=0,
                                 max_output_tokens=10) as stream:
        events = list(stream)
    # a random tiny model runs to max_output_tokens: the stream ends with response.incomplete (the SDK's
    # get_final_response() only accepts response.completed), whose response is the final one
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == "response." + ("incomplete" if resp.status == "incomplete" else "completed")
    assert final.status == resp.status and deltas == final.output_text == resp.output_text


class Verdict(pydantic.BaseModel):
    label: typing.Literal["yes", "no"]
    score: int = pydantic.Field(ge=0, le=9)


def test_sdk_parse_with_a_pydantic_model(client):
    for temperature in (0.0, 1.0):
        parsed = client.responses.parse(model="tiny", input="Is it good?", text_format=Verdict,
                                        temperature=temperature, max_output_tokens=40)
        assert isinstance(parsed.output_parsed, Verdict), parsed.output_text


def test_sdk_errors_map_to_its_exceptions(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", background=True)
    assert err.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")


class Price(pydantic.BaseModel):
    item: typing.Literal["apple", "pear"]
    coins: int = pydantic.Field(ge=0, le=9)


def test_agents_sdk_runs_a_function_tool_plain_and_streamed(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def lookup_price(item: typing.Literal["apple", "pear"]) -> str:
        """The price of an item in the shop."""
        calls.append(item)
        return f"{item}: 3 coins"

    async def run_both():
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="k", max_retries=0))
        # tool_choice required on the first turn (the SDK resets it after a call): a random tiny model calls the
        # tool because the grammar makes it, then answers in text
        # the answer turn is structured (output_type -> text.format json_schema): a random model's free text would
        # run to max_tokens, which the SDK treats as a failed run; 160: the vocabulary is byte-level, and a call is ~80
        settings = agents.ModelSettings(tool_choice="required", temperature=0.0, max_tokens=160)
        agent = agents.Agent(name="shop", instructions="Answer with prices.", tools=[lookup_price], model=model,
                             model_settings=settings, output_type=Price)
        plain = await agents.Runner.run(agent, "What does an apple cost?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "What does a pear cost?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return plain, streamed, kinds

    plain, streamed, kinds = asyncio.run(run_both())
    assert len(calls) == 2 and set(calls) <= {"apple", "pear"}
    assert isinstance(plain.final_output, Price) and isinstance(streamed.final_output, Price)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_codex_shaped_request_streams_to_completion(server):
    body = json.loads(FIXTURE.read_text())
    body.pop("_comment")
    body["model"] = "tiny"
    body["max_output_tokens"] = 24  # Codex leaves it to the server; a random tiny model would fill the context
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers={"Authorization": "Bearer k"},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                                 "response.incomplete")
    final = events[-1]["response"]
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done_items == final["output"] and final["usage"]["input_tokens"] > 0
    assert final["store"] is False and final["tools"][0]["name"] == "shell"
    # what Codex does next: the reply's items appended to the history, sent again (no previous_response_id)
    body["input"] = body["input"] + [{k: v for k, v in item.items() if k != "status"} for item in done_items] + \
        [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks."}]}]
    body["stream"] = False
    again = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": "Bearer k"}, timeout=120)
    assert again.status_code == 200, again.text


def test_disconnect_mid_stream_aborts(server):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers={"Authorization": "Bearer k"},
                      timeout=30) as r:
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break  # hang up after the first token
    deadline = time.monotonic() + 10
    while server.metric("specserve_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the response kept generating after the client hung up"
        time.sleep(0.05)
    assert server.metric('specserve_request_failure_total{model="tiny",reason="abort"}') >= 1
