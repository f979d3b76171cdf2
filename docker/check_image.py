"""Runs a built specserve image the way a user would and checks it (called by docker/test-image.sh):
health within the start period, chat + streamed chat through the OpenAI SDK, /metrics, HEALTHCHECK healthy,
non-root uid, --read-only with a tmpfs for the cache, and `docker stop` with a stream in flight -> exit 0."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
from openai import OpenAI

START_PERIOD_S = 180  # the Dockerfile's HEALTHCHECK --start-period
STOP_TIMEOUT_S = 60  # > the server's 30 s --shutdown-timeout, so a draining stream is never SIGKILLed
UID = "10001"


def docker(*args: str, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Container:
    """One `docker run -d --network host` of the image on a free loopback port; removed on exit."""

    def __init__(self, image: str, *extra: str):
        self.port = free_port()
        self.name = f"specserve-test-{uuid.uuid4().hex[:8]}"
        docker("run", "-d", "--name", self.name, "--network", "host", "--stop-timeout", str(STOP_TIMEOUT_S),
               "-e", f"SPECSERVE_PORT={self.port}", "-e", "SPECSERVE_HOST=127.0.0.1", *extra, image)
        self.base = f"http://127.0.0.1:{self.port}"
        self.sdk = OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            print(f"--- logs of {self.name} ---\n" + docker("logs", "--tail", "60", self.name, check=False),
                  file=sys.stderr)
        docker("rm", "-f", self.name, check=False)

    def state(self, field: str) -> str:
        return docker("inspect", "-f", "{{" + field + "}}", self.name)

    def wait_ready(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_PERIOD_S:
            if self.state(".State.Running") != "true":
                raise AssertionError(f"container exited with {self.state('.State.ExitCode')} before ready")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"/health not 200 within the {START_PERIOD_S} s start period")

    def model(self) -> str:
        return self.sdk.models.list().data[0].id


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)
    print(f"  ok  {what}")


def check_chat(c: Container, model: str) -> None:
    # a request that repeats its prompt, so the CPU default (n-gram prompt lookup) finds drafts whatever the CPU;
    # the answer itself is not checked: in bf16 near-ties differ between CPUs (tests/engine/test_demo_pair.py
    # checks answers in fp32)
    ask = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    r = c.sdk.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                      messages=[{"role": "user", "content": ask}])
    text = r.choices[0].message.content or ""
    check(bool(text.strip()) and r.usage.completion_tokens > 0, f"chat completion answers: {text[:60]!r}")
    spec = (r.model_extra or {}).get("speculation") or {}
    check(spec.get("num_draft_tokens", 0) > 0, f"chat completion speculated: {spec}")


def check_stream(c: Container, model: str) -> float:
    """Returns the stream's rate in tokens/s, to size the stream that must outlast `docker stop`'s signal."""
    t0 = time.monotonic()
    chunks = list(c.sdk.chat.completions.create(
        model=model, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Write a haiku about the sea."}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(bool(text.strip()) and finish in (["stop"], ["length"]) and chunks[-1].usage is not None,
          f"streamed chat: {len(chunks)} chunks, finish {finish}, {text[:40]!r}")
    return chunks[-1].usage.completion_tokens / (time.monotonic() - t0)


def check_metrics(c: Container) -> None:
    body = httpx.get(c.base + "/metrics", timeout=10).text
    drafted = [ln for ln in body.splitlines() if ln.startswith("specserve_spec_decode_num_draft_tokens_total{")]
    check(bool(drafted) and float(drafted[0].rsplit(" ", 1)[1]) > 0, f"/metrics scraped: {drafted[:1]}")


def check_cpu_kernels(c: Container) -> None:
    """The image has no compiler: the kernels built in its build stage load (x86-64 hosts)."""
    probe = ("import platform; from specserve.engine.model.cpu_kernels import build; "
             "print(platform.machine(), build.load() is not None, build.compiler())")
    machine, loaded, cc = docker("exec", c.name, "python", "-c", probe).split()
    check(cc == "None" and (loaded == "True" or machine != "x86_64"),
          f"CPU kernels without a compiler: loaded {loaded} on {machine} (compiler {cc})")


def check_healthcheck(c: Container) -> None:
    t0 = time.monotonic()
    while (status := c.state(".State.Health.Status")) == "starting" and time.monotonic() - t0 < START_PERIOD_S:
        time.sleep(1)
    check(status == "healthy", f"HEALTHCHECK status {status!r}")


def check_uid(c: Container) -> None:
    status = docker("exec", c.name, "cat", "/proc/1/status")
    uids = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("Uid:"))
    check(set(uids) == {UID}, f"PID 1 runs as uid {uids[0]} (not root)")


def check_stop_with_stream(c: Container, model: str, tokens_per_s: float) -> None:
    """`docker stop` while a stream is open: the stream must finish whole, the container must exit 0. The stream is
    sized to last ~5 s at the measured rate: long enough to be in flight at the signal (checked: chunks arrive after
    it), far inside the server's 30 s drain."""
    max_tokens = int(min(max(5 * tokens_per_s, 64), 1500))
    result: dict = {}
    last_chunk = [0.0]
    first = threading.Event()

    def stream() -> None:
        try:
            n, finish, usage = 0, None, None
            for ch in c.sdk.chat.completions.create(
                    model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": "Tell me a story."}]):
                first.set()
                last_chunk[0] = time.monotonic()
                if ch.choices:
                    n += 1
                    finish = ch.choices[0].finish_reason or finish
                usage = ch.usage or usage
            result.update(finish=finish, tokens=usage.completion_tokens if usage else None)
        except Exception as e:  # reported by the check below
            result["error"] = repr(e)
        finally:
            first.set()

    t = threading.Thread(target=stream)
    t.start()
    check(first.wait(120) and "error" not in result, "stream started before docker stop")
    stop_at = time.monotonic()
    stop = subprocess.run(["docker", "stop", c.name], capture_output=True, text=True)
    t.join(STOP_TIMEOUT_S)
    check(last_chunk[0] > stop_at, f"stream still in flight {last_chunk[0] - stop_at:.1f} s after docker stop began")
    check(result.get("finish") == "length" and result.get("tokens") == max_tokens,
          f"in-flight stream finished whole during the drain: {result} of {max_tokens}")
    check(stop.returncode == 0 and c.state(".State.ExitCode") == "0",
          f"docker stop rc {stop.returncode}, container exit code {c.state('.State.ExitCode')}")


def main(image: str) -> None:
    print(f"test-image: checking {image}")
    with Container(image) as c:
        print(f"  ok  /health 200 after {c.wait_ready():.1f} s (start period {START_PERIOD_S} s)")
        model = c.model()
        check_chat(c, model)
        rate = check_stream(c, model)
        check_metrics(c)
        check_cpu_kernels(c)
        check_uid(c)
        check_healthcheck(c)
        check_stop_with_stream(c, model, rate)
    with Container(image, "--read-only", "--tmpfs", "/home/specserve/.cache", "--tmpfs", "/tmp") as c:
        print(f"  ok  --read-only: /health 200 after {c.wait_ready():.1f} s")
        check_chat(c, c.model())
        stop = subprocess.run(["docker", "stop", c.name], capture_output=True, text=True)
        check(stop.returncode == 0 and c.state(".State.ExitCode") == "0", "--read-only: docker stop -> exit 0")
    print("test-image: PASSED")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "specserve:test")
