"""/metrics after real traffic: every documented metric present, promtool-clean, and read back through a real
Prometheus scraping a real server (Debian's package, fetched by tools/install-prometheus.sh)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.api.server_process import Server, free_port
from tests.api.test_endpoints import CHAT

PROM_BIN = Path(__file__).resolve().parents[2] / ".cache" / "prometheus" / "usr" / "bin"
METRICS = [
    "specserve_spec_decode_num_drafts_total", "specserve_spec_decode_num_draft_tokens_total",
    "specserve_spec_decode_num_accepted_tokens_total", "specserve_spec_decode_num_accepted_tokens_per_pos_total",
    "specserve_spec_decode_acceptance_rate", "specserve_spec_decode_accepted_length_bucket",
    "specserve_spec_decode_num_speculative_tokens_bucket", "specserve_spec_decode_draft_seconds_bucket",
    "specserve_spec_decode_verify_seconds_bucket", "specserve_time_to_first_token_seconds_bucket",
    "specserve_inter_token_latency_seconds_bucket", "specserve_e2e_request_latency_seconds_bucket",
    "specserve_request_queue_time_seconds_bucket", "specserve_prompt_tokens_total",
    "specserve_generation_tokens_total", "specserve_request_success_total", "specserve_request_failure_total",
    "specserve_kv_cache_usage_ratio", "specserve_num_requests_running", "specserve_num_requests_waiting",
    "specserve_prefix_cache_queries_total", "specserve_prefix_cache_hits_total", "specserve_cache_config_info",
]


def _need(tool: str) -> Path:
    path = PROM_BIN / tool
    if not path.exists():
        pytest.skip(f"{tool} not found at {path}: run tools/install-prometheus.sh (Debian's prometheus package)")
    return path


def _values(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]


def test_all_metrics_after_traffic_and_promtool(client):
    for body in (CHAT | {"max_tokens": 12, "ignore_eos": True}, CHAT | {"max_tokens": 5, "n": 2},
                 CHAT | {"temperature": 9}):
        client.post("/v1/chat/completions", json=body)
    text = client.get("/metrics").text
    for name in METRICS:
        assert _values(text, name), f"{name} missing from /metrics"
    assert sum(_values(text, "specserve_request_success_total")) >= 3
    assert 'reason="invalid_request"' in text
    drafted = sum(_values(text, "specserve_spec_decode_num_draft_tokens_total"))
    accepted = sum(_values(text, "specserve_spec_decode_num_accepted_tokens_total"))
    assert drafted > 0 and 0 <= sum(_values(text, "specserve_spec_decode_acceptance_rate")) <= 1
    assert sum(_values(text, "specserve_spec_decode_num_accepted_tokens_per_pos_total")) == accepted
    # the inference gateway's endpoint picker reads the KV geometry from these labels (value 1)
    (info,) = [line for line in text.splitlines() if line.startswith("specserve_cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert (int(labels["block_size"]), int(labels["num_gpu_blocks"])) == client.app.state.engine.kv_cache_blocks
    assert int(labels["num_gpu_blocks"]) > 0 and info.endswith(" 1.0")
    proc = subprocess.run([str(_need("promtool")), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_scrapes_acceptance_rate(tiny, tmp_path):
    prometheus = _need("prometheus")
    server = Server(tiny, "--num-speculative-tokens", "3")
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: specserve\n    static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]\n")
    prom = subprocess.Popen([str(prometheus), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(4):
            httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "The quick", "max_tokens": 16, "ignore_eos": True})
        text = httpx.get(server.url + "/metrics").text
        expected = (sum(_values(text, "specserve_spec_decode_num_accepted_tokens_total"))
                    / sum(_values(text, "specserve_spec_decode_num_draft_tokens_total")))
        query = ("sum(specserve_spec_decode_num_accepted_tokens_total) / "
                 "sum(specserve_spec_decode_num_draft_tokens_total)")
        deadline, got = time.monotonic() + 45, None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": query}, timeout=5)
                result = r.json()["data"]["result"]
                if result and abs(float(result[0]["value"][1]) - expected) < 1e-9:
                    got = float(result[0]["value"][1])
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        assert got is not None, f"Prometheus never returned the acceptance rate {expected}"
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        assert server.stop() == 0
