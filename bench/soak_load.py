"""The soak's client load: a weighted mix of streamed chat, completions, mid-stream disconnects and invalid
requests, each recorded by outcome (ok, 4xx, 5xx, disconnect, hung, transport error)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from bench.soak import ServerProcess

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n",
    "Once upon a time, in a small village by the sea,",
    "# Parse a CSV file and return a list of dictionaries\nimport csv\n\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "Ünïcödé text: café, naïve, 東京, 😀 and ∑ symbols",
]
# kind -> weight in the mix
MIX = {"chat_stream": 35, "completion": 30, "disconnect": 15, "bad_temperature": 7, "unknown_field": 7,
       "malformed_json": 6}
INVALID_KINDS = frozenset({"bad_temperature", "unknown_field", "malformed_json"})


@dataclass
class Stats:
    outcomes: Counter = field(default_factory=Counter)  # outcome -> count
    by_kind: dict = field(default_factory=lambda: defaultdict(Counter))  # kind -> outcome -> count
    latency: dict = field(default_factory=lambda: defaultdict(list))  # kind -> seconds of ok requests
    ttft: list = field(default_factory=list)  # seconds to the first text of ok / dropped streams
    completion_tokens: int = 0
    examples: dict = field(default_factory=dict)  # outcome -> its first occurrence (kind, detail), ok excepted

    def record(self, kind: str, outcome: str, detail: str | None = None) -> None:
        self.outcomes[outcome] += 1
        self.by_kind[kind][outcome] += 1
        if detail and outcome not in self.examples and outcome not in ("ok", "disconnect"):
            self.examples[outcome] = {"kind": kind, "detail": detail[:500]}


def _status_outcome(kind: str, status: int) -> str:
    if kind in INVALID_KINDS:
        if status >= 500:
            return f"5xx_invalid:{status}"
        return f"4xx:{status}" if status >= 400 else f"invalid_accepted:{status}"
    if status >= 500:
        return f"5xx:{status}"
    return f"4xx:{status}" if status >= 400 else "ok"


def _body(kind: str, model: str, rng: random.Random, max_tokens: int) -> tuple[str, dict | bytes]:
    prompt = rng.choice(PROMPTS)
    sampling = {"max_tokens": rng.randint(4, max_tokens), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        sampling["seed"] = rng.randrange(1 << 31)
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}]} | sampling
    if kind == "chat_stream":
        return "/v1/chat/completions", chat | {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": prompt} | sampling
    if kind == "disconnect":
        if rng.random() < 0.5:
            return "/v1/chat/completions", chat | {"stream": True, "ignore_eos": True}
        return "/v1/completions", {"model": model, "prompt": prompt, "stream": True, "ignore_eos": True} | sampling
    if kind == "bad_temperature":
        return "/v1/chat/completions", chat | {"temperature": rng.choice([-0.5, 2.5, 100.0])}
    if kind == "unknown_field":
        return "/v1/completions", {"model": model, "prompt": prompt, "frobnicate": True} | sampling
    if kind == "malformed_json":
        text = json.dumps(chat)
        return "/v1/chat/completions", text[: rng.randint(1, len(text) - 1)].encode()
    raise ValueError(kind)


def _event_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


async def one_request(client: httpx.AsyncClient, kind: str, model: str, rng: random.Random, stats: Stats,
                      args: argparse.Namespace) -> None:
    path, body = _body(kind, model, rng, args.max_tokens)
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    streamed = isinstance(body, dict) and body.get("stream")
    # several tokens of one speculative step may arrive as one event: drop early enough to be mid-stream
    drop_after = rng.randint(1, max(1, body["max_tokens"] // 4)) if kind == "disconnect" else None
    start = time.monotonic()
    try:
        async with asyncio.timeout(args.hung_timeout):
            if not streamed:
                r = await client.post(path, **kw)
                outcome = _status_outcome(kind, r.status_code)
                stats.record(kind, outcome, f"{r.status_code} {r.text[:300]}")
                if outcome == "ok":
                    stats.latency[kind].append(time.monotonic() - start)
                    stats.completion_tokens += r.json().get("usage", {}).get("completion_tokens", 0)
                return
            async with client.stream("POST", path, **kw) as r:
                if r.status_code != 200:
                    await r.aread()
                    stats.record(kind, _status_outcome(kind, r.status_code), f"{r.status_code} {r.text[:300]}")
                    return
                events, first_text, done, error, usage = 0, None, False, None, None
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = json.dumps(event)
                        continue
                    usage = event.get("usage") or usage
                    if first_text is None and _event_text(event):
                        first_text = time.monotonic() - start
                    events += 1
                    if drop_after is not None and events >= drop_after:
                        break  # leaving the block closes the connection mid-stream: the server must abort
                if first_text is not None:
                    stats.ttft.append(first_text)
                if error is not None:
                    stats.record(kind, "stream_error", error)
                elif drop_after is not None and not done:
                    stats.record(kind, "disconnect")
                elif not done:
                    stats.record(kind, "stream_truncated", f"{events} events, no [DONE]")
                else:
                    stats.record(kind, "ok")
                    stats.latency[kind].append(time.monotonic() - start)
                    if usage:
                        stats.completion_tokens += usage.get("completion_tokens", 0)
    except TimeoutError:
        stats.record(kind, "hung", f"{path} no complete response after {args.hung_timeout:g} s")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        stats.record(kind, "transport_error", f"{path} {exc!r}")


async def worker(i: int, server: ServerProcess, client: httpx.AsyncClient, model: str, stats: Stats,
                 deadline: float, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed * 1000 + i)
    kinds, weights = list(MIX), list(MIX.values())
    while time.monotonic() < deadline and server.proc.poll() is None:  # a dead server ends the load early
        errors = stats.outcomes["transport_error"]
        await one_request(client, rng.choices(kinds, weights)[0], model, rng, stats, args)
        if stats.outcomes["transport_error"] > errors:
            await asyncio.sleep(0.1)  # no tight loop against a server that refuses connections


# -- clients that attack the transport (--abusers): each opens a burst of connections of one kind at once ---------
ABUSE = {"slow_head": 30, "slow_body": 30, "silent": 15, "header_flood": 25}
_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"


async def _send_abuse(kind: str, writer: asyncio.StreamWriter) -> None:
    if kind == "header_flood":  # vLLM's CVE-2025-48956: a head of 10,000 headers, in one write
        writer.write(b"GET /health HTTP/1.1\r\nhost: soak\r\n" + b"".join(b"x-%d: y\r\n" % i for i in range(10_000))
                     + b"\r\n")
    elif kind == "slow_head":  # a header line every half second, never the end of the head
        writer.write(_HEAD)
        for i in range(10_000):
            await asyncio.sleep(0.5)
            writer.write(b"x-%d: y\r\n" % i)
    elif kind == "slow_body":  # a 100 kB body announced, one byte a second sent
        writer.write(_HEAD + b"content-length: 100000\r\n\r\n")
        for _ in range(100_000):
            writer.write(b" ")
            await asyncio.sleep(1.0)
    await asyncio.sleep(3600)  # "silent": connected, says nothing


async def abuse_one(kind: str, host: str, port: int, stats: Stats, args: argparse.Namespace) -> None:
    """One hostile connection: the server must answer it with a 4xx/503 or close it, within --hung-timeout."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        stats.record(kind, "abuse_refused_connect", repr(exc))  # the listen queue was full: not a failure
        return
    sender = asyncio.create_task(_send_abuse(kind, writer))
    answer = b""
    try:
        async with asyncio.timeout(args.hung_timeout):
            while chunk := await reader.read(65536):
                answer += chunk
    except TimeoutError:
        stats.record(kind, "abuse_held", f"still open after {args.hung_timeout:g} s")
        return
    except OSError:
        pass  # reset by the server: closed
    finally:
        sender.cancel()
        writer.close()
    status = answer.split(b" ", 2)[1].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else "none"
    if status.startswith(("2", "3")):
        stats.record(kind, f"abuse_accepted:{status}", answer[:300].decode(errors="replace"))
    else:
        stats.record(kind, f"closed:{status}")
        stats.latency[kind].append(time.monotonic() - start)  # how long the server held it


async def abuser(i: int, server: ServerProcess, stats: Stats, deadline: float, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed * 1000 + 500 + i)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    kinds, weights = list(ABUSE), list(ABUSE.values())
    while time.monotonic() < deadline and server.proc.poll() is None:
        kind = rng.choices(kinds, weights)[0]
        burst = rng.randint(1, args.abuse_burst)
        await asyncio.gather(*(abuse_one(kind, host, int(port), stats, args) for _ in range(burst)))
