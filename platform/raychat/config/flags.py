"""The one generator of command-line flags: one `--flag` per leaf of a config class, grouped by section.

Every flag defaults to None ("not given"), so precedence is explicit and the same for every command:
flags > the preset or --config file > the command's defaults (the config class's, with its section overrides).

One storage root for a chain of stages: when --storage-path is chosen (by flag or preset) and an input of
STORAGE_INPUTS is not, that input is the run of that name under the root (`--storage-path /mnt/runs` alone
reads /mnt/runs/data and /mnt/runs/tokenizer, also where the working directory holds a ./data).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from raychat.config.presets import LAYERS, PRESET_HELP, STAGE_SECTIONS, preset_values, read_preset
from raychat.config.schema import (
    ConfigError,
    _base_type,
    _hints,
    aliases,
    coerce,
    deprecated,
    flag_name,
    flatten,
    from_dict,
    leaves,
    shown,
    to_flat,
)

STORAGE_INPUTS = {"data_dir": "data", "tokenizer_path": "tokenizer"}


def add_flags(
    parser: argparse.ArgumentParser,
    cls,
    defaults=None,
    preset: str | None = None,
    preset_aliases: tuple[str, ...] = (),
    unused: dict[str, str] | None = None,
) -> None:
    """Add `--preset` (default `preset`; None = no --preset flag) and one flag per leaf of `cls`, plus a
    deprecated flag per name of `cls.DEPRECATED` (raychat.config.schema.deprecated) and of `preset_aliases`.

    defaults: the instance whose values the help shows (default `cls()`).
    unused: {leaf: why} of the leaves the command does not use (raychat.config.train.UNUSED_FLAGS): their
        flags stay listed, and given, fail parsing in one line naming the flag and why (a preset may still
        set them: its values are not flags).
    """
    defaults = defaults if defaults is not None else cls()
    if preset is not None:
        parser.add_argument(
            "--preset", *preset_aliases, dest="preset", default=preset, action=_Store,
            deprecated=preset_aliases, help=f"{PRESET_HELP} (default: {preset})",
        )  # fmt: skip
    old = {name: [] for name in leaves(cls)}
    for alias, name in deprecated(cls).items():
        old[name].append(flag_name(alias))
    _add_section(parser, cls, defaults, cls.__name__, old, unused or {})


TYPED = "typed_flags"  # the namespace's {dest: the option string given}: errors name the flag a user typed


class _Store(argparse.Action):
    """Store the value and the option string it came with (TYPED); a deprecated option string prints, once,
    "<prog>: --old is deprecated, use --new"."""

    def __init__(self, option_strings, dest, deprecated=(), **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.deprecated, self.warned = tuple(deprecated), False

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.deprecated and not self.warned:
            self.warned = True
            print(
                f"{parser.prog}: {option_string} is deprecated, use {self.option_strings[0]}", file=sys.stderr
            )
        setattr(namespace, self.dest, values)
        vars(namespace).setdefault(TYPED, {})[self.dest] = option_string


class _Unused(argparse.Action):
    """A flag the command does not use: refused, naming the option string given and why."""

    def __init__(self, option_strings, dest, why: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(None, f"argument {option_string}: not used: {self.why}")


def _add_section(
    parser, cls, defaults, title: str, old: dict[str, list[str]], unused: dict[str, str]
) -> None:
    hints = _hints(cls)
    summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())  # the first paragraph, unwrapped
    group = parser.add_argument_group(title, summary or None)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            _add_section(parser, hints[f.name], getattr(defaults, f.name), f"{title}.{f.name}", old, unused)
            continue
        if not f.metadata.get("flag", True):
            continue
        if f.name in unused:
            is_bool = _base_type(hints[f.name])[0] is bool
            names = [flag_name(f.name), *old[f.name]]
            names += [f"--no-{n[2:]}" for n in names] if is_bool else []
            group.add_argument(
                *names, dest=f.name, default=None, action=_Unused, why=unused[f.name],
                nargs=0 if is_bool else None, metavar=None if is_bool else "VALUE", help=f"not used: {unused[f.name]}",
            )  # fmt: skip
            continue
        default = getattr(defaults, f.name)
        required = "(required)" in f.metadata["help"] and default == ""
        # a None default is not shown: the option's help says what "not given" means (test_cli checks it)
        plain = required or default is None
        help = f.metadata["help"] if plain else f"{f.metadata['help']} (default: {shown(default)})"
        primary = flag_name(f.name)
        _add_flag(group, [primary, *old[f.name]], f, hints[f.name], help, old[f.name])
        for alias in f.metadata.get("aliases", ()):  # a flag of its own, so that its errors name it
            _add_flag(group, [flag_name(alias)], f, hints[f.name], f"the same as {primary}", ())


def _add_flag(group, names: list[str], f: dataclasses.Field, hint, help: str, deprecated) -> None:
    """The flag `names` (the first names it in errors) of option `f`, stored under its field name."""
    kind, _ = _base_type(hint)
    if kind is bool:
        group.add_argument(
            *names, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help
        )
        return
    choices = f.metadata.get("choices")
    group.add_argument(
        *names, dest=f.name, default=None, choices=choices, help=help, action=_Store, deprecated=deprecated,
        type=lambda text, name=names[0]: _parse(hint, text, name),
        metavar=None if choices else kind.__name__.upper(),
    )  # fmt: skip


def _parse(hint, text: str, name: str):
    try:
        return coerce(hint, text, name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def given(args: argparse.Namespace, cls) -> dict:
    """{flat name: value} of the flags of `cls` that were given on the command line (`--max-tokens none`
    too: its value None, which replaces the preset's)."""
    typed = getattr(args, TYPED, {})
    return {
        name: getattr(args, name)
        for name in leaves(cls)
        if getattr(args, name, None) is not None or name in typed
    }


def chosen(args: argparse.Namespace, cls, section: str) -> set[str]:
    """The flat names of `cls` that the command line sets: a flag given, or an option the preset's `section`
    sets (--preset, not 'none'; flat or nested: `data: {data_dir: ...}` sets data_dir); the others hold the
    config's defaults (or the STORAGE_INPUTS rule's).

    Raises:
        ConfigError: the preset's section holds an unknown key (raychat.config.schema.flatten).
    """
    name = getattr(args, "preset", None)
    preset = preset_values(name, section) if name and name.strip() and name != "none" else {}
    return {*flatten(cls, preset), *given(args, cls)}


def _as_typed(args: argparse.Namespace, cls, flags: dict) -> dict:
    """`flags` ({flat name: value}) keyed by the alias a flag was typed as, where it was (see TYPED)."""
    typed, alias = getattr(args, TYPED, {}), aliases(cls)
    out = {}
    for name, value in flags.items():
        key = typed.get(name, "").removeprefix("--").replace("-", "_")
        out[key if alias.get(key) == name else name] = value
    return out


def _check_sections(name: str, cls, section: str) -> None:
    """Refuse preset `name` when it has none of the sections `section` reads (LAYERS) and every key it has is
    a stage section that is also a section of `cls` (`eval:` alone for `raychat rl`, `data:` alone for
    pretrain): written as options nested by sections, it would be read as other commands' sections and
    ignored.

    Raises:
        ConfigError: naming the sections the command reads and those the file has.
    """
    data = read_preset(name)
    own = {f.name for f in dataclasses.fields(cls) if f.metadata.get("section")}
    if data and set(data) <= own:
        layers = LAYERS.get(section, (section,))
        raise ConfigError(
            f"--preset {name}: no {' or '.join(map(repr, layers))} section; its sections {sorted(data)} are "
            f"other commands' (stage sections: {list(STAGE_SECTIONS)}): put this command's options under "
            f"{layers[-1]}:"
        )


def from_args(args: argparse.Namespace, cls, section: str, base=None, where: str | None = None):
    """The config of a command: `base` (default `cls()`), the preset's `section` (when --preset is given and
    not 'none'), then the flags given, checked once merged (a flag may mend a preset's value that is invalid
    on its own), then the STORAGE_INPUTS rule (see the module doc).

    Raises:
        ConfigError: an unknown preset key or a bad value; a flag's is named as --flag, also in a config
            whose errors otherwise name keys (ServeConfig: a preset's values are named by key); a preset of
            only other commands' sections that are also sections of `cls` (_check_sections).
        FileNotFoundError: no such preset (lists the known ones).
    """
    config = base if base is not None else cls()
    name = getattr(args, "preset", None)
    if name is not None and not name.strip():
        raise ConfigError(f"--preset must not be blank: {PRESET_HELP}")
    preset = preset_values(name, section) if name and name != "none" else {}
    if name and name != "none" and not preset:
        _check_sections(name, cls, section)
    flags = _as_typed(args, cls, given(args, cls))
    config = from_dict(cls, preset, base=config, where=where, flags=flags)
    picked = chosen(args, cls, section)
    root = to_flat(config).get("storage_path")
    if "storage_path" in picked and root is not None:  # `storage_path: none` chooses no root
        root = root.rstrip("/")
        # a path, not the bare run name: a bare name that exists in the working directory is read from there
        inputs = {
            k: f"{root}/{run}" for k, run in STORAGE_INPUTS.items() if k in leaves(cls) and k not in picked
        }
        config = from_dict(cls, inputs, base=config)
    return config
