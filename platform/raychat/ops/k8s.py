"""KubeRay (ray.io/v1) manifests for raychat, built in one place (`raychat k8s generate|submit`: ops/k8s_cli.py).

The files in k8s/base/ and the overlays' kustomization.yaml are the output of `raychat k8s generate`
(tests/unit/test_k8s.py fails when they drift), so the RayCluster, the RayJobs and the RayService share one
cluster spec, and the RayService's serveConfigV2 is the text of serve/chat.yaml byte for byte (the gpu
overlay's: that config with each ChatServer replica on a GPU, gpu_serve_config).

The RayJobs are the chain of stages (CHAIN), each one command on the PVC's storage root
(/mnt/checkpoints/runs): data prepare -> tokenizer train -> pretrain -> sft --init-from latest -> rl --init-from
latest -> eval -> export, each stage's run named after it; the RayService serves <root>/rl/latest. One command a
RayJob: KubeRay pastes the entrypoint unquoted into its submitter's `bash -c "... ray job submit -- <entrypoint>
; ..."`, where a `&&` would end the submitted command and run the rest in the submitter pod. The
base runs the `cluster` preset as it is (its 32 ranks on 4 GPU pods); the cpu-dev overlay the same commands
with the `tiny` preset (tests/cluster/test_stage_jobs.py runs exactly those on a real cluster). Each RayJob
ends at its stage's deadline (activeDeadlineSeconds, DEADLINES_S).

Cluster shape: a CPU head (num-cpus 0: no training or serving work lands on it) and a GPU worker group of
whole-node pods (GPUS_PER_POD GPUs each, so the ranks of one node share it and talk over NVLink) autoscaled
0..GPU_PODS by the KubeRay autoscaler v2 (autoscalerOptions.version v2, worker restartPolicy Never as the
KubeRay docs require for v2), Ray token authentication (authOptions.mode token: the operator makes the secret
and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN), a ReadWriteMany PVC for checkpoints at /mnt/checkpoints, and /dev/shm
a memory emptyDir in every Ray pod (a container's own is 64 MB: too small for Ray's object store and NCCL).
The image `raychat:0.1.0` is the repository's Dockerfile (rayproject/ray:<ray version>-py311-gpu with raychat
installed at /home/ray/raychat); an overlay's kustomize `images:` points it at a registry.

The gpu overlay alone adds the vLLM path's RayService (raychat-vllm, rayservice_vllm): serve/vllm.yaml verbatim
(Ray Serve LLM on the export RayJob's <root>/hf) on the image `raychat-vllm:0.1.0` (the same Dockerfile built
with the vLLM environment: EXTRAS=vllm, CONSTRAINTS=constraints-vllm.txt). k8s/overlays/monitoring holds a
PodMonitor (Prometheus Operator) for port `metrics` of every raychat Ray pod (pod_monitor).

The run checkpoints in a bucket come from kustomize components (k8s/components, kind Component) that four
overlays stack (OBJECT_STORAGE_OVERLAYS: on the base or the gpu overlay, with either credentials component):
components/object-storage (render_object_storage_component: the chain's --storage-path from pretraining on and
the chat RayService's checkpoint at s3://<bucket>/raychat, data and tokenizer on the PVC, which every node reads
as files; the bucket set once, in its hand-kept settings.yaml), components/s3-secret (AWS_* in every Ray container
from the Secret raychat-s3, envFrom) and components/service-account (every Ray pod's serviceAccountName from
settings.yaml: an IAM role's, no Secret). The gpu ones also set the chat serve config on the bucket and on GPUs,
and the export's --out on the PVC that the vLLM RayService reads (render_object_storage_overlay).

Hardening (Pod Security "restricted"): every pod and container, the RayJobs' submitter pods and the autoscaler
sidecar included, runs as the image's `ray` user (uid 1000, gid 100; fsGroup 100 so the PVC is writable), non-root,
without privilege escalation, with every capability dropped and the RuntimeDefault seccomp profile. The RayService's
containers read RAYCHAT_API_KEY from the Secret raychat-api-key (key api-key), which the manifests do not create
(the pods do not start without it). One NetworkPolicy admits, to every raychat pod: any port from the raychat pods
of the namespace (Ray's GCS, raylet, object-transfer and worker ports, partly random), the Serve port from
anywhere, the dashboard and metrics ports from the namespace, the dashboard from the KubeRay operator's pods and
the metrics port from the Prometheus Operator's Prometheus pods.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from raychat.atomic import atomic_write_text
from raychat.ops.jobs import STAGE_STOP_WAIT_S, STAGES, STOP_WAIT_ENV

RAY_VERSION = "2.60.0"
IMAGE = "raychat:0.1.0"
# the vLLM path's image: the same Dockerfile with the vLLM environment (EXTRAS=vllm, CONSTRAINTS=constraints-vllm.txt)
IMAGE_VLLM = "raychat-vllm:0.1.0"
VLLM_SERVE_CONFIG = "serve/vllm.yaml"  # the vLLM RayService's serveConfigV2, verbatim
APP_DIR = "/home/ray/raychat"
CHECKPOINTS_PVC = "raychat-checkpoints"
CHECKPOINTS_MOUNT = "/mnt/checkpoints"
STORAGE_ROOT = f"{CHECKPOINTS_MOUNT}/runs"  # --storage-path of every RayJob; the RayService's checkpoints
# --task-data-dir of sft, rl and eval: the hub tasks' files and the CORE bundle on the PVC (the image has no
# runs/task_data and the pods set no $RAYCHAT_TASK_DATA); README "nanochat's full report card" fills it
TASK_DATA = f"{CHECKPOINTS_MOUNT}/task_data"
# The base's GPU group: whole 8-GPU nodes, one pod each, as many as the `cluster` preset's 32 ranks take. A pod
# asks for what an 8-GPU node (H100/A100 class: 96-208 CPUs, >= 1 TiB) can give a pod and Ray's CPUs match
# ray_cluster.yaml's GPU node (48): 8 ranks x 5 CPUs + 8 for Ray Data.
GPU_PODS, GPUS_PER_POD, GPU_POD_CPUS, GPU_POD_MEMORY = 4, 8, 48, "512Gi"
SHM_SIZE = {"head": "4Gi", "gpu": "64Gi"}  # /dev/shm (a memory emptyDir; counts against the pod's memory)
# A RayJob's deadline (activeDeadlineSeconds), about twice its stage's expected time on the `cluster` preset
# (raychat/presets/cluster.yaml: pretraining ~3 h at an assumed 40% MFU) plus an hour for nodes to start:
# past it KubeRay stops the job and deletes its cluster, so a hung job does not hold 32 GPUs.
HOUR = 3600
DEADLINES_S = {
    "data": 6 * HOUR,  # 490 shards (~46 GB) downloaded
    "tokenizer": 3 * HOUR,  # 2B characters of tokenizer training
    "pretrain": 8 * HOUR,
    "sft": 2 * HOUR,
    "rl": 3 * HOUR,
    "eval": 2 * HOUR,
    "export": 1 * HOUR,
    "speedrun": 24 * HOUR,
}
CHAIN = (
    "data",
    "tokenizer",
    "pretrain",
    "sft",
    "rl",
    "eval",
    "export",
)  # the RayJobs of k8s/base, in the order they chain
LABELS = {"app.kubernetes.io/name": "raychat", "app.kubernetes.io/part-of": "raychat"}
RAY_UID, RAY_GID = 1000, 100  # the `ray` user and its group (users) in the rayproject/ray images
API_KEY_SECRET, API_KEY_SECRET_KEY = "raychat-api-key", "api-key"  # the RayService's RAYCHAT_API_KEY
SERVE_PORT, DASHBOARD_PORT, METRICS_PORT = 8000, 8265, 8080
KUBERAY_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # the operator's pods (Helm chart)
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # the Prometheus Operator's Prometheus pods
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# a RayJob's name: KubeRay's ValidateRayJobMetadata wants a DNS-1035 label (a letter first) of at most 47 characters
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RAYJOB_NAME_MAX = 47
# The GPUs a stage's RayJob driver reserves (entrypointNumGpus), the base's and `raychat k8s submit`'s default:
# the eval driver evaluates on cuda (the cluster and gpu8 presets).
ENTRYPOINT_NUM_GPUS = {"eval": 1}
# What a RayJob's second shell would still interpret in a stage argument: KubeRay's submitter runs `ray job submit
# -- ARGS`, whose CLI joins ARGS with subprocess.list2cmdline (double quotes around an argument with a blank, no
# quotes otherwise) for the job's `sh -c`
_SHELL_IN_QUOTES = '$`\\"'
# (not ~: what it expands to, the home of the job's user, is what raychat makes of an input path's ~ there)
_SHELL_UNQUOTED = _SHELL_IN_QUOTES + "'\n;&|<>()*?[#"


def _volume_bits(shm_size: str) -> tuple[list, list]:
    """(volumes, volumeMounts) of a Ray pod: the checkpoint PVC and /dev/shm, a memory emptyDir of shm_size."""
    volumes = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": CHECKPOINTS_PVC}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
    ]
    mounts = [
        {"name": "checkpoints", "mountPath": CHECKPOINTS_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def pod_security() -> dict:
    """The pod-level securityContext of every raychat pod: the image's `ray` user (never root), fsGroup so the
    checkpoint PVC is writable, the RuntimeDefault seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RAY_UID,
        "runAsGroup": RAY_GID,
        "fsGroup": RAY_GID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict:
    """The securityContext of every container: non-root, no privilege escalation, every capability dropped,
    RuntimeDefault seccomp (what Pod Security "restricted" asks of a container)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RAY_UID,
        "runAsGroup": RAY_GID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def api_key_env() -> list[dict]:
    """RAYCHAT_API_KEY from the Secret API_KEY_SECRET (key API_KEY_SECRET_KEY); a pod without the Secret does
    not start, so the service never runs without a key."""
    ref = {"name": API_KEY_SECRET, "key": API_KEY_SECRET_KEY}
    return [{"name": "RAYCHAT_API_KEY", "valueFrom": {"secretKeyRef": ref}}]


def cluster_spec(image: str = IMAGE, max_gpu_pods: int = GPU_PODS, env: list[dict] | None = None) -> dict:
    """The RayClusterSpec shared by the RayCluster, every RayJob and the RayService; `env` is added to every
    Ray container (the RayService's API key)."""
    volumes, mounts = _volume_bits(SHM_SIZE["head"])
    gpu_volumes, gpu_mounts = _volume_bits(SHM_SIZE["gpu"])
    gpu_resources = {"cpu": str(GPU_POD_CPUS), "memory": GPU_POD_MEMORY, "nvidia.com/gpu": str(GPUS_PER_POD)}
    extra = {"env": env} if env else {}
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
                            {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": SERVE_PORT, "name": "serve"},
                            {"containerPort": METRICS_PORT, "name": "metrics"},
                        ],
                        **extra,
                        "resources": {
                            "requests": {"cpu": "4", "memory": "16Gi"},
                            "limits": {"cpu": "4", "memory": "16Gi"},
                        },
                        "volumeMounts": mounts,
                        "securityContext": container_security(),
                    }
                ],
                "volumes": volumes,
                "securityContext": pod_security(),
            },
        },
    }
    worker = {
        "groupName": "gpu",
        "replicas": 0,
        "minReplicas": 0,
        "maxReplicas": max_gpu_pods,
        "rayStartParams": {"metrics-export-port": "8080"},
        "template": {
            "metadata": {"labels": dict(LABELS)},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": image,
                        "ports": [{"containerPort": METRICS_PORT, "name": "metrics"}],
                        **extra,
                        "resources": {"requests": dict(gpu_resources), "limits": dict(gpu_resources)},
                        "volumeMounts": gpu_mounts,
                        "securityContext": container_security(),
                    }
                ],
                "volumes": gpu_volumes,
                "securityContext": pod_security(),
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
    }
    return {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": "v2",
            "idleTimeoutSeconds": 60,
            "upscalingMode": "Default",
            "securityContext": container_security(),  # the autoscaler sidecar KubeRay adds to the head pod
        },
        "authOptions": {"mode": "token"},
        "headGroupSpec": head,
        "workerGroupSpecs": [worker],
    }


