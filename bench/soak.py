"""Soak test: start `specserve serve` on 127.0.0.1, drive it with a mixed concurrent load for N minutes, watch its
memory and KV gauges, and check it ends idle, with the KV cache empty, and exits 0 on SIGTERM. Not run in CI.

`python -m bench.soak --minutes 10 --concurrency 8 [--model M --draft-model D] [--port P] [--out results.json]
 [--extra-args "--dtype float32 --max-num-seqs 16"]`

The load mixes streamed chat completions, non-streamed completions, streams the client drops at a random point,
and invalid requests (temperature out of range, an unknown field, malformed JSON). Every few seconds it samples
the server's RSS (VmRSS of /proc/PID/status) and the `specserve_kv_cache_usage_ratio`,
`specserve_num_requests_running` and `specserve_num_requests_waiting` gauges of /metrics.

Prints a JSON report (stdout, or --out FILE) and a summary table (stderr). Exits 1 when a valid request got a 5xx
or ended with an error event, any request hung (no response within --hung-timeout), an invalid request was
accepted or got a 5xx, a transport error happened, the server did not go back to idle with an empty KV cache,
or it did not exit 0 on SIGTERM (with --strict-rss also when RSS grew more than 10% after warm-up); 2 when the
server never became healthy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"  # the only address this script ever talks to
GAUGES = {"kv": "specserve_kv_cache_usage_ratio", "running": "specserve_num_requests_running",
          "waiting": "specserve_num_requests_waiting"}
RSS_FLAT_RATIO = 1.10
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, required=True, help="duration of the load phase")
    ap.add_argument("--concurrency", type=int, required=True, help="concurrent client workers")
    ap.add_argument("--model", help="target model (default: the bundled demo pair)")
    ap.add_argument("--draft-model", help="draft model (default: the bundled demo draft when --model is unset)")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--extra-args", default="", help="more `specserve serve` flags, one shell-quoted string")
    ap.add_argument("--out", help="write the JSON report here instead of stdout")
    ap.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request (drawn in [4, N])")
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS / gauge samples")
    ap.add_argument("--warmup-seconds", type=float, default=None,
                    help="RSS baseline taken this long into the load (default: 20%% of it, at most 60 s)")
    ap.add_argument("--hung-timeout", type=float, default=120.0,
                    help="a request with no complete response after this many seconds counts as hung")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health 200")
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="seconds to wait after the load for running = waiting = 0 and KV usage = 0")
    ap.add_argument("--shutdown-wait", type=float, default=None,
                    help="seconds to wait for exit after SIGTERM (default: --shutdown-timeout of the server + 30)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--strict-rss", action="store_true",
                    help=f"also fail when RSS at the end exceeds {RSS_FLAT_RATIO} x RSS after warm-up")
    ap.add_argument("--keep-log", action="store_true", help="keep the server log file even when all went well")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.max_tokens < 4:
        ap.error("--minutes must be > 0, --concurrency >= 1, --max-tokens >= 4")
    extra = shlex.split(args.extra_args)
    if any(a == "--host" or a.startswith("--host=") for a in extra):
        ap.error("--extra-args may not set --host: the soak only ever talks to 127.0.0.1")
    if any(a == "--port" or a.startswith("--port=") for a in extra):
        ap.error("use --port, not --extra-args, to choose the port")
    return args


# -- the server ----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _flag_value(extra: list[str], flag: str) -> str | None:
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            return extra[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class ServerProcess:
    def __init__(self, args: argparse.Namespace):
        self.port = args.port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        extra = shlex.split(args.extra_args)
        self.cmd = [sys.executable, "-m", "server.cli", "serve", "--host", HOST, "--port", str(self.port)]
        if args.model:
            self.cmd += ["--model", args.model]
        if args.draft_model:
            self.cmd += ["--draft-model", args.draft_model]
        self.cmd += extra
        self.api_key = _flag_value(extra, "--api-key") or os.environ.get("SPECSERVE_API_KEY")
        timeout = _flag_value(extra, "--shutdown-timeout") or os.environ.get("SPECSERVE_SHUTDOWN_TIMEOUT") or 30
        self.shutdown_wait = args.shutdown_wait if args.shutdown_wait is not None else float(timeout) + 30
        fd, self.log_path = tempfile.mkstemp(prefix="specserve-soak-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        # a file, not a pipe: a pipe nobody reads fills up and blocks the server's logging
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=Path(__file__).resolve().parents[1])
        self.pid = self.proc.pid

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
        except OSError:
            return None
        return None

    def log_tail(self, n: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self) -> tuple[int | None, float]:
        """SIGTERM, then wait; SIGKILL (exit code None) when it does not stop in time."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=self.shutdown_wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            code = None
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.log.close()


