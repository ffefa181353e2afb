"""Vendor the JSON schemas of the custom resources the manifests use, so CI validates them
offline: each CRD's openAPIV3Schema for one served version, descriptions dropped.

    python deploy/kubernetes/schemas/extract.py CRD.yaml [CRD.yaml ...]

Sources (pinned): Envoy Gateway v1.9.0's
charts/gateway-crds-helm/templates/{standard-gatewayapi-crds.yaml,
generated/gateway.envoyproxy.io_backendtrafficpolicies.yaml} (Gateway API v1.6.1 and Envoy
Gateway's BackendTrafficPolicy) and prometheus-operator v0.93.0's
example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml.
"""

from __future__ import annotations

import json
import os
import sys

import yaml

WANTED = {  # (group, kind) -> version
    ("gateway.networking.k8s.io", "Gateway"): "v1",
    ("gateway.networking.k8s.io", "HTTPRoute"): "v1",
    ("gateway.networking.k8s.io", "GRPCRoute"): "v1",
    ("gateway.envoyproxy.io", "BackendTrafficPolicy"): "v1alpha1",
    ("monitoring.coreos.com", "PodMonitor"): "v1",
}


def _strip(node):
    """Drop descriptions (most of the bytes); keep everything that constrains."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _documents(path: str):
    # NOTE: the Helm chart's copies open and close with a template line: not YAML
    with open(path) as f:
        text = "".join(line for line in f if not line.lstrip().startswith("{{"))
    docs = yaml.safe_load_all(text)
    return [d for d in docs if d and d.get("kind") == "CustomResourceDefinition"]


def main(paths: list[str]) -> None:
    out_dir = os.path.dirname(os.path.abspath(__file__))
    for path in paths:
        for crd in _documents(path):
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            version = WANTED.get((group, kind))
            if version is None:
                continue
            (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
            schema = _strip(served["schema"]["openAPIV3Schema"])
            name = f"{kind.lower()}_{group}_{version}.json"
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(schema, f, separators=(",", ":"), sort_keys=True)
            print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
