"""docker/k8s/gateway: the Gateway API Inference Extension manifests. Built-in kinds validated strictly against the
Kubernetes OpenAPI schemas bundled in kubernetes-validate (offline); InferencePool, Gateway and HTTPRoute against the
structural schemas restated in gateway_schemas.py; the links between them (labels, ports, names); and the endpoint
picker's configuration against a live specserve /metrics: every metric it is told to read exists, has the type and
labels its model-server protocol asks for, and means what the picker assumes (a 0..1 KV fraction, request counts)."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import make_client, wait_ready
from tests.deploy.dockerfile_parse import ROOT
from tests.deploy.gateway_schemas import SCHEMAS, cel_rules

GATEWAY = ROOT / "docker" / "k8s" / "gateway"
DOCS = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(GATEWAY.glob("*.yaml"))}
ALL = [(name, d) for name, docs in DOCS.items() for d in docs]
BUILTIN = [(n, d) for n, d in ALL if (d["apiVersion"], d["kind"]) not in SCHEMAS]
CUSTOM = [(n, d) for n, d in ALL if (d["apiVersion"], d["kind"]) in SCHEMAS]
DEPLOYMENT = next(d for d in yaml.safe_load_all((ROOT / "docker" / "k8s" / "deployment.yaml").read_text()) if d)


def _one(kind: str, name: str | None = None) -> dict:
    (doc,) = [d for _, d in ALL if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def epp_config() -> dict:
    return yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])


def engine_config() -> dict:
    extractor = next(p for p in epp_config()["plugins"] if p["type"] == "core-metrics-extractor")
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return engine


def test_expected_kinds():
    assert sorted((n, d["kind"]) for n, d in ALL) == [
        ("epp.yaml", "ConfigMap"), ("epp.yaml", "Deployment"), ("epp.yaml", "Role"), ("epp.yaml", "RoleBinding"),
        ("epp.yaml", "Service"), ("epp.yaml", "ServiceAccount"), ("httproute.yaml", "Gateway"),
        ("httproute.yaml", "HTTPRoute"), ("inferencepool.yaml", "InferencePool")]


@pytest.mark.parametrize("version", ("1.29", "latest"))
@pytest.mark.parametrize("name,doc", BUILTIN, ids=[f"{n}:{d['kind']}" for n, d in BUILTIN])
def test_builtin_kinds_schema_valid(name, doc, version):
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, kv.latest_version() if version == "latest" else version, strict=True)


@pytest.mark.parametrize("name,doc", CUSTOM, ids=[f"{n}:{d['kind']}" for n, d in CUSTOM])
def test_custom_resources_schema_valid(name, doc):
    jsonschema.validate(doc, SCHEMAS[(doc["apiVersion"], doc["kind"])])
    assert cel_rules(doc) == []


def test_schemas_reject_mistakes():
    pool = copy.deepcopy(_one("InferencePool"))
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")  # misspelt
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, SCHEMAS[(pool["apiVersion"], "InferencePool")])
    pool = copy.deepcopy(_one("InferencePool"))
    pool["spec"]["endpointPickerRef"].pop("port")
    assert cel_rules(pool)
    route = copy.deepcopy(_one("HTTPRoute"))
    route["spec"]["rules"][0]["timeouts"]["request"] = "ten minutes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(route, SCHEMAS[(route["apiVersion"], "HTTPRoute")])


def test_pool_selects_the_specserve_pods_and_names_the_picker():
    pool = _one("InferencePool")["spec"]
    pod = DEPLOYMENT["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert [p["number"] for p in pool["targetPorts"]] == [p["containerPort"] for p in container["ports"]]
    service = _one("Service", pool["endpointPickerRef"]["name"])
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert pool["endpointPickerRef"]["port"]["number"] in ports
    epp = _one("Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    (picker,) = epp["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in picker["args"])
    assert args["pool-name"] == _one("InferencePool")["metadata"]["name"]
    assert int(args["grpc-port"]) == pool["endpointPickerRef"]["port"]["number"]
    named = {p["name"]: p["containerPort"] for p in picker["ports"]}
    assert named[ports[int(args["grpc-port"])]["targetPort"]] == int(args["grpc-port"])
    mount = next(m["mountPath"] for m in picker["volumeMounts"] if m["name"] == "config")
    assert args["config-file"] == f"{mount}/config.yaml"
    assert epp["spec"]["serviceAccountName"] == _one("RoleBinding")["subjects"][0]["name"]
    resources = {r for rule in _one("Role")["rules"] for r in rule["resources"]}
    assert {"pods", "inferencepools"} <= resources


def test_route_sends_everything_to_the_pool():
    route, gateway = _one("HTTPRoute")["spec"], _one("Gateway")
    assert [p["name"] for p in route["parentRefs"]] == [gateway["metadata"]["name"]]
    (rule,) = route["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": _one("InferencePool")["metadata"]["name"]}]


def test_picker_config_is_consistent():
    config = epp_config()
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= declared and declared <= set(refs)
    scorers = {r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= scorers


def _spec(spec: str) -> tuple[str, dict]:
    """The picker's metric specification syntax: name{label=value,...}."""
    m = re.fullmatch(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*", spec)
    assert m, spec
    labels = dict(re.findall(r'(\w+)\s*=\s*"?([^",}]+)"?', m.group(2) or ""))
    return m.group(1), labels


@pytest.fixture(scope="module")
def scraped(tiny):
    with make_client(tiny, served_model_name="tiny", max_num_seqs=1) as c:
        wait_ready(c)
        c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]})
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        yield families, c.app.state.engine.kv_cache_blocks


def test_picker_reads_metrics_specserve_exports_with_the_protocols_types(scraped):
    families, (block_size, num_blocks) = scraped
    engine = engine_config()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        name, labels = _spec(engine[key])
        assert name in families, f"{key}: {name} not exported"
        assert families[name].type == "gauge", f"{key}: the protocol asks for a gauge"
        (sample,) = [s for s in families[name].samples if labels.items() <= s.labels.items()]
        if key != "kvUsageSpec":  # the request above has finished: an idle server reports 0, not its last batch
            assert sample.value == 0, key
        if key == "kvUsageSpec":  # the picker scores 1 - value: a fraction, not a percentage
            assert 0 <= sample.value <= 1
    name, _ = _spec(engine["cacheInfoSpec"])
    (sample,) = families[name].samples
    assert int(sample.labels[engine["cacheBlockSizeLabelName"]]) == block_size
    assert int(sample.labels[engine["cacheNumBlocksLabelName"]]) == num_blocks


def test_data_source_scrapes_the_servers_metrics_path():
    source = next(p for p in epp_config()["plugins"] if p["type"] == "metrics-data-source")["parameters"]
    pod = DEPLOYMENT["spec"]["template"]["metadata"]["annotations"]
    assert source["path"] == pod["prometheus.io/path"] and source["scheme"] == "http"
