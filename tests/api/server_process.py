"""A real `specserve serve` subprocess on 127.0.0.1 for tests that need sockets, signals and scrapers."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tiny, *extra: str, env: dict | None = None, nofile: int | None = None):
        """nofile: the server's descriptor limit, soft and hard (so that it cannot raise it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specserve", "serve", "--model", str(tiny["llama"]), "--draft-model",
               str(tiny["llama_draft"]), "--dtype", "float32", "--kv-cache-memory", "16MiB",
               "--served-model-name", "tiny", "--port", str(self.port), "--log-level", "warning", *extra]
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        self.proc = subprocess.Popen(cmd, env=os.environ | (env or {}), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.1)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)
