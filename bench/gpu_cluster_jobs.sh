#!/usr/bin/env bash
# Issue 12 on a GPU machine (prepared, NOT run: this project's machines have no GPU). Under 8 minutes:
# `ray start --head` on the GPU machine, then pretraining (depth 12, 50 steps, on the GPU) and SFT from it, each
# submitted as a Ray job with `raychat submit`; the job logs' step lines (tokens/s, MFU) are committed under
# bench/results/.
#
#   bash bench/gpu_cluster_jobs.sh            # from the repo root, with .venv built (make venv)
#
# The issue names `raychat submit --num-gpus 1 pretrain ...`: --num-gpus reserves GPUs for the job's DRIVER
# (entrypoint_num_gpus). On a 1-GPU machine that reservation would hold the only GPU while the Ray Train worker
# waits for one, forever; so the driver reserves a GPU only when the machine has more than one.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"  # the job's `python` must be this venv's (docs/deployment.md)
export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-gpu-jobs}
export RAY_AUTH_MODE=token
ROOT=${ROOT:-/tmp/raychat-gpu-runs}
OUT=bench/results/gpu_cluster_jobs.md
LOGS=bench/results/gpu_cluster_jobs
GPUS=$(nvidia-smi -L | wc -l)
DRIVER_GPUS=()
if [ "$GPUS" -gt 1 ]; then DRIVER_GPUS=(--num-gpus 1); fi
mkdir -p "$RAY_TMPDIR" "$ROOT" "$LOGS"

ray start --head --num-gpus="$GPUS" --temp-dir="$RAY_TMPDIR" --include-dashboard=true \
    --dashboard-host=127.0.0.1 --disable-usage-stats
trap 'ray stop --force' EXIT
ADDR=(--address http://127.0.0.1:8265)

submit() {  # submit JOB_ID STAGE ARGS...: one Ray job, followed; its log to $LOGS/JOB_ID.log
    local id=$1; shift
    local t0=$SECONDS
    raychat submit "${ADDR[@]}" --job-id "$id" "$@" 2>&1 | tee "$LOGS/$id.log"
    echo "$id: $((SECONDS - t0)) s" >> "$LOGS/wall.txt"
}

: > "$LOGS/wall.txt"
submit gpu-data data prepare --storage-path "$ROOT"                                 # debian-docs, ~1 min
submit gpu-tokenizer tokenizer train --storage-path "$ROOT" --vocab-size 8192
INPUTS=(--storage-path "$ROOT" --data-dir "$ROOT/data" --tokenizer-path "$ROOT/tokenizer")  # gpu8 names its own
submit gpu-pretrain "${DRIVER_GPUS[@]}" pretrain --preset gpu8 "${INPUTS[@]}" --depth 12 --use-gpu \
    --num-workers 1 --num-iterations 50 --eval-every 0 --checkpoint-every 50
# SFT takes the shape (--depth) from its --init-from and reads no --data-dir: both are refused there
submit gpu-sft "${DRIVER_GPUS[@]}" sft --preset gpu8 --storage-path "$ROOT" --tokenizer-path "$ROOT/tokenizer" --use-gpu \
    --num-workers 1 --num-iterations 50 --eval-every 0 --checkpoint-every 50 --init-from latest

{
    echo "# issue 12 on a GPU: pretrain + SFT as Ray jobs (bench/gpu_cluster_jobs.sh)"
    echo
    echo "Command: \`bash bench/gpu_cluster_jobs.sh\`; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $GPUS; load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo '```'
    cat "$LOGS/wall.txt"
    grep -h "step .*tok/s" "$LOGS/gpu-pretrain.log" "$LOGS/gpu-sft.log" | sed 's/^.*) //'
    echo '```'
} > "$OUT"
cat "$OUT"
