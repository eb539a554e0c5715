"""`raychat k8s generate` (k8s/ from raychat.ops.k8s's manifests) and `raychat k8s submit <stage>`, which creates
a RayJob through the official `kubernetes` client (CustomObjectsApi, the optional extra `raychat[k8s]`);
`--dry-run` prints it instead."""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

from raychat.log import plural
from raychat.ops.jobs import K8S_EXTRA_INSTALL
from raychat.ops.k8s import check_label, check_rayjob_name, rayjob, render_all, to_yaml, write_generated
from raychat.ops.submit import repo_root

REQUEST_TIMEOUT_S = (
    10.0,
    60.0,
)  # (connect, read): without one, a server that accepts and never answers hangs


class KubeConfigError(RuntimeError):
    """The kubeconfig that --kubeconfig, --context or $KUBECONFIG names does not load, or, given none of them,
    neither ~/.kube/config nor the in-cluster configuration does."""


def create_rayjob(
    body: dict, namespace: str, kubeconfig: str | None = None, context: str | None = None
) -> dict:
    """POST the RayJob through kubernetes.client.CustomObjectsApi (the kubeconfig; given none of `kubeconfig`,
    `context` and $KUBECONFIG, ~/.kube/config, else the in-cluster configuration of a pod).

    Raises KubeConfigError when the configuration does not load (naming --kubeconfig, --context or $KUBECONFIG
    when one was given: a pod's in-cluster configuration would send the RayJob to another cluster),
    kubernetes.client.exceptions.ApiException when the API server refuses the object,
    urllib3.exceptions.MaxRetryError when it cannot be reached and urllib3.exceptions.TimeoutError when it does
    not answer within REQUEST_TIMEOUT_S (connect, read seconds)."""
    from kubernetes import client, config

    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
    except config.ConfigException as kube_error:
        if kubeconfig:
            where = f"--kubeconfig {kubeconfig}"
        elif os.environ.get("KUBECONFIG"):
            where = f"$KUBECONFIG ({os.environ['KUBECONFIG']})"
        else:
            where = "~/.kube/config"
        if context:
            where += f", --context {context}"
        why = "no such file" if kubeconfig and not Path(kubeconfig).exists() else str(kube_error).rstrip(".")
        if kubeconfig or context or os.environ.get("KUBECONFIG"):
            raise KubeConfigError(
                f"no Kubernetes configuration: {where}: {why} (the in-cluster configuration of a pod is used "
                "only without --kubeconfig, --context and $KUBECONFIG)"
            ) from None
        try:
            config.load_incluster_config()
        except config.ConfigException as in_cluster_error:
            raise KubeConfigError(
                f"no Kubernetes configuration: {where}: {why}; in-cluster configuration: "
                f"{str(in_cluster_error).rstrip('.')} (not in a pod); pass --kubeconfig FILE (and --context NAME)"
            ) from None
    api = client.CustomObjectsApi()
    return api.create_namespaced_custom_object(
        group="ray.io", version="v1", namespace=namespace, plural="rayjobs", body=body,
        _request_timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip


def unreachable(e, name: str, namespace: str) -> str:
    """One line for an API server that cannot be reached (urllib3 MaxRetryError: refused, connect timeout,
    DNS) or does not answer in time (ReadTimeoutError: the POST was sent, so the RayJob may exist)."""
    from urllib3.exceptions import ReadTimeoutError

    where = f"{e.pool.host}:{e.pool.port}"
    if isinstance(e, ReadTimeoutError):
        return (
            f"the API server {where} did not answer within {REQUEST_TIMEOUT_S[1]:g} s; the RayJob may have "
            f"been created: kubectl get rayjob {name} -n {namespace}"
        )
    args = getattr(e.reason, "args", ())  # (connection, message) for urllib3's connection errors
    why = args[-1] if args and isinstance(args[-1], str) else str(e.reason)
    return f"cannot reach the API server {where}: {why}"


def cmd_generate(args) -> int:
    repo = Path(args.repo).resolve() if args.repo else repo_root("--repo")
    if not (repo / "serve" / "chat.yaml").is_file():
        raise ValueError(
            f"--repo {args.repo or repo}: not a raychat checkout (no serve/chat.yaml to render from)"
        )
    if args.check:
        k8s = repo / "k8s"
        stale = [
            n for n, t in render_all(repo).items() if not (k8s / n).is_file() or (k8s / n).read_text() != t
        ]
        if stale:
            print(f"k8s/ is out of date ({', '.join(stale)}): run `raychat k8s generate`", file=sys.stderr)
            return 1
        return 0
    changed = write_generated(repo)
    print(f"k8s/: {plural(len(changed), 'file')} written" + (f": {', '.join(changed)}" if changed else ""))
    return 0


def cmd_submit(args) -> int:
    stage_args = list(args.stage_args)
    # the random part: two submits of one stage in the same second name two RayJobs
    name = args.name or f"raychat-{args.stage}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    try:
        check_label(args.namespace, "--namespace")
        if args.name:
            check_rayjob_name(args.name, "--name")
        body = rayjob(
            args.stage, stage_args, name=name, image=args.image, ttl_s=args.ttl, backoff_limit=args.retries,
            num_gpus=args.num_gpus, num_cpus=args.num_cpus or 0,
        )  # fmt: skip
    except ValueError as e:
        print(f"raychat k8s submit: error: {e}", file=sys.stderr)
        return 2
    for note in args.stage_notes:  # raychat.commands.StageArgs, as `raychat submit` prints them
        print(f"raychat k8s submit: note: {note}", file=sys.stderr)
    if args.dry_run:
        body["metadata"]["namespace"] = args.namespace
        sys.stdout.write(to_yaml(body))
        return 0
    try:
        from kubernetes.client.exceptions import ApiException
    except ModuleNotFoundError as e:
        raise ValueError(
            f"creating the RayJob needs the k8s extra, and this Python ({sys.executable}) lacks "
            f"{e.name.partition('.')[0]!r}: {K8S_EXTRA_INSTALL}; --dry-run prints the RayJob without it"
        ) from None
    from urllib3.exceptions import MaxRetryError, ReadTimeoutError

    try:
        created = create_rayjob(body, args.namespace, args.kubeconfig, args.context)
    except KubeConfigError as e:
        print(f"raychat k8s submit: error: {e}", file=sys.stderr)
        return 2
    except (MaxRetryError, ReadTimeoutError) as e:
        print(f"raychat k8s submit: error: {unreachable(e, name, args.namespace)}", file=sys.stderr)
        return 4
    except ApiException as e:
        print(
            f"raychat k8s submit: error: the API server refused the RayJob ({e.status} {e.reason}): {e.body}",
            file=sys.stderr,
        )
        return 4
    print(f"rayjob.ray.io/{created['metadata']['name']} created in namespace {args.namespace}")
    return 0
