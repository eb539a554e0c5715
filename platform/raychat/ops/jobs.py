"""raychat's Ray jobs: the stages with an entrypoint under jobs/, and the Jobs API's default address (standard
library only: the `raychat submit` parser reads them without importing Ray)."""

STAGES = ("data", "tokenizer", "pretrain", "sft", "rl", "eval", "export", "speedrun")
# `command` runs the words after it as the entrypoint (any command, e.g. a smoke test of the cluster).
SUBMIT_CHOICES = STAGES + ("command",)
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
