"""The machinery of raychat's one configuration system: nested dataclasses whose leaves are options.

A config is a dataclass of sections (dataclasses), possibly nested; a leaf field is an option made with
`option(default, help, ...)`. Every leaf has one flat name, its field name, which is also its `--flag`
(underscores become dashes) and its key in YAML presets. Flat names are unique within one top-level config.

`from_dict(cls, values)` builds a config from a dict that holds sections as nested dicts (the form
`to_dict` writes) or leaves by flat name or alias (the form presets, `--config` files and `serve run`
args use), converting strings ("2", "0.5", "true", "none") to the leaf's type. Each section validates
itself in `__post_init__` (`Section.__post_init__` checks choices and bounds, subclasses add more), so a bad
value raises ConfigError naming the flag and the allowed values.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import math
import re
import types
import typing
from dataclasses import MISSING, field
from decimal import Decimal
from functools import cache
from pathlib import Path

import yaml

from raychat.cli_parser import did_you_mean


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message names the flag and the allowed values."""


PACKAGE_DIR = Path(__file__).resolve().parents[1]


@cache
def owned_choices(module: str, name: str) -> tuple:
    """The allowed values of an option, owned by the module that implements it (`name`, a top-level tuple of
    literals there, e.g. raychat.data.loader.packing.OVERFLOW_POLICIES), read from that module's source
    without importing it: building a parser (`raychat <command> --help`) imports neither torch nor Ray, and
    the list exists once, beside the code that acts on it. Raises ConfigError when the module has no
    literal of that name."""
    return tuple(owned_literal(module, name))


def owned_literal(module: str, name: str):
    """The value of the top-level literal `name` of raychat module `module` (a limit an option shares with the
    code that enforces it, e.g. raychat.engine.prefix_cache.BLOCK_TOKENS), read as owned_choices reads.
    Raises ConfigError when the module has no literal of that name."""
    path = PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if [getattr(t, "id", None) for t in targets] == [name] and node.value is not None:
            return ast.literal_eval(node.value)
    raise ConfigError(f"{module} has no literal {name} (a value an option names)")


# The one run-name rule: a run is one directory strictly below the storage root, never the root itself, a
# parent, a hidden name or a path.
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
RUN_NAME_RULE = "letters, digits and '._-', not starting with '.'"
LATEST = "latest"


def check_run_name(value: str, flag: str) -> str:
    """`value` when it is a run name (RUN_NAME_RULE), else ConfigError naming `flag`."""
    if not isinstance(value, str) or not RUN_NAME.fullmatch(value):
        raise ConfigError(f"{flag}: {value!r} is not a run name ({RUN_NAME_RULE})")
    return value


def check_reference(value: str, flag: str) -> str:
    """A checkpoint reference: '' (none), `latest`, a path (holds '/') or URI, or a run name (RUN_NAME_RULE);
    ConfigError naming `flag` for a bare word that is none of these (e.g. '..')."""
    if value and "/" not in value and value != LATEST and not RUN_NAME.fullmatch(value):
        raise ConfigError(
            f"{flag}: {value!r} is not a run name ({RUN_NAME_RULE}); write a directory as a path "
            f"(./{value}/ or an absolute path)"
        )
    return value


TASK_SPEC_FORM = "name[:count],..."
SEED_MAX = 2**63 - 1  # int64: torch.manual_seed refuses seeds past 2**64 - 1, torch.tensor past 2**63 - 1


def parse_task_spec(
    value: str, flag: str, names: tuple[str, ...], empty_ok: bool = False
) -> list[tuple[str, int | None]]:
    """[(name, count or None)] of a task spec "calculator:2000,chatterbot,spelling:1000" (TASK_SPEC_FORM; a
    name may repeat; blank items are skipped).

    Raises ConfigError naming `flag`, the item, the form and `names`: a name not in `names`, a count that is
    not a positive integer, or (unless empty_ok) no task at all."""

    def refuse(item: str, why: str):
        raise ConfigError(f"{flag}: {item!r}: {why}; the form is {TASK_SPEC_FORM}; tasks: {', '.join(names)}")

    out = []
    for item in filter(None, (s.strip() for s in value.split(","))):
        name, colon, count = (part.strip() for part in item.partition(":"))
        if name not in names:
            refuse(item, f"unknown task {name!r}")
        if colon and not (re.fullmatch(r"[0-9]+", count) and int(count) >= 1):
            refuse(item, "the count must be a positive integer")
        out.append((name, int(count) if colon else None))
    if not out and not empty_ok:
        refuse(value, "no task")
    return out


