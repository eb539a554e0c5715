"""KubeRay (ray.io/v1) manifests for raychat, built in one place, and `raychat k8s generate|submit`.

The files in k8s/base/ are the output of `raychat k8s generate` (tests/test_k8s.py fails when they drift),
so the RayCluster, the RayJobs and the RayService share one cluster spec, and the RayService's serveConfigV2
is the text of serve/chat.yaml byte for byte. `raychat k8s submit <stage>` creates the same RayJob through the
official `kubernetes` client (CustomObjectsApi); `--dry-run` prints it instead.

Cluster shape: a CPU head (num-cpus 0: no training or serving work lands on it) and a GPU worker group
autoscaled 0..8 by the KubeRay autoscaler v2 (autoscalerOptions.version v2, worker restartPolicy Never as
the KubeRay docs require for v2), Ray token authentication (authOptions.mode token: the operator makes the
secret and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN), and a ReadWriteMany PVC for checkpoints at /mnt/checkpoints.
The image `raychat` (placeholder name, set with kustomize `images:`) is rayproject/ray:<ray version>-py311-gpu
with raychat installed at /home/ray/raychat (see docs/deployment.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

from raychat.ops.submit import repo_root

RAY_VERSION = "2.60.0"
IMAGE = "raychat:0.1.0"
APP_DIR = "/home/ray/raychat"
CHECKPOINTS_PVC = "raychat-checkpoints"
CHECKPOINTS_MOUNT = "/mnt/checkpoints"
RAYJOB_STAGES = ("pretrain", "sft", "rl", "eval", "speedrun")
BASE_STAGES = ("pretrain", "sft", "rl")  # RayJobs kept in k8s/base
LABELS = {"app.kubernetes.io/name": "raychat", "app.kubernetes.io/part-of": "raychat"}
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _volume_bits() -> tuple[list, list]:
    volumes = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": CHECKPOINTS_PVC}}]
    mounts = [{"name": "checkpoints", "mountPath": CHECKPOINTS_MOUNT}]
    return volumes, mounts


def cluster_spec(image: str = IMAGE, max_gpu_workers: int = 8) -> dict:
    """The RayClusterSpec shared by the RayCluster, every RayJob and the RayService."""
    volumes, mounts = _volume_bits()
    env = [{"name": "RAYCHAT_STORAGE", "value": f"{CHECKPOINTS_MOUNT}/runs"}]
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "metrics-export-port": "8080"},
        "template": {
            "metadata": {"labels": dict(LABELS)},
            "spec": {
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "env": env,
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
                        "env": env,
                        "ports": [{"containerPort": 8080, "name": "metrics"}],
                        "resources": {
                            "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
                            "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
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


def rayjob(
    stage: str,
    stage_args: list[str] | None = None,
    name: str | None = None,
    image: str = IMAGE,
    ttl_s: int = 3600,
    backoff_limit: int = 1,
) -> dict:
    """A RayJob running `python jobs/<stage>.py ARGS` in /home/ray/raychat on its own cluster, deleted
    ttl_s seconds after the job finishes, retried backoff_limit times. Raises ValueError for an unknown
    stage or an invalid name."""
    if stage not in RAYJOB_STAGES:
        raise ValueError(f"stage must be one of {', '.join(RAYJOB_STAGES)}; got {stage!r}")
    runtime_env = {"working_dir": APP_DIR, "env_vars": {"RAYCHAT_STORAGE": f"{CHECKPOINTS_MOUNT}/runs"}}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _meta(name or f"raychat-{stage}", **{"raychat.io/stage": stage}),
        "spec": {
            "entrypoint": shlex.join(["python", f"jobs/{stage}.py", *(stage_args or [])]),
            "runtimeEnvYAML": yaml.safe_dump(runtime_env, sort_keys=False),
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": ttl_s,
            "backoffLimit": backoff_limit,
            "rayClusterSpec": cluster_spec(image),
        },
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
    """{file name in k8s/base: text}. Reads repo/serve/chat.yaml."""
    serve_text = (repo / "serve" / "chat.yaml").read_text()
    files = {
        "pvc-checkpoints.yaml": checkpoints_pvc(),
        "raycluster.yaml": raycluster(),
        **{f"rayjob-{s}.yaml": rayjob(s) for s in BASE_STAGES},
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


def write_base(repo: Path) -> list[str]:
    """Write k8s/base atomically (tmp + os.replace); returns the names that changed."""
    base = repo / "k8s" / "base"
    base.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in render_base(repo).items():
        path = base / name
        if path.is_file() and path.read_text() == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=base, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        changed.append(name)
    return changed


def create_rayjob(
    body: dict, namespace: str, kubeconfig: str | None = None, context: str | None = None
) -> dict:
    """POST the RayJob through kubernetes.client.CustomObjectsApi (kubeconfig, else in-cluster config)."""
    from kubernetes import client, config

    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
    except config.ConfigException:
        config.load_incluster_config()
    api = client.CustomObjectsApi()
    return api.create_namespaced_custom_object(
        group="ray.io", version="v1", namespace=namespace, plural="rayjobs", body=body
    )


def cmd_generate(args) -> int:
    repo = Path(args.repo).resolve() if args.repo else repo_root()
    if args.check:
        base = repo / "k8s" / "base"
        stale = [
            n for n, t in render_base(repo).items() if not (base / n).is_file() or (base / n).read_text() != t
        ]
        if stale:
            print(
                f"k8s/base is out of date ({', '.join(stale)}): run `raychat k8s generate`", file=sys.stderr
            )
            return 1
        return 0
    changed = write_base(repo)
    print(f"k8s/base: {len(changed)} file(s) written" + (f": {', '.join(changed)}" if changed else ""))
    return 0


def cmd_submit(args) -> int:
    stage_args = list(args.stage_args)
    if stage_args[:1] == ["--"]:
        stage_args = stage_args[1:]
    name = args.name or f"raychat-{args.stage}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        body = rayjob(
            args.stage, stage_args, name=name, image=args.image, ttl_s=args.ttl, backoff_limit=args.retries
        )
    except ValueError as e:
        print(f"raychat k8s submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        body["metadata"]["namespace"] = args.namespace
        sys.stdout.write(to_yaml(body))
        return 0
    from kubernetes.client.exceptions import ApiException

    try:
        created = create_rayjob(body, args.namespace, args.kubeconfig, args.context)
    except ApiException as e:
        print(
            f"raychat k8s submit: the API server refused the RayJob ({e.status} {e.reason}): {e.body}",
            file=sys.stderr,
        )
        return 4
    print(f"rayjob.ray.io/{created['metadata']['name']} created in namespace {args.namespace}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("k8s", help="KubeRay: generate k8s/base, submit a stage as a RayJob")
    sub = p.add_subparsers(dest="k8s_command", metavar="<generate|submit>", required=True)
    g = sub.add_parser("generate", help="(re)write k8s/base from the code and serve/chat.yaml")
    g.add_argument("--repo", help="checkout to write into (default: this raychat checkout)")
    g.add_argument("--check", action="store_true", help="exit 1 if k8s/base differs from the generated files")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser(
        "submit",
        help="create a RayJob for a stage",
        usage=f"raychat k8s submit [options] {{{','.join(RAYJOB_STAGES)}}} [stage args...]",
        description="Create a RayJob running `python jobs/<stage>.py ARGS` on its own autoscaling cluster. "
        "Options come before the stage; everything after the stage goes to the stage unchanged.",
    )
    s.add_argument("stage", choices=RAYJOB_STAGES)
    s.add_argument("stage_args", nargs=argparse.REMAINDER)
    s.add_argument("--namespace", default="default")
    s.add_argument("--name", help="RayJob name (default raychat-<stage>-<YYYYmmdd-HHMMSS>)")
    s.add_argument("--image", default=IMAGE, help=f"container image with raychat installed (default {IMAGE})")
    s.add_argument("--ttl", type=int, default=3600, help="seconds to keep the finished RayJob's cluster")
    s.add_argument("--retries", type=int, default=1, help="backoffLimit: retries of a failed job")
    s.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    s.add_argument("--context", help="kubeconfig context")
    s.add_argument("--dry-run", action="store_true", help="print the RayJob YAML instead of creating it")
    s.set_defaults(func=cmd_submit)
