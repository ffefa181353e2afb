"""Render a kustomization (base or overlay) the way `kubectl kustomize` does, for the subset of
Kustomize these manifests use, so CI renders and validates them with PyPI packages only:

    python deploy/kubernetes/render.py deploy/kubernetes/overlays/two-gpus > rendered.yaml

Supported: `resources` (files, or folders holding a kustomization.yaml), `namespace`,
`labels[].pairs` (metadata labels only), `patches` with a `target` (kind, name) and a JSON 6902
patch file. Any other field is refused: a new Kustomize feature needs a line here first.
"""

from __future__ import annotations

import copy
import os
import sys

import jsonpatch
import yaml

KNOWN = {"apiVersion", "kind", "resources", "namespace", "labels", "patches"}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                  "PersistentVolume", "StorageClass", "GatewayClass"}


def load_documents(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _kustomization(folder: str) -> dict:
    with open(os.path.join(folder, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    unknown = sorted(set(k) - KNOWN)
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml: unsupported fields {unknown}")
    return k


def _patch(objects: list[dict], folder: str, spec: dict) -> None:
    target = spec["target"]
    with open(os.path.join(folder, spec["path"])) as f:
        ops = yaml.safe_load(f)
    hits = [i for i, o in enumerate(objects)
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
    if len(hits) != 1:
        raise ValueError(f"patch {spec['path']}: target {target} matches {len(hits)} objects")
    objects[hits[0]] = jsonpatch.apply_patch(objects[hits[0]], ops)  # NOTE: a failed test op raises


def render(folder: str) -> list[dict]:
    """The objects `kubectl kustomize folder` would emit (in resource order)."""
    k = _kustomization(folder)
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = os.path.join(folder, entry)
        objects += render(path) if os.path.isdir(path) else load_documents(path)
    objects = copy.deepcopy(objects)
    for spec in k.get("patches", []):
        _patch(objects, folder, spec)
    for obj in objects:
        meta = obj.setdefault("metadata", {})
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = k["namespace"]
        for label in k.get("labels", []):
            if set(label) - {"pairs"}:
                raise ValueError(f"labels: only `pairs` is supported, got {sorted(label)}")
            meta.setdefault("labels", {}).update(label["pairs"])
    return objects


if __name__ == "__main__":
    yaml.safe_dump_all(render(sys.argv[1]), sys.stdout, sort_keys=False)