def parse_counters(text: str) -> dict[str, float]:
    """specserve_request_success_total / _failure_total by label (finish_reason / reason), summed over models."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name, label in (("specserve_request_success_total", "finish_reason"),
                            ("specserve_request_failure_total", "reason")):
            if line.startswith(name + "{") and f'{label}="' in line:
                value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                key = f"{'success' if 'success' in name else 'failure'}:{value}"
                out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def parse_gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        for key, name in GAUGES.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


async def wait_healthy(server: ServerProcess, client: httpx.AsyncClient, timeout: float) -> str | None:
    """None when /health answers 200, else why not."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return f"the server exited with {server.proc.returncode} before becoming healthy"
        try:
            r = await client.get("/health", timeout=2)
            if r.status_code == 200:
                return None
            last = f"{r.status_code} {r.text[:300]}"
            if r.status_code == 503 and '"dead"' in r.text:
                return f"the engine failed to start: {last}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        await asyncio.sleep(0.25)
    return f"/health not 200 after {timeout:.0f} s (last: {last})"


# -- the load -------------------------------------------------------------------------------------------------------

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


async def sampler(server: ServerProcess, client: httpx.AsyncClient, t0: float, samples: list, stop: asyncio.Event,
                  interval: float) -> None:
    while True:
        sample = {"t": round(time.monotonic() - t0, 2), "rss_mb": server.rss_mb()}
        try:
            r = await client.get("/metrics", timeout=10)
            sample |= parse_gauges(r.text)
        except httpx.HTTPError as exc:
            sample["error"] = repr(exc)
        samples.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except TimeoutError:
            pass


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict:
    """The gauges once running = waiting = 0 and KV usage = 0, or the last ones seen after `timeout`."""
    deadline = time.monotonic() + timeout
    gauges: dict = {}
    while True:
        try:
            gauges = parse_gauges((await client.get("/metrics", timeout=10)).text)
        except httpx.HTTPError as exc:
            gauges = {"error": repr(exc)}
        if gauges.get("running") == 0 and gauges.get("waiting") == 0 and gauges.get("kv") == 0:
            return gauges | {"idle": True}
        if time.monotonic() >= deadline:
            return gauges | {"idle": False}
        await asyncio.sleep(0.5)


# -- report ---------------------------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None}
    xs = sorted(values)

    def q(p):  # linear interpolation between closest ranks
        pos = (len(xs) - 1) * p
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 4)

    return {"n": len(xs), "p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "max": round(xs[-1], 4)}


def rss_summary(samples: list[dict], warmup_s: float) -> dict:
    points = [(s["t"], s["rss_mb"]) for s in samples if s.get("rss_mb") is not None]
    if not points:
        return {"first_mb": None}
    after = [rss for t, rss in points if t >= warmup_s] or [points[-1][1]]
    post_warmup, last = after[0], points[-1][1]
    return {"first_mb": round(points[0][1], 1), "after_warmup_mb": round(post_warmup, 1),
            "max_mb": round(max(r for _, r in points), 1), "last_mb": round(last, 1),
            "last_over_warmup": round(last / post_warmup, 3), "flat": last <= RSS_FLAT_RATIO * post_warmup,
            "warmup_s": round(warmup_s, 1)}


def kv_summary(samples: list[dict]) -> dict:
    kv = [s["kv"] for s in samples if "kv" in s]
    if not kv:
        return {"max": None}
    return {"max": round(max(kv), 4), "mean": round(sum(kv) / len(kv), 4), "last_sample": kv[-1],
            "max_running": max((s.get("running", 0) for s in samples), default=0),
            "max_waiting": max((s.get("waiting", 0) for s in samples), default=0)}


def failures_of(report: dict, strict_rss: bool) -> list[str]:
    out = []
    o = report["requests"]["by_outcome"]
    for key, n in sorted(o.items()):
        if key.startswith(("5xx:", "5xx_invalid:", "invalid_accepted:")) or key in (
                "hung", "stream_error", "stream_truncated", "transport_error"):
            out.append(f"{n} request(s) with outcome {key}")
    final = report["final_gauges"]
    if not final.get("idle"):
        out.append(f"the server did not go idle with an empty KV cache: {final}")
    if report["server"].get("exited_during_load") is not None:
        out.append(f"the server exited with {report['server']['exited_during_load']} during the load")
    if report["server"]["exit_code"] != 0:
        out.append(f"server exit code {report['server']['exit_code']} after SIGTERM (None: killed)")
    if strict_rss and report["rss"].get("flat") is False:
        out.append(f"RSS grew after warm-up: {report['rss']}")
    return out


def summary_table(report: dict) -> str:
    lines = ["", f"## soak: {report['config']['minutes']} min x {report['config']['concurrency']} workers, "
                 f"model {report['model']}", "", "| outcome | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(report["requests"]["by_outcome"].items())]
    lines += ["", "| kind | " + " | ".join(sorted(report["requests"]["by_outcome"])) + " |",
              "|---|" + "---|" * len(report["requests"]["by_outcome"])]
    for kind, counts in sorted(report["requests"]["by_kind"].items()):
        lines.append(f"| {kind} | " + " | ".join(str(counts.get(k, 0)) for k in
                                                 sorted(report["requests"]["by_outcome"])) + " |")
    lines += ["", "| latency (s) | n | p50 | p95 | p99 |", "|---|---|---|---|---|"]
    for name, p in [*report["latency_s"].items(), ("ttft (streams)", report["ttft_s"])]:
        lines.append(f"| {name} | {p['n']} | {p['p50']} | {p['p95']} | {p['p99']} |")
    t, rss, kv = report["throughput"], report["rss"], report["kv"]
    lines += ["", f"throughput: {t['completion_tokens']} completion tokens in {t['load_seconds']} s = "
                  f"{t['tokens_per_s']} tok/s, {t['requests_per_s']} req/s",
              f"RSS MiB: first {rss.get('first_mb')}, after warm-up {rss.get('after_warmup_mb')}, "
              f"max {rss.get('max_mb')}, last {rss.get('last_mb')} -> flat: {rss.get('flat')}",
              f"KV usage: max {kv.get('max')}, mean {kv.get('mean')}; max running {kv.get('max_running')}, "
              f"max waiting {kv.get('max_waiting')}",
              f"server counters: {report['server_counters']}",
              f"after the load: {report['final_gauges']} (idle after {report['idle_wait_s']} s)",
              f"server: exit code {report['server']['exit_code']} after SIGTERM in "
              f"{report['server']['shutdown_s']} s; log {report['server']['log']}",
              "", "RESULT: " + ("PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"]))]
    return "\n".join(lines)


