"""KubeRay (ray.io/v1) manifests for raychat, built in one place (`raychat k8s generate|submit`: ops/k8s_cli.py).

The files in k8s/base/ and k8s/overlays/cpu-dev/kustomization.yaml are the output of `raychat k8s generate`
(tests/test_k8s.py fails when they drift), so the RayCluster, the RayJobs and the RayService share one
cluster spec, and the RayService's serveConfigV2 is the text of serve/chat.yaml byte for byte.

The RayJobs are the chain of stages (CHAIN), each a complete command on the PVC's storage root
(/mnt/checkpoints/runs): data prepare + tokenizer -> pretrain -> sft --init-from latest -> rl --checkpoint
latest -> eval -> export, each stage's run named after it; the RayService serves <root>/rl/latest. The
base runs the `cluster` preset on the GPU group (8 pods of 1 GPU: --num-workers 8); the cpu-dev overlay
the same commands with the `tiny` preset (tests/test_stage_jobs.py runs exactly those on a real cluster).

Cluster shape: a CPU head (num-cpus 0: no training or serving work lands on it) and a GPU worker group
autoscaled 0..8 by the KubeRay autoscaler v2 (autoscalerOptions.version v2, worker restartPolicy Never as
the KubeRay docs require for v2), Ray token authentication (authOptions.mode token: the operator makes the
secret and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN), and a ReadWriteMany PVC for checkpoints at /mnt/checkpoints.
The image `raychat` (placeholder name, set with kustomize `images:`) is rayproject/ray:<ray version>-py311-gpu
with raychat installed at /home/ray/raychat (see docs/deployment.md).
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from pathlib import Path

import yaml

RAY_VERSION = "2.60.0"
IMAGE = "raychat:0.1.0"
APP_DIR = "/home/ray/raychat"
CHECKPOINTS_PVC = "raychat-checkpoints"
CHECKPOINTS_MOUNT = "/mnt/checkpoints"
STORAGE_ROOT = f"{CHECKPOINTS_MOUNT}/runs"  # --storage-path of every RayJob; the RayService's checkpoints
GPU_WORKERS, GPU_WORKER_CPUS = 8, 8  # the base's GPU group: at most 8 pods of 1 GPU and 8 CPUs
RAYJOB_STAGES = ("data", "tokenizer", "pretrain", "sft", "rl", "eval", "export", "speedrun")
CHAIN = (
    "data",
    "pretrain",
    "sft",
    "rl",
    "eval",
    "export",
)  # the RayJobs of k8s/base, in the order they chain
LABELS = {"app.kubernetes.io/name": "raychat", "app.kubernetes.io/part-of": "raychat"}
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _volume_bits() -> tuple[list, list]:
    volumes = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": CHECKPOINTS_PVC}}]
    mounts = [{"name": "checkpoints", "mountPath": CHECKPOINTS_MOUNT}]
    return volumes, mounts


def cluster_spec(image: str = IMAGE, max_gpu_workers: int = GPU_WORKERS) -> dict:
    """The RayClusterSpec shared by the RayCluster, every RayJob and the RayService."""
    volumes, mounts = _volume_bits()
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "metrics-export-port": "8080"},
        "template": {
            "metadata": {"labels": dict(LABELS)},
            "spec": {
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "ports": [
                            {"containerPort": 6379, "name": "gcs-server"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": 8000, "name": "serve"},
                            {"containerPort": 8080, "name": "metrics"},
                        ],
                        "resources": {
                            "requests": {"cpu": "4", "memory": "16Gi"},
                            "limits": {"cpu": "4", "memory": "16Gi"},
                        },
                        "volumeMounts": mounts,
                    }
                ],
                "volumes": volumes,
            },
        },
    }
    worker = {
        "groupName": "gpu",
        "replicas": 0,
        "minReplicas": 0,
        "maxReplicas": max_gpu_workers,
        "rayStartParams": {"metrics-export-port": "8080"},
        "template": {
            "metadata": {"labels": dict(LABELS)},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": image,
                        "ports": [{"containerPort": 8080, "name": "metrics"}],
                        "resources": {
                            "requests": {
                                "cpu": str(GPU_WORKER_CPUS),
                                "memory": "64Gi",
                                "nvidia.com/gpu": "1",
                            },
                            "limits": {"cpu": str(GPU_WORKER_CPUS), "memory": "64Gi", "nvidia.com/gpu": "1"},
                        },
                        "volumeMounts": mounts,
                    }
                ],
                "volumes": volumes,
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
    }
    return {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"version": "v2", "idleTimeoutSeconds": 60, "upscalingMode": "Default"},
        "authOptions": {"mode": "token"},
        "headGroupSpec": head,
        "workerGroupSpecs": [worker],
    }


def _meta(name: str, **labels) -> dict:
    if not _DNS1123.match(name) or len(name) > 63:
        raise ValueError(f"name must be a DNS-1123 label (lowercase, digits, '-', <= 63 chars); got {name!r}")
    return {"name": name, "labels": {**LABELS, **labels}}


def raycluster(image: str = IMAGE) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta("raychat"),
        "spec": cluster_spec(image),
    }


def chain_commands(preset: str, shape: tuple[str, ...] = (), root: str = STORAGE_ROOT) -> dict[str, list]:
    """{RayJob stage: its commands ([stage, *args] each)}: the chain of CHAIN on one storage root. `shape`
    (e.g. --num-workers 8) goes to the Ray Train stages, so they fit the RayJob's cluster."""
    common = ["--preset", preset, "--storage-path", root]
    return {
        "data": [["data", "prepare", *common], ["tokenizer", "train", *common]],
        "pretrain": [["pretrain", *common, *shape, "--run-name", "pretrain"]],
        "sft": [["sft", *common, *shape, "--run-name", "sft", "--init-from", "latest"]],
        "rl": [["rl", *common, "--run-name", "rl", "--checkpoint", "latest"]],
        "eval": [["eval", *common, "--run-name", "eval", "--checkpoint", "latest"]],
        "export": [["export", "--storage-path", root, "--run-name", "hf", "--checkpoint", "latest"]],
    }


