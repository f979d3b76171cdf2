"""An app with the real engine on tiny random models, driven in-process with Starlette's TestClient."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from specserve.config.schema import AppConfig, EngineConfig, ServerConfig
from specserve.server.app import create_app


def make_client(tiny, **engine_kw) -> TestClient:
    server_fields = ServerConfig.__dataclass_fields__
    server_kw = {k: engine_kw.pop(k) for k in list(engine_kw) if k in server_fields}
    engine = dict(model=str(tiny["llama"]), draft_model=str(tiny["llama_draft"]), num_speculative_tokens=3,
                  dtype="float32", device="cpu", kv_cache_memory=1 << 24, seed=0) | engine_kw
    return TestClient(create_app(AppConfig(EngineConfig(**engine), ServerConfig(**server_kw))))


def wait_ready(client: TestClient, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(tiny):
    with make_client(tiny, served_model_name="tiny") as c:
        wait_ready(c)
        yield c