def option(
    default,
    help: str,
    choices: tuple | list | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    positive: bool = False,
    aliases: tuple[str, ...] = (),
    flag: bool = True,
    kind: str | None = None,
    blank_ok: bool = False,
):
    """A leaf field: its default, its --help text, allowed values (choices, >= ge, > gt, <= le, a positive
    integer, kind "run_name" (check_run_name) or "reference" (check_reference); a text option with a non-blank
    default refuses a blank value unless blank_ok, since a blank path is the current directory), alias names
    (also flags and YAML keys), and whether the command line gets a flag for it."""
    meta = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "ge": ge,
        "gt": gt,
        "le": le,
        "positive": positive,
        "kind": kind,
        "blank_ok": blank_ok,
    }
    return field(default=default, metadata={**meta, "aliases": tuple(aliases), "flag": flag})


def section(cls, **defaults):
    """A section field: an instance of `cls`, with `defaults` replacing the section's own defaults (the one
    place a command states that it defaults differently, e.g. RL's learning rates)."""
    return field(default_factory=lambda: cls(**defaults), metadata={"section": True, "defaults": defaults})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# flat name -> the alias its value was given under, while from_dict builds a config
_SPELLED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("spelled", default=None)
# while from_dict builds a command line's config (flags given): the flat names whose values came from its preset
_PRESET: contextvars.ContextVar[frozenset | None] = contextvars.ContextVar("preset", default=None)


def label(cls, name: str) -> str:
    """How errors name option `name` of section `cls`: its --flag, or its key where the section's NAMING is
    "key" (build_app args and keyword arguments are written as keys), except in a command line's config, which
    names by key only the values its preset gave; under the alias the value was given as (`--replicas`,
    `max_rows:`), where it was."""
    preset = _PRESET.get()
    naming = getattr(cls, "NAMING", "flag") if preset is None or name in preset else "flag"
    name = (_SPELLED.get() or {}).get(name, name)
    return name if naming == "key" else flag_name(name)


class Section:
    """Base of every section: __post_init__ converts and checks each leaf against its option's limits."""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            if f.metadata.get("section"):
                continue
            name = label(type(self), f.name)
            value = coerce(hints[f.name], getattr(self, f.name), name)
            object.__setattr__(self, f.name, value)
            check(f, value, name)


