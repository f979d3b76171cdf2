"""Soak test: start `specserve serve` on 127.0.0.1, drive it with a mixed concurrent load for N minutes, watch its
memory and KV gauges, and check it ends idle, with the KV cache empty, and exits 0 on SIGTERM. Not run in CI.

`python -m bench.soak --minutes 10 --concurrency 8 [--model M --draft-model D] [--port P] [--out results.json]
 [--extra-args "--dtype float32 --max-num-seqs 16"]`

The load mixes streamed chat completions, non-streamed completions, streams the client drops at a random point,
and invalid requests (temperature out of range, an unknown field, malformed JSON); with --abusers, also bursts of
hostile connections (slow heads, slow bodies, silent ones, 10,000-header floods) that the server must close. Every
few seconds it samples the server's RSS (VmRSS of /proc/PID/status) and the `specserve_kv_cache_usage_ratio`,
`specserve_num_requests_running` and `specserve_num_requests_waiting` gauges of /metrics.

Prints a JSON report (stdout, or --out FILE) and a summary table (stderr). Exits 1 when a valid request got a 5xx
or ended with an error event, any request hung (no response within --hung-timeout), an invalid request was
accepted or got a 5xx, a transport error happened, a hostile connection was answered 2xx or held past
--hung-timeout, the server did not go back to idle with an empty KV cache, or it did not exit 0 on SIGTERM (with
--strict-rss also when RSS grew more than 10% after warm-up); 2 when the server never became healthy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.output import emit
from bench.soak_load import Stats, abuser, worker
from bench.soak_report import RSS_FLAT_RATIO, failures_of, kv_summary, percentiles, rss_summary, summary_table

HOST = "127.0.0.1"  # the only address this script ever talks to
GAUGES = {"kv": "specserve_kv_cache_usage_ratio", "running": "specserve_num_requests_running",
          "waiting": "specserve_num_requests_waiting"}
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
    ap.add_argument("--abusers", type=int, default=0,
                    help="more workers that attack the transport: slow heads and bodies, silent connections, "
                         "header floods (give the server short --header-timeout etc. in --extra-args)")
    ap.add_argument("--abuse-burst", type=int, default=8, help="an abuser opens up to this many connections at once")
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
        self.cmd = [sys.executable, "-m", "specserve", "serve", "--host", HOST, "--port", str(self.port)]
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
        await asyncio.gather(*(worker(i, server, client, model, stats, deadline, args) for i in range(args.concurrency)),
                             *(abuser(i, server, stats, deadline, args) for i in range(args.abusers)))
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
    emit(report, args.out)
    if "error" in report:
        print(f"soak: {report['error']}\n{report.get('server_log_tail', '')}", file=sys.stderr)
    else:
        print(summary_table(report), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
