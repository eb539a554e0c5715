"""k8s/: the generated base is current, every kustomize build validates and is hardened (Pod Security
"restricted" on every pod, the RayService's API key from a Secret, a NetworkPolicy that admits only what the
cluster needs), `raychat k8s submit` posts a RayJob.

Builds use tests/support/kustomize.py (`kubectl kustomize`, checked against a small fallback renderer that stands in
without kubectl). KubeRay objects are validated against the
openAPIV3Schema of ../shared/kuberay-crds (made strict: unknown fields are errors, as with kubectl's
--validate=strict); core objects with kubernetes-validate (Kubernetes 1.32 schemas, strict).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.kustomize import kustomize_build

from raychat.cli import build_parser
from raychat.cli import main as raychat_main
from raychat.commands import STAGE_CONFIGS
from raychat.config import TrainConfig, from_args, from_dict, preset_values, to_flat
from raychat.config.train import UNUSED_FLAGS
from raychat.ops import k8s, k8s_cli

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO.parent / "shared" / "kuberay-crds"
# the object-storage overlays: {build: (on the gpu overlay, credentials component)}
OBJECT_STORAGE_BUILDS = {f"k8s/overlays/{o}": v for o, v in k8s.OBJECT_STORAGE_OVERLAYS.items()}
BUILDS = ["k8s/base", "k8s/overlays/cpu-dev", "k8s/overlays/gpu", *OBJECT_STORAGE_BUILDS]
GPU_BUILDS = ["k8s/overlays/gpu", *(b for b, (gpu, _) in OBJECT_STORAGE_BUILDS.items() if gpu)]


@pytest.fixture(scope="module")
def builds() -> dict[str, list[dict]]:
    return {b: kustomize_build(REPO / b) for b in BUILDS}


# ---------------------------------------------------------------- schemas


def _strict(schema):
    """Unknown fields become errors wherever the CRD lists properties and does not preserve unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    assert CRDS.is_dir(), f"{CRDS} missing: the KubeRay CRDs live in shared/kuberay-crds beside the repo"
    schemas = {}
    for f in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(f.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 20k lines
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        # a validator built once: jsonschema.validate() would re-check the large schema on every call
        schemas[crd["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(
            _strict(v1["schema"]["openAPIV3Schema"])
        )
    assert set(schemas) >= {"RayCluster", "RayJob", "RayService"}
    return schemas


def validate_object(d: dict, crd_schemas: dict) -> None:
    if d["apiVersion"] == "ray.io/v1":
        crd_schemas[d["kind"]].validate(d)
    else:
        kubernetes_validate.validate(d, "1.32.0", strict=True)


# ---------------------------------------------------------------- tests


def test_base_is_generated_from_code_and_serve_config():
    assert k8s.render_base(REPO) == {p.name: p.read_text() for p in (REPO / "k8s" / "base").glob("*.yaml")}, (
        "k8s/base is stale: run `raychat k8s generate`"
    )
    cpu_dev = (REPO / "k8s" / "overlays" / "cpu-dev" / "kustomization.yaml").read_text()
    assert k8s.render_cpu_dev() == cpu_dev, "k8s/overlays/cpu-dev/kustomization.yaml is stale"
    gpu = (REPO / "k8s" / "overlays" / "gpu" / "kustomization.yaml").read_text()
    assert k8s.render_gpu(REPO) == gpu, "k8s/overlays/gpu/kustomization.yaml is stale"
    for name, text in k8s.render_all(REPO).items():  # the components and the object-storage overlays too
        assert (REPO / "k8s" / name).read_text() == text, f"k8s/{name} is stale"
    assert raychat_main(["k8s", "generate", "--check"]) == 0


def test_rayservice_serve_config_is_serve_chat_yaml_verbatim(builds):
    from ray.serve.schema import ServeDeploySchema

    serve_text = (REPO / "serve" / "chat.yaml").read_text()
    for b, docs in builds.items():
        (svc,) = [d for d in docs if d["kind"] == "RayService" and d["metadata"]["name"] == "raychat-chat"]
        if b not in GPU_BUILDS and b not in OBJECT_STORAGE_BUILDS:  # they change it (tests below)
            assert svc["spec"]["serveConfigV2"] == serve_text, b
    app = ServeDeploySchema.model_validate(yaml.safe_load(serve_text)).applications[0]
    assert app.import_path == "raychat.serve.app:build_app"


def test_the_gpu_overlay_puts_each_chat_replica_on_a_gpu(builds):
    from ray.serve.schema import ServeDeploySchema

    from raychat.serve.app import device_for
    from raychat.serve.deployments import read_serve_app

    serve_text = (REPO / "serve" / "chat.yaml").read_text()
    base = yaml.safe_load(serve_text)
    cpu = read_serve_app(base["applications"][0])
    (svc,) = [d for d in builds["k8s/overlays/gpu"] if d["kind"] == "RayService" and d["metadata"]["name"] == "raychat-chat"]  # fmt: skip
    gpu_text = svc["spec"]["serveConfigV2"]
    assert gpu_text == k8s.gpu_serve_config(serve_text)
    gpu = yaml.safe_load(gpu_text)
    # serve/chat.yaml plus one key: ChatServer's ray_actor_options.num_gpus = 1 (serve/chat.yaml sets none)
    (server,) = [d for d in base["applications"][0]["deployments"] if d["name"] == "ChatServer"]
    assert "num_gpus" not in server["ray_actor_options"] and cpu.replica.num_gpus == 0
    server["ray_actor_options"]["num_gpus"] = 1
    assert gpu == base
    # what Serve makes of it: each ChatServer replica reserves 1 GPU and puts its model on cuda
    replica = read_serve_app(gpu["applications"][0]).replica
    assert (replica.num_gpus, device_for(replica.num_gpus), device_for(cpu.replica.num_gpus)) == (
        1,
        "cuda",
        "cpu",
    )
    assert ServeDeploySchema.model_validate(gpu).applications[0].import_path == "raychat.serve.app:build_app"


def test_gpu_serve_config_sets_the_chat_server_deployment_option_else_the_arg():
    text = """applications:
  - name: raychat
    import_path: raychat.serve.app:build_app
    args: {checkpoint: /c}
    deployments:
      - {name: ChatIngress, ray_actor_options: {num_cpus: 0.25}}
      - {name: ChatServer, ray_actor_options: {num_cpus: 2}}
"""
    (app,) = yaml.safe_load(k8s.gpu_serve_config(text))["applications"]
    assert app["args"] == {"checkpoint": "/c"}
    assert app["deployments"] == [
        {"name": "ChatIngress", "ray_actor_options": {"num_cpus": 0.25}},
        {"name": "ChatServer", "ray_actor_options": {"num_cpus": 2, "num_gpus": 1}},
    ]
    # no ChatServer ray_actor_options in the file: build_app's arg (adding ray_actor_options would drop num_cpus)
    (app,) = yaml.safe_load(k8s.gpu_serve_config(text.replace(", ray_actor_options: {num_cpus: 2}", "")))[
        "applications"
    ]
    assert app["args"] == {"checkpoint": "/c", "num_gpus": 1} and app["deployments"][1] == {
        "name": "ChatServer"
    }
    with pytest.raises(ValueError, match="no application with import_path raychat.serve.app:build_app"):
        k8s.gpu_serve_config("applications:\n  - {name: x, import_path: other:app}\n")


@pytest.mark.parametrize("build", BUILDS)
def test_every_object_validates(builds, crd_schemas, build):
    docs = builds[build]
    kinds = sorted(d["kind"] for d in docs)
    expected = [
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "RayCluster",
        *["RayJob"] * len(k8s.CHAIN),
        "RayService",
    ]
    extra = {
        "k8s/base": [],
        "k8s/overlays/cpu-dev": ["Namespace"],
        "k8s/overlays/gpu": ["Namespace", "RayService"],
        # settings.yaml is local-config: kustomize reads it, never emits it
        **{b: ["Namespace", "RayService"] if gpu else [] for b, (gpu, _) in OBJECT_STORAGE_BUILDS.items()},
    }
    assert kinds == sorted(expected + extra[build])  # the gpu overlay's second RayService: the vLLM path
    for d in docs:
        validate_object(d, crd_schemas)


def test_validation_catches_mistakes(builds, crd_schemas):
    cluster = copy.deepcopy(next(d for d in builds["k8s/base"] if d["kind"] == "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3  # typo
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        validate_object(cluster, crd_schemas)
    job = copy.deepcopy(next(d for d in builds["k8s/base"] if d["kind"] == "RayJob"))
    job["spec"]["backoffLimit"] = "1"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(job, crd_schemas)
    pvc = copy.deepcopy(next(d for d in builds["k8s/base"] if d["kind"] == "PersistentVolumeClaim"))
    pvc["spec"]["accessMode"] = ["ReadWriteMany"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(pvc, crd_schemas)


def test_cluster_shapes(builds):
    base = {(d["kind"], d["metadata"]["name"]): d for d in builds["k8s/base"]}
    rc = base[("RayCluster", "raychat")]["spec"]
    assert rc["autoscalerOptions"]["version"] == "v2" and rc["enableInTreeAutoscaling"] is True
    assert rc["authOptions"] == {"mode": "token"}
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # CPU head takes no work
    worker = rc["workerGroupSpecs"][0]
    # whole 8-GPU nodes, one pod each: the cluster preset's 32 ranks fill 4 of them (8 ranks of a node in one
    # pod share NVLink), and Ray's 48 CPUs a pod fit 8 ranks x 5 CPUs + 8 for Ray Data
    assert (worker["minReplicas"], worker["maxReplicas"]) == (0, 4)
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["cpu"]) == ("8", "48")
    cluster = to_flat(from_dict(TrainConfig, preset_values("cluster", "pretrain")))
    assert (cluster["num_workers"], 8 * cluster["cpus_per_worker"] + 8) == (4 * 8, 48)
    want = {
        "data": "python jobs/data.py prepare --preset cluster --storage-path /mnt/checkpoints/runs",
        "tokenizer": "python jobs/tokenizer.py train --preset cluster --storage-path /mnt/checkpoints/runs",
        "pretrain": "python jobs/pretrain.py --preset cluster --storage-path /mnt/checkpoints/runs --run-name pretrain",
        "sft": "python jobs/sft.py --preset cluster --storage-path /mnt/checkpoints/runs --run-name sft --init-from latest "
        "--task-data-dir /mnt/checkpoints/task_data",
        "rl": "python jobs/rl.py --preset cluster --storage-path /mnt/checkpoints/runs --run-name rl --init-from latest "
        "--task-data-dir /mnt/checkpoints/task_data",
        "eval": "python jobs/eval.py --preset cluster --storage-path /mnt/checkpoints/runs --run-name eval "
        "--checkpoint latest --task-data-dir /mnt/checkpoints/task_data",
        "export": "python jobs/export.py --storage-path /mnt/checkpoints/runs --run-name hf --checkpoint latest",
    }  # fmt: skip
    for stage in k8s.CHAIN:
        spec = base[("RayJob", f"raychat-{stage}")]["spec"]
        assert spec["entrypoint"] == want[stage]
        assert spec.get("entrypointNumGpus", 0) == (1 if stage == "eval" else 0)  # the eval driver: cuda
        # a stopped stage's driver has 30 s (Ray's default 3 s) to print where it resumes, as `raychat submit`'s
        assert yaml.safe_load(spec["runtimeEnvYAML"]) == {
            "working_dir": "/home/ray/raychat",
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "30"},
        }
        assert (spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"], spec["backoffLimit"]) == (
            True,
            3600,
            1,
        )
        hours = {"data": 6, "tokenizer": 3, "pretrain": 8, "sft": 2, "rl": 3, "eval": 2, "export": 1}[stage]
        assert spec["activeDeadlineSeconds"] == hours * 3600  # a hung job does not hold the GPUs forever
        assert spec["rayClusterSpec"] == rc
    # the RayService serves the RL run's newest checkpoint from the same PVC root
    svc = base[("RayService", "raychat-chat")]["spec"]
    (app,) = yaml.safe_load(svc["serveConfigV2"])["applications"]
    assert app["args"]["checkpoint"] == "/mnt/checkpoints/runs/rl/latest"
    # every pod mounts the checkpoint PVC, and /dev/shm as memory (a container's own is 64 MB)
    for group, shm in [(rc["headGroupSpec"], "4Gi"), (worker, "64Gi")]:
        (container,) = group["template"]["spec"]["containers"]
        assert container["volumeMounts"] == [
            {"name": "checkpoints", "mountPath": "/mnt/checkpoints"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ]
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}

    dev = {(d["kind"], d["metadata"]["name"]): d for d in builds["k8s/overlays/cpu-dev"]}
    for stage in k8s.CHAIN:  # the same commands on the tiny preset
        job = dev[("RayJob", f"raychat-{stage}")]["spec"]
        assert job["entrypoint"] == want[stage].replace("--preset cluster", "--preset tiny")
        assert "entrypointNumGpus" not in job
    for (kind, _), d in dev.items():
        if kind == "Namespace":
            continue
        assert d["metadata"]["namespace"] == "raychat-dev"
        spec = {"RayCluster": lambda s: s, "RayJob": lambda s: s["rayClusterSpec"]}.get(
            kind, lambda s: s.get("rayClusterConfig")
        )(d["spec"])
        if spec is None:
            continue
        w = spec["workerGroupSpecs"][0]
        assert (w["groupName"], w["maxReplicas"]) == ("cpu", 2)
        assert "nvidia.com/gpu" not in w["template"]["spec"]["containers"][0]["resources"]["limits"]
        images = {c["image"] for g in [spec["headGroupSpec"], w] for c in g["template"]["spec"]["containers"]}
        assert images == {"raychat-cpu:0.1.0"}
    gpu_images = {
        c["image"]
        for d in builds["k8s/overlays/gpu"]
        if d["kind"] == "RayJob"
        for g in [
            d["spec"]["rayClusterSpec"]["headGroupSpec"],
            *d["spec"]["rayClusterSpec"]["workerGroupSpecs"],
        ]
        for c in g["template"]["spec"]["containers"]
    }
    assert gpu_images == {"registry.example.com/raychat:0.1.0"}


# ---------------------------------------------------------------- hardening

RAY_SPEC = {"RayCluster": lambda s: s, "RayJob": lambda s: s["rayClusterSpec"], "RayService": lambda s: s["rayClusterConfig"]}  # fmt: skip
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}  # fmt: skip


def pods(d: dict) -> list[tuple[str, dict, list[dict]]]:
    """(where, pod template, securityContexts of containers KubeRay adds) of every pod a KubeRay object makes:
    the head (with the autoscaler sidecar), each worker group and a RayJob's submitter; [] for other kinds."""
    if d["kind"] not in RAY_SPEC:
        return []
    spec = RAY_SPEC[d["kind"]](d["spec"])
    sidecar = [spec["autoscalerOptions"]["securityContext"]] if spec.get("enableInTreeAutoscaling") else []
    out = [("head", spec["headGroupSpec"]["template"], sidecar)]
    out += [(f"worker {g['groupName']}", g["template"], []) for g in spec["workerGroupSpecs"]]
    if d["kind"] == "RayJob":
        out.append(("submitter", d["spec"]["submitterPodTemplate"], []))
    return out


def restricted_violations(template: dict, added: list[dict] = ()) -> list[str]:
    """What Pod Security "restricted" (Kubernetes 1.32) refuses in a pod template, one "field: why" each;
    `added` are the securityContexts of containers the operator adds to the pod."""
    spec = template["spec"]
    pod_sc = spec.get("securityContext", {})
    bad = [f"spec.{k}: must not be true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for v in spec.get("volumes", []):
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            bad.append(f"volumes[{v['name']}]: {kind} is not allowed")
    containers = spec.get("initContainers", []) + spec["containers"]
    contexts = [(c["name"], c.get("securityContext", {}), c) for c in containers]
    contexts += [(f"added[{i}]", sc, {}) for i, sc in enumerate(added)]
    for name, sc, c in contexts:
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}.allowPrivilegeEscalation: must be false")
        if sc.get("privileged"):
            bad.append(f"{name}.privileged: must not be true")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}.capabilities: must drop ALL and add at most NET_BIND_SERVICE")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}.runAsNonRoot: must be true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{name}.runAsUser: must not be 0")
        seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}.seccompProfile: must be RuntimeDefault or Localhost")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}.ports: no hostPort")
    return bad