def shown(value) -> str:
    """`value` as messages, --help and plans print it: a float in its shortest form, a whole one without ".0"
    (20.0 -> 20, -1.0 -> -1) and from 1e6 on in e-notation (4470000000.0 -> 4.47e9: what a user types, and
    it parses back to the same float); an int as it is; anything else as its repr ('runs', None, True)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, int) or not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < 1e6:
        return str(int(value))
    text = f"{Decimal(repr(value)).normalize():e}" if value.is_integer() else repr(value)
    return text.replace("e+", "e")


def check(f: dataclasses.Field, value, flag: str) -> None:
    """Raise ConfigError when `value` breaks the choices or bounds of option `f` (named `flag` in errors)."""
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ConfigError(f"{flag} must be one of {list(m['choices'])}, got {value!r}")
    if m.get("kind") == "run_name" and value is not None:
        check_run_name(value, flag)
    elif m.get("kind") == "reference" and value is not None:
        check_reference(value, flag)
    if isinstance(value, str) and not value.strip() and str(f.default).strip() and not m.get("blank_ok"):
        raise ConfigError(f"{flag} must not be blank, got {value!r} (default: {f.default!r})")
    if value is None or isinstance(value, (bool, str)):
        return
    if m.get("positive") and value <= 0:
        raise ConfigError(f"{flag} must be a positive integer, got {shown(value)}")
    if m.get("ge") is not None and value < m["ge"]:
        raise ConfigError(f"{flag} must be >= {shown(m['ge'])}, got {shown(value)}")
    if m.get("gt") is not None and value <= m["gt"]:
        raise ConfigError(f"{flag} must be > {shown(m['gt'])}, got {shown(value)}")
    if m.get("le") is not None and value > m["le"]:
        raise ConfigError(f"{flag} must be <= {shown(m['le'])}, got {shown(value)}")


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _base_type(hint) -> tuple[type, bool]:
    """(int | float | str | bool | a dataclass, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return kinds[0], len(kinds) < len(args)
    return hint, False


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def coerce(hint, value, flag: str):
    """`value` converted to the field's type: strings parsed, ints widened to float; ConfigError (naming
    `flag`) otherwise. An optional field's "none" / "null" is None, and so is a blank string, except for a
    string field, where a blank value (`--prompt "$UNSET"`) is a ConfigError rather than a silent None."""
    kind, optional = _base_type(hint)
    if isinstance(value, str) and optional and value.strip().lower() in ("", "none", "null"):
        if kind is str and value.strip().lower() not in ("none", "null"):  # `-p "$UNSET"`: not "no value"
            raise ConfigError(f"{flag} must be a non-blank string, or 'none' for no value; got {value!r}")
        return None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{flag} must be {_describe(kind)}, got None")
    if kind is bool:
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        number = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except (ValueError, OverflowError):  # not a number; an int too large for a float
                pass
        if number is not None:
            if not math.isfinite(number):  # NaN passes every bound check; no option means anything by inf
                raise ConfigError(f"{flag} must be a finite number, got {value!r}")
            return number
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{flag} must be {_describe(kind)}, got {value!r}")


def _describe(kind) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def leaves(cls) -> dict[str, tuple[tuple[str, ...], dataclasses.Field]]:
    """flat name -> (path of section names, leaf field) for every leaf of config class `cls`."""
    return dict(_leaves(cls))


@cache
def _leaves(cls) -> tuple:
    out: dict = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            for name, (path, leaf) in _leaves(hints[f.name]):
                out[name] = ((f.name, *path), leaf)
        else:
            if f.name in out:
                raise TypeError(f"{cls.__name__}: two options are named {f.name!r}")
            out[f.name] = ((), f)
    return tuple(out.items())


def aliases(cls) -> dict[str, str]:
    """alias -> flat name for every leaf of `cls` that has aliases, and the config's DEPRECATED names."""
    own = {a: name for name, (_, f) in leaves(cls).items() for a in f.metadata.get("aliases", ())}
    return {**own, **deprecated(cls)}


def deprecated(cls) -> dict[str, str]:
    """old name -> flat name: a config's `DEPRECATED` class attribute, names kept one release (still YAML keys
    and flags; the flag prints that it is deprecated)."""
    return dict(getattr(cls, "DEPRECATED", {}))


def flatten(cls, values: dict, where: str | None = None, spelled: dict | None = None) -> dict:
    """`values` (nested sections and/or flat names and aliases) as {flat name: value}; `spelled`, when given,
    gets {flat name: alias} of each value given under an alias.

    Raises:
        ConfigError: keys that are neither a section of `cls` nor a flat name or alias, as
            "unknown <where> [keys]; allowed: [...]" (where defaults to "<cls> settings"); a section's key
            whose value is not a mapping; one option under two of its names (its name and an alias, or two
            aliases), as "<where>: 'replicas' and 'max_replicas' both set max_replicas; give one".
    """
    names, alias = leaves(cls), aliases(cls)
    sections = {f.name for f in dataclasses.fields(cls) if f.metadata.get("section")}
    out: dict = {}
    keys: dict = {}  # flat name -> (the key its value was given under, with its section; that key alone)
    unknown = []

    def put(name: str, path: str, key: str, value) -> None:
        # one spelling twice (a section's key and a flat one, as `{**to_dict(cfg), name: value}`): the later wins
        if name in keys and keys[name][1] != key:
            raise ConfigError(
                f"{where or cls.__name__ + ' settings'}: {keys[name][0]!r} and {path!r} both set {name}; give one"
            )
        keys[name], out[name] = (path, key), value

    for key, value in (values or {}).items():
        if key in sections and isinstance(value, dict):
            inner: dict = {}
            for name, v in flatten(_hints(cls)[key], value, where, inner).items():
                put(name, f"{key}.{inner.get(name, name)}", inner.get(name, name), v)
            if spelled is not None:
                spelled.update(inner)
        elif key in names or key in alias:  # before sections: RL's old flat `checkpoint` names a section too
            put(alias.get(key, key), key, key, value)
            if spelled is not None and key in alias:
                spelled[alias[key]] = key
        elif key in sections:
            raise ConfigError(
                f"{where or cls.__name__ + ' settings'}: section {key!r} must be a mapping of its options, got "
                f"{type(value).__name__} {value!r}"
            )
        else:
            unknown.append(key)
    if unknown:
        allowed = sorted(set(names) | set(alias) | sections)
        raise ConfigError(
            f"unknown {where or cls.__name__ + ' settings'} {sorted(unknown)}{close_keys(sorted(unknown), allowed)}; "
            f"allowed: {allowed}"
        )
    return out


def close_keys(unknown: list[str], allowed: list[str]) -> str:
    """' (did you mean depth?)' for the keys of `unknown` close to one of `allowed` (raychat.cli_parser's
    did_you_mean, as the command line's flags: `deph`, `num_iters`, `grad_clip_norm`); '' when none is."""
    close = [(key, did_you_mean(key, allowed)) for key in unknown]
    close = [(key, match) for key, match in close if match]
    if not close:
        return ""
    hint = ", ".join(match if len(unknown) == 1 else f"{match} for {key}" for key, match in close)
    return f" (did you mean {hint}?)"


def from_dict(
    cls, values: dict | None = None, base=None, where: str | None = None, flags: dict | None = None
):
    """A `cls` instance: `base` (an instance, default `cls()`) with `values` (see flatten) on top, then `flags`
    (None, or {flat name or alias: value} given on a command line, `values` being its preset's). The result is
    checked once, whole: a flag may mend a value that `values` alone makes invalid (a preset's kv_group with
    --depth).

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a value outside its allowed set; a value
            given under an alias is named by that alias; given flags, every option but those `values` set is
            named by its --flag, whatever its section's NAMING.
    """
    spelled: dict[str, str] = {}
    flat = flatten(cls, values or {}, where, spelled)
    typed: dict[str, str] = {}
    given = flatten(cls, flags or {}, where, typed)
    spelled = {name: alias for name, alias in spelled.items() if name not in given} | typed
    preset = None if flags is None else frozenset(flat) - frozenset(given)
    tokens = _SPELLED.set(spelled), _PRESET.set(preset)
    try:
        return _build(cls, flat | given, base)
    finally:
        _SPELLED.reset(tokens[0])
        _PRESET.reset(tokens[1])


def _build(cls, flat: dict, base):
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            sub_base = getattr(base, f.name) if base is not None else f.default_factory()
            kwargs[f.name] = _build(hints[f.name], flat, sub_base)
        elif f.name in flat:
            kwargs[f.name] = coerce(hints[f.name], flat[f.name], label(cls, f.name))
        elif base is not None:
            kwargs[f.name] = getattr(base, f.name)
        elif f.default is MISSING:
            raise ConfigError(f"{label(cls, f.name)} is required")
    return cls(**kwargs)


def to_dict(config) -> dict:
    """The nested dict of a config (sections as dicts); from_dict(type(config), to_dict(config)) == config."""
    return dataclasses.asdict(config)


def to_yaml(config, section: str) -> str:
    """The config as a preset file with one section (read back by from_dict(cls, preset_values(path, ...)))."""
    return yaml.safe_dump({section: to_dict(config)}, sort_keys=False)


def to_flat(config) -> dict:
    """{flat name: value} of every leaf of a config instance."""
    out = {}
    for name, (path, _) in leaves(type(config)).items():
        obj = config
        for p in path:
            obj = getattr(obj, p)
        out[name] = getattr(obj, name)
    return out
