"""The Ray Serve application: a FastAPI ingress (ChatIngress) in front of autoscaled engine replicas
(ChatServer), both built by `build_app(args)` for `serve run` / `serve deploy` (serve/chat.yaml) and
`raychat serve`.

  serve run raychat.serve.app:build_app checkpoint=/path/to/ckpt api_key=KEY
  serve deploy serve/chat.yaml      (RAYCHAT_API_KEY in the app's runtime env or every node's environment)

Without a key (args api_key, else RAYCHAT_API_KEY) build_app refuses unless args allow_unauthenticated is
true (`raychat serve` sets it where its own --host check let no key through): serve/chat.yaml binds 0.0.0.0,
and a cluster whose nodes lacked the variable served every route to anyone.

ChatIngress parses, validates and streams (raychat.serve.ingress); ChatServer replicas each hold the model
and one continuous-batching Scheduler (raychat.serve.server). Streams go through a DeploymentHandle with
stream=True; when the HTTP client disconnects, Serve cancels the ingress request, the ingress closes the
handle stream (DeploymentResponseGenerator.cancel) and the replica's generator frees its row.

`args`: the options of raychat.config.ServeConfig by flat name (`checkpoint` is required; `raychat serve
--help` lists every option with its default); strings from `serve run key=value` are converted. The options
Serve owns (replica resources, autoscaling, max_ongoing_requests, queue bounds: raychat.serve.deployments)
belong in a Serve config's `deployments:` section instead (serve/chat.yaml puts them there), which Serve
applies in place: args are hashed into the app's code version, so a changed arg restarts every replica. The
ingress' max_ongoing_requests (at least 1000) follows args' max_replicas only.

`checkpoint` is any reference raychat.checkpoint_manager resolves (a checkpoint dir, a run dir, <run dir>/latest,
on a shared directory, s3:// or gs://); as given, it is the model id unless args model_id names one (a run dir
served again at a newer checkpoint keeps its id). build_app resolves it once, so every replica serves the same
checkpoint, and a replica on another node fetches a remote one itself (raychat.checkpoint.load_model). A run's local
checkpoint (checkpoint_<step>) is served from a snapshot beside it that the run's pruning leaves (pinned), so
replicas started later load it too; the ingress and the replicas mark it in use while the app runs
(raychat.serve.in_use), and the run's next snapshot deletes only snapshots unmarked for a day. Each replica
marks its node's cached copy of a remote one in use the same way (raychat.serve.server.ChatServer), so a new
commit of it resolved later keeps that copy. A remote one, or one deleted otherwise, fails every replica
started after that with pruned_message. While ChatServer is failing so, /health and chat requests answer 503 with the
Serve controller's reason within about `health_timeout_s` (HandleClient), where a request to replicas that
are busy or starting waits.
`max_replicas_per_node` spreads ChatServer replicas over nodes (Serve's deployment option of that name).

Overload is refused, never queued without bound: each Serve proxy queues at most `ingress_max_queued_requests`
for the ingress and each ingress replica at most `max_queued_requests` for the ChatServer replicas (Serve's
`max_queued_requests`, answered 429 with Retry-After: `retry_after_s`), and each replica's engine holds at
most `max_pending` requests waiting for a KV slot (raychat.serve.server: 429). A request ends after
`request_timeout_s` (504-status error, slot freed). Liveness is progress: ChatServer's check_health fails when
the engine has stopped or has not stepped for `stall_timeout_s` with requests live, and Serve replaces the
replica (its health-check machinery: every health_check_period_s, default 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time

import psutil
import ray
import torch
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from raychat.checkpoint_manager import (
    IN_USE_MARK_S,
    CheckpointError,
    checkpoint_gone,
    find_checkpoint,
    is_run_checkpoint,
    is_snapshot,
    snapshot_checkpoint,
)
from raychat.config import ConfigError, ServeConfig, from_dict
from raychat.gc_heap import freeze_gc_heap
from raychat.serve.api import MAX_BODY_BYTES
from raychat.serve.deployments import INGRESS_DEPLOYMENT, SERVER_DEPLOYMENT, deployment_options
from raychat.serve.errors import EngineOverloadedError, EngineUnavailableError
from raychat.serve.in_use import MarkInUse
from raychat.serve.ingress import create_app
from raychat.serve.server import ChatServer, default_model_id, merge_deltas
from raychat.storage import copy_command

# what a handle raises when no ChatServer replica can take (or finish) a request: 503, retry later
UNAVAILABLE = (RayActorError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)
# Serve's deployment statuses in which ChatServer takes no request until it recovers or is deployed again
FAILED = ("UNHEALTHY", "DEPLOY_FAILED")
# seconds one controller answer (server_state) serves every request of this ingress that asks
STATE_REUSE_S = 1.0
# build_app without a key: `serve deploy serve/chat.yaml` (host 0.0.0.0) served every route to anyone
NO_KEY = (
    "build_app: no API key, so every route would be open to anyone who reaches Serve's HTTP proxies: set "
    "RAYCHAT_API_KEY (in the app's runtime_env env_vars, or in the environment of every node: Serve builds the "
    "app on one of them) or args.api_key, or set args.allow_unauthenticated: true to serve without a key"
)
log = logging.getLogger(__name__)


def serve_config(args: dict | ServeConfig | None) -> ServeConfig:
    """The typed config of build_app's `args` (keys of raychat.config.ServeConfig by flat name; strings from
    `serve run key=value` are converted; max_rows is the old name of max_slots); api_key falls back to the
    environment's RAYCHAT_API_KEY. A config without a key passes here (build_application refuses it).

    Raises:
        ValueError: missing checkpoint, an unknown key (naming the allowed keys) or a value of the wrong type.
    """
    config = (
        args if isinstance(args, ServeConfig) else from_dict(ServeConfig, args or {}, where="build_app args")
    )
    if not config.checkpoint:
        raise ConfigError("build_app needs args['checkpoint'] (a raychat checkpoint directory)")
    if not config.api_key and os.environ.get("RAYCHAT_API_KEY"):
        config = from_dict(ServeConfig, {"api_key": os.environ["RAYCHAT_API_KEY"]}, base=config)
    return config


@serve.deployment(name=SERVER_DEPLOYMENT)
class ChatServerDeployment:
    """One engine replica (a ChatServer); its methods are called through a DeploymentHandle. `snapshot`: the
    run's snapshot it serves (None: not one), marked in use every `mark_every_s` seconds while it lives."""

    def __init__(
        self,
        checkpoint: str,
        max_slots: int,
        max_len: int | None,
        stream_interval: int,
        engine_process: bool,
        torch_threads: int | None,
        model_id: str | None,
        dtype: str,
        prefill_chunk_tokens: int,
        limits: dict | None = None,
        snapshot: str | None = None,
        mark_every_s: float = IN_USE_MARK_S,
    ):
        self.in_use = MarkInUse(snapshot, mark_every_s) if snapshot else None
        # what this replica reserved (ray_actor_options: build_app's, or a Serve config's deployments: entry)
        reserved = ray.get_runtime_context().get_assigned_resources()
        device = device_for(reserved.get("GPU", 0))
        if torch_threads is None:  # the CPUs it reserved
            torch_threads = max(1, int(reserved.get("CPU", 1)))
        kwargs = {"max_slots": max_slots, "max_len": max_len, "stream_interval": stream_interval}
        kwargs["deployment"] = SERVER_DEPLOYMENT
        kwargs |= {"dtype": dtype, "prefill_chunk_tokens": prefill_chunk_tokens, **(limits or {})}
        if model_id:
            kwargs["model_id"] = model_id
        if engine_process:
            kwargs["torch_threads"] = torch_threads
        else:
            torch.set_num_threads(torch_threads)
        try:
            self.engine = ChatServer.from_checkpoint(checkpoint, device, engine_process, **kwargs)
        except Exception:
            if checkpoint_gone(checkpoint):
                raise CheckpointError(pruned_message(checkpoint)) from None
            raise
        freeze_gc_heap()  # this replica's model and imports: never scanned by the cyclic GC again

    async def generate(self, request: dict):
        """Yields lists of event dicts: every event ready when the consumer asks is sent in one message (its
        deltas merged into one), so under load one Ray streaming message carries several tokens (no added
        latency when idle)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump():
            try:
                async for event in self.engine.generate(request):
                    queue.put_nowait(event)
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(pump())
        try:
            done = False
            while not done:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                if batch[-1] is None:
                    batch.pop()
                    done = True
                if batch:
                    yield merge_deltas(batch)
            await task  # re-raises an engine failure
        finally:
            if not task.done():
                task.cancel()  # the caller left: cancelling pump closes engine.generate, which frees the row
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def info(self) -> dict:
        return self.engine.info()

    def check(self, requests: list[dict]) -> dict | None:
        """ChatServer.check: the error event of the first of `requests` the engine would refuse, else None."""
        return self.engine.check(requests)

    def stats(self) -> dict:
        """ChatServer.stats plus rss_bytes: resident memory of this replica process and its children (the
        engine process, which holds the model and KV cache), child_pids: their process ids (an engine
        process that restarted has a new one) and pid: this replica's process id."""
        me = psutil.Process()
        children = me.children(recursive=True)
        rss = me.memory_info().rss + sum(c.memory_info().rss for c in children)
        pids = {"pid": me.pid, "child_pids": sorted(c.pid for c in children)}
        return {**self.engine.stats(), "rss_bytes": rss, **pids}

    def check_health(self) -> None:
        """Serve's health check (ChatServer.check_health): raises when the engine stopped or stalled; Serve
        then replaces this replica."""
        self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def pruned_message(checkpoint: str) -> str:
    """Why a replica cannot start on `checkpoint` (a local path, s3:// or gs:// URI), which build_app resolved
    and which is gone since (one line, what Serve's status message ends with), with the copy command of its
    scheme (raychat.storage.copy_command)."""
    return (
        f"checkpoint {checkpoint} no longer exists: it was deleted after this app resolved its checkpoint "
        "reference to it, most likely pruned by the training run that wrote it (pretrain, sft and rl keep only "
        "their newest --keep-checkpoints checkpoints, default 2), so no new replica can load it. Serve a "
        "checkpoint that nothing prunes (a finished run's, or a copy out of the run directory into a directory "
        f"DEST, as `{copy_command(checkpoint, 'DEST')}` would have copied this one), or train with a larger "
        "--keep-checkpoints; then deploy the app again"
    )