@pytest.mark.parametrize("build", BUILDS)
def test_every_pod_meets_pod_security_restricted(builds, build):
    seen = []
    for d in builds[build]:
        for where, template, added in pods(d):
            seen.append((d["kind"], where))
            assert restricted_violations(template, added) == [], (d["metadata"]["name"], where)
            # both levels carry it: the pod's context alone and every container's alone would pass
            pod_sc = template["spec"]["securityContext"]
            assert (pod_sc["runAsNonRoot"], pod_sc["runAsUser"], pod_sc["fsGroup"]) == (True, 1000, 100)
            assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
            for sc in [c["securityContext"] for c in template["spec"]["containers"]] + added:
                assert (sc["runAsNonRoot"], sc["runAsUser"], sc["allowPrivilegeEscalation"]) == (
                    True,
                    1000,
                    False,
                )
                assert sc["capabilities"] == {"drop": ["ALL"]}
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # head + worker of the RayCluster, each RayJob (+ its submitter) and the RayService(s: gpu adds vLLM's)
    assert len(seen) == 2 + 3 * len(k8s.CHAIN) + 2 * (1 + (build in GPU_BUILDS))
    for job in [d for d in builds[build] if d["kind"] == "RayJob"]:  # the submitter runs the head's image
        images = [
            t["spec"]["containers"][0]["image"] for where, t, _ in pods(job) if where in ("head", "submitter")
        ]
        assert images[0] == images[1], images


