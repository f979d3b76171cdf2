"""`specserve serve --tensor-parallel-size 2` (tiny models, CPU, gloo): it answers, and a killed rank ends the server
with a log line naming the rank and exit status 1 — even with a request in flight — instead of a hang."""

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.api.server_process import Server

pytestmark = pytest.mark.slow  # two real processes per server


def _workers(pid: int) -> list[int]:
    """The server's tensor-parallel worker processes (spawned Python children, not multiprocessing's helpers)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
            and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


def _chat(url: str, max_tokens: int, stream: bool = False):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_two_rank_server_answers_and_a_killed_rank_ends_it(tiny):
    server = Server(tiny, "--tensor-parallel-size", "2", "--num-speculative-tokens", "2")
    try:
        reply = _chat(server.url, 16)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 16
        workers = _workers(server.proc.pid)
        assert len(workers) == 1
        in_flight = threading.Thread(target=lambda: _swallow(_chat, server.url, 200, True), daemon=True)
        in_flight.start()
        deadline = time.monotonic() + 10
        while server.metric("specserve_num_requests_running") < 1:  # the request is in the engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        status = server.proc.wait(timeout=60)  # never a hang
        log = server.proc.stdout.read()
        assert status == 1, log
        assert f"rank 1 (pid {workers[0]}) exited with code -9" in log, log
        in_flight.join(timeout=10)
        assert not in_flight.is_alive()
    finally:
        server.stop()


def _swallow(fn, *args):
    try:
        fn(*args)
    except httpx.HTTPError:
        pass


def test_a_worker_does_not_outlive_a_killed_rank_0(tiny):
    server = Server(tiny, "--tensor-parallel-size", "2", "--num-speculative-tokens", "0")
    try:
        workers = _workers(server.proc.pid)
        assert len(workers) == 1
        server.proc.kill()
        server.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while Path(f"/proc/{workers[0]}").exists() and _alive(workers[0]):
            assert time.monotonic() < deadline, "the worker outlived rank 0"
            time.sleep(0.2)
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    """Not gone and not a zombie waiting for its (dead) parent's reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
