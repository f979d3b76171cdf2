"""bench/loadgen.py: percentiles and the per-request timing of a streamed chat completion (fake SSE server)."""

import asyncio
import json

import httpx

from bench.loadgen import one_request, percentile


def test_percentile_interpolates():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.9) == 9.0


def _sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_one_request_counts_usage_tokens_not_chunks_and_reports_errors():
    chunks = [{"choices": [{"delta": {"content": "ab"}}]}, {"choices": [{"delta": {"content": "cd"}}]},
              {"choices": [], "usage": {"completion_tokens": 5}}]

    def handler(request):
        if json.loads(request.content)["model"] == "bad":
            return httpx.Response(400, json={"error": {"message": "no"}})
        return httpx.Response(200, text=_sse(chunks), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            return await one_request(client, {"model": "m"}), await one_request(client, {"model": "bad"})

    ok, bad = asyncio.run(go())
    assert ok["tokens"] == 5 and ok["ttft_s"] <= ok["e2e_s"] and ok["itl_s"] >= 0
    assert bad["error"].startswith("400")