def base_commands() -> dict[str, list]:
    """The commands of k8s/base: the `cluster` preset on GPU_WORKERS pods, one Ray Data CPU left in each."""
    return chain_commands(
        "cluster", ("--num-workers", str(GPU_WORKERS), "--cpus-per-worker", str(GPU_WORKER_CPUS - 1))
    )


def cpu_dev_commands() -> dict[str, list]:
    """The commands of the cpu-dev overlay: the `tiny` preset (minutes on 2 CPUs)."""
    return chain_commands("tiny")


def entrypoint(commands: list[list[str]]) -> str:
    """`python jobs/<stage>.py ARGS` of each [stage, *args] (what `raychat submit <stage> ARGS` runs), joined
    by ` && `: each runs once the one before succeeded."""
    return " && ".join(shlex.join(["python", f"jobs/{stage}.py", *args]) for stage, *args in commands)


def rayjob(
    stage: str,
    stage_args: list[str] | None = None,
    name: str | None = None,
    image: str = IMAGE,
    ttl_s: int = 3600,
    backoff_limit: int = 1,
    commands: list[list[str]] | None = None,
    num_gpus: float = 0,
) -> dict:
    """A RayJob running `python jobs/<stage>.py ARGS` (or the chain of `commands`, see entrypoint) in
    /home/ray/raychat on its own cluster, its driver reserving `num_gpus`, deleted ttl_s seconds after the job
    finishes, retried backoff_limit times. Raises ValueError for an unknown stage or an invalid name."""
    if stage not in RAYJOB_STAGES:
        raise ValueError(f"stage must be one of {', '.join(RAYJOB_STAGES)}; got {stage!r}")
    spec = {
        "entrypoint": entrypoint(commands or [[stage, *(stage_args or [])]]),
        "runtimeEnvYAML": yaml.safe_dump({"working_dir": APP_DIR}, sort_keys=False),
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": ttl_s,
        "backoffLimit": backoff_limit,
    }
    if num_gpus:
        spec["entrypointNumGpus"] = num_gpus
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _meta(name or f"raychat-{stage}", **{"raychat.io/stage": stage}),
        "spec": {**spec, "rayClusterSpec": cluster_spec(image)},
    }


