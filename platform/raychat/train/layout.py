"""The CPU layout of a training run: the Ray cluster it runs on and the CPUs its workers and Ray Data reserve.

A run that streams its rows through Ray Data needs, besides the workers' reservations, room for Ray Data's
tasks. Ray 2.60's `read_parquet` first lists the files in a ListFiles task that reserves 1 CPU whatever
`num_cpus` the read is given, then reads and tokenizes in tasks of the stage's `data_cpus`. With less than
1 CPU left after the workers the dataset waits forever at 0% CPU ("Cluster resources are not enough to run
any task from TaskPoolMapOperator[ReadFilesParquetV2]", e.g. 1 worker x 1.75 CPUs on 2 CPUs). So
check_cpu_layout asks for max(data_cpus, RAY_DATA_MIN_CPUS) CPUs beside the workers, and refuses anything
else before training starts.

A run that finds no Ray cluster (no ray.init yet, no RAY_ADDRESS) starts a local one with the machine's
cores plus one logical CPU for Ray Data (LOCAL_DATA_CPUS): the data tasks are light (the loop's data wait
is in bench/results/train_throughput.md), so one worker can reserve every
core and still be fed. On a connected cluster (RAY_ADDRESS, e.g. a `ray job submit` job, or RAY_ADDRESS=auto
for a `ray start` cluster on this machine) the check reads what the cluster can become after connecting
(raychat.capacity: the autoscaler's node types where published, else the alive nodes when nothing autoscales),
before the Ray Train run starts.
"""

from __future__ import annotations

import os

import ray

from raychat.capacity import (
    Capacity,
    check_bundles,
    fmt_bundle,
    local_capacity,
    read_capacity,
    start_local_cluster,
)
from raychat.config.schema import flag_name
from raychat.log import plural
from raychat.sigterm import init_keeping_handler

RAY_DATA_MIN_CPUS = (
    1.0  # Ray 2.60 read_parquet's ListFiles task (ray/data/_internal/planner/plan_list_files_op.py)
)
LOCAL_DATA_CPUS = 1  # logical CPUs the local cluster adds beside the cores, for Ray Data's tasks


def data_reservation(data_cpus: float) -> float:
    """CPUs a stage's Ray Data pipeline needs free beside the workers: 0 when the stage has none
    (data_cpus == 0), else max(data_cpus, RAY_DATA_MIN_CPUS)."""
    return max(data_cpus, RAY_DATA_MIN_CPUS) if data_cpus > 0 else 0.0


def local_cores() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    return len(os.sched_getaffinity(0))


def local_cluster_cpus() -> int:
    """Logical CPUs of the local Ray cluster a run starts: the cores + LOCAL_DATA_CPUS."""
    return local_cores() + LOCAL_DATA_CPUS


def layout_flags(num_workers: int, cpus_per_worker: float, use_gpu: bool = False, option=flag_name) -> str:
    """The worker group as its user set it, '--num-workers 2 x --cpus-per-worker 1' (+ ' --use-gpu'), each
    option named by `option` (raychat.train.launch.Flags.option: the speedrun's are its preset's keys,
    'train.num_workers')."""
    gpu = f" {option('use_gpu')}" if use_gpu else ""
    return f"{option('num_workers')} {num_workers} x {option('cpus_per_worker')} {cpus_per_worker:g}{gpu}"


def check_cpu_layout(
    num_workers: int,
    cpus_per_worker: float,
    data_cpus: float,
    cluster_cpus: float,
    node_cpus: float,
    option=flag_name,
) -> str:
    """Refuse a layout that could never be scheduled; returns its description for the printed plan.

    Args:
        num_workers, cpus_per_worker: the Ray Train worker group (--num-workers, --cpus-per-worker).
        data_cpus: what each of the stage's Ray Data tasks reserves (0 = the stage has no Ray Data).
        cluster_cpus: the cluster's logical CPUs; node_cpus: the largest node's.
        option: how the refusals name an option (layout_flags).
    Raises:
        ValueError: the workers plus data_reservation(data_cpus) need more CPUs than the cluster has, or one
            worker needs more than any node has (the message names the options and the CPUs it would need).
    """
    data = data_reservation(data_cpus)
    needed = num_workers * cpus_per_worker + data
    layout = layout_flags(num_workers, cpus_per_worker, option=option)
    if cpus_per_worker > node_cpus + 1e-9:
        raise ValueError(
            f"{layout}: one worker needs {plural(cpus_per_worker, 'CPU')}, the largest node has {node_cpus:g}"
        )
    if needed > cluster_cpus + 1e-9:
        why = (
            f" plus {plural(data, 'CPU')} for Ray Data (its read_parquet lists files in 1-CPU tasks)"
            if data
            else ""
        )
        most = (cluster_cpus - data) / num_workers
        fix = (
            f"lower {option('cpus_per_worker')} to at most {most:g} or {option('num_workers')}"
            if most > 0
            else f"it needs more than the {plural(data, 'CPU')} Ray Data reserves (a larger node, or more nodes)"
        )
        raise ValueError(
            f"{layout}{why} needs {plural(needed, 'CPU')}; the cluster has {cluster_cpus:g}: {fix}, or the data "
            "tasks would never be scheduled and the run would wait forever"
        )
    threads = max(1, round(cpus_per_worker))
    return (
        f"layout: {plural(num_workers, 'worker')} x {plural(cpus_per_worker, 'CPU')} "
        f"({plural(threads, 'torch thread')} each)"
        + (f" + {plural(data, 'CPU')} for Ray Data" if data else "")
        + f" of {plural(cluster_cpus, 'CPU')}"
    )


