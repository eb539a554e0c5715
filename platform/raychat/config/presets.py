"""YAML presets: package data under raychat/presets/ (read through importlib.resources, so they are found from
any directory, in a wheel and in a Ray job's py_modules copy), or any YAML file by path.

A preset has one section per stage, each holding options by flat name (the --flag without dashes):
  data:      `raychat data prepare` (source, num_shards)
  tokenizer: `raychat tokenizer train` (vocab_size)
  train:     pretraining (TrainConfig)       sft: SFT, on top of train (TrainConfig)
  rl:        RL (RLConfig)                   serve: `raychat serve` / build_app (ServeConfig)
  eval:      `raychat eval` (EvalConfig)
A file with none of these sections is one section by itself (an RL `--config` file of RLConfig options).
"""

from __future__ import annotations

from collections.abc import Hashable
from importlib import resources
from pathlib import Path

import yaml

from raychat.config.schema import close_keys

STAGE_SECTIONS = ("data", "tokenizer", "train", "sft", "rl", "serve", "eval")
# what a command reads from a preset: its sections, later ones on top
LAYERS = {"pretrain": ("train",), "sft": ("train", "sft"), "rl": ("rl",), "serve": ("serve",)}
SPEEDRUN_PRESET_HELP = "preset name (tiny, cpu, gpu8, cluster: raychat/presets/) or a YAML path"
PRESET_HELP = f"{SPEEDRUN_PRESET_HELP}; 'none' = no preset"  # the stage commands'; a speedrun needs one


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in resources.files("raychat").joinpath("presets").iterdir()
                  if p.name.endswith(".yaml"))  # fmt: skip


def read_preset(name_or_path: str) -> dict:
    """The whole preset as a dict: a shipped preset by name, or a YAML file by path.

    Raises:
        FileNotFoundError: no such preset or file (the message lists the shipped presets).
        ValueError: the file is not UTF-8 text, not valid YAML (the message names the line; a key given twice
            in one mapping counts as invalid) or not a mapping of sections that are mappings; a file with a
            stage section and a key that is none (naming it, a close section name and STAGE_SECTIONS).
    """
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(
                f"--preset: file {path} does not exist; shipped presets: {preset_names()}"
            )
        if not path.is_file():
            raise ValueError(f"--preset: {path} is not a regular file; shipped presets: {preset_names()}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--preset: {path} is not a UTF-8 text file (byte {e.start}: {e.reason})"
            ) from None
    else:
        item = resources.files("raychat").joinpath("presets", f"{name_or_path}.yaml")
        if not item.is_file():
            raise FileNotFoundError(f"--preset: no preset {name_or_path!r}; known presets: {preset_names()}")
        text = item.read_text()
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"--preset: {name_or_path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ValueError(f"preset {name_or_path}: expected a mapping of sections, got {type(data).__name__}")
    # a file without stage sections is one section (its keys are options); with one, every key is a section
    unknown = sorted(str(key) for key in data if key not in STAGE_SECTIONS)
    if unknown and len(unknown) < len(data):
        raise ValueError(
            f"--preset {name_or_path}: unknown sections {unknown}{close_keys(unknown, list(STAGE_SECTIONS))}; "
            f"allowed: {list(STAGE_SECTIONS)}"
        )
    for section in STAGE_SECTIONS:
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ValueError(
                f"--preset {name_or_path}: section {section!r} must be a mapping of options, got "
                f"{type(data[section]).__name__} {data[section]!r}"
            )
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently); the
    keys a merge key (`<<: *base`) brings in are not the mapping's own, which replace them as in safe_load."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader refuses it below: "found unhashable key", naming its line
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def preset_section(name_or_path: str, section: str) -> dict:
    """One stage section of a preset ({} when absent); a file without stage sections is the section itself."""
    data = read_preset(name_or_path)
    if not any(s in data for s in STAGE_SECTIONS):
        return dict(data)
    return dict(data.get(section) or {})


def preset_values(name_or_path: str, command: str) -> dict:
    """What `command` (pretrain, sft, rl, serve, or a section name) reads from a preset: its LAYERS, each on
    top of the one before (_layered: an sft `optim: {matrix_lr: 0.01}` keeps the train section's other optim
    options)."""
    data = read_preset(name_or_path)
    if not any(s in data for s in STAGE_SECTIONS):
        return dict(data)
    out: dict = {}
    for layer in LAYERS.get(command, (command,)):
        out = _layered(out, data.get(layer) or {})
    return out


def _layered(lower: dict, upper: dict) -> dict:
    """`upper` on top of `lower`, options by flat name or nested in sections: an option `upper` sets (a key
    whose value is not a mapping, at any depth: flat names are unique in a config) leaves `lower` wherever
    `lower` has it, and a section both have is layered key by key."""

    def options(values: dict) -> set:
        return {k for k, v in values.items() if not isinstance(v, dict)}.union(
            *(options(v) for v in values.values() if isinstance(v, dict))
        )

    def without(values: dict, names: set) -> dict:
        return {
            k: without(v, names) if isinstance(v, dict) else v
            for k, v in values.items()
            if isinstance(v, dict) or k not in names
        }

    out = without(lower, options(upper))
    for key, value in upper.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _layered(out[key], value) if both else value
    return out
