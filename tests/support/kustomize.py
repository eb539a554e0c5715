"""`kubectl kustomize` of a k8s/ build, or, without kubectl, a small renderer (resources, namespace, images,
JSON6902 `patches`: exactly the features k8s/ uses) that stands in; where kubectl exists the two must agree."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import yaml


def _json_patch(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "remove":
            del node[key]
        elif op["op"] in ("replace", "add"):
            if op["op"] == "replace" and not (key in node if isinstance(node, dict) else key < len(node)):
                raise KeyError(f"replace of missing {op['path']}")
            node[key] = copy.deepcopy(op["value"])
        else:
            raise NotImplementedError(op["op"])


def _set_images(node, images: list[dict]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    for im in images:
                        if c.get("image", "").split(":")[0] == im["name"]:
                            c["image"] = f"{im.get('newName', im['name'])}:{im['newTag']}"
            _set_images(value, images)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, images)


def kustomize_fallback(path: Path) -> list[dict]:
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for res in k.get("resources", []):
        target = path / res
        if target.is_dir():
            docs += kustomize_fallback(target)
        else:
            docs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (path / patch["path"]).read_text())
        t = patch["target"]
        for d in docs:
            if d["kind"] == t["kind"] and t.get("name", d["metadata"]["name"]) == d["metadata"]["name"]:
                _json_patch(d, ops)
    if "images" in k:
        _set_images(docs, k["images"])
    if "namespace" in k:
        for d in docs:
            if d["kind"] != "Namespace":
                d["metadata"]["namespace"] = k["namespace"]
    return docs


def _key(d: dict) -> tuple:
    return (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])


def kustomize_build(path: Path) -> list[dict]:
    """The objects of the kustomize build at `path` (kubectl's, checked against the fallback's)."""
    docs = kustomize_fallback(path)
    if shutil.which("kubectl"):
        text = subprocess.run(
            ["kubectl", "kustomize", str(path)], check=True, capture_output=True, text=True
        ).stdout
        real = [d for d in yaml.safe_load_all(text) if d]
        assert sorted(real, key=_key) == sorted(docs, key=_key), f"fallback renderer disagrees on {path}"
        docs = real
    return docs