def server_state(app_name: str) -> tuple[str, bool]:
    """ChatServer's state in application `app_name` as the Serve controller reports it, in one line:
    "ChatServer is UNHEALTHY (replicas: 1 STARTING): <the last line of its status message>" (where Serve puts
    the error of a replica that failed to start); and whether it is failing: no replica RUNNING while Serve
    reports it UNHEALTHY or DEPLOY_FAILED, or a replica that failed to start (a deployment that is only
    starting or scaling up is not). Blocks on a call to the controller."""
    d = serve.status().applications[app_name].deployments[SERVER_DEPLOYMENT]
    states = sorted((getattr(k, "value", k), n) for k, n in d.replica_states.items())
    replicas = ", ".join(f"{n} {state}" for state, n in states) or "none"
    lines = d.message.strip().splitlines()
    line = f"{SERVER_DEPLOYMENT} is {d.status.value} (replicas: {replicas})" + (
        f": {lines[-1].strip()}" if lines else ""
    )
    running = dict(states).get("RUNNING", 0) > 0
    return line, not running and (d.status.value in FAILED or "failed to start" in d.message)


async def _awaited(awaitable):
    """`awaitable` as a coroutine (what asyncio.wait_for takes: a DeploymentResponse is only awaitable)."""
    return await awaitable


