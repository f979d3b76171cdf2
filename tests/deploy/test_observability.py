"""docker/compose.yaml, docker/prometheus.yml and the provisioned Grafana dashboard: structure, cross-references
(datasource uid, mount paths, scrape target) and every PromQL expression (syntax with promtool when
tools/install-prometheus.sh has fetched it; metric and label names always)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from specserve.config.loader import build_config
from tests.deploy.contract import DASHBOARD, DOCKER, SERIES, concrete, dashboard, series_names, targets
from tests.deploy.dockerfile_parse import DOCKERFILE, ROOT, image, instructions

COMPOSE_TEXT = (DOCKER / "compose.yaml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
PROVISIONING = DOCKER / "grafana" / "provisioning"
DATASOURCES = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
PROVIDERS = yaml.safe_load((PROVISIONING / "dashboards" / "specserve.yaml").read_text())
DASH = dashboard()
DS_UID = DATASOURCES["datasources"][0]["uid"]


def _defaults(value: str) -> str:
    """Compose interpolation with an empty environment: ${X:-d} and ${X-d} give d, ${X} gives ''."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def _mounts(service: str) -> dict[str, str]:
    """container path -> host path (relative to docker/) of the service's bind mounts and volumes."""
    out = {}
    for v in COMPOSE["services"][service].get("volumes", []):
        host, container = _defaults(v).split(":")[:2]
        out[container] = host
    return out


# ---- compose ---------------------------------------------------------------------------------------------------

def test_compose_has_the_three_services_built_and_wired():
    services = COMPOSE["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    build = services["specserve"]["build"]
    assert (DOCKER / build["context"]).resolve() == ROOT
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == ROOT / "Dockerfile"
    declared = {a.split("=")[0] for k, a in instructions(DOCKERFILE.read_text()) if k == "ARG"}
    assert set(build["args"]) <= declared
    assert _defaults(build["args"]["TORCH_INDEX_URL"]) == "https://download.pytorch.org/whl/cpu"
    assert [_defaults(p) for p in services["specserve"]["ports"]] == ["8000:8000"]
    for name in ("prometheus", "grafana"):
        assert ":" in services[name]["image"] and not services[name]["image"].endswith(":latest"), "pinned tag"
    assert services["prometheus"]["depends_on"] == ["specserve"]
    assert services["grafana"]["depends_on"] == ["prometheus"]
    assert set(COMPOSE["volumes"]) >= {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])
                                       if not v.startswith((".", "$", "/"))}


def test_compose_specserve_env_parses_and_user_models_volume():
    env = {k: _defaults(str(v)) for k, v in COMPOSE["services"]["specserve"]["environment"].items()}
    assert all(k.startswith("SPECSERVE_") for k in env)
    build_config(None, env)  # every name is a setting, every default value parses
    assert _mounts("specserve")["/models"] == "./user-models"
    assert re.search(r"#\s*SPECSERVE_MODEL: /models/", COMPOSE_TEXT), "commented example pointing into the volume"
    assert str(Path(image().env["HF_HOME"])) in _mounts("specserve")


