"""Structural schemas (JSON Schema) of the three custom resources docker/k8s/gateway/ uses, restated by hand from
their v1 CRDs: InferencePool (gateway-api-inference-extension, inference.networking.k8s.io/v1) and Gateway /
HTTPRoute (Gateway API, gateway.networking.k8s.io/v1, standard channel), for the fields and rules that matter to
these manifests. Objects are closed (additionalProperties false) as the API server prunes / strict-decodes unknown
fields; the CRDs' CEL rules that bear on these manifests are in cel_rules(). kubernetes-validate bundles only the
built-in kinds, so these stand in for the CRDs offline."""

from __future__ import annotations

DNS_LABEL = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
GROUP = {"type": "string", "maxLength": 253, "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}


def _obj(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return _obj({"apiVersion": {"const": api_version}, "kind": {"const": kind},
                 "metadata": {"type": "object", "required": ["name"]}, "spec": spec, "status": {"type": "object"}},
                ("apiVersion", "kind", "metadata", "spec"))


INFERENCE_POOL = _resource("inference.networking.k8s.io/v1", "InferencePool", _obj({
    "selector": _obj({"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                      "additionalProperties": LABEL_VALUE}}, ("matchLabels",)),
    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _obj({"number": PORT}, ("number",))},
    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
    "endpointPickerRef": _obj({"group": GROUP, "kind": KIND, "name": NAME, "port": _obj({"number": PORT}, ("number",)),
                               "failureMode": {"enum": ["FailOpen", "FailClose"]}}, ("name",)),
}, ("selector", "targetPorts")))

_PARENT_REF = _obj({"group": GROUP, "kind": KIND, "namespace": DNS_LABEL, "name": NAME, "sectionName": DNS_LABEL,
                    "port": PORT}, ("name",))
_PATH_MATCH = _obj({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                    "value": {"type": "string", "maxLength": 1024}})
_BACKEND_REF = _obj({"group": GROUP, "kind": KIND, "name": NAME, "namespace": DNS_LABEL, "port": PORT,
                     "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}, "filters": {"type": "array"}},
                    ("name",))

HTTP_ROUTE = _resource("gateway.networking.k8s.io/v1", "HTTPRoute", _obj({
    "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
    "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
    "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _obj({
        "name": DNS_LABEL,
        "matches": {"type": "array", "maxItems": 64, "items": _obj({
            "path": _PATH_MATCH, "headers": {"type": "array"}, "queryParams": {"type": "array"},
            "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]}})},
        "filters": {"type": "array", "maxItems": 16},
        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
        "timeouts": _obj({"request": DURATION, "backendRequest": DURATION}),
    })},
}))

GATEWAY = _resource("gateway.networking.k8s.io/v1", "Gateway", _obj({
    "gatewayClassName": {"type": "string", "minLength": 1, "maxLength": 253},
    "listeners": {"type": "array", "minItems": 1, "maxItems": 64, "items": _obj({
        "name": DNS_LABEL, "hostname": {"type": "string"}, "port": PORT,
        "protocol": {"type": "string", "minLength": 1, "maxLength": 255},
        "tls": {"type": "object"}, "allowedRoutes": {"type": "object"}}, ("name", "port", "protocol"))},
    "addresses": {"type": "array"}, "infrastructure": {"type": "object"},
}, ("gatewayClassName", "listeners")))

SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
           ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
           ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY}


def cel_rules(doc: dict) -> list[str]:
    """The CRDs' x-kubernetes-validations that these manifests could break: messages of the broken ones."""
    spec, broken = doc["spec"], []
    if doc["kind"] == "InferencePool":
        ports = [p["number"] for p in spec["targetPorts"]]
        if len(set(ports)) != len(ports):
            broken.append("port number must be unique")
        ref = spec.get("endpointPickerRef")
        if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
            broken.append("port is required when kind is 'Service' or unspecified (defaults to 'Service')")
    if doc["kind"] == "HTTPRoute":
        for rule in spec["rules"]:
            for match in rule.get("matches", []):
                path = match.get("path", {})
                if path.get("type", "PathPrefix") == "PathPrefix" and not path.get("value", "/").startswith("/"):
                    broken.append("value must be an absolute path and start with '/' when type one of ['Exact', "
                                  "'PathPrefix']")
            t = rule.get("timeouts", {})
            if "request" in t and "backendRequest" in t and _seconds(t["backendRequest"]) > _seconds(t["request"]):
                broken.append("backendRequest timeout cannot be longer than request timeout")
    if doc["kind"] == "Gateway":
        names = [listener["name"] for listener in spec["listeners"]]
        if len(set(names)) != len(names):
            broken.append("Listener name must be unique within the Gateway")
    return broken


def _seconds(duration: str) -> float:
    import re
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|h|m|s)", duration))
