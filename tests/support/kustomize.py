"""`kubectl kustomize` of a k8s/ build, or, without kubectl, a small renderer (resources, `components`, namespace,
images, JSON6902 `patches`, `replacements` by kind and name with the options delimiter, index and create,
local-config resources left out: exactly the features k8s/ uses) that stands in; where kubectl exists the two
must agree."""

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


def _replace(docs: list[dict], replacements: list[dict]) -> None:
    """kustomize `replacements`: each source field's value put in each target's fieldPaths (dotted, a list item
    by its index); options: `create` missing fields, `delimiter` + `index`: replace that part of the string."""
    for r in replacements:
        src = r["source"]
        (source,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (src["kind"], src["name"])]
        value = source
        for part in src["fieldPath"].split("."):
            value = value[part]
        for t in r["targets"]:
            select, options = t["select"], t.get("options", {})
            for d in docs:
                if (
                    d["kind"] != select["kind"]
                    or select.get("name", d["metadata"]["name"]) != d["metadata"]["name"]
                ):
                    continue
                for field in t["fieldPaths"]:
                    *parents, last = field.split(".")
                    node = d
                    for part in parents:
                        node = node[int(part)] if isinstance(node, list) else node[part]
                    if "delimiter" in options:
                        parts = node[last].split(options["delimiter"])
                        parts[options["index"]] = value
                        node[last] = options["delimiter"].join(parts)
                    elif last in node or options.get("create"):
                        node[last] = value
                    else:
                        raise KeyError(f"replacement of missing {field} in {d['metadata']['name']}")


def _local_config(d: dict) -> bool:
    return (d["metadata"].get("annotations") or {}).get("config.kubernetes.io/local-config") == "true"


def _accumulate(path: Path, docs: list[dict]) -> list[dict]:
    """Kustomization (or Component) `path` applied to `docs`: its resources added, its components applied in
    order (each to what the kustomization holds so far), then its own patches, images, namespace, replacements."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    for res in k.get("resources", []):
        target = path / res
        if target.is_dir():
            docs += kustomize_fallback(target)
        else:
            docs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for component in k.get("components", []):
        assert yaml.safe_load((path / component / "kustomization.yaml").read_text())["kind"] == "Component"
        docs = _accumulate(path / component, docs)
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
    _replace(docs, k.get("replacements", []))
    return docs


def kustomize_fallback(path: Path) -> list[dict]:
    """The objects of the build at `path`; local-config ones (a replacement's source) are read, never output."""
    return [d for d in _accumulate(path, []) if not _local_config(d)]


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
