"""Many live streams against a real server: random client drops (mid-prefill and mid-stream) leave the others'
output exact and every gauge back at zero; SIGTERM with many streams open lets them all finish, then exit 0."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

from tests.api.server_process import Server

PROMPTS = ["The quick brown fox", "def main():", "café", "Speculative decoding", "x", "lazy dog", "return 0",
           "verifies them"]


async def _stream(url: str, prompt: str, max_tokens: int, drop_after: int | None = None) -> str | None:
    """Stream a greedy completion; drop_after=n hangs up after n data events (0: before any answer arrives)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, seen = [], 0
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if drop_after == 0:
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                seen += 1
                if drop_after is not None and seen >= drop_after:
                    return None
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def _gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for name in ("specserve_kv_cache_usage_ratio", "specserve_num_requests_running",
                     "specserve_num_requests_waiting"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, "--max-num-seqs", "6", "--max-queue-len", "64")
    yield s
    s.stop()


def test_random_drops_leave_others_exact_and_gauges_zero(server):
    reference = {p: asyncio.run(_stream(server.url, p, 30)) for p in PROMPTS}
    rng = random.Random(1234)
    jobs = []
    for i in range(24):
        prompt = PROMPTS[i % len(PROMPTS)]
        drop = rng.choice([None, None, 0, 1, 3, 8]) if i % 3 else None
        jobs.append((prompt, drop))

    async def main():
        return await asyncio.gather(*(_stream(server.url, p, 30, d) for p, d in jobs))

    results = asyncio.run(main())
    assert sum(d is not None for _, d in jobs) >= 6
    for (prompt, drop), text in zip(jobs, results):
        if drop is None:
            assert text == reference[prompt]
    deadline = time.monotonic() + 20
    while (g := _gauges(server.url)) and any(g.values()):
        assert time.monotonic() < deadline, f"gauges did not return to zero: {g}"
        time.sleep(0.1)


def test_sigterm_with_many_streams_open(tiny):
    s = Server(tiny, "--max-num-seqs", "4", "--shutdown-timeout", "60")
    reference = [asyncio.run(_stream(s.url, p, 60)) for p in PROMPTS]

    async def main():
        tasks = [asyncio.create_task(_stream(s.url, p, 60)) for p in PROMPTS]
        for _ in range(200):  # SIGTERM once every stream is admitted (running or waiting)
            g = _gauges(s.url)
            if g.get("specserve_num_requests_running", 0) + g.get("specserve_num_requests_waiting", 0) >= 8:
                break
            await asyncio.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert results == reference  # every open stream ran to its end with the exact greedy text
    assert s.proc.wait(timeout=90) == 0