def unavailable(e: Exception) -> EngineUnavailableError:
    """A handle's exception (UNAVAILABLE) as raychat's 503, in one line a client may see: its type and its
    message's first line. Ray's ActorDiedError goes on with the dead replica's actor id, pid, node IP and
    namespace; those are logged here (a warning), not answered."""
    log.warning(
        "no %s replica could take or finish a request: %s: %s", SERVER_DEPLOYMENT, type(e).__name__, e
    )
    first = next(iter(str(e).strip().splitlines()), "")
    return EngineUnavailableError(f"{type(e).__name__}: {first}" if first else type(e).__name__)


def overloaded(e: BackPressureError) -> EngineOverloadedError:
    """Serve's BackPressureError as raychat's 429, with its Retry-After in whole seconds (>= 1)."""
    return EngineOverloadedError(str(e), max(1, math.ceil(e.retry_after_s or 1)))


class HandleClient:
    """The ingress' engine client over a DeploymentHandle to ChatServer (protocol in raychat.serve.ingress).

    timeout_s: seconds info() and stats() wait for a replica's answer, and how often check() and generate()
        ask the Serve controller whether ChatServer is failing while their call waits for a replica's answer
        (None: as long as Serve routes the call, which is for ever while no replica runs, e.g. while each new
        one fails to start).
    """

    def __init__(self, handle, timeout_s: float | None = None):
        self.handle, self.timeout_s = handle, timeout_s
        self._asking: asyncio.Future | None = None  # the latest server_state call, shared (see _state)
        self._asked_at = 0.0

    async def info(self) -> dict:
        return await self._call(self.handle.info)

    async def stats(self) -> dict:
        return await self._call(self.handle.stats)

    async def check(self, requests: list[dict]) -> dict | None:
        """ChatServer.check on a replica, waited for as generate()'s first event is (a request waits for a
        busy replica, never for one that cannot start); errors as generate()'s."""
        try:
            return await self._answer(self.handle.check.remote(requests))
        except BackPressureError as e:
            raise overloaded(e) from e
        except UNAVAILABLE as e:
            raise unavailable(e) from e

    async def _call(self, method):
        """`await method.remote()`; the replicas' queue being full (these calls share it with generate)
        raises EngineOverloadedError, no replica to answer EngineUnavailableError, and so does no answer
        within timeout_s (the message then says what the Serve controller reports: server_state)."""
        try:
            return await asyncio.wait_for(_awaited(method.remote()), self.timeout_s)
        except BackPressureError as e:
            raise overloaded(e) from e
        except UNAVAILABLE as e:
            raise unavailable(e) from e
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise EngineUnavailableError(await self._no_answer()) from None

    async def _no_answer(self) -> str:
        head = f"no {SERVER_DEPLOYMENT} replica answered within {self.timeout_s:g} s"
        try:
            return f"{head}; {(await self._state())[0]}"
        except Exception as e:  # noqa: BLE001 - the controller's silence must not hide the answer
            return f"{head}; the Serve controller did not say why ({type(e).__name__}: {e})"

    async def _state(self) -> tuple[str, bool]:
        """server_state of this handle's app within timeout_s (else asyncio.TimeoutError); an answer that
        started less than STATE_REUSE_S ago, or is still on its way, is shared by every caller."""
        if self._asking is None or (
            self._asking.done() and time.monotonic() - self._asked_at > STATE_REUSE_S
        ):
            call = asyncio.to_thread(server_state, self.handle.app_name)
            self._asking = asyncio.ensure_future(asyncio.wait_for(call, self.timeout_s))
            self._asked_at = time.monotonic()
        return await asyncio.shield(self._asking)

    async def _first(self, gen) -> list:
        """The first batch of the stream `gen` ([] if it ends without one), waited for by _answer."""
        try:
            return await self._answer(anext(gen))
        except StopAsyncIteration:
            return []

    async def _answer(self, awaitable):
        """What `awaitable` (a replica's answer) gives. While it has not come, every timeout_s the Serve
        controller is asked whether ChatServer is failing (server_state); if it is, the wait ends in
        EngineUnavailableError with /health's reason (a request waits for a replica that is busy, starting or
        being added, never for one that cannot start)."""
        answer = asyncio.ensure_future(_awaited(awaitable))
        try:
            while not (await asyncio.wait({answer}, timeout=self.timeout_s))[0]:
                try:
                    failing = (await self._state())[1]
                except Exception:  # noqa: BLE001 - the controller's silence is no reason to fail the request
                    continue
                if failing:
                    raise EngineUnavailableError(await self._no_answer())
            return answer.result()
        finally:
            answer.cancel()  # nothing once it is done; else the caller stopped waiting

    async def generate(self, request: dict):
        """The replica's events; a full queue (Serve's max_queued_requests) raises EngineOverloadedError
        (429), a replica that died or no replica to take the request EngineUnavailableError (503; an error
        event once streaming)."""
        gen = self.handle.options(stream=True).generate.remote(request)
        finished = False
        try:
            for event in await self._first(gen):
                yield event
            async for batch in gen:
                for event in batch:
                    yield event
            finished = True
        except BackPressureError as e:
            finished = True
            raise overloaded(e) from e
        except UNAVAILABLE as e:
            finished = True
            raise unavailable(e) from e
        finally:
            if not finished:
                gen.cancel()  # client left or the consumer stopped early: cancel the replica's generator


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress()
class ChatIngress:
    """HTTP ingress: the FastAPI app of raychat.serve.ingress over a handle to ChatServer; health_timeout_s:
    HandleClient's timeout_s. `snapshot`: the run's snapshot the app serves (None: not one), marked in use
    every `mark_every_s` seconds while the app runs, also while ChatServer has no replica."""

    def __init__(
        self,
        engine,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        health_timeout_s: float | None = None,
        snapshot: str | None = None,
        mark_every_s: float = IN_USE_MARK_S,
    ):
        self.in_use = MarkInUse(snapshot, mark_every_s) if snapshot else None
        self.client = HandleClient(engine, health_timeout_s)
        self.api_key, self.max_body_bytes = api_key, max_body_bytes

    def __serve_build_asgi_app__(self):
        return create_app(self.client, api_key=self.api_key, max_body_bytes=self.max_body_bytes)


