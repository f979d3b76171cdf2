"""docker/k8s: every built-in resource validated (strict: unknown fields fail) against the Kubernetes OpenAPI
schemas bundled in kubernetes-validate (offline); the ServiceMonitor CRD, which those schemas lack, and the links
between resources (labels, ports, probes, env, GPU) are checked here."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from specserve.config.loader import build_config
from tests.deploy.dockerfile_parse import ROOT, image

K8S = ROOT / "docker" / "k8s"
VERSIONS = ("1.29", "latest")  # oldest still common in managed clusters, and the newest bundled
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _docs() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}


DOCS = _docs()
ALL = [(name, d) for name, docs in DOCS.items() for d in docs]


def _one(kind: str, file: str) -> dict:
    (doc,) = [d for d in DOCS[file] if d["kind"] == kind]
    return doc


DEPLOYMENTS = {f: _one("Deployment", f) for f in ("deployment.yaml", "deployment-gpu.yaml")}
SERVICE = _one("Service", "service.yaml")


@pytest.fixture(scope="module")
def kv():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate; it bundles the schemas)")
    return kubernetes_validate


def test_expected_files_and_kinds():
    kinds = sorted((name, d["kind"]) for name, d in ALL)
    assert kinds == [("deployment-gpu.yaml", "Deployment"), ("deployment.yaml", "Deployment"),
                     ("hpa.yaml", "HorizontalPodAutoscaler"), ("service.yaml", "Service"),
                     ("servicemonitor.yaml", "ServiceMonitor")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,doc", ALL, ids=[f"{n}:{d['kind']}" for n, d in ALL])
def test_schema_valid(kv, name, doc, version):
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        pytest.skip(f"{doc['kind']} is a CRD ({doc['apiVersion']}): no bundled schema; checked in "
                    "test_servicemonitor_selects_the_service")
    kv.validate(doc, kv.latest_version() if version == "latest" else version, strict=True)


def test_validator_rejects_mistakes(kv):
    """The offline validator really checks: a misspelt field and a wrong type both fail."""
    bad = copy.deepcopy(DEPLOYMENTS["deployment.yaml"])
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.29", strict=True)
    bad = copy.deepcopy(DEPLOYMENTS["deployment.yaml"])
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.29", strict=True)


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "from-" + next(iter(e.get("valueFrom", {"x": 0})))) for e in c["env"]}


@pytest.mark.parametrize("file", DEPLOYMENTS)
def test_deployment_probes_security_metrics_and_env(file):
    dep = DEPLOYMENTS[file]
    pod = dep["spec"]["template"]
    spec, c = pod["spec"], _container(dep)
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000}
    # models load after the server listens: /health is 503 until then, so a startup probe guards liveness
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 300, "at least 5 minutes to load the models"
    assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] >= 30
    assert c["readinessProbe"]["periodSeconds"] <= 10
    # non-root, the image's numeric uid
    uid = int(image().uid)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == uid
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    if c["securityContext"].get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", str(Path(image().env["HF_HOME"]).parent)} <= mounts, "writable /tmp and HF cache"
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                                              "prometheus.io/path": "/metrics"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # the Service named specserve would inject SPECSERVE_PORT=tcp://...: specserve would refuse to start
    assert spec["enableServiceLinks"] is False
    env = _env(c)
    specserve_env = {k: v for k, v in env.items() if k.startswith("SPECSERVE_")}
    assert specserve_env
    config = build_config(None, specserve_env)  # every name is a setting and every value parses
    assert spec["terminationGracePeriodSeconds"] >= config.server.shutdown_timeout + 5
    assert "SPECSERVE_HOST" not in env and "SPECSERVE_PORT" not in env  # the image's 0.0.0.0:8000


def test_gpu_variant():
    cpu, gpu = (_container(DEPLOYMENTS[f]) for f in ("deployment.yaml", "deployment-gpu.yaml"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert "cuda" in gpu["image"].split(":")[-1] and "cuda" not in cpu["image"]
    assert _env(gpu)["SPECSERVE_DEVICE"] == "cuda"
    # same name and labels: the GPU file replaces the CPU one behind the same Service / HPA / ServiceMonitor
    names = {DEPLOYMENTS[f]["metadata"]["name"] for f in DEPLOYMENTS}
    assert names == {"specserve"}


def test_service_selects_the_pods_by_named_port():
    for dep in DEPLOYMENTS.values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert SERVICE["spec"]["selector"].items() <= labels.items()
    (port,) = SERVICE["spec"]["ports"]
    assert port["name"] == "http" and port["port"] == 8000 and port["targetPort"] == "http"


def test_servicemonitor_selects_the_service():
    sm = _one("ServiceMonitor", "servicemonitor.yaml")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= SERVICE["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in SERVICE["spec"]["ports"]} and ep["path"] == "/metrics"
    assert set(sm["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels"}
    assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings",
                       "metricRelabelings"}


def test_hpa_scales_the_deployment_on_the_waiting_queue():
    hpa = _one("HorizontalPodAutoscaler", "hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specserve"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "specserve_num_requests_waiting"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "prometheus-adapter" in (K8S / "hpa.yaml").read_text()  # the custom metrics API it depends on
