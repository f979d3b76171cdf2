"""The metric names and labels the dashboard may use (README's metrics table, issue 5), and the dashboard's
PromQL expressions with Grafana's variables made concrete."""

from __future__ import annotations

import json
import re

from tests.deploy.dockerfile_parse import ROOT

DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "specserve.json"

COUNTERS = {
    "specserve_spec_decode_num_drafts": {"method"},
    "specserve_spec_decode_num_draft_tokens": {"method"},
    "specserve_spec_decode_num_accepted_tokens": {"method"},
    "specserve_spec_decode_num_accepted_tokens_per_pos": {"method", "position"},
    "specserve_prompt_tokens": set(),
    "specserve_generation_tokens": set(),
    "specserve_request_success": {"finish_reason"},
    "specserve_request_failure": {"reason"},
    "specserve_prefix_cache_queries": set(),
    "specserve_prefix_cache_hits": set(),
}
GAUGES = {
    "specserve_spec_decode_acceptance_rate": {"method"},
    "specserve_num_requests_running": set(),
    "specserve_num_requests_waiting": set(),
    "specserve_kv_cache_usage_ratio": set(),
}
HISTOGRAMS = {
    "specserve_spec_decode_accepted_length": {"method"},
    "specserve_spec_decode_num_speculative_tokens": {"method"},
    "specserve_spec_decode_draft_seconds": {"method"},
    "specserve_spec_decode_verify_seconds": {"method"},
    "specserve_time_to_first_token_seconds": set(),
    "specserve_inter_token_latency_seconds": set(),
    "specserve_e2e_request_latency_seconds": set(),
    "specserve_request_queue_time_seconds": set(),
}
FAMILIES = COUNTERS | GAUGES | HISTOGRAMS

# series name as queried -> (family, labels it carries)
SERIES: dict[str, tuple[str, set[str]]] = {}
for _name, _labels in COUNTERS.items():
    SERIES[_name + "_total"] = (_name, {"model"} | _labels)
for _name, _labels in GAUGES.items():
    SERIES[_name] = (_name, {"model"} | _labels)
for _name, _labels in HISTOGRAMS.items():
    SERIES[_name + "_bucket"] = (_name, {"model", "le"} | _labels)
    SERIES[_name + "_sum"] = SERIES[_name + "_count"] = (_name, {"model"} | _labels)

GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$model": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def concrete(expr: str) -> str:
    """The expression as Grafana sends it (variables substituted), for a PromQL parser."""
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    return expr


def series_names(expr: str) -> set[str]:
    """Metric names in an expression: identifiers directly before a `{` matcher (every selector here has one)."""
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr))


def targets(dash: dict | None = None) -> list[tuple[dict, dict]]:
    """(panel, target) for every query of every panel, rows' nested panels included."""
    dash = dashboard() if dash is None else dash
    out = []
    for panel in dash["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p, t) for t in p.get("targets", [])]
    return out