def test_compose_gpu_reservation_is_there_commented():
    block = "\n".join(ln.split("#", 1)[1] for ln in COMPOSE_TEXT.splitlines()
                      if ln.strip().startswith("#") and "#" in ln)
    snippet = block[block.index(" deploy:"):]
    parsed = yaml.safe_load("\n".join(ln[1:] for ln in snippet.splitlines()[:7]))
    (device,) = parsed["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "deploy" not in COMPOSE["services"]["specserve"]  # CPU by default


def test_prometheus_scrapes_specserve_metrics():
    assert _mounts("prometheus")["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "specserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert ["specserve:8000"] in [sc["targets"] for sc in job["static_configs"]]


def test_grafana_provisioning_matches_the_mounts():
    mounts = _mounts("grafana")
    assert (DOCKER / mounts["/etc/grafana/provisioning"]).resolve() == PROVISIONING
    (ds,) = DATASOURCES["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["uid"]
    (provider,) = PROVIDERS["providers"]
    host = mounts[provider["options"]["path"]]  # the provider reads the folder compose mounts there
    assert (DOCKER / host).resolve() == DASHBOARD.parent
    home = COMPOSE["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


# ---- dashboard -------------------------------------------------------------------------------------------------

def _all_panels() -> list[dict]:
    return [p for top in DASH["panels"] for p in [top, *top.get("panels", [])]]


def test_dashboard_structure():
    panels = _all_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert DASH["uid"] and DASH["title"] and isinstance(DASH["schemaVersion"], int)
    for p in panels:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"], f"panel {p['title']!r} has no query"
            assert p["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
    for panel, t in targets(DASH):
        assert t.get("expr", "").strip(), f"panel {panel['title']!r} target {t.get('refId')} has no expr"
        assert t["datasource"]["uid"] == DS_UID
    refs = [(p["id"], t["refId"]) for p, t in targets(DASH)]
    assert len(refs) == len(set(refs))
    (var,) = DASH["templating"]["list"]
    assert var["name"] == "model" and var["datasource"]["uid"] == DS_UID
    assert re.fullmatch(r"label_values\((\w+), model\)", var["query"]["query"])
    assert series_names(var["query"]["query"] + "{") <= set(SERIES) | {"label_values"}


def test_dashboard_metric_and_label_names():
    used = set()
    for panel, t in targets(DASH):
        names = series_names(t["expr"])
        assert names, f"{panel['title']}: no metric selector in {t['expr']}"
        assert names <= set(SERIES), f"{panel['title']}: unknown metrics {names - set(SERIES)}"
        # every selector follows the dashboard's model variable
        assert t["expr"].count('{model=~"$model"}') == t["expr"].count("{"), t["expr"]
        labels = set().union(*(SERIES[n][1] for n in names))
        grouping = {lab.strip() for g in re.findall(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)", t["expr"])
                    for lab in g.split(",") if lab.strip()}
        assert grouping <= labels, f"{panel['title']}: labels {grouping - labels} are not on {names}"
        used |= {SERIES[n][0] for n in names}
    # the list: every metric family appears somewhere on the dashboard
    assert used == {family for family, _ in SERIES.values()}


def test_dashboard_key_queries():
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in _all_panels() if p["type"] != "row"}
    flat = "\n".join(e for es in exprs.values() for e in es)
    assert re.search(r"rate\(specserve_spec_decode_num_accepted_tokens_total\{[^}]*\}\[5m\]\)\) / "
                     r"sum by \(model, method\) \(rate\(specserve_spec_decode_num_draft_tokens_total", flat)
    assert re.search(r"1 \+ sum\(rate\(specserve_spec_decode_num_accepted_tokens_total.*\)\) / "
                     r"sum\(rate\(specserve_spec_decode_num_drafts_total", flat)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.95", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(specserve_{hist}_bucket" in flat, (hist, q)
    assert "rate(specserve_generation_tokens_total{model=~\"$model\"}[1m])" in flat
    assert "rate(specserve_prompt_tokens_total{model=~\"$model\"}[1m])" in flat
    assert "group_left" in next(e for es in exprs.values() for e in es if "per_pos" in e)


def _promtool() -> Path:
    path = ROOT / ".cache" / "prometheus" / "usr" / "bin" / "promtool"
    if not path.exists():
        pytest.skip(f"no promtool at {path}: run tools/install-prometheus.sh (Debian's prometheus package)")
    return path


def test_dashboard_promql_parses(tmp_path):
    """Prometheus' own parser (promtool check rules) on every dashboard query, variables substituted."""
    promtool = _promtool()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel{p['id']}:{t['refId']}", "expr": concrete(t["expr"])} for p, t in targets(DASH)]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    ok = subprocess.run([str(promtool), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rules["groups"][0]["rules"].append({"record": "broken", "expr": "sum(rate(specserve_prompt_tokens_total[1m])"})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    bad = subprocess.run([str(promtool), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0, "promtool must reject a broken expression"


def test_prometheus_config_passes_promtool():
    ok = subprocess.run([str(_promtool()), "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