def test_the_restricted_check_catches_each_gap(builds):
    job = next(d for d in builds["k8s/base"] if d["kind"] == "RayJob")
    _, template, added = pods(job)[0]

    def broken(change) -> list[str]:
        t = copy.deepcopy(template)
        change(t["spec"], t["spec"]["containers"][0]["securityContext"])
        return restricted_violations(t, added)

    def no_seccomp(pod, c):
        del pod["securityContext"]["seccompProfile"], c["seccompProfile"]

    def no_non_root(pod, c):
        del pod["securityContext"]["runAsNonRoot"], c["runAsNonRoot"]

    assert broken(lambda pod, c: c.pop("allowPrivilegeEscalation")) == ["ray-head.allowPrivilegeEscalation: must be false"]  # fmt: skip
    assert broken(lambda pod, c: c["capabilities"].update(drop=[])) == ["ray-head.capabilities: must drop ALL and add at most NET_BIND_SERVICE"]  # fmt: skip
    assert broken(lambda pod, c: c["capabilities"].update(add=["SYS_ADMIN"])) == ["ray-head.capabilities: must drop ALL and add at most NET_BIND_SERVICE"]  # fmt: skip
    assert broken(no_seccomp) == ["ray-head.seccompProfile: must be RuntimeDefault or Localhost"]
    assert broken(no_non_root) == ["ray-head.runAsNonRoot: must be true"]
    assert broken(lambda pod, c: c.update(runAsUser=0)) == ["ray-head.runAsUser: must not be 0"]
    assert broken(lambda pod, c: pod.update(hostNetwork=True)) == ["spec.hostNetwork: must not be true"]
    assert broken(lambda pod, c: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}})) == ["volumes[h]: hostPath is not allowed"]  # fmt: skip
    assert restricted_violations(template, [{}]) == [
        "added[0].allowPrivilegeEscalation: must be false",
        "added[0].capabilities: must drop ALL and add at most NET_BIND_SERVICE",
    ]  # the autoscaler sidecar inherits the pod's runAsNonRoot and seccomp, not the rest