def device_for(num_gpus: float) -> str:
    """The torch device of a replica that reserves `num_gpus` GPUs: "cuda" (Ray sets CUDA_VISIBLE_DEVICES to
    its GPUs, so "cuda" is the first of them) for any GPU, else "cpu". A ChatServer replica calls it with the
    GPUs Ray assigned it, so a Serve config's `deployments:` entry that reserves a GPU moves the model too."""
    return "cuda" if num_gpus > 0 else "cpu"


def pinned(checkpoint: str) -> str:
    """What the replicas load for `checkpoint` (find_checkpoint's answer): a run's local checkpoint_<step>
    directory as a snapshot that the run's pruning leaves alone (raychat.checkpoint_manager.snapshot_checkpoint,
    in the run dir: hard links); anything else as it is. Where the run dir takes no snapshot (not writable: the
    OSError is logged as a warning), the checkpoint itself.

    Raises CheckpointError: a file of the checkpoint differs from its commit marker; ValueError: a symbolic
    link leads the snapshot out of the run dir."""
    if not is_run_checkpoint(checkpoint):
        return checkpoint
    try:
        return str(snapshot_checkpoint(checkpoint))
    except OSError as e:
        log.warning(
            "checkpoint: no snapshot of %s in its run dir (%s): serving it in place, so a replica that starts "
            "after its run pruned it fails",
            checkpoint,
            e,
        )
        return checkpoint