def submitter_template(image: str = IMAGE) -> dict:
    """The pod of a RayJob's submitter (K8sJobMode: a Kubernetes Job that runs `ray job submit`): KubeRay's
    default (the head's image, 500m CPU / 200Mi requested, 1 CPU / 1Gi at most, never restarted; KubeRay fills
    in the command) with the securityContext of every raychat pod."""
    container = {
        "name": "ray-job-submitter",
        "image": image,
        "resources": {
            "requests": {"cpu": "500m", "memory": "200Mi"},
            "limits": {"cpu": "1", "memory": "1Gi"},
        },
        "securityContext": container_security(),
    }
    return {
        "metadata": {"labels": dict(LABELS)},
        "spec": {"restartPolicy": "Never", "containers": [container], "securityContext": pod_security()},
    }


def check_label(value: str, what: str = "name") -> str:
    """`value` when it is a DNS-1123 label (what Kubernetes names and namespaces are), else ValueError."""
    if not _DNS1123.match(value) or len(value) > 63:
        raise ValueError(
            f"{what} must be a DNS-1123 label (lowercase, digits, '-', <= 63 chars); got {value!r}"
        )
    return value


def check_rayjob_name(value: str, what: str = "name") -> str:
    """`value` when KubeRay takes it as a RayJob's name (a DNS-1035 label of at most RAYJOB_NAME_MAX characters:
    the operator refuses any other after the API server accepted it), else ValueError naming `what`."""
    if not _DNS1035.match(value) or len(value) > RAYJOB_NAME_MAX:
        raise ValueError(
            f"{what} must be a DNS-1035 label of at most {RAYJOB_NAME_MAX} characters (KubeRay's RayJob name: "
            f"a lowercase letter first, then lowercase letters, digits and '-', not ending in '-'); got {value!r}"
        )
    return value