@pytest.mark.parametrize("build", BUILDS)
def test_the_rayservice_takes_its_api_key_from_a_secret(builds, build):
    docs = builds[build]
    assert not [d for d in docs if d["kind"] == "Secret"]  # the key is never in the manifests
    for d in docs:
        for where, template, _ in pods(d):
            for c in template["spec"]["containers"]:
                keys = [e for e in c.get("env", []) if e["name"] == "RAYCHAT_API_KEY"]
                if d["metadata"]["name"] != "raychat-chat":  # the vLLM app reads no key (docs/deployment.md)
                    assert keys == [], (d["metadata"]["name"], where)  # only the chat service holds the key
                    continue
                want = {"secretKeyRef": {"name": "raychat-api-key", "key": "api-key"}}
                assert keys == [{"name": "RAYCHAT_API_KEY", "valueFrom": want}], where
    (svc,) = [d for d in docs if d["kind"] == "RayService" and d["metadata"]["name"] == "raychat-chat"]
    (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    assert "api_key" not in app["args"]  # build_app reads RAYCHAT_API_KEY (raychat.serve.app.serve_config)
    assert "allow_unauthenticated" not in app["args"]  # so build_app refuses to serve without the key


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # no matchExpressions in k8s/
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admits(policy: dict, pod_labels: dict, source: dict, port: int) -> bool:
    """NetworkPolicy ingress semantics for TCP `port` of a pod with `pod_labels` in the policy's namespace:
    a pod the policy does not select is open; else some rule must admit both the port (no `ports` = all) and
    the source (no `from` = any). source: {"labels", "namespace": "same" | "other"}; a peer's podSelector
    without namespaceSelector means the policy's namespace, namespaceSelector {} any namespace."""
    spec = policy["spec"]
    if not _selects(spec["podSelector"], pod_labels):
        return True
    for rule in spec.get("ingress", []):
        if "ports" in rule and not any(p["protocol"] == "TCP" and p["port"] == port for p in rule["ports"]):
            continue
        for peer in rule.get("from", [None]):
            if peer is None:
                return True
            assert "ipBlock" not in peer
            if "namespaceSelector" in peer:
                assert peer["namespaceSelector"] == {}, peer  # any namespace
            elif source["namespace"] != "same":
                continue
            if _selects(peer.get("podSelector", {}), source["labels"]):
                return True
    return False


RAY_PORTS = [6379, 10001, 8265, 8080, 52365, 8076, 23456]  # GCS, client, dashboard, metrics, agent, object manager, a worker port  # fmt: skip
RAYCHAT_POD = {"labels": dict(k8s.LABELS), "namespace": "same"}
NEIGHBOUR = {"labels": {"app": "notebook"}, "namespace": "same"}
OUTSIDER = {"labels": {"app": "ingress-nginx"}, "namespace": "other"}
OPERATOR = {"labels": {"app.kubernetes.io/name": "kuberay-operator"}, "namespace": "other"}
PROMETHEUS = {
    "labels": {"app.kubernetes.io/name": "prometheus"},
    "namespace": "other",
}  # the PodMonitor's scraper
# (source, ports it reaches); every other port of RAY_PORTS + [8000] is refused
REACHES = [
    (RAYCHAT_POD, {*RAY_PORTS, 8000}),
    (NEIGHBOUR, {8000, 8265, 8080}),
    (OUTSIDER, {8000}),
    (OPERATOR, {8000, 8265}),
    (PROMETHEUS, {8000, 8080}),
]


@pytest.mark.parametrize("build", BUILDS)
def test_the_network_policy_admits_only_what_the_cluster_needs(builds, build):
    (policy,) = [d for d in builds[build] if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    templates = [t for d in builds[build] for _, t, _ in pods(d)]
    assert len(templates) == 2 + 3 * len(k8s.CHAIN) + 2 * (1 + (build in GPU_BUILDS))
    for template in templates:  # the policy covers every pod, the RayJobs' submitters included
        labels = template["metadata"]["labels"]
        assert _selects(policy["spec"]["podSelector"], labels)
        for source, allowed in REACHES:
            reached = {port for port in [*RAY_PORTS, 8000] if admits(policy, labels, source, port)}
            assert reached == allowed, (source, sorted(reached))
    if build in ("k8s/overlays/cpu-dev", *GPU_BUILDS):  # the overlays that set a namespace
        namespaces = {d["metadata"].get("namespace") for d in builds[build] if d["kind"] != "Namespace"}
        assert len(namespaces) == 1 and policy["metadata"]["namespace"] in namespaces


def test_the_policy_check_sees_an_open_rule(builds):
    (policy,) = [d for d in builds["k8s/base"] if d["kind"] == "NetworkPolicy"]
    opened = copy.deepcopy(policy)
    del opened["spec"]["ingress"][2]["from"]  # dashboard + metrics from anywhere
    assert admits(opened, dict(k8s.LABELS), OUTSIDER, 8265) and not admits(
        policy, dict(k8s.LABELS), OUTSIDER, 8265
    )
    assert admits(policy, {"app": "other"}, OUTSIDER, 6379)  # pods it does not select stay open


SFT = ["sft", "--storage-path", "/mnt/checkpoints/runs"]


def test_two_submits_in_one_second_name_two_rayjobs(capsys, monkeypatch):
    """The default RayJob name was raychat-<stage>-<time to the second>: two submits of one stage in the same
    second (a loop over presets) named the same RayJob, and the API server refused the second (409). A random
    suffix makes them two."""
    monkeypatch.setattr(k8s_cli.time, "strftime", lambda fmt, *t: "20261205-213400")
    names = []
    for _ in range(2):
        assert raychat_main(["k8s", "submit", "--dry-run", *SFT]) == 0
        names.append(yaml.safe_load(capsys.readouterr().out)["metadata"]["name"])
    assert all(re.fullmatch(r"raychat-sft-20261205-213400-[0-9a-f]{6}", n) for n in names), names
    assert names[0] != names[1]


def test_k8s_submit_dry_run_prints_a_valid_rayjob(capsys, crd_schemas):
    rc = raychat_main(
        [
            "k8s",
            "submit",
            "--dry-run",
            "--name",
            "t1",
            "--namespace",
            "ml",
            "--ttl",
            "60",
            "sft",
            "--storage-path",
            "/mnt/checkpoints/runs",
            "--num-iterations",
            "4",
        ]
    )
    assert rc == 0
    job = yaml.safe_load(capsys.readouterr().out)
    validate_object(job, crd_schemas)
    assert job["metadata"] == {
        "name": "t1",
        "labels": {**k8s.LABELS, "raychat.io/stage": "sft"},
        "namespace": "ml",
    }
    assert (
        job["spec"]["entrypoint"]
        == "python jobs/sft.py --storage-path /mnt/checkpoints/runs --num-iterations 4"
    )
    assert job["spec"]["ttlSecondsAfterFinished"] == 60
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {
        "working_dir": "/home/ray/raychat",
        "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "30"},  # was none: Ray's 3 s from SIGTERM to SIGKILL
    }
    assert raychat_main(["k8s", "submit", "--dry-run", "--name", "Bad_Name", *SFT]) == 2
    capsys.readouterr()
    for flags in (["--ttl", "-5"], ["--retries", "-2"]):  # negative: the API server would refuse the RayJob
        assert raychat_main(["k8s", "submit", "--dry-run", "--name", "t1", *flags, *SFT]) == 2
        assert "--ttl and --retries must be >= 0" in capsys.readouterr().err
    assert (
        raychat_main(["k8s", "submit", "--dry-run", "--namespace", "Bad NS", *SFT]) == 2
    )  # was written as is
    assert capsys.readouterr().err == (
        "raychat k8s submit: error: --namespace must be a DNS-1123 label (lowercase, digits, '-', <= 63 chars); got "
        "'Bad NS'\n"
    )


def test_k8s_submit_says_where_its_job_looks_for_task_data(capsys):
    """StageArgs built `raychat submit`'s task data note for `raychat k8s submit` too, which printed none: a
    RayJob's eval reads the CORE bundle from runs/task_data of its copy of /home/ray/raychat (the image holds no
    runs/, its pods set no $RAYCHAT_TASK_DATA) and scored it "n/a: no data" with no line saying why."""
    stage = ["eval", "--storage-path", "/mnt/checkpoints/runs", "--checkpoint", "latest"]
    assert raychat_main(["k8s", "submit", "--dry-run", "--name", "e1", *stage]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["spec"]["entrypoint"] == (
        "python jobs/eval.py --storage-path /mnt/checkpoints/runs --checkpoint latest"
    )
    assert err == (
        "raychat k8s submit: note: stage eval reads the CORE bundle (eval_bundle/) from the task data directory, "
        "--task-data-dir not given: $RAYCHAT_TASK_DATA of the node it runs on, else runs/task_data in the job's "
        "temporary copy of the checkout, uploaded without runs/ (what is not there scores 'n/a: no data'); to "
        "read them from storage every node mounts give --task-data-dir, e.g. --task-data-dir "
        "/mnt/checkpoints/task_data\n"
    )
    # the PVC's task data (every pod mounts /mnt/checkpoints), or a stage that reads none: no note
    for argv in ([*stage, "--task-data-dir", "/mnt/checkpoints/task_data"], SFT):
        assert raychat_main(["k8s", "submit", "--dry-run", "--name", "e1", *argv]) == 0
        assert capsys.readouterr().err == ""


# exactly the command of docs/deployment.md
RL_ARGS = ["rl", "--storage-path", "/mnt/checkpoints/runs", "--init-from", "latest"]


class _FakeApiServer(BaseHTTPRequestHandler):
    calls: list = []

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append((self.path, body))
        reply = json.dumps({**body, "metadata": {**body["metadata"], "uid": "u-1"}}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def _write_kubeconfig(path: Path, port: int) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "loop", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t0k"}}],
                "contexts": [{"name": "loop", "context": {"cluster": "loop", "user": "u"}}],
                "current-context": "loop",
            }
        )
    )
    return path


def test_k8s_submit_posts_through_the_kubernetes_client(tmp_path, capsys, crd_schemas):
    server = HTTPServer(("127.0.0.1", 0), _FakeApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = _write_kubeconfig(tmp_path / "kubeconfig", server.server_port)
    try:
        rc = raychat_main(
            [
                "k8s",
                "submit",
                "--kubeconfig",
                str(kubeconfig),
                "--namespace",
                "ml",
                "--name",
                "rl-1",
                *RL_ARGS,
            ]
        )
    finally:
        server.shutdown()
    assert rc == 0
    assert capsys.readouterr().out.strip() == "rayjob.ray.io/rl-1 created in namespace ml"
    ((path, body),) = _FakeApiServer.calls
    assert path == "/apis/ray.io/v1/namespaces/ml/rayjobs"
    validate_object(body, crd_schemas)
    assert body == k8s.rayjob("rl", RL_ARGS[1:], name="rl-1")


def test_k8s_submit_without_a_configuration_or_a_server_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """No kubeconfig and not in a pod: exit 2 naming both and the flag; an API server that does not answer: exit
    4 naming its address. Neither a traceback."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # in-cluster configuration: not in a pod
    argv = ["k8s", "submit", "--kubeconfig", str(tmp_path / "none"), "--name", "rl-1", *RL_ARGS]
    assert raychat_main(argv) == 2
    assert capsys.readouterr().err == (
        f"raychat k8s submit: error: no Kubernetes configuration: --kubeconfig {tmp_path / 'none'}: no such file "
        "(the in-cluster configuration of a pod is used only without --kubeconfig, --context and $KUBECONFIG)\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert raychat_main([*argv[:2], *argv[4:]]) == 2
    assert capsys.readouterr().err == (
        "raychat k8s submit: error: no Kubernetes configuration: ~/.kube/config: Invalid kube-config file. No "
        "configuration found; in-cluster configuration: Service host/port is not set (not in a pod); pass "
        "--kubeconfig FILE (and --context NAME)\n"
    )
    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv[3] = str(_write_kubeconfig(tmp_path / "kubeconfig", port))
    assert raychat_main(argv) == 4
    err = capsys.readouterr().err
    assert (
        err.startswith(f"raychat k8s submit: error: cannot reach the API server 127.0.0.1:{port}: ")
        and err.count("\n") == 1
    )
    assert "Connection refused" in err
    monkeypatch.setattr(k8s_cli, "REQUEST_TIMEOUT_S", (1.0, 0.5))
    with socket.socket() as silent:  # accepts the connection (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        argv[3] = str(_write_kubeconfig(tmp_path / "kubeconfig", port))
        assert raychat_main(argv) == 4
    assert capsys.readouterr().err == (
        f"raychat k8s submit: error: the API server 127.0.0.1:{port} did not answer within 0.5 s; "
        "the RayJob may have been created: kubectl get rayjob rl-1 -n default\n"
    )


def test_k8s_a_connect_timeout_and_the_default_kubeconfig_read_as_sentences(tmp_path, monkeypatch):
    from urllib3 import HTTPConnectionPool
    from urllib3.connection import HTTPConnection
    from urllib3.exceptions import ConnectTimeoutError, MaxRetryError

    conn = HTTPConnection("10.0.0.1", 6443)
    reason = ConnectTimeoutError(conn, "Connection to 10.0.0.1 timed out. (connect timeout=10.0)")
    e = MaxRetryError(HTTPConnectionPool("10.0.0.1", 6443), "/apis", reason=reason)
    assert k8s_cli.unreachable(e, "rl-1", "ml") == (
        "cannot reach the API server 10.0.0.1:6443: Connection to 10.0.0.1 timed out. (connect timeout=10.0)"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(k8s_cli.KubeConfigError, match=r"^no Kubernetes configuration: ~/\.kube/config: "):
        k8s_cli.create_rayjob({}, "ml")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kc"))
    with pytest.raises(
        k8s_cli.KubeConfigError,
        match=rf"^no Kubernetes configuration: \$KUBECONFIG \({re.escape(str(tmp_path / 'kc'))}\): ",
    ):
        k8s_cli.create_rayjob({}, "ml")


@pytest.fixture
def in_a_pod(tmp_path, monkeypatch):
    """This process as if in a pod (the in-cluster loader's service-account token and CA, KUBERNETES_SERVICE_HOST
    and _PORT), with the POST of the RayJob recorded, not sent: returns the list of hosts the RayJobs went to."""
    from kubernetes import client
    from kubernetes.config import incluster_config

    (tmp_path / "token").write_text("pod-token")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    sent = []

    def record(self, group, version, namespace, plural, body, **kwargs):
        sent.append(self.api_client.configuration.host)
        return {"metadata": {"name": body["metadata"]["name"]}}

    monkeypatch.setattr(client.CustomObjectsApi, "create_namespaced_custom_object", record)
    return sent


def test_k8s_submit_in_a_pod_never_trades_a_named_kubeconfig_for_the_pods_cluster(tmp_path, capsys, in_a_pod):
    """In a pod, a --kubeconfig that does not exist or a --context it does not hold fell back to the pod's
    in-cluster configuration: the RayJob was created in the pod's own cluster, exit 0. Only without
    --kubeconfig, --context and $KUBECONFIG is the in-cluster configuration used."""
    kubeconfig = _write_kubeconfig(tmp_path / "kubeconfig", 6443)
    submit = ["k8s", "submit", "--name", "rl-1", *RL_ARGS]
    assert raychat_main([*submit[:2], "--kubeconfig", str(tmp_path / "kubeconfg"), *submit[2:]]) == 2
    assert capsys.readouterr().err == (
        f"raychat k8s submit: error: no Kubernetes configuration: --kubeconfig {tmp_path / 'kubeconfg'}: no such "
        "file (the in-cluster configuration of a pod is used only without --kubeconfig, --context and "
        "$KUBECONFIG)\n"
    )
    assert raychat_main([*submit[:2], "--kubeconfig", str(kubeconfig), "--context", "lop", *submit[2:]]) == 2
    assert capsys.readouterr().err == (
        f"raychat k8s submit: error: no Kubernetes configuration: --kubeconfig {kubeconfig}, --context lop: "
        f"Invalid kube-config file. Expected object with name lop in {kubeconfig}/contexts list (the in-cluster "
        "configuration of a pod is used only without --kubeconfig, --context and $KUBECONFIG)\n"
    )
    assert in_a_pod == []
    assert raychat_main([*submit[:2], "--kubeconfig", str(kubeconfig), "--context", "loop", *submit[2:]]) == 0
    assert raychat_main(submit) == 0  # nothing named: the pod's own cluster
    assert in_a_pod == ["http://127.0.0.1:6443", "https://10.96.0.1:443"]


def _without_k8s_extra(monkeypatch, *packages: str) -> None:
    """Import `packages` as if not installed (ModuleNotFoundError), their imported modules forgotten."""
    for name in list(sys.modules):
        if name.partition(".")[0] in packages:
            monkeypatch.delitem(sys.modules, name)
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)


def test_k8s_submit_without_the_k8s_extra_says_so_in_one_line(monkeypatch, capsys):
    """Without the kubernetes client (raychat[k8s]: the Dockerfile's image, the wheel) `k8s submit` ended in a
    ModuleNotFoundError traceback; --dry-run needs no client."""
    _without_k8s_extra(monkeypatch, "kubernetes")
    assert raychat_main(["k8s", "submit", "--dry-run", "--name", "rl-1", *RL_ARGS]) == 0
    capsys.readouterr()
    assert raychat_main(["k8s", "submit", "--name", "rl-1", *RL_ARGS]) == 2
    assert capsys.readouterr() == (
        "",
        f"raychat k8s submit: error: creating the RayJob needs the k8s extra, and this Python ({sys.executable}) "
        "lacks 'kubernetes': pip install -c constraints.txt -e \".[k8s]\" in the raychat checkout; --dry-run prints "
        "the RayJob without it  (RAYCHAT_DEBUG=1 shows the traceback)\n",
    )


def test_k8s_generate_outside_a_checkout_names_its_own_flag(tmp_path, monkeypatch, capsys):
    """From an installed raychat (no checkout above the package) `k8s generate` said "pass --working-dir <repo>",
    a flag of `raychat submit`; its own is --repo."""
    from raychat.ops import submit

    installed = tmp_path / "site-packages" / "raychat" / "ops" / "submit.py"
    monkeypatch.setattr(submit, "__file__", str(installed))
    assert raychat_main(["k8s", "generate"]) == 2
    assert capsys.readouterr().err == (
        f"raychat k8s generate: error: no raychat checkout above {installed}; pass --repo <repo>  "
        "(RAYCHAT_DEBUG=1 shows the traceback)\n"
    )


# ---------------------------------------------------------------- the vLLM RayService, the PodMonitor


def test_the_vllm_rayservice_is_in_the_gpu_overlay_alone(builds, crd_schemas):
    from ray.serve.schema import ServeDeploySchema

    from raychat.serve import vllm

    text = (REPO / "serve" / "vllm.yaml").read_text()
    # serve/vllm.yaml is what `python -m raychat.serve.vllm --hf-dir /mnt/checkpoints/runs/hf --accelerator-type ""
    # --no-check-files --out serve/vllm.yaml` writes: the export RayJob's output, any GPU type
    config = vllm.serve_config(f"{k8s.STORAGE_ROOT}/hf", check_files=False, accelerator_type="")
    assert text == yaml.safe_dump(config, sort_keys=False), "serve/vllm.yaml is stale: rewrite it (see above)"
    (app,) = config["applications"]
    (llm,) = app["args"]["llm_configs"]
    assert (app["import_path"], llm["model_loading_config"]["model_source"]) == (
        "ray.serve.llm:build_openai_app",
        "/mnt/checkpoints/runs/hf",
    )
    assert "accelerator_type" not in llm  # any GPU the cluster has
    assert ServeDeploySchema.model_validate(config).applications[0].name == "raychat-vllm"
    for build in BUILDS:  # no GPUs elsewhere: no vLLM
        if build not in GPU_BUILDS:
            assert [d for d in builds[build] if d["metadata"]["name"] == "raychat-vllm"] == [], build
    (svc,) = [d for d in builds["k8s/overlays/gpu"] if d["metadata"]["name"] == "raychat-vllm"]
    validate_object(svc, crd_schemas)
    assert (svc["kind"], svc["metadata"]["namespace"], svc["spec"]["serveConfigV2"]) == (
        "RayService",
        "raychat",
        text,
    )
    spec = svc["spec"]["rayClusterConfig"]
    images = {c["image"] for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]] for c in g["template"]["spec"]["containers"]}  # fmt: skip
    assert images == {"registry.example.com/raychat-vllm:0.1.0"}  # the image built with EXTRAS=vllm
    assert spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"  # fmt: skip


# ---------------------------------------------------------------- the object-storage overlays

PVC_ROOT, S3_ROOT = "/mnt/checkpoints/runs", "s3://my-bucket/raychat"
TASK_DATA = "/mnt/checkpoints/task_data"  # the hub tasks' files on the PVC (k8s.TASK_DATA, by hand)


def flag_values(entrypoint: str, flag: str) -> list[str]:
    """The values of `flag` in a RayJob's entrypoint, in order."""
    words = shlex.split(entrypoint)
    return [words[i + 1] for i, w in enumerate(words) if w == flag]


def resolved_paths(entrypoint: str) -> dict[str, dict]:
    """{command: its storage_path, data_dir and tokenizer_path} of each command of an entrypoint, as the command
    resolves them (its parser, the preset, the flags, the STORAGE_INPUTS rule), the leaves it reads only."""
    out = {}
    for command in entrypoint.split(" && "):
        _, script, *words = shlex.split(command)
        name = re.fullmatch(r"jobs/(\w+)\.py", script)[1]
        cls, section, defaults = STAGE_CONFIGS[name]
        base = from_dict(cls, defaults) if defaults else None
        flat = to_flat(from_args(build_parser(name).parse_args([name, *words]), cls, section, base=base))
        keys = [
            k
            for k in ("storage_path", "data_dir", "tokenizer_path", "task_data_dir")
            if k not in UNUSED_FLAGS.get(name, {})
        ]
        out[name] = {k: flat[k] for k in keys if k in flat}
    return out


def chain_on_the_bucket(root: str = S3_ROOT, export_out: str | None = None) -> dict[str, str]:
    """The RayJob entrypoints of an object-storage overlay, by hand: data and tokenizer on the PVC, every
    checkpoint stage's run on `root`, the export to `export_out` when given."""
    out = f" --out {export_out}" if export_out else ""
    return {
        "data": f"python jobs/data.py prepare --preset cluster --storage-path {PVC_ROOT}",
        "tokenizer": f"python jobs/tokenizer.py train --preset cluster --storage-path {PVC_ROOT}",
        "pretrain": f"python jobs/pretrain.py --preset cluster --storage-path {root} --run-name pretrain "
        f"--data-dir {PVC_ROOT}/data --tokenizer-path {PVC_ROOT}/tokenizer",
        "sft": f"python jobs/sft.py --preset cluster --storage-path {root} --run-name sft --init-from latest "
        f"--tokenizer-path {PVC_ROOT}/tokenizer --task-data-dir {TASK_DATA}",
        "rl": f"python jobs/rl.py --preset cluster --storage-path {root} --run-name rl --init-from latest "
        f"--task-data-dir {TASK_DATA}",
        "eval": f"python jobs/eval.py --preset cluster --storage-path {root} --run-name eval --checkpoint latest "
        f"--data-dir {PVC_ROOT}/data --task-data-dir {TASK_DATA}",
        "export": f"python jobs/export.py --storage-path {root} --run-name hf --checkpoint latest{out}",
    }  # fmt: skip


@pytest.mark.parametrize("build", OBJECT_STORAGE_BUILDS)
def test_each_object_storage_overlay_keeps_checkpoints_in_the_bucket_and_data_on_the_pvc(builds, build):
    gpu, _ = OBJECT_STORAGE_BUILDS[build]
    docs = {(d["kind"], d["metadata"]["name"]): d for d in builds[build]}
    entrypoints = {stage: docs[("RayJob", f"raychat-{stage}")]["spec"]["entrypoint"] for stage in k8s.CHAIN}
    # on GPUs the export goes to the PVC, where the vLLM RayService reads it (serve/vllm.yaml)
    assert entrypoints == chain_on_the_bucket(export_out=f"{PVC_ROOT}/hf" if gpu else None)
    every = " && ".join(entrypoints.values())
    # data and tokenizer are written to the PVC, every checkpoint stage's run to the bucket
    assert flag_values(every, "--storage-path") == [PVC_ROOT] * 2 + [S3_ROOT] * 5
    assert flag_values(every, "--data-dir") == [f"{PVC_ROOT}/data"] * 2
    assert flag_values(every, "--tokenizer-path") == [f"{PVC_ROOT}/tokenizer"] * 2
    # what each command reads, defaults included (a --storage-path alone would put data and tokenizer under it)
    resolved = {name: paths for e in entrypoints.values() for name, paths in resolved_paths(e).items()}
    assert resolved == {
        "data": {"storage_path": PVC_ROOT},
        "tokenizer": {"storage_path": PVC_ROOT, "data_dir": f"{PVC_ROOT}/data"},
        "pretrain": {"storage_path": S3_ROOT, "data_dir": f"{PVC_ROOT}/data", "tokenizer_path": f"{PVC_ROOT}/tokenizer"},
        "sft": {"storage_path": S3_ROOT, "tokenizer_path": f"{PVC_ROOT}/tokenizer", "task_data_dir": TASK_DATA},  # no shards
        "rl": {"storage_path": S3_ROOT, "task_data_dir": TASK_DATA},
        "eval": {"storage_path": S3_ROOT, "data_dir": f"{PVC_ROOT}/data", "task_data_dir": TASK_DATA},
        "export": {"storage_path": S3_ROOT},
    }  # fmt: skip
    # the chat RayService serves the RL run's newest checkpoint from the bucket, on a GPU a replica on the gpu
    # overlays; the rest is serve/chat.yaml's config
    text = docs[("RayService", "raychat-chat")]["spec"]["serveConfigV2"]
    config, chat = yaml.safe_load(text), yaml.safe_load((REPO / "serve" / "chat.yaml").read_text())
    assert config["applications"][0]["args"]["checkpoint"] == f"{S3_ROOT}/rl/latest"
    chat["applications"][0]["args"]["checkpoint"] = f"{S3_ROOT}/rl/latest"
    if gpu:
        (server,) = [d for d in chat["applications"][0]["deployments"] if d["name"] == "ChatServer"]
        server["ray_actor_options"]["num_gpus"] = 1
    assert config == chat
    if gpu:  # the vLLM RayService reads the export the export RayJob wrote
        (llm,) = yaml.safe_load(docs[("RayService", "raychat-vllm")]["spec"]["serveConfigV2"])["applications"]
        source = llm["args"]["llm_configs"][0]["model_loading_config"]["model_source"]
        assert flag_values(entrypoints["export"], "--out") == [source] == [f"{PVC_ROOT}/hf"]
    # the base's NetworkPolicy: ingress only, so the pods' egress (HTTPS to the S3 endpoint) stays open
    (policy,) = [d for d in builds[build] if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]


@pytest.mark.parametrize("build", OBJECT_STORAGE_BUILDS)
def test_an_object_storage_overlay_is_its_base_with_the_bucket_and_one_kind_of_credentials(builds, build):
    """Every object is the base's (the gpu overlay's) but for the entrypoints and serve config checked above
    and, in each Ray pod, envFrom the Secret (s3-secret) or the serviceAccountName (service-account), not both:
    the GPUs, tolerations, images and namespace of the gpu overlay stay as they are."""
    gpu, credentials = OBJECT_STORAGE_BUILDS[build]
    under = {(d["kind"], d["metadata"]["name"]): d for d in builds["k8s/overlays/gpu" if gpu else "k8s/base"]}
    assert sorted((d["kind"], d["metadata"]["name"]) for d in builds[build]) == sorted(under)
    with_credentials = []
    for d in builds[build]:
        key = (d["kind"], d["metadata"]["name"])
        stripped = copy.deepcopy(d)
        for where, template, _ in pods(stripped):
            (container,) = template["spec"]["containers"]
            env_from, account = (
                container.pop("envFrom", None),
                template["spec"].pop("serviceAccountName", None),
            )
            if where == "submitter":  # `ray job submit` alone: opens no storage
                assert (env_from, account) == (None, None), key
                continue
            if credentials == "s3-secret":
                assert (env_from, account) == ([{"secretRef": {"name": "raychat-s3"}}], None), (key, where)
            else:
                assert (env_from, account) == (None, "raychat"), (key, where)  # settings.yaml's default
            with_credentials.append((*key, where))
        if d["kind"] == "RayJob" and d["metadata"]["name"] not in ("raychat-data", "raychat-tokenizer"):
            stripped["spec"]["entrypoint"] = under[key]["spec"]["entrypoint"]
        if key == ("RayService", "raychat-chat"):
            stripped["spec"]["serveConfigV2"] = under[key]["spec"]["serveConfigV2"]
        assert stripped == under[key], key
    # head and worker of the RayCluster, of each RayJob and of the RayService(s: the gpu overlay's vLLM one)
    assert len(with_credentials) == 2 * (1 + len(k8s.CHAIN) + 1 + gpu) == len(set(with_credentials))
    if (
        gpu
    ):  # what the gpu overlay gives them, kept: whole 8-GPU pods on the tainted GPU nodes, in its namespace
        for d in builds[build]:
            for where, template, _ in pods(d):
                if where.startswith("worker"):
                    spec = template["spec"]
                    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8", d[
                        "metadata"
                    ]
                    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]  # fmt: skip
                    assert "nodeSelector" not in spec  # neither base nor gpu overlay pins nodes
            assert d["metadata"].get("namespace") == "raychat" or d["kind"] == "Namespace"
    # the keys are never in the manifests, and settings.yaml (local-config) is not applied
    assert [d["kind"] for d in builds[build] if d["kind"] in ("Secret", "ConfigMap", "ServiceAccount")] == []


def test_only_the_object_storage_overlays_give_the_ray_pods_credentials(builds):
    for build in BUILDS:
        if build in OBJECT_STORAGE_BUILDS:
            continue
        for d in builds[build]:
            for where, template, _ in pods(d):
                assert "envFrom" not in template["spec"]["containers"][0], (build, where)
                assert "serviceAccountName" not in template["spec"], (build, where)  # KubeRay's own SA


def test_the_bucket_and_the_service_account_are_set_in_settings_yaml_alone(tmp_path):
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    settings = tmp_path / "k8s" / "components" / "object-storage" / "settings.yaml"
    assert not [n for n in k8s.render_all(REPO) if n.endswith("settings.yaml")]  # generate keeps your values
    text = settings.read_text()
    assert "\n  bucket: my-bucket\n  serviceAccountName: raychat\n" in text
    settings.write_text(text.replace("bucket: my-bucket", "bucket: team-bucket/exp1").replace(
        "serviceAccountName: raychat", "serviceAccountName: raychat-irsa"))  # fmt: skip
    root = "s3://team-bucket/exp1/raychat"
    for build, (gpu, credentials) in OBJECT_STORAGE_BUILDS.items():
        docs = kustomize_build(tmp_path / build)  # kubectl's build and the fallback's agree
        entrypoints = {d["metadata"]["labels"]["raychat.io/stage"]: d["spec"]["entrypoint"] for d in docs if d["kind"] == "RayJob"}  # fmt: skip
        assert entrypoints == chain_on_the_bucket(root, export_out=f"{PVC_ROOT}/hf" if gpu else None), build
        (app,) = yaml.safe_load(next(d for d in docs if d["metadata"]["name"] == "raychat-chat")["spec"]["serveConfigV2"])["applications"]  # fmt: skip
        assert app["args"]["checkpoint"] == f"{root}/rl/latest"
        accounts = [
            t["spec"].get("serviceAccountName") for d in docs for w, t, _ in pods(d) if w != "submitter"
        ]
        want = "raychat-irsa" if credentials == "service-account" else None
        assert accounts == [want] * 2 * (1 + len(k8s.CHAIN) + 1 + gpu), build
        assert "my-bucket" not in yaml.safe_dump_all(docs), build
    # a replacement sets one '/'-separated part: the generator refuses a text with the bucket twice
    with pytest.raises(ValueError, match="my-bucket must be one '/'-separated part, once"):
        k8s.bucket_replacement("RayJob", "x", "spec.entrypoint", "a s3://my-bucket/r && b s3://my-bucket/r")


def test_the_object_storage_component_alone_on_the_gpu_overlay_would_serve_from_cpus(tmp_path):
    """Why the gpu-object-storage overlays set the chat serve config themselves: the component's and the gpu
    overlay's are each a patch of the whole serveConfigV2 text, so stacked, the later one wins."""
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    stack = tmp_path / "k8s" / "overlays" / "mine"
    stack.mkdir()
    (stack / "kustomization.yaml").write_text(
        "resources: [../gpu]\ncomponents: [../../components/object-storage, ../../components/s3-secret]\n"
    )
    (svc,) = [d for d in kustomize_build(stack) if d["metadata"]["name"] == "raychat-chat"]
    (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    (server,) = [d for d in app["deployments"] if d["name"] == "ChatServer"]
    assert (
        app["args"]["checkpoint"] == f"{S3_ROOT}/rl/latest" and "num_gpus" not in server["ray_actor_options"]
    )


MONITORING = "k8s/overlays/monitoring"
# the fields of the Prometheus Operator's PodMonitor CRD (monitoring.coreos.com/v1, prometheus-operator 0.91,
# example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml) that k8s/ uses, strict: a misspelt
# field is an error (the CRD itself is not in shared/)
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {"enum": ["replace", "Replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
    },
}
POD_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$",
                            },
                            "relabelings": {"type": "array", "items": _RELABEL},
                        },
                    },
                },
            },
        },
    },
}


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to `labels`."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok &= {"Exists": present, "DoesNotExist": not present, "In": value in e.get("values", []),
               "NotIn": value not in e.get("values", [])}[e["operator"]]  # fmt: skip
    return ok


