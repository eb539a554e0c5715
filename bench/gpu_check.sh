#!/usr/bin/env bash
# The GPU check of issue 21 item 6: one command, under 9 minutes on one H100/H200, one JSON line at the end
# (bench/gpu_check.py says what it measures). Prepared on a CPU machine: NOT run here (no GPU).
#
#   bash bench/gpu_check.sh                 # from the repo root, .venv built with CUDA torch (README)
#   bash bench/gpu_check.sh --dry-run       # tiny sizes on the CPU (tests/ray/test_gpu_check.py runs it)
#
# The vLLM column needs the vLLM environment (constraints-vllm.txt); without it the JSON says it was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
export PYTHONPATH="$PWD/platform:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec python bench/gpu_check.py "$@"