def _meta(name: str, **labels) -> dict:
    check_label(name)
    return {"name": name, "labels": {**LABELS, **labels}}


def raycluster(image: str = IMAGE) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta("raychat"),
        "spec": cluster_spec(image),
    }


def chain_commands(
    preset: str, shape: tuple[str, ...] = (), root: str = STORAGE_ROOT, inputs: str | None = None
) -> dict[str, list[str]]:
    """{RayJob stage: its stage arguments}: the chain of CHAIN on one storage root. `shape`
    (e.g. --num-workers 8) goes to the Ray Train stages, so they fit the RayJob's cluster. `inputs`: the root of
    the data and tokenizer runs when it is not `root` (checkpoints on object storage, whose data and tokenizer
    every node reads as files: a local or NFS root), given to the stages that read them as --data-dir and
    --tokenizer-path. sft, rl and eval read the hub tasks' files from TASK_DATA (--task-data-dir)."""
    common = ["--preset", preset, "--storage-path", root]
    task_data = ["--task-data-dir", TASK_DATA]
    data_dir = ["--data-dir", f"{inputs}/data"] if inputs else []
    tokenizer = ["--tokenizer-path", f"{inputs}/tokenizer"] if inputs else []
    data_stages = ["--preset", preset, "--storage-path", inputs or root]
    return {
        "data": ["prepare", *data_stages],
        "tokenizer": ["train", *data_stages],
        "pretrain": [*common, *shape, "--run-name", "pretrain", *data_dir, *tokenizer],
        "sft": [*common, *shape, "--run-name", "sft", "--init-from", "latest", *tokenizer, *task_data],
        "rl": [*common, "--run-name", "rl", "--init-from", "latest", *task_data],
        "eval": [*common, "--run-name", "eval", "--checkpoint", "latest", *data_dir, *task_data],
        "export": ["--storage-path", root, "--run-name", "hf", "--checkpoint", "latest"],
    }


def base_commands() -> dict[str, list[str]]:
    """The commands of k8s/base: the `cluster` preset as it is (its 32 ranks fill GPU_PODS pods)."""
    return chain_commands("cluster")


def cpu_dev_commands() -> dict[str, list[str]]:
    """The commands of the cpu-dev overlay: the `tiny` preset (minutes on 2 CPUs)."""
    return chain_commands("tiny")


def entrypoint(stage: str, stage_args: list[str]) -> str:
    """`python jobs/<stage>.py ARGS` (what `raychat submit <stage> ARGS` runs), one command: a RayJob's
    entrypoint reaches a shell twice (KubeRay's submitter, then the job's), see check_stage_args.

    Raises:
        ValueError: an argument that the job's shell would interpret (check_stage_args).
    """
    check_stage_args(stage_args)
    return shlex.join(["python", f"jobs/{stage}.py", *stage_args])