def kuberay_pod_labels(cluster: str, where: str, template: dict) -> dict:
    """The labels KubeRay gives a Ray pod of RayCluster `cluster` (ray-operator/controllers/ray/common/pod.go):
    the template's, ray.io/cluster, ray.io/node-type (head | worker), ray.io/group, ray.io/is-ray-node."""
    node_type, _, group = where.partition(" ")
    return {
        **template["metadata"]["labels"],
        "ray.io/cluster": cluster,
        "ray.io/node-type": node_type,
        "ray.io/group": group or "headgroup",
        "ray.io/is-ray-node": "yes",
    }


def test_the_pod_monitor_scrapes_the_metrics_port_of_every_ray_pod(builds):
    docs = kustomize_build(REPO / MONITORING)
    assert [d["kind"] for d in docs] == ["PodMonitor"]
    (monitor,) = docs
    assert monitor == k8s.pod_monitor()
    jsonschema.Draft7Validator(POD_MONITOR_SCHEMA).validate(monitor)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    # node type, cluster and group of the pod become labels of every series
    assert {(r["sourceLabels"][0], r["targetLabel"]) for r in endpoint["relabelings"]} == {
        ("__meta_kubernetes_pod_label_ray_io_node_type", "ray_node_type"),
        ("__meta_kubernetes_pod_label_ray_io_cluster", "ray_io_cluster"),
        ("__meta_kubernetes_pod_label_ray_io_group", "ray_group"),
    }
    selector = monitor["spec"]["selector"]
    for build in BUILDS:
        scraped = 0
        for d in builds[build]:
            for where, template, _ in pods(d):
                if where == "submitter":  # not a Ray node: no ray.io/cluster label, no metrics port
                    assert not selects(selector, template["metadata"]["labels"]), d["metadata"]["name"]
                    continue
                labels = kuberay_pod_labels(d["metadata"]["name"], where, template)
                assert selects(selector, labels), (build, d["metadata"]["name"], where)
                (container,) = template["spec"]["containers"]
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                spec = RAY_SPEC[d["kind"]](d["spec"])
                group = spec["headGroupSpec"] if where == "head" else spec["workerGroupSpecs"][0]
                # the named port is the one Ray exports its metrics on
                assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]) == 8080
                scraped += 1
        assert scraped == 2 + 2 * len(k8s.CHAIN) + 2 * (1 + (build in GPU_BUILDS)), build
    # what the selector leaves out: other apps' pods, a raychat pod that is not a Ray node
    assert not selects(selector, {"app.kubernetes.io/name": "notebook", "ray.io/cluster": "x"})
    assert not selects(selector, dict(k8s.LABELS))