def build_app(args: dict | ServeConfig) -> Application:
    """The application for `serve run raychat.serve.app:build_app key=value ...` and a Serve config's
    import_path (keys: ServeConfig): build_application(args). Serve calls an application builder with exactly
    one argument and refuses one that takes more (TypeError at deploy), so this takes `args` only. Serve
    builds a config file's app in a task on a node of the cluster, so RAYCHAT_API_KEY is read there (the
    app's runtime_env, else that node's environment). Errors: build_application's; Serve shows them in the
    app's DEPLOY_FAILED status (`serve status`), the exception's line last."""
    return build_application(args)


def build_application(args: dict | ServeConfig, mark_every_s: float = IN_USE_MARK_S) -> Application:
    """The application of `args` (keys: ServeConfig). Its model id (/v1/models, each response's "model"):
    args model_id, else args checkpoint as given (default_model_id), so a run dir served again at a newer
    checkpoint keeps its id. A run's local checkpoint is bound as its snapshot (pinned); while the app runs,
    its ingress and ChatServer replicas mark the snapshot (or a snapshot named directly) in use every
    `mark_every_s` seconds (raychat.serve.in_use), so the run's next snapshot_checkpoint keeps it.

    Raises:
        ValueError: invalid args (see serve_config); no API key (args api_key, else RAYCHAT_API_KEY) without
            args allow_unauthenticated (NO_KEY), before the checkpoint is looked at; a checkpoint reference
            that names no committed checkpoint (one line naming `checkpoint` and what is there);
            CheckpointError (a ValueError): a file of a run's checkpoint differs from its commit marker (named).
    """
    c = serve_config(args)
    if not c.api_key and not c.allow_unauthenticated:
        raise ConfigError(NO_KEY)
    r, a = c.replica, c.autoscaling
    checkpoint = find_checkpoint(c.checkpoint, flag="checkpoint")
    model_id = c.model_id or default_model_id(c.checkpoint)  # not a snapshot's name: the run's reference
    checkpoint = pinned(checkpoint)
    in_use = {"snapshot": checkpoint if is_snapshot(checkpoint) else None, "mark_every_s": mark_every_s}
    options = deployment_options(c)  # what a Serve config's deployments: section may override in place
    backpressure = BackpressureConfig(status_code=429, retry_after_s=c.retry_after_s)
    limits = {"max_pending": r.max_pending, "request_timeout_s": r.request_timeout_s}
    limits |= {"stall_timeout_s": r.stall_timeout_s, "retry_after_s": c.retry_after_s}
    limits["prefix_cache_tokens"] = "auto" if r.prefix_cache_tokens is None else r.prefix_cache_tokens
    limits["kv_dtype"] = r.kv_dtype
    engine = ChatServerDeployment.options(
        **options[SERVER_DEPLOYMENT], backpressure_config=backpressure
    ).bind(
        checkpoint,
        r.max_slots,
        r.max_len,
        r.stream_interval,
        r.engine_process,
        r.torch_threads,
        model_id,
        r.dtype,
        r.prefill_chunk_tokens,
        limits=limits,
        **in_use,
    )
    return ChatIngress.options(
        **options[INGRESS_DEPLOYMENT],
        max_ongoing_requests=max(1000, 4 * r.max_ongoing_requests * a.max_replicas),
        backpressure_config=backpressure,
    ).bind(engine, c.api_key, health_timeout_s=c.health_timeout_s, **in_use)