async def run(args: argparse.Namespace, server: ServerProcess) -> dict:
    load_s = args.minutes * 60
    warmup_s = args.warmup_seconds if args.warmup_seconds is not None else min(60.0, 0.2 * load_s)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.hung_timeout)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits,
                                 headers=server.headers()) as client, \
            httpx.AsyncClient(base_url=server.url, timeout=timeout, headers=server.headers()) as probe:
        t_start = time.monotonic()
        why = await wait_healthy(server, probe, args.startup_timeout)
        if why is not None:
            return {"error": why, "startup_s": round(time.monotonic() - t_start, 1)}
        startup_s = time.monotonic() - t_start
        model = (await probe.get("/v1/models")).json()["data"][0]["id"]
        stats, samples, stop = Stats(), [], asyncio.Event()
        t0 = time.monotonic()
        sampling = asyncio.create_task(sampler(server, probe, t0, samples, stop, args.sample_interval))
        deadline = t0 + load_s
        await asyncio.gather(*(worker(i, server, client, model, stats, deadline, args) for i in range(args.concurrency)))
        load_seconds = time.monotonic() - t0
        exited_during_load = server.proc.poll()
        stop.set()
        await sampling
        t_idle = time.monotonic()
        if exited_during_load is None:
            final = await wait_idle(probe, args.idle_timeout)
        else:
            final = {"idle": False, "error": "the server is not running"}
        idle_wait_s = time.monotonic() - t_idle
        final["rss_mb"] = server.rss_mb()
        try:
            counters = parse_counters((await probe.get("/metrics", timeout=10)).text)
        except httpx.HTTPError as exc:
            counters = {"error": repr(exc)}
    code, shutdown_s = server.terminate()
    total = sum(stats.outcomes.values())
    return {
        "model": model,
        "startup_s": round(startup_s, 1),
        "requests": {"total": total, "by_outcome": dict(stats.outcomes),
                     "by_kind": {k: dict(v) for k, v in stats.by_kind.items()},
                     "examples": stats.examples},
        "latency_s": {kind: percentiles(v) for kind, v in sorted(stats.latency.items())},
        "ttft_s": percentiles(stats.ttft),
        "throughput": {"load_seconds": round(load_seconds, 1), "completion_tokens": stats.completion_tokens,
                       "tokens_per_s": round(stats.completion_tokens / load_seconds, 2),
                       "requests_per_s": round(total / load_seconds, 2)},
        "rss": rss_summary(samples, warmup_s),
        "kv": kv_summary(samples),
        "final_gauges": final,
        "idle_wait_s": round(idle_wait_s, 1),
        "server_counters": counters,  # the server's own view: success by finish_reason, failure by reason
        "server": {"exit_code": code, "shutdown_s": round(shutdown_s, 1), "exited_during_load": exited_during_load},
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = ServerProcess(args)
    report: dict = {}
    try:
        report = asyncio.run(run(args, server))
    finally:
        server.kill()  # only if still running (an error above); a normal run has already stopped it
    report = {"config": {k: v for k, v in vars(args).items()}, "command": server.cmd, "pid": server.pid,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}} | report
    report.setdefault("server", {})["log"] = server.log_path
    if "error" in report:
        report["passed"], report["failures"] = False, [report["error"]]
        report["server_log_tail"] = server.log_tail()
        status = 2
    else:
        report["failures"] = failures_of(report, args.strict_rss)
        report["passed"] = not report["failures"]
        status = 0 if report["passed"] else 1
        if not report["passed"]:
            report["server_log_tail"] = server.log_tail()
    if report["passed"] and not args.keep_log:
        Path(server.log_path).unlink(missing_ok=True)
        report["server"]["log"] = None
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if "error" in report:
        print(f"soak: {report['error']}\n{report.get('server_log_tail', '')}", file=sys.stderr)
    else:
        print(summary_table(report), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
