"""raychat's Ray jobs: the stages with an entrypoint under jobs/, the Jobs API's default address and the k8s
extra's install line (standard library only: the `raychat submit` parser reads them without importing Ray)."""

STAGES = ("data", "tokenizer", "pretrain", "sft", "rl", "eval", "export", "speedrun")
# `command` runs the words after it as the entrypoint (any command, e.g. a smoke test of the cluster).
SUBMIT_CHOICES = STAGES + ("command",)
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Ray's job supervisor SIGKILLs a stopped job's driver RAY_JOB_STOP_WAIT_TIME_S after its SIGTERM (3 s in Ray
# 2.60), read from its own environment, which the job's runtime_env env_vars reach; a stage's driver took up to
# 4.1 s from SIGTERM to exit (docs/deployment.md): a stage's job gets 30 s (`raychat submit`: job_env_vars; the
# RayJobs: raychat.ops.k8s.rayjob)
STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
STAGE_STOP_WAIT_S = 30
# the optional extra `raychat[k8s]` (kubernetes, grafana-client, niquests) that `k8s submit` (not --dry-run) and
# `grafana provision` need
K8S_EXTRA_INSTALL = 'pip install -c constraints.txt -e ".[k8s]" in the raychat checkout'
