"""An asyncio load generator for any OpenAI-compatible server: a fixed prompt set, streamed chat completions at
given concurrency levels, and per level the TTFT / inter-token / end-to-end percentiles, tokens/s and errors.

`python -m bench.loadgen --url http://127.0.0.1:8000 --concurrency 1,4,16 --max-tokens 64 [--requests-per-level N]
 [--model NAME] [--out results.json]`

Tokens are counted from the final `usage` when the server sends it (`stream_options.include_usage`), else as the
content chunks received (one token each on servers that stream token by token). Inter-token latency of a request
is (last content chunk - first content chunk) / (tokens - 1), so a server that sends several tokens in one chunk
(speculation) is not flattered or penalised by its chunking. Greedy (`temperature: 0`) unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from bench.output import emit
from bench.prompts import heldout_prompts


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-quantile (0 <= q <= 1); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """Stream one chat completion; times relative to the request's start."""
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:300]
            return {"error": f"{r.status_code} {text}"}
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return {"error": str(event["error"])[:300]}
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter() - t0
                    first = now if first is None else first
                    last = now
                    chunks += 1
    end = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") else chunks
    if first is None:
        return {"error": "no content received"}
    return request_timing(first, last, end, tokens)


def request_timing(first: float, last: float, end: float, tokens: int) -> dict:
    """One request's times (seconds from its start): first and last content, end; tokens share the interval."""
    return {"ttft_s": first, "e2e_s": end, "tokens": tokens,
            "itl_s": (last - first) / (tokens - 1) if tokens > 1 else None}


async def run_level(client: httpx.AsyncClient, body_for, prompts: list[str], concurrency: int, n_requests: int,
                    offset: int = 0) -> dict:
    """n_requests requests with at most `concurrency` in flight (a new one starts as one ends)."""
    queue = list(range(n_requests))
    results: list[dict] = []

    async def worker():
        while queue:
            i = queue.pop(0)
            results.append(await one_request(client, body_for(prompts[(offset + i) % len(prompts)])))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize_level(results, concurrency, time.perf_counter() - t0)


def summarize_level(results: list[dict], concurrency: int, wall: float) -> dict:
    """A level's row from its requests' request_timing() dicts (or {"error": ...})."""
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)

    def pct(key: str) -> dict:
        vals = [r[key] for r in ok if r.get(key) is not None]
        return {"p50": percentile(vals, 0.5), "p90": percentile(vals, 0.9), "p99": percentile(vals, 0.99)}

    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "first_error": next((r["error"] for r in results if "error" in r), None),
            "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_s": pct("ttft_s"), "itl_s": pct("itl_s"), "e2e_s": pct("e2e_s")}


def chat_body(model: str, max_tokens: int, temperature: float, extra: dict | None = None):
    def body(prompt: str) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
                **(extra or {})}
    return body


async def run(url: str, model: str, concurrency: list[int], max_tokens: int, requests_per_level: int | None,
              temperature: float = 0.0, extra: dict | None = None, headers: dict | None = None,
              prompts: list[str] | None = None, warmup: int = 2) -> list[dict]:
    """Every level in order, after `warmup` untimed requests; requests per level = max(c, requests_per_level)."""
    prompts = prompts or heldout_prompts()
    body = chat_body(model, max_tokens, temperature, extra)
    async with httpx.AsyncClient(base_url=url, headers=headers or {}) as client:
        if warmup:
            await run_level(client, body, prompts, min(2, warmup), warmup)
        rows = []
        for c in concurrency:
            rows.append(await run_level(client, body, prompts, c, max(c, requests_per_level or 2 * c)))
            r = rows[-1]
            print(f"[loadgen] c={c} {r['tokens_per_s']:.1f} tok/s itl p50 {fmt_ms(r['itl_s']['p50'])} "
                  f"ttft p50 {fmt_ms(r['ttft_s']['p50'])} errors {r['errors']}", file=sys.stderr, flush=True)
        return rows


def fmt_ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f} ms"


def table(rows: list[dict]) -> str:
    lines = ["| streams | tokens/s | TTFT p50 / p90 | inter-token p50 / p90 | end-to-end p50 | errors |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {fmt_ms(r['ttft_s']['p50'])} / "
                     f"{fmt_ms(r['ttft_s']['p90'])} | {fmt_ms(r['itl_s']['p50'])} / {fmt_ms(r['itl_s']['p90'])} | "
                     f"{fmt_ms(r['e2e_s']['p50'])} | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", help="the request's model field (default: the first of GET /v1/models)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--requests-per-level", type=int, help="default 2 x concurrency")
    ap.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = args.model or httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rows = asyncio.run(run(args.url, model, [int(c) for c in args.concurrency.split(",")], args.max_tokens,
                           args.requests_per_level, args.temperature, json.loads(args.extra_body)))
    emit({"url": args.url, "model": model, "rows": rows}, args.out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