def check_stage_args(stage_args: list[str]) -> None:
    """Refuse what a RayJob's second shell would change: KubeRay's submitter (`bash -c`) turns the entrypoint back
    into words for `ray job submit -- WORDS`, whose CLI joins them with subprocess.list2cmdline for the job's
    `sh -c`: double quotes around a word with a space or tab (or an empty one), none around any other. So
    $ ` \\ " are refused in every argument (expanded inside double quotes), and in an argument without a space
    or tab also ' ; & | < > ( ) * ? [ # and a line break.

    Raises:
        ValueError: naming the first such argument and its characters.
    """
    for arg in stage_args:
        quoted = not arg or " " in arg or "\t" in arg  # list2cmdline's rule
        special = _SHELL_IN_QUOTES if quoted else _SHELL_UNQUOTED
        found = [c for c in special if c in arg]
        if found:
            chars = " ".join("a line break" if c == "\n" else c for c in found)
            raise ValueError(
                f"stage argument {arg!r}: {chars} would be interpreted by the RayJob's second shell (the job's "
                "`sh -c`, after KubeRay's `ray job submit`); a RayJob's stage arguments hold no $ ` \\ \", nor, "
                "in one without a space, ' ; & | < > ( ) * ? [ # or a line break"
            )


def rayjob(
    stage: str,
    stage_args: list[str] | None = None,
    name: str | None = None,
    image: str = IMAGE,
    ttl_s: int = 3600,
    backoff_limit: int = 1,
    num_gpus: float | None = None,
    num_cpus: float = 0,
    deadline_s: int | None = None,
) -> dict:
    """A RayJob running `python jobs/<stage>.py ARGS` (see entrypoint) in /home/ray/raychat on its own cluster,
    its driver reserving `num_gpus` GPUs (default ENTRYPOINT_NUM_GPUS: 1 for eval, else 0) and `num_cpus` CPUs
    (entrypointNumGpus / entrypointNumCpus, left out when 0) and given STAGE_STOP_WAIT_S seconds from a stop's
    SIGTERM to its SIGKILL (RAY_JOB_STOP_WAIT_TIME_S in its runtime env, as `raychat submit` gives a stage: time
    to print where it resumes), stopped (its cluster deleted) deadline_s seconds after it starts (default
    DEADLINES_S[stage]), deleted ttl_s seconds after the job finishes, retried backoff_limit times. Raises
    ValueError for an unknown stage, a name KubeRay refuses (check_rayjob_name), a stage argument the job's
    shell would interpret (check_stage_args) or a negative ttl_s or backoff_limit."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}; got {stage!r}")
    name = check_rayjob_name(name or f"raychat-{stage}")
    if ttl_s < 0 or backoff_limit < 0:  # Kubernetes refuses negative ttlSecondsAfterFinished / backoffLimit
        raise ValueError(
            f"--ttl and --retries must be >= 0 (seconds, retries); got {ttl_s} and {backoff_limit}"
        )
    spec = {
        "entrypoint": entrypoint(stage, stage_args or []),
        "runtimeEnvYAML": yaml.safe_dump(
            {"working_dir": APP_DIR, "env_vars": {STOP_WAIT_ENV: str(STAGE_STOP_WAIT_S)}}, sort_keys=False
        ),
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": ttl_s,
        "activeDeadlineSeconds": deadline_s or DEADLINES_S[stage],
        "backoffLimit": backoff_limit,
    }
    num_gpus = ENTRYPOINT_NUM_GPUS.get(stage, 0) if num_gpus is None else num_gpus
    if num_gpus:
        spec["entrypointNumGpus"] = num_gpus
    if num_cpus:
        spec["entrypointNumCpus"] = num_cpus
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _meta(name, **{"raychat.io/stage": stage}),
        "spec": {
            **spec,
            "rayClusterSpec": cluster_spec(image),
            "submitterPodTemplate": submitter_template(image),
        },
    }


def rayservice(serve_config_text: str, image: str = IMAGE) -> dict:
    """The chat RayService; serveConfigV2 is `serve_config_text` unchanged (serve/chat.yaml); every container
    reads RAYCHAT_API_KEY from the Secret (api_key_env), which build_app takes as the ingress' key."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": _meta("raychat-chat"),
        "spec": {
            "serveConfigV2": serve_config_text,
            "rayClusterConfig": cluster_spec(image, env=api_key_env()),
        },
    }