def local_cluster_capacity() -> Capacity:
    """The local cluster a run starts (local_cluster_cpus), as raychat.capacity describes a cluster, known before
    it starts."""
    return local_capacity(local_cluster_cpus())


def starts_local_cluster() -> bool:
    """Whether a run of this process would start the local cluster (start_or_connect): it is connected to no Ray
    cluster and RAY_ADDRESS names none."""
    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


def check_local_layout(
    num_workers: int, cpus_per_worker: float, data_cpus: float, use_gpu: bool = False, option=flag_name
) -> str:
    """check_cpu_layout on the local cluster a run starts (one node of local_cluster_cpus CPUs), which is known
    before Ray starts; returns its description.

    Raises:
        ValueError: as check_cpu_layout; `use_gpu` (the local cluster has no GPU nodes). One line naming the
            options as `option` does (layout_flags).
    """
    cpus = local_cluster_cpus()
    if use_gpu:
        raise ValueError(
            f"{layout_flags(num_workers, cpus_per_worker, use_gpu, option)}: {option('use_gpu')} needs a Ray "
            "cluster with GPU nodes (RAY_ADDRESS); this machine's local cluster has none"
        )
    return check_cpu_layout(num_workers, cpus_per_worker, data_cpus, cpus, cpus, option)


def worker_bundle(cpus_per_worker: float, use_gpu: bool) -> dict:
    """What one Ray Train worker reserves: {"CPU": cpus_per_worker} plus {"GPU": 1} with --use-gpu."""
    return {"CPU": cpus_per_worker, **({"GPU": 1.0} if use_gpu else {})}


def start_or_connect(
    num_workers: int, cpus_per_worker: float, data_cpus: float, use_gpu: bool = False, option=flag_name
) -> tuple[str, Capacity]:
    """Use the Ray cluster this process is connected to, connect to RAY_ADDRESS, or start the local cluster
    (local_cluster_cpus); check the layout against what the cluster can become (raychat.capacity: the
    autoscaler's node types, not only the alive nodes) and return (its description, that Capacity).

    On a cluster whose node types are known, the layout is checked against them (check_bundles, then
    check_cpu_layout with the largest type that holds a worker and the most CPUs the types hold together);
    on an autoscaling cluster whose node types are not published, every layout is accepted here and the wait
    is bounded by --schedule-timeout-s (raychat.train.launch). option: how the refusals name an option
    (layout_flags).

    Raises:
        ValueError: the layout does not fit; for a local cluster before Ray starts; one line naming the options,
            the need and the largest node type.
        raychat.capacity.ClusterStartError: the local cluster did not start (one line, with a hint).
        raychat.sigterm.Terminated: SIGTERM while Ray started, under raychat.sigterm.raise_terminated (Ray starts
            through init_keeping_handler: Ray's native handler aborted the process), raised once ray.init returned.
    """
    flags = layout_flags(num_workers, cpus_per_worker, use_gpu, option)
    if starts_local_cluster():
        line = check_local_layout(num_workers, cpus_per_worker, data_cpus, use_gpu, option)
        init_keeping_handler(start_local_cluster, num_cpus=local_cluster_cpus())
        line = (
            f"{line} (a local Ray cluster: {plural(local_cores(), 'core')} + {LOCAL_DATA_CPUS} for Ray Data)"
        )
        return line, read_capacity()
    if not ray.is_initialized():
        init_keeping_handler(ray.init)
    capacity = read_capacity()
    bundle = worker_bundle(cpus_per_worker, use_gpu)
    check_bundles([bundle] * num_workers, capacity, flags)
    if not capacity.known:
        line = f"layout: {plural(num_workers, 'worker')} x {fmt_bundle(bundle)} on {capacity.describe()}"
        return line, capacity
    largest = capacity.largest(bundle)
    node_cpus = largest.resources.get("CPU", 0.0) if largest else 0.0
    line = check_cpu_layout(num_workers, cpus_per_worker, data_cpus, capacity.total("CPU"), node_cpus, option)
    return f"{line} ({capacity.describe()})", capacity
