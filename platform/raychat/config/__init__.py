"""raychat's one configuration system: nested dataclass sections validated in __post_init__, one generator
of --flags (raychat.config.flags), YAML presets shipped as package data (raychat.config.presets).

  PrepareConfig, TokenizerConfig (raychat.config.data)  `raychat data prepare`, `raychat tokenizer train`
  TrainConfig (raychat.config.train)  pretrain / SFT: run, model, optim, data, layout, train
  RLConfig    (raychat.config.rl)     RL: training's run, optim and checkpoint sections, and RL's own
  SpeedrunConfig (raychat.config.speedrun)  `raychat speedrun`: the stage configs on one output root
  EvalConfig, ExportConfig (raychat.config.eval)  `raychat eval`, `raychat export`
  ServeConfig, VLLMConfig (raychat.config.serve)  the chat app's build_app args; the vLLM Serve config
"""

from raychat.config.eval import ChatConfig, EvalConfig, ExportConfig
from raychat.config.flags import add_flags, from_args
from raychat.config.presets import preset_names, preset_section, preset_values
from raychat.config.rl import RLConfig
from raychat.config.schema import ConfigError, from_dict, to_dict, to_flat, to_yaml
from raychat.config.serve import ServeConfig, VLLMConfig
from raychat.config.speedrun import SpeedrunConfig
from raychat.config.train import SFT_DEFAULTS, TrainConfig

__all__ = [
    "SFT_DEFAULTS",
    "ChatConfig",
    "ConfigError",
    "EvalConfig",
    "ExportConfig",
    "RLConfig",
    "ServeConfig",
    "SpeedrunConfig",
    "TrainConfig",
    "VLLMConfig",
    "add_flags",
    "from_args",
    "from_dict",
    "preset_names",
    "preset_section",
    "preset_values",
    "to_dict",
    "to_flat",
    "to_yaml",
]
