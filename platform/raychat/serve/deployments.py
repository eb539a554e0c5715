"""The options of the chat app's two deployments that Ray Serve owns (replica resources, autoscaling, request
bounds), written as a Serve config file's `deployments:` section; and the ServeConfig that a Serve config
application (`args` + `deployments:`) describes.

Why a `deployments:` section and not build_app args: Serve hashes an application's `args` into its code
version, so a changed arg restarts every replica; options in `deployments:` are Serve's own and it applies
them in place (a new max_replicas or target_ongoing_requests changes the autoscaler's bounds, the running
replicas stay). build_app applies the same options through `.options()` (raychat.serve.app), so `raychat
serve` and `serve run ...:build_app key=value` need no `deployments:` section; every default is
raychat.config.ServeConfig's.

The mapping (ServeConfig option -> Serve deployment option):
  ChatServer   num_cpus, num_gpus          -> ray_actor_options.num_cpus, .num_gpus
               max_ongoing_requests, max_queued_requests, max_replicas_per_node -> the option of that name
               min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, downscale_delay_s,
               look_back_period_s          -> autoscaling_config.<name> (plus initial_replicas =
                                              max(1, min_replicas): a new app starts with one replica)
  ChatIngress  ingress_num_cpus            -> ray_actor_options.num_cpus
               ingress_max_queued_requests -> max_queued_requests

Serve replaces `ray_actor_options` and `autoscaling_config` whole when a `deployments:` entry sets them (a key
left out takes Serve's default, not raychat's), so read_serve_app refuses an entry that leaves out a key
raychat sets there.
"""

from __future__ import annotations

from raychat.config import ConfigError, ServeConfig, from_dict
from raychat.config.schema import aliases

SERVER_DEPLOYMENT = "ChatServer"
INGRESS_DEPLOYMENT = "ChatIngress"

AUTOSCALING_KEYS = (
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "upscale_delay_s",
    "downscale_delay_s",
    "look_back_period_s",
)
# {deployment: {Serve option: ServeConfig option}} for the options that are not nested
FLAT = {
    SERVER_DEPLOYMENT: {
        "max_ongoing_requests": "max_ongoing_requests",
        "max_queued_requests": "max_queued_requests",
        "max_replicas_per_node": "max_replicas_per_node",
    },
    INGRESS_DEPLOYMENT: {"max_queued_requests": "ingress_max_queued_requests"},
}
# {deployment: {ray_actor_options key: ServeConfig option}}; each key is required where ray_actor_options is set
ACTOR = {
    SERVER_DEPLOYMENT: {"num_cpus": "num_cpus", "num_gpus": "num_gpus"},
    INGRESS_DEPLOYMENT: {"num_cpus": "ingress_num_cpus"},
}
REQUIRED_ACTOR = {SERVER_DEPLOYMENT: ("num_cpus",), INGRESS_DEPLOYMENT: ("num_cpus",)}  # num_gpus: Ray's 0
# the ServeConfig options a deployments: section carries
SERVE_OWNED = frozenset(
    [
        *AUTOSCALING_KEYS,
        *(k for m in FLAT.values() for k in m.values()),
        *(k for m in ACTOR.values() for k in m.values()),
    ]
)


def deployment_options(config: ServeConfig) -> dict[str, dict]:
    """{deployment name: its Serve options} of `config`, in the shape of a Serve config file's `deployments:`
    entry (without `name`); build_app passes them to `.options()`. max_replicas_per_node appears only when set
    (None = Serve's default, no limit)."""
    r, a = config.replica, config.autoscaling
    autoscaling = {k: getattr(a, k) for k in AUTOSCALING_KEYS}
    autoscaling["initial_replicas"] = max(1, a.min_replicas)
    server = {
        "ray_actor_options": {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
        "max_ongoing_requests": r.max_ongoing_requests,
        "max_queued_requests": r.max_queued_requests,
        "autoscaling_config": autoscaling,
    }
    if r.max_replicas_per_node:
        server["max_replicas_per_node"] = r.max_replicas_per_node
    ingress = {
        "ray_actor_options": {"num_cpus": config.ingress_num_cpus},
        "max_queued_requests": config.ingress_max_queued_requests,
    }
    return {SERVER_DEPLOYMENT: server, INGRESS_DEPLOYMENT: ingress}


def deployment_args(deployments: list[dict] | None) -> dict:
    """The ServeConfig options (flat names) that a Serve config application's `deployments:` section sets.

    Raises:
        ValueError (ConfigError): an entry for another deployment, an option raychat does not map (naming the
            allowed ones), or a ray_actor_options / autoscaling_config that leaves out a key raychat sets
            there (Serve would use its own default for it).
    """
    args: dict = {}
    for entry in deployments or []:
        entry = dict(entry)
        name = entry.pop("name", None)
        where = f"deployments[{name}]"
        if name not in FLAT:
            raise ConfigError(f"deployments: no deployment {name!r}; the chat app has {sorted(FLAT)}")
        allowed = sorted(
            [*FLAT[name], "ray_actor_options", *(["autoscaling_config"] * (name == SERVER_DEPLOYMENT))]
        )
        unknown = sorted(set(entry) - set(allowed))
        if unknown:
            raise ConfigError(f"{where}: options {unknown} are not raychat's; allowed: {allowed}")
        for serve_key, key in FLAT[name].items():
            if serve_key in entry:
                args[key] = entry[serve_key]
        if "ray_actor_options" in entry:
            actor = entry["ray_actor_options"] or {}
            _complete(f"{where}.ray_actor_options", actor, REQUIRED_ACTOR[name], ACTOR[name])
            # every key counts as set: Serve runs a key left out at its default (num_gpus 0), whatever args say
            args |= {key: actor.get(k, 0) for k, key in ACTOR[name].items()}
        if "autoscaling_config" in entry:
            auto = dict(entry["autoscaling_config"] or {})
            auto.pop("initial_replicas", None)
            _complete(f"{where}.autoscaling_config", auto, AUTOSCALING_KEYS, AUTOSCALING_KEYS)
            args |= auto
    return args


def _complete(where: str, given: dict, required, allowed) -> None:
    missing = [k for k in required if k not in given]
    unknown = sorted(set(given) - set(allowed))
    if missing or unknown:
        raise ConfigError(
            f"{where}: Serve replaces it whole, so it needs {list(required)} (a key left out takes Serve's "
            f"default, not raychat's) and allows only {list(allowed)}; missing {missing}, unknown {unknown}"
        )


def read_serve_app(app: dict) -> ServeConfig:
    """The ServeConfig of one application of a Serve config file (a dict: `args` and `deployments:`), with
    each value where the file puts it.

    Raises:
        ValueError (ConfigError): see deployment_args; an option set both in args (under its name or an alias)
            and in deployments: (a ray_actor_options there sets each of its keys, one left out to Serve's
            default), or an invalid value (raychat.config.from_dict).
    """
    args, options = dict(app.get("args") or {}), deployment_args(app.get("deployments"))
    alias = aliases(ServeConfig)
    twice = sorted({alias.get(k, k) for k in args} & set(options))
    if twice:
        raise ConfigError(f"{twice} set both in args and in deployments: (one place each)")
    return from_dict(ServeConfig, args | options, where="build_app args and deployments")