def rayservice_vllm(serve_config_text: str, image: str = IMAGE_VLLM) -> dict:
    """The vLLM path's RayService (raychat-vllm): serveConfigV2 is `serve_config_text` unchanged (serve/vllm.yaml,
    written by `python -m raychat.serve.vllm --no-check-files`: Ray Serve LLM's build_openai_app on the export
    at STORAGE_ROOT/hf), on the shared cluster spec with the vLLM image. Ray Serve LLM's OpenAI app has no API
    key of its own, so no RAYCHAT_API_KEY here: put the Serve port behind an authenticating gateway."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": _meta("raychat-vllm"),
        "spec": {"serveConfigV2": serve_config_text, "rayClusterConfig": cluster_spec(image)},
    }


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def network_policy() -> dict:
    """Ingress to every raychat pod (selected by LABELS; egress is left open): any port from the raychat pods
    of the namespace (Ray's own ports, partly random), SERVE_PORT from anywhere, DASHBOARD_PORT and METRICS_PORT
    from any pod of the namespace, DASHBOARD_PORT from the KubeRay operator (it submits jobs and deploys
    Serve apps through the dashboard; any namespace, found by its pods' label) and METRICS_PORT from the
    Prometheus Operator's Prometheus pods (any namespace: the PodMonitor's scrapes, pod_monitor)."""
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(KUBERAY_OPERATOR_LABELS)}}
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(PROMETHEUS_LABELS)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta("raychat"),
        "spec": {
            "podSelector": {"matchLabels": dict(LABELS)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(LABELS)}}]},
                {"ports": _tcp(SERVE_PORT)},
                {"from": [{"podSelector": {}}], "ports": _tcp(DASHBOARD_PORT, METRICS_PORT)},
                {"from": [operator], "ports": _tcp(DASHBOARD_PORT)},
                {"from": [prometheus], "ports": _tcp(METRICS_PORT)},
            ],
        },
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
    """{file name in k8s/base: text}. Reads repo/serve/chat.yaml. Each RayJob's driver reserves
    ENTRYPOINT_NUM_GPUS (the eval's a GPU: the cluster preset evaluates on cuda)."""
    serve_text = (repo / "serve" / "chat.yaml").read_text()
    commands = base_commands()
    files = {
        "networkpolicy.yaml": network_policy(),
        "pvc-checkpoints.yaml": checkpoints_pvc(),
        "raycluster.yaml": raycluster(),
        **{f"rayjob-{s}.yaml": rayjob(s, commands[s]) for s in CHAIN},
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
    for stage, stage_args in cpu_dev_commands().items():
        ops = [{"op": "replace", "path": "/spec/entrypoint", "value": entrypoint(stage, stage_args)}]
        if stage in ENTRYPOINT_NUM_GPUS:
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


GPU_REGISTRY_IMAGE = "registry.example.com/raychat"  # the gpu overlay's image: IMAGE pushed to your registry
GPU_REGISTRY_IMAGE_VLLM = "registry.example.com/raychat-vllm"  # and IMAGE_VLLM's (the vLLM RayService)
GPU_SERVE_GPUS = 1  # GPUs of each ChatServer replica in the gpu overlay's RayService
SERVE_APP_IMPORT = "raychat.serve.app:build_app"
SERVE_SERVER_DEPLOYMENT = "ChatServer"  # raychat.serve.app.SERVER_DEPLOYMENT (ops does not import serve)
GPU_NOTE = f"""# GPU cluster: the raychat image from your registry, GPU workers autoscaled 0..{GPU_PODS} (base), 1 TiB of
# shared checkpoint storage, and each ChatServer replica of the RayService on {GPU_SERVE_GPUS} GPU (serve/chat.yaml
# sets none: on the base its replicas run on the GPU pods' CPUs). One replica a node (max_replicas_per_node).
# Also the vLLM path's RayService (raychat-vllm: serve/vllm.yaml on the raychat-vllm image; GPUs only).
# Build: kubectl kustomize k8s/overlays/gpu | kubectl apply -f -
"""


def _chat_apps(config: dict) -> list[dict]:
    """The applications of a Serve config (a dict) that import SERVE_APP_IMPORT; ValueError when none does."""
    apps = [a for a in config.get("applications") or [] if a.get("import_path") == SERVE_APP_IMPORT]
    if not apps:
        raise ValueError(f"serve config: no application with import_path {SERVE_APP_IMPORT}")
    return apps


def _put_server_on_gpus(config: dict, num_gpus: float) -> None:
    """Each ChatServer replica of the raychat application of `config` (a Serve config dict) reserves `num_gpus`
    GPUs: the ray_actor_options of its `deployments:` entry for ChatServer where it sets them, else build_app's
    args.num_gpus (adding ray_actor_options would drop num_cpus). ValueError when no application is raychat's."""
    for app in _chat_apps(config):
        entries = [d for d in app.get("deployments") or [] if d.get("name") == SERVE_SERVER_DEPLOYMENT]
        if entries and "ray_actor_options" in entries[0]:
            entries[0]["ray_actor_options"]["num_gpus"] = num_gpus
        else:
            app.setdefault("args", {})["num_gpus"] = num_gpus


def gpu_serve_config(serve_text: str, num_gpus: float = GPU_SERVE_GPUS) -> str:
    """serve/chat.yaml's config (`serve_text`, Serve's config file format) with each ChatServer replica of the
    raychat application reserving `num_gpus` GPUs (_put_server_on_gpus: Serve's own option where the file sets
    ray_actor_options; a replica puts its model on cuda when Ray assigned it a GPU, raychat.serve.app.device_for).
    Comments are not kept (a YAML round trip), nor the final line break (kubectl kustomize drops it from a
    patch's value).

    Raises:
        ValueError: no application imports raychat.serve.app:build_app.
    """
    config = yaml.safe_load(serve_text)
    _put_server_on_gpus(config, num_gpus)
    head = f"# serve/chat.yaml with each {SERVE_SERVER_DEPLOYMENT} replica on {num_gpus} GPU (raychat k8s generate)\n"
    return head + to_yaml(config).rstrip("\n")  # no final line break: kustomize drops it from a patch value


def render_gpu(repo: Path) -> str:
    """k8s/overlays/gpu/kustomization.yaml: the image from your registry, a 1Ti PVC, and the RayService's
    serveConfigV2 replaced by gpu_serve_config of repo/serve/chat.yaml."""
    serve_text = (repo / "serve" / "chat.yaml").read_text()
    pvc = [{"op": "replace", "path": "/spec/resources/requests/storage", "value": "1Ti"}]
    service = [{"op": "replace", "path": "/spec/serveConfigV2", "value": gpu_serve_config(serve_text)}]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "raychat",
        "resources": ["../../base", "namespace.yaml", "rayservice-vllm.yaml"],
        "images": [
            {"name": "raychat", "newName": GPU_REGISTRY_IMAGE, "newTag": IMAGE.split(":")[1]},
            {"name": "raychat-vllm", "newName": GPU_REGISTRY_IMAGE_VLLM, "newTag": IMAGE_VLLM.split(":")[1]},
        ],
        "patches": [
            {
                "target": {"version": "v1", "kind": "PersistentVolumeClaim", "name": CHECKPOINTS_PVC},
                "patch": to_yaml(pvc).rstrip("\n"),
            },
            {
                "target": {"group": "ray.io", "version": "v1", "kind": "RayService", "name": "raychat-chat"},
                "patch": to_yaml(service).rstrip("\n"),
            },
        ],
    }
    return HEADER + GPU_NOTE + to_yaml(kustomization)


VLLM_HEADER = (
    f"# Generated by `raychat k8s generate` from platform/raychat/ops/k8s.py and {VLLM_SERVE_CONFIG}: do not edit.\n"
    "# The vLLM path (GPUs only, hence the gpu overlay alone): Ray Serve LLM on the export at "
    f"{STORAGE_ROOT}/hf\n# (the export RayJob's output), image {IMAGE_VLLM}. No API key: see docs/deployment.md.\n"
)


def render_gpu_vllm(repo: Path) -> str:
    """k8s/overlays/gpu/rayservice-vllm.yaml: rayservice_vllm of repo/serve/vllm.yaml."""
    return VLLM_HEADER + to_yaml(rayservice_vllm((repo / VLLM_SERVE_CONFIG).read_text()))


# Checkpoints in a bucket, built from kustomize components (k8s/components, kind Component) that the overlays
# stack: object-storage (the chain's checkpoint stages and the chat RayService on the bucket; settings.yaml),
# and one way for the Ray pods to get credentials, s3-secret (envFrom the Secret S3_SECRET) or service-account
# (the pods' serviceAccountName: an IAM role bound to it, no Secret). OBJECT_STORAGE_OVERLAYS names the overlays.
S3_SECRET = "raychat-s3"  # AWS_* of every Ray container (envFrom); the manifests do not create it
# components/object-storage/settings.yaml (kept by hand, so `raychat k8s generate` keeps your values): a ConfigMap
# that kustomize reads and never applies, whose `bucket` replaces the placeholder S3_BUCKET and whose
# `serviceAccountName` the service-account component gives every Ray pod
S3_SETTINGS = "raychat-object-storage"
S3_BUCKET = "my-bucket"
S3_ROOT = f"s3://{S3_BUCKET}/raychat"  # --storage-path of the checkpoint stages; the RayService's checkpoints
CLUSTER_SPEC_AT = {
    "RayCluster": "/spec",
    "RayJob": "/spec/rayClusterSpec",
    "RayService": "/spec/rayClusterConfig",
}
COMPONENT_API = "kustomize.config.k8s.io/v1alpha1"  # kind: Component
# {overlay: (on the gpu overlay, credentials component)}
OBJECT_STORAGE_OVERLAYS = {
    "object-storage": (False, "s3-secret"),
    "object-storage-service-account": (False, "service-account"),
    "gpu-object-storage": (True, "s3-secret"),
    "gpu-object-storage-service-account": (True, "service-account"),
}
VLLM_EXPORT = f"{STORAGE_ROOT}/hf"  # where the vLLM RayService reads the export (serve/vllm.yaml): the PVC
OBJECT_STORAGE_COMPONENT_NOTE = f"""# Run checkpoints in a bucket (a kustomize Component: the overlays object-storage* and gpu-object-storage* list
# it): the --storage-path of the pretrain, sft, rl, eval and export RayJobs and the chat RayService's checkpoint
# are {S3_ROOT}; data and tokenizer stay on the PVC ({STORAGE_ROOT}: every node reads
# them as files). Your bucket, and the service account of the service-account component, go in settings.yaml
# alone (not generated: kept as you edit it). Credentials: the s3-secret or the service-account component,
# listed after this one.
"""
S3_SECRET_NOTE = f"""# Credentials from the Secret {S3_SECRET} (a kustomize Component): every Ray container (head and worker of the
# RayCluster, the RayJobs and the RayServices) reads its AWS_* variables from it (envFrom). Not created here:
# docs/deployment.md. The RayJobs' submitters run `ray job submit` alone and open no storage.
"""
SERVICE_ACCOUNT_NOTE = """# Credentials from the pods' identity, no Secret (a kustomize Component): every Ray pod (head and worker of the
# RayCluster, the RayJobs and the RayServices) runs as the service account serviceAccountName of
# ../object-storage/settings.yaml, bound to an IAM role (EKS IAM roles for service accounts, EKS Pod Identity).
# Not created here: docs/deployment.md. The RayJobs' submitters run `ray job submit` alone and keep the default.
"""


def object_storage_serve_config(serve_text: str, root: str = S3_ROOT, num_gpus: float = 0) -> str:
    """serve/chat.yaml's config (`serve_text`) serving `root`/rl/latest: build_app's checkpoint arg of the raychat
    application, each ChatServer replica on `num_gpus` GPUs when > 0 (see gpu_serve_config). Comments and the
    final line break are not kept (see gpu_serve_config).

    Raises:
        ValueError: no application imports raychat.serve.app:build_app.
    """
    config = yaml.safe_load(serve_text)
    for app in _chat_apps(config):
        app.setdefault("args", {})["checkpoint"] = f"{root}/rl/latest"
    on = ""
    if num_gpus:
        _put_server_on_gpus(config, num_gpus)
        on = f", each {SERVE_SERVER_DEPLOYMENT} replica on {num_gpus} GPU"
    head = f"# serve/chat.yaml serving the RL run's newest checkpoint on object storage{on} (raychat k8s generate)\n"
    return head + to_yaml(config).rstrip("\n")


def bucket_replacement(kind: str, name: str, field: str, text: str) -> dict:
    """A kustomize replacement target: the S3_BUCKET of `text` (object `name`'s `field`, dotted), found as the
    '/'-separated part it is (s3://<bucket>/...), replaced by the settings' bucket.

    Raises ValueError unless `text` holds S3_BUCKET as such a part exactly once (a replacement sets one part)."""
    parts = text.split("/")
    if parts.count(S3_BUCKET) != 1:
        raise ValueError(
            f"{kind} {name} {field}: {S3_BUCKET} must be one '/'-separated part, once; got {text!r}"
        )
    return {
        "select": {"kind": kind, "name": name},
        "fieldPaths": [field],
        "options": {"delimiter": "/", "index": parts.index(S3_BUCKET)},
    }


def _ray_target(kind: str, name: str | None = None) -> dict:
    return {"group": "ray.io", "version": "v1", "kind": kind, **({"name": name} if name else {})}


def _patch(target: dict, ops: list[dict]) -> dict:
    return {"target": target, "patch": to_yaml(ops).rstrip("\n")}


def _ray_pod_specs(kind: str) -> list[str]:
    """The JSON pointers of the head's and the worker group's pod spec in a KubeRay object of `kind`."""
    at = CLUSTER_SPEC_AT[kind]
    return [f"{at}/headGroupSpec/template/spec", f"{at}/workerGroupSpecs/0/template/spec"]


def _settings(field: str, targets: list[dict]) -> dict:
    """A replacement of settings.yaml's `field` (data.<field> of the ConfigMap S3_SETTINGS) into `targets`."""
    return {
        "source": {"kind": "ConfigMap", "name": S3_SETTINGS, "fieldPath": f"data.{field}"},
        "targets": targets,
    }


def _chain_on_bucket(export_out: str | None = None) -> dict[str, str]:
    """{stage: RayJob entrypoint} of the checkpoint stages on S3_ROOT (chain_commands with the PVC's STORAGE_ROOT
    as data and tokenizer root; the data and tokenizer stages stay the base's), the export to `export_out` when
    given."""
    commands = chain_commands("cluster", root=S3_ROOT, inputs=STORAGE_ROOT)
    if export_out:
        commands["export"] += ["--out", export_out]
    return {s: entrypoint(s, args) for s, args in commands.items() if s not in ("data", "tokenizer")}


def _entrypoint_patches(entrypoints: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """(patches, bucket replacement targets) that set each RayJob raychat-<stage>'s entrypoint."""
    patches, bucket = [], []
    for stage, text in entrypoints.items():
        name = f"raychat-{stage}"
        patches.append(_patch(_ray_target("RayJob", name), [{"op": "replace", "path": "/spec/entrypoint", "value": text}]))  # fmt: skip
        bucket.append(bucket_replacement("RayJob", name, "spec.entrypoint", text))
    return patches, bucket


def _serve_patch(serve_config: str) -> tuple[dict, dict]:
    """(patch, bucket replacement target) that set the chat RayService's serveConfigV2."""
    ops = [{"op": "replace", "path": "/spec/serveConfigV2", "value": serve_config}]
    target = bucket_replacement("RayService", "raychat-chat", "spec.serveConfigV2", serve_config)
    return _patch(_ray_target("RayService", "raychat-chat"), ops), target


def render_object_storage_component(repo: Path) -> str:
    """k8s/components/object-storage/kustomization.yaml (a Component): settings.yaml, the chain's checkpoint
    stages and the chat RayService on S3_ROOT (_chain_on_bucket, object_storage_serve_config of
    repo/serve/chat.yaml: replicas on CPUs, as the base's), and replacements that put settings.yaml's bucket in
    every URI. The base's NetworkPolicy restricts ingress only, so the pods reach the S3 endpoint as they are."""
    patches, bucket = _entrypoint_patches(_chain_on_bucket())
    serve, target = _serve_patch(object_storage_serve_config((repo / "serve" / "chat.yaml").read_text()))
    component = {
        "apiVersion": COMPONENT_API,
        "kind": "Component",
        "resources": ["settings.yaml"],
        "patches": [*patches, serve],
        "replacements": [_settings("bucket", [*bucket, target])],
    }
    return HEADER + OBJECT_STORAGE_COMPONENT_NOTE + to_yaml(component)


def render_s3_secret_component() -> str:
    """k8s/components/s3-secret/kustomization.yaml (a Component): envFrom the Secret S3_SECRET in the head's and
    the worker group's container of every KubeRay object."""
    patches = []
    for kind in CLUSTER_SPEC_AT:
        ops = [
            {
                "op": "add",
                "path": f"{pod}/containers/0/envFrom",
                "value": [{"secretRef": {"name": S3_SECRET}}],
            }
            for pod in _ray_pod_specs(kind)
        ]
        patches.append(_patch(_ray_target(kind), ops))
    component = {"apiVersion": COMPONENT_API, "kind": "Component", "patches": patches}
    return HEADER + S3_SECRET_NOTE + to_yaml(component)


def render_service_account_component() -> str:
    """k8s/components/service-account/kustomization.yaml (a Component): settings.yaml's serviceAccountName as
    the serviceAccountName of the head's and the worker group's pod of every KubeRay object (a replacement:
    the object-storage component, listed before it, brings the settings)."""
    targets = [
        {
            "select": {"kind": kind},
            "fieldPaths": [
                f"{pod.lstrip('/').replace('/', '.')}.serviceAccountName" for pod in _ray_pod_specs(kind)
            ],
            "options": {"create": True},
        }
        for kind in CLUSTER_SPEC_AT
    ]
    component = {"apiVersion": COMPONENT_API, "kind": "Component", "replacements": [_settings("serviceAccountName", targets)]}  # fmt: skip
    return HEADER + SERVICE_ACCOUNT_NOTE + to_yaml(component)


CREDENTIALS_NOTE = {
    "s3-secret": f"the Ray pods' credentials from the Secret {S3_SECRET} (components/s3-secret: AWS_* by envFrom).\n",
    "service-account": "the Ray pods' credentials from their service account (components/service-account:\n"
    "# the serviceAccountName of settings.yaml, bound to an IAM role; no Secret).\n",
}
GPU_OBJECT_STORAGE_NOTE = f"""# Also here, after the components: the chat RayService's serve config on the bucket and on GPUs at once (each
# is a patch of the whole serveConfigV2 text), and the export RayJob's --out on the PVC, where the vLLM
# RayService reads it ({VLLM_EXPORT}).
"""


def _object_storage_note(overlay: str, gpu: bool, credentials: str) -> str:
    under, namespace = ("The gpu overlay", "") if gpu else ("The base", " -n raychat")
    return (
        f"# {under} with the run checkpoints in a bucket (components/object-storage; your bucket in its\n"
        f"# settings.yaml), {CREDENTIALS_NOTE[credentials]}{GPU_OBJECT_STORAGE_NOTE if gpu else ''}"
        f"# Build: kubectl kustomize k8s/overlays/{overlay} | kubectl apply{namespace} -f -\n"
    )


def render_object_storage_overlay(repo: Path, overlay: str) -> str:
    """k8s/overlays/<overlay>/kustomization.yaml of OBJECT_STORAGE_OVERLAYS: the base (or the gpu overlay) with
    the components object-storage and its credentials component. On the gpu overlay it also sets, after the
    components, the chat RayService's serve config on the bucket with each ChatServer replica on GPU_SERVE_GPUS
    GPUs, and the export RayJob's --out VLLM_EXPORT (the vLLM RayService reads the PVC), each with its bucket
    replacement (the component's ran before these patches)."""
    gpu, credentials = OBJECT_STORAGE_OVERLAYS[overlay]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["../gpu" if gpu else "../../base"],
        "components": ["../../components/object-storage", f"../../components/{credentials}"],
    }
    if gpu:
        patches, bucket = _entrypoint_patches({"export": _chain_on_bucket(VLLM_EXPORT)["export"]})
        serve_text = (repo / "serve" / "chat.yaml").read_text()
        serve, target = _serve_patch(object_storage_serve_config(serve_text, num_gpus=GPU_SERVE_GPUS))
        kustomization["patches"] = [*patches, serve]
        kustomization["replacements"] = [_settings("bucket", [*bucket, target])]
    return HEADER + _object_storage_note(overlay, gpu, credentials) + to_yaml(kustomization)


def pod_monitor() -> dict:
    """A PodMonitor (Prometheus Operator, monitoring.coreos.com/v1) scraping port `metrics` (METRICS_PORT, Ray's
    metrics-export-port) of every Ray pod of a raychat cluster: the pods with LABELS and KubeRay's ray.io/cluster
    label (the RayCluster's, each RayJob's and the RayServices'; not the RayJobs' submitter pods), in the
    PodMonitor's namespace. Relabelled: ray.io/cluster -> ray_io_cluster (the label that the Cluster filter of
    Ray's dashboards, which `raychat grafana provision` uploads, selects on), ray.io/node-type (head | worker) ->
    ray_node_type, ray.io/group -> ray_group."""
    relabel = [
        {"action": "replace", "sourceLabels": [f"__meta_kubernetes_pod_label_ray_io_{k}"], "targetLabel": t}
        for k, t in (("cluster", "ray_io_cluster"), ("node_type", "ray_node_type"), ("group", "ray_group"))
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta("raychat"),
        "spec": {
            "selector": {
                "matchLabels": dict(LABELS),
                "matchExpressions": [{"key": "ray.io/cluster", "operator": "Exists"}],
            },
            "podMetricsEndpoints": [
                {"port": "metrics", "path": "/metrics", "interval": "15s", "relabelings": relabel}
            ],
        },
    }


MONITORING_NOTE = """# Prometheus Operator scraping of every raychat Ray pod (needs the operator's CRDs; apply in the namespace of
# the raychat pods): kubectl kustomize k8s/overlays/monitoring | kubectl apply -n raychat -f -
"""


def render_monitoring() -> dict[str, str]:
    """{file name in k8s/overlays/monitoring: text}: the PodMonitor and its kustomization."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["podmonitor.yaml"],
    }
    return {
        "podmonitor.yaml": HEADER + to_yaml(pod_monitor()),
        "kustomization.yaml": HEADER + MONITORING_NOTE + to_yaml(kustomization),
    }


def render_all(repo: Path) -> dict[str, str]:
    """{path relative to k8s/: text} of every generated file."""
    return {
        **{f"base/{name}": text for name, text in render_base(repo).items()},
        "overlays/cpu-dev/kustomization.yaml": render_cpu_dev(),
        "overlays/gpu/kustomization.yaml": render_gpu(repo),
        "overlays/gpu/rayservice-vllm.yaml": render_gpu_vllm(repo),
        **{f"overlays/monitoring/{name}": text for name, text in render_monitoring().items()},
        "components/object-storage/kustomization.yaml": render_object_storage_component(repo),
        "components/s3-secret/kustomization.yaml": render_s3_secret_component(),
        "components/service-account/kustomization.yaml": render_service_account_component(),
        **{
            f"overlays/{o}/kustomization.yaml": render_object_storage_overlay(repo, o)
            for o in OBJECT_STORAGE_OVERLAYS
        },
    }


def write_generated(repo: Path) -> list[str]:
    """Write every generated file under repo/k8s atomically (raychat.atomic); returns the paths that
    changed (relative to k8s/)."""
    changed = []
    for name, text in render_all(repo).items():
        path = repo / "k8s" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.read_text() == text:
            continue
        atomic_write_text(path, text)
        changed.append(name)
    return changed