def test_the_pod_monitor_schema_catches_mistakes():
    monitor = k8s.pod_monitor()
    validator = jsonschema.Draft7Validator(POD_MONITOR_SCHEMA)
    for path, value in [
        (("spec", "podMetricsEndpoints", 0, "targetPort"), 8080),  # misspelt/unsupported field
        (("spec", "selector", "matchExpressions", 0, "operator"), "Exist"),
        (("spec", "podMetricsEndpoints", 0, "interval"), "15"),
    ]:
        broken = copy.deepcopy(monitor)
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert list(validator.iter_errors(broken)), path


def test_k8s_generate_from_a_folder_that_is_not_a_checkout(tmp_path, capsys):
    assert raychat_main(["k8s", "generate", "--repo", str(tmp_path)]) == 2  # was "[Errno 2] No such file ..."
    assert capsys.readouterr().err == (
        f"raychat k8s generate: error: --repo {tmp_path}: not a raychat checkout (no serve/chat.yaml to render from)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- what KubeRay does with a RayJob

CHAINING = {"&&", "||", ";", "|"}


def kuberay_submitter(entrypoint: str, tmp_path: Path) -> list[list[str]]:
    """Run the submitter pod's command as KubeRay v1 builds it (K8sJobMode: common/job.go BuildJobSubmitCommand,
    the entrypoint pasted in unquoted; the controller runs `/bin/bash -c` of the words joined by spaces) with
    stubs of `ray` and `python` on PATH; returns the argv of every stub call, in order (python's: a command that
    ran in the submitter pod itself)."""
    log, stubs = tmp_path / "calls.jsonl", tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for tool, code in (("ray", 1), ("python", 0)):  # `ray job status` fails: the job does not exist yet
        (stubs / tool).write_text(
            f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
            f"sys.exit({code} if sys.argv[1:3] == ['job', 'status'] else 0)\n"
        )
        (stubs / tool).chmod(0o755)
    address, job = "http://raychat-head-svc:8265", "raychat-job-abcde"
    env_json = shlex.quote(json.dumps({"working_dir": "/home/ray/raychat"}))
    words = ["if", "!", "ray", "job", "status", "--address", address, job, ">/dev/null", "2>&1", ";", "then",
             "ray", "job", "submit", "--address", address, "--no-wait", "--runtime-env-json", env_json,
             "--submission-id", job, "--", entrypoint, ";", "fi", ";",
             "ray", "job", "logs", "--address", address, "--follow", job]  # fmt: skip
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"}
    subprocess.run(["/bin/bash", "-c", " ".join(words)], env=env, check=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    log.unlink()
    return [[Path(c[0]).name, *c[1:]] for c in calls]


def test_every_rayjob_submits_one_command_and_runs_nothing_in_its_submitter(builds, tmp_path):
    """The data RayJob chained `data.py prepare ... && tokenizer.py train ...`: KubeRay pastes the entrypoint
    unquoted into its submitter's `bash -c`, so the `&&` ended the submitted command there and the tokenizer
    ran in the submitter pod (1 CPU, no PVC) and never wrote the tokenizer. Each stage is now a RayJob of one
    command: raychat-data, then raychat-tokenizer."""
    for build in BUILDS:
        rayjobs = [d for d in builds[build] if d["kind"] == "RayJob"]
        assert sorted(d["metadata"]["name"] for d in rayjobs) == sorted(f"raychat-{s}" for s in k8s.CHAIN)
        for d in rayjobs:
            text = d["spec"]["entrypoint"]
            lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
            assert CHAINING.isdisjoint(lexer), (build, d["metadata"]["name"], text)
    stages = {
        d["metadata"]["name"]: d["spec"]["entrypoint"] for d in builds["k8s/base"] if d["kind"] == "RayJob"
    }
    assert (
        stages["raychat-data"]
        == "python jobs/data.py prepare --preset cluster --storage-path /mnt/checkpoints/runs"
    )
    assert stages["raychat-tokenizer"] == (
        "python jobs/tokenizer.py train --preset cluster --storage-path /mnt/checkpoints/runs"
    )
    assert k8s.CHAIN.index("tokenizer") == k8s.CHAIN.index("data") + 1  # it reads the data prepare wrote
    for (
        name,
        text,
    ) in stages.items():  # what KubeRay's submitter does with each: one `ray job submit` of it all
        calls = kuberay_submitter(text, tmp_path)
        assert [c[:3] for c in calls] == [
            ["ray", "job", "status"],
            ["ray", "job", "submit"],
            ["ray", "job", "logs"],
        ]
        assert calls[1][calls[1].index("--") + 1 :] == shlex.split(text), name


def the_jobs_argv(entrypoint: str, tmp_path: Path) -> list[str]:
    """The argv that `python` gets in the Ray job of a RayJob with this entrypoint: KubeRay's submitter (see
    kuberay_submitter) hands the words to `ray job submit`, whose CLI joins them with subprocess.list2cmdline
    (ray/dashboard/modules/job/cli.py) for the job's `sh -c` (Ray's job supervisor: shell=True)."""
    submit = kuberay_submitter(entrypoint, tmp_path)[1]
    command = subprocess.list2cmdline(submit[submit.index("--") + 1 :])
    env = {**os.environ, "PATH": f"{tmp_path / 'stubs'}:{os.environ['PATH']}", "HOME": "/home/ray"}
    subprocess.run(["/bin/sh", "-c", command], env=env, check=True, timeout=60, cwd=tmp_path)
    log = tmp_path / "calls.jsonl"
    ((python, *argv),) = [json.loads(line) for line in log.read_text().splitlines()]
    log.unlink()
    return argv


def test_a_stage_argument_the_jobs_shell_would_interpret_is_refused(tmp_path, capsys):
    """--run-name 'exp$HOME' reached the job as exp/root: the job's `sh -c` expanded it, since `ray job submit`
    re-joins the words KubeRay's submitter gave it (list2cmdline: double quotes around a word with a blank,
    none otherwise)."""
    with pytest.raises(ValueError) as e:
        k8s.rayjob("pretrain", ["--run-name", "a$HOME"])
    assert str(e.value) == (
        "stage argument 'a$HOME': $ would be interpreted by the RayJob's second shell (the job's `sh -c`, after "
        "KubeRay's `ray job submit`); a RayJob's stage arguments hold no $ ` \\ \", nor, in one without a space, "
        "' ; & | < > ( ) * ? [ # or a line break"
    )
    unchecked = shlex.join(["python", "jobs/pretrain.py", "--run-name", "a$HOME"])  # what the RayJob held
    assert the_jobs_argv(unchecked, tmp_path) == ["jobs/pretrain.py", "--run-name", "a/home/ray"]
    for bad, chars in [("exp`id`", "`"), ("/mnt/a b/$(id -u)", "$"), ("a\\b", "\\"), ('a "b"', '"'),
                       ("s3://b/r?x=1&y=2", "& ?"), ("x;y", ";"), ("it's", "'"), ("a\nb", "a line break")]:  # fmt: skip
        with pytest.raises(
            ValueError, match=rf"^stage argument {re.escape(repr(bad))}: {re.escape(chars)} would"
        ):
            k8s.rayjob("pretrain", ["--storage-path", bad])
    # what is taken reaches the job word for word
    good = ["--run-name", "exp-1.a_b", "--storage-path", "/mnt/a b/c", "--prompt", "it's 1; 2 & 3 | (4) * ?",
            "--tasks", "gsm8k:0.5,arc=1+2@x%", "--empty", ""]  # fmt: skip
    assert the_jobs_argv(k8s.rayjob("pretrain", good)["spec"]["entrypoint"], tmp_path) == [
        "jobs/pretrain.py",
        *good,
    ]
    # the stage's own parser takes this path (a run name with $ it refuses itself), the RayJob does not
    argv = ["k8s", "submit", "--dry-run", "--name", "t1", "pretrain", "--storage-path", "/mnt/$USER/runs"]
    assert raychat_main(argv) == 2
    assert capsys.readouterr().err.startswith(
        "raychat k8s submit: error: stage argument '/mnt/$USER/runs': $ would be interpreted by the RayJob's "
    )


def test_k8s_submit_eval_reserves_the_base_manifests_gpu_for_its_driver(capsys, crd_schemas):
    """`raychat k8s submit eval` gave its driver no GPU (rayjob without num_gpus, no --num-gpus flag): on the
    base's cluster it landed on the 0-CPU head, where the cluster preset's cuda eval fails. Each stage's driver
    now reserves what the base's RayJob gives it (eval: 1 GPU); --num-gpus and --num-cpus override."""
    eval_ = ["eval", "--preset", "cluster", "--checkpoint", "latest", "--task-data-dir", TASK_DATA]
    runs = {
        (): {"entrypointNumGpus": 1},
        ("--num-gpus", "0", "--num-cpus", "2"): {"entrypointNumCpus": 2},
        ("--num-gpus", "0.5"): {"entrypointNumGpus": 0.5},
    }
    for flags, want in runs.items():
        assert raychat_main(["k8s", "submit", "--dry-run", "--name", "e1", *flags, *eval_]) == 0
        job = yaml.safe_load(capsys.readouterr().out)
        validate_object(job, crd_schemas)
        got = {k: v for k, v in job["spec"].items() if k.startswith("entrypointNum")}
        assert got == want, flags
    base = yaml.safe_load((REPO / "k8s" / "base" / "rayjob-eval.yaml").read_text())
    assert base["spec"]["entrypointNumGpus"] == 1
    assert (
        raychat_main(["k8s", "submit", "--dry-run", "--name", "p1", "pretrain", "--preset", "cluster"]) == 0
    )
    assert [k for k in yaml.safe_load(capsys.readouterr().out)["spec"] if k.startswith("entrypointNum")] == []
    with pytest.raises(SystemExit) as e:
        raychat_main(["k8s", "submit", "--dry-run", "--num-gpus", "-1", *eval_])
    assert e.value.code == 2
    assert "error: argument --num-gpus: must be >= 0, got -1" in capsys.readouterr().err


def test_k8s_submit_takes_only_a_name_kuberay_takes_for_a_rayjob(capsys):
    """--name took any DNS-1123 label of up to 63 characters; KubeRay's ValidateRayJobMetadata wants a DNS-1035
    label (a letter first) of at most 47, so the API server created the RayJob ("created" printed) and the
    operator then refused it."""
    rule = (
        "must be a DNS-1035 label of at most 47 characters (KubeRay's RayJob name: a lowercase letter first, then "
        "lowercase letters, digits and '-', not ending in '-')"
    )
    for name in ("r" * 60, "1stjob", "r" * 48):
        assert raychat_main(["k8s", "submit", "--dry-run", "--name", name, *SFT]) == 2
        assert capsys.readouterr().err == f"raychat k8s submit: error: --name {rule}; got {name!r}\n"
    assert raychat_main(["k8s", "submit", "--dry-run", "--name", "r" * 47, *SFT]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metadata"]["name"] == "r" * 47
    with pytest.raises(ValueError, match=f"^name {re.escape(rule)}; got '9a'$"):
        k8s.rayjob("sft", name="9a")
    # the longest default name: raychat-<stage>-<YYYYmmdd-HHMMSS>-<6 hex>
    assert len(f"raychat-{max(k8s.STAGES, key=len)}-20261205-213400-abcdef") <= k8s.RAYJOB_NAME_MAX


def test_the_pod_monitor_labels_the_cluster_as_rays_dashboards_filter_it():
    """The PodMonitor wrote ray.io/cluster to ray_cluster, but the Cluster filter of the Ray dashboards that
    `raychat grafana provision` uploads selects on another label, so their panels were empty on KubeRay."""
    from ray.dashboard.modules.metrics.dashboards.default_dashboard_panels import default_dashboard_config

    (cluster_filter,) = [f for f in default_dashboard_config.standard_global_filters if '"$Cluster"' in f]
    label = cluster_filter.split("=~")[0]
    (endpoint,) = k8s.pod_monitor()["spec"]["podMetricsEndpoints"]
    targets = {r["sourceLabels"][0]: r["targetLabel"] for r in endpoint["relabelings"]}
    assert targets["__meta_kubernetes_pod_label_ray_io_cluster"] == label == "ray_io_cluster"
