"""deploy/kubernetes offline: rendered objects validate and resolve; configure.sh's config parses.

deploy/kubernetes, offline: the base and every overlay rendered (deploy/kubernetes/render.py),
core kinds validated against Kubernetes' schemas (kubernetes-validate, strict), custom resources
against their CRDs' schemas vendored in deploy/kubernetes/schemas (unknown fields refused), the
references between objects resolved, the shutdown budget added up, and the pods' configure.sh
run on the real model repository with the result parsed by the adapter's own config code.

The HPA's metric names against a live server's /metrics: tests/integration/test_scale_out.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
from hsserve.triton.config import split_parameters

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
sys.path.insert(0, DEPLOY)
from render import render

K8S_VERSION = "1.33.0"  # NOTE: the oldest Kubernetes the manifests promise to work on
FOLDERS = ["base", *(os.path.join("overlays", d)
                     for d in sorted(os.listdir(os.path.join(DEPLOY, "overlays"))))]


def _strict(schema):
    """A CRD schema that refuses unknown fields (the API server would silently prune them)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _crd_schema(obj: dict) -> dict | None:
    group, _, version = obj["apiVersion"].rpartition("/")
    path = os.path.join(DEPLOY, "schemas", f"{obj['kind'].lower()}_{group}_{version}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        schema = _strict(json.load(f))
    schema["properties"]["metadata"] = {"type": "object"}  # NOTE: checked by the API server
    return schema


def validate(obj: dict) -> None:
    """Raises on an invalid object, or one of a kind no schema here knows (SchemaNotFoundError)."""
    schema = _crd_schema(obj)
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture(scope="module", params=FOLDERS)
def rendered(request) -> dict[tuple[str, str], dict]:
    objects = render(os.path.join(DEPLOY, request.param))
    keyed = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(keyed) == len(objects), "two objects of one kind share a name"
    return keyed


def test_every_object_validates(rendered):
    for obj in rendered.values():
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "hsserve", obj["metadata"]


def test_the_validators_refuse_a_typo(rendered):
    """The checks above can fail: one unknown field in a core and in a custom resource."""
    deployment = json.loads(json.dumps(rendered[("Deployment", "hsserve")]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    policy = json.loads(json.dumps(rendered[("BackendTrafficPolicy", "hsserve")]))
    policy["spec"]["loadBalancer"]["consistentHash"]["headr"] = {"name": "x"}
    with pytest.raises(jsonschema.ValidationError):
        validate(policy)
    policy["spec"]["loadBalancer"]["consistentHash"] = {"type": "SessionHeader"}
    with pytest.raises(jsonschema.ValidationError):
        validate(policy)


def _container(rendered) -> dict:
    (container,) = rendered[("Deployment", "hsserve")]["spec"]["template"]["spec"]["containers"]
    return container


def _env(rendered) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _container(rendered)["env"]}


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_selectors_and_ports_resolve(rendered):
    pod = rendered[("Deployment", "hsserve")]["spec"]["template"]
    labels, ports = pod["metadata"]["labels"], {p["name"] for p in _container(rendered)["ports"]}
    services = {name: o for (kind, name), o in rendered.items() if kind == "Service"}
    for svc in services.values():
        assert _matches(svc["spec"]["selector"], labels)
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    assert _matches(rendered[("PodDisruptionBudget", "hsserve")]["spec"]["selector"]["matchLabels"],
                    labels)
    monitor = rendered[("PodMonitor", "hsserve")]["spec"]
    assert _matches(monitor["selector"]["matchLabels"], labels)
    assert {e["port"] for e in monitor["podMetricsEndpoints"]} == {"metrics"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _container(rendered)[probe]["httpGet"]["port"] in ports
    target = rendered[("HorizontalPodAutoscaler", "hsserve")]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) in rendered
    for (kind, name), route in rendered.items():
        if kind.endswith("Route"):
            for parent in route["spec"]["parentRefs"]:
                listeners = rendered[("Gateway", parent["name"])]["spec"]["listeners"]
                (listener,) = [x for x in listeners if x["name"] == parent["sectionName"]]
                assert kind in {k["kind"] for k in listener["allowedRoutes"]["kinds"]}
            for rule in route["spec"]["rules"]:
                for ref in rule["backendRefs"]:
                    ports_of = {p["port"] for p in services[ref["name"]]["spec"]["ports"]}
                    assert ref["port"] in ports_of, ref
    for ref in rendered[("BackendTrafficPolicy", "hsserve")]["spec"]["targetRefs"]:
        assert (ref["kind"], ref["name"]) in rendered


def test_volumes_and_secrets_exist(rendered):
    spec = rendered[("Deployment", "hsserve")]["spec"]["template"]["spec"]
    for volume in spec["volumes"]:
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in rendered
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert ("PersistentVolumeClaim", claim) in rendered
    mounts = {m["name"] for m in _container(rendered)["volumeMounts"]}
    assert mounts == {v["name"] for v in spec["volumes"]}
    for e in _container(rendered)["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["key"] in rendered[("Secret", ref["name"])]["stringData"]


def _llm_parameters(rendered) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in shlex.split(_env(rendered)["LLM_PARAMETERS"]))


def test_the_shutdown_budget_adds_up(rendered):
    """preStop sleep, then SIGTERM: llm drains for drain_timeout_s within tritonserver's exit
    timeout, all within terminationGracePeriodSeconds (else the kubelet SIGKILLs mid-drain)."""
    spec = rendered[("Deployment", "hsserve")]["spec"]["template"]["spec"]
    pre_stop = _container(rendered)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    exit_timeout = int(_env(rendered)["EXIT_TIMEOUT_S"])
    drain = float(_llm_parameters(rendered)["drain_timeout_s"])
    assert drain + 5 <= exit_timeout
    assert int(pre_stop[1]) + exit_timeout + 5 <= spec["terminationGracePeriodSeconds"]
    assert '--exit-timeout-secs="$EXIT_TIMEOUT_S"' in _container(rendered)["args"][0]


def _parameters(config_text: str) -> dict[str, str]:
    return dict(re.findall(r'key: "([^"]+)", value: \{ string_value: "([^"]*)" \}', config_text))


def test_configure_script_writes_a_config_the_adapter_accepts(rendered, tmp_path):
    script = rendered[("ConfigMap", "hsserve-configure")]["data"]["configure.sh"]
    env = {**os.environ, **{k: v for k, v in _env(rendered).items() if v is not None},
           "HSSERVE_REPOSITORY_SOURCE": os.path.join(ROOT, "model_repository"),
           "HSSERVE_REPOSITORY": str(tmp_path / "repo")}
    subprocess.run(["bash", "-c", script], env=env, check=True, capture_output=True)
    with open(tmp_path / "repo" / "llm" / "config.pbtxt") as f:
        text = f.read()
    count = _env(rendered)["LLM_INSTANCES_PER_GPU"]
    assert f"instance_group [{{ count: {count}, kind: KIND_GPU }}]" in text
    params = _parameters(text)
    for key, value in _llm_parameters(rendered).items():
        assert params[key] == value, key
    adapter, _ = split_parameters(params)  # NOTE: raises on an unknown key or a bad value
    assert adapter.drain_timeout_s == float(_llm_parameters(rendered)["drain_timeout_s"])
    source = os.listdir(os.path.join(ROOT, "model_repository"))
    assert sorted(os.listdir(tmp_path / "repo")) == sorted(source)


def test_a_bad_parameter_is_refused():
    """The same path refuses a misspelt key, as the server would at load."""
    with open(os.path.join(ROOT, "model_repository", "llm", "config.pbtxt")) as f:
        params = {**_parameters(f.read()), "drain_timeout": "30"}
    with pytest.raises(Exception, match="drain_timeout"):
        split_parameters(params)