def rayservice(serve_config_text: str, image: str = IMAGE) -> dict:
    """The chat RayService; serveConfigV2 is `serve_config_text` unchanged (serve/chat.yaml)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": _meta("raychat-chat"),
        "spec": {"serveConfigV2": serve_config_text, "rayClusterConfig": cluster_spec(image)},
    }


def checkpoints_pvc(size: str = "200Gi") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(CHECKPOINTS_PVC),
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}},
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, data: str):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)


HEADER = "# Generated by `raychat k8s generate` from platform/raychat/ops/k8s.py and serve/chat.yaml: do not edit.\n"


def render_base(repo: Path) -> dict[str, str]:
    """{file name in k8s/base: text}. Reads repo/serve/chat.yaml. The eval RayJob's driver takes a GPU (the
    cluster preset evaluates on cuda)."""
    serve_text = (repo / "serve" / "chat.yaml").read_text()
    commands = base_commands()
    files = {
        "pvc-checkpoints.yaml": checkpoints_pvc(),
        "raycluster.yaml": raycluster(),
        **{
            f"rayjob-{s}.yaml": rayjob(s, commands=commands[s], num_gpus=1 if s == "eval" else 0)
            for s in CHAIN
        },
        "rayservice-chat.yaml": rayservice(serve_text),
    }
    out = {name: HEADER + to_yaml(obj) for name, obj in files.items()}
    out["kustomization.yaml"] = HEADER + to_yaml(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": sorted(n for n in files),
        }
    )
    return out


CPU_DEV_NOTE = """# CPU-only development cluster (e.g. kind or minikube): CPU workers instead of GPUs, small pods, at most 2
# workers, and the chain's RayJobs on the `tiny` preset (the wiring in minutes; set another preset for a
# model). Build: kubectl kustomize k8s/overlays/cpu-dev | kubectl apply -f -
"""


def render_cpu_dev() -> str:
    """k8s/overlays/cpu-dev/kustomization.yaml: CPU workers (the static patch files beside it), a small RWO
    PVC, and each RayJob's entrypoint replaced by cpu_dev_commands' (the eval driver then needs no GPU)."""
    static = [
        {"target": {"group": "ray.io", "version": "v1", "kind": k}, "path": f"cpu-workers-{k.lower()}.yaml"}
        for k in ("RayCluster", "RayJob", "RayService")
    ]
    pvc = [
        {"op": "replace", "path": "/spec/resources/requests/storage", "value": "10Gi"},
        {"op": "replace", "path": "/spec/accessModes", "value": ["ReadWriteOnce"]},
    ]
    jobs = []
    for stage, commands in cpu_dev_commands().items():
        ops = [{"op": "replace", "path": "/spec/entrypoint", "value": entrypoint(commands)}]
        if stage == "eval":
            ops.append({"op": "remove", "path": "/spec/entrypointNumGpus"})
        target = {"group": "ray.io", "version": "v1", "kind": "RayJob", "name": f"raychat-{stage}"}
        jobs.append({"target": target, "patch": to_yaml(ops).rstrip("\n")})
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "raychat-dev",
        "resources": ["../../base", "namespace.yaml"],
        "images": [{"name": "raychat", "newName": "raychat-cpu", "newTag": "0.1.0"}],
        "patches": [
            *static,
            {
                "target": {"version": "v1", "kind": "PersistentVolumeClaim", "name": CHECKPOINTS_PVC},
                "patch": to_yaml(pvc).rstrip("\n"),
            },
            *jobs,
        ],
    }
    return HEADER + CPU_DEV_NOTE + to_yaml(kustomization)


def render_all(repo: Path) -> dict[str, str]:
    """{path relative to k8s/: text} of every generated file."""
    return {
        **{f"base/{name}": text for name, text in render_base(repo).items()},
        "overlays/cpu-dev/kustomization.yaml": render_cpu_dev(),
    }


def write_generated(repo: Path) -> list[str]:
    """Write every generated file under repo/k8s atomically (tmp + os.replace); returns the paths that
    changed (relative to k8s/)."""
    changed = []
    for name, text in render_all(repo).items():
        path = repo / "k8s" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.read_text() == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        changed.append(name)
    return changed
