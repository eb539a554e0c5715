"""The speedrun's configuration (`raychat speedrun`): each stage's own config, built once from a preset on one
output root in the layout README documents (<out>/data, <out>/tokenizer, <out>/checkpoints/{base,sft},
<out>/rl/rl, and the task data directory of SFT, RL and the report card: <out>/task_data unless the preset or
$RAYCHAT_TASK_DATA names one). A stage's input checkpoint is the stage before's result, set when that stage has
run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from raychat.config.data import PrepareConfig, TokenizerConfig
from raychat.config.presets import preset_section, preset_values
from raychat.config.rl import RLConfig
from raychat.config.schema import ConfigError, coerce, flatten, from_dict, owned_literal
from raychat.config.train import SFT_DEFAULTS, TrainConfig

DATA = "data"  # the speedrun's prepared data under --out
TASK_DATA = "task_data"  # the speedrun's task data directory under --out
# the storage roots of its runs under --out: checkpoints/{base,sft}, rl/rl
CHECKPOINTS = "checkpoints"
RL = "rl"


class StageConfigError(ConfigError):
    """A ConfigError raised while one training stage's config was built from the preset: `stage` is "pretrain",
    "sft" or "rl"; the message names the options as that stage's command does (--flags): raychat.speedrun names
    them by the preset's keys (raychat.speedrun.stage_keys)."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


def _stage(stage: str, cls, values: dict, **kw):
    """from_dict(cls, values, **kw); its ConfigError as StageConfigError of `stage`."""
    try:
        return from_dict(cls, values, **kw)
    except ConfigError as e:
        raise StageConfigError(str(e), stage) from e


def _flat(stage: str, cls, values: dict, where: str) -> dict:
    """flatten(cls, values, where); its ConfigError as StageConfigError of `stage`."""
    try:
        return flatten(cls, values, where)
    except ConfigError as e:
        raise StageConfigError(str(e), stage) from e


def _length(stage: str, cls, name: str, sections: dict[str, dict]) -> int:
    """Option `name` (SFT's num_iterations, RL's steps) as the preset's `sections` ({section: its values},
    flat or nested; a later one on top) set it, 0 when none does.

    Raises:
        StageConfigError: an unknown key in a section.
        ConfigError: a value that is not an integer, naming `<section>.<name>` ("sft.num_iterations must be an
            integer, got None").
    """
    value, key = 0, ""
    for section, values in sections.items():
        flat = _flat(stage, cls, values, f"{section} settings")
        if name in flat:
            value, key = flat[name], f"{section}.{name}"
    return coerce(int, value, key)


@dataclass
class SpeedrunConfig:
    """The stages of the speedrun; sft and rl are None when the preset does not run them: its `sft` section
    is absent or sets no positive num_iterations (one it does not set is its `train` section's, as for
    `raychat sft`), its `rl` section sets no positive steps. sft_keys: the flat names the `sft` section sets
    (the other SFT settings are the `train` section's), read with the preset once: how the speedrun's lines
    name SFT's options (raychat.speedrun.speedrun_flags)."""

    out: str
    data: PrepareConfig
    tokenizer: TokenizerConfig
    pretrain: TrainConfig
    sft: TrainConfig | None
    rl: RLConfig | None
    sft_keys: frozenset[str] = frozenset()

    @classmethod
    def from_preset(cls, preset: str, out: str = "runs", num_iterations: int | None = None) -> SpeedrunConfig:
        """The preset's stage sections on the layout under `out` (made absolute); `num_iterations` replaces
        pretraining's. SFT's and RL's task_data_dir: the preset's (SFT's: its sft section's, else its train
        section's), else '' when $RAYCHAT_TASK_DATA is set (which then names it), else <out>/task_data.

        Raises:
            ConfigError: an unknown key or a bad value in a section (the message names the section; of the
                train, sft and rl sections a StageConfigError naming the stage); an sft num_iterations or rl
                steps that is not an integer, naming the key (`sft.num_iterations`); a blank
                `out` (which would put the runs in the current directory), a file, or a URI (s3://, gs://).
        """
        if not out.strip() or (Path(out).exists() and not Path(out).is_dir()):
            raise ConfigError(f"--out must be a directory, got {out!r} (default: 'runs')")
        if "://" in out:  # Path() would make s3://b/x the local folder ./s3:/b/x
            raise ConfigError(
                f"--out must be a local or NFS directory (every node reads the data and the tokenizer under it as "
                f"files), got {out!r}"
            )
        root = Path(out).resolve()
        data_dir, tok_dir, checkpoints = root / DATA, root / "tokenizer", root / CHECKPOINTS
        data = from_dict(
            PrepareConfig, {**preset_section(preset, "data"), "out": str(data_dir)}, where="data settings"
        )
        tokenizer = from_dict(
            TokenizerConfig,
            {**preset_section(preset, "tokenizer"), "data_dir": str(data_dir), "out": str(tok_dir)},
            where="tokenizer settings",
        )
        layout = {"data_dir": str(data_dir), "tokenizer_path": str(tok_dir), "storage_path": str(checkpoints)}
        train_values = preset_values(preset, "pretrain")
        values = {**train_values, **layout, "run_name": "base", "stage": "pretrain"}
        if num_iterations is not None:
            values["num_iterations"] = num_iterations
        pretrain = _stage("pretrain", TrainConfig, values, where="train settings")
        sft_values, rl_values = preset_section(preset, "sft"), preset_section(preset, "rl")
        env = owned_literal("raychat.tasks.hub_data", "TASK_DATA_ENV")
        task_data = "" if os.environ.get(env) else str(root / TASK_DATA)  # '': the variable names it
        sft_keys = frozenset(_flat("sft", TrainConfig, sft_values, "sft settings"))
        layers = {"train": train_values, "sft": sft_values} if sft_values else {}
        sft_iterations = _length("sft", TrainConfig, "num_iterations", layers)
        sft = None
        if sft_iterations > 0:
            tasks_dir = pretrain.data.task_data_dir or task_data  # the train section's, else the speedrun's
            sft_values = {"eval_every": 0, "checkpoint_every": 0, "task_data_dir": tasks_dir, **sft_values}
            # its num_iterations as _length found it: the train section's, not --num-iterations' (pretraining's)
            sft_values |= {**SFT_DEFAULTS, "num_iterations": sft_iterations}
            sft = _stage("sft", TrainConfig, sft_values, base=pretrain, where="sft settings")
        rl = None
        if _length("rl", RLConfig, "steps", {"rl": rl_values}) > 0:
            rl_values = {
                "task_data_dir": task_data,
                **rl_values,
                "storage_path": str(root / RL),
                "run_name": "rl",
            }
            rl = _stage("rl", RLConfig, rl_values, where="rl settings")
        return cls(str(root), data, tokenizer, pretrain, sft, rl, sft_keys)
