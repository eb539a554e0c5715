#!/usr/bin/env bash
# Issue 13's GPU check, prepared but NOT run here (the machines this was written on have no GPU):
# `raychat serve --num-gpus 1` with a depth-12 random model on the GPU, then the hostile soak
# (bench/serve_hostile.py) for 2 minutes at 64 streams, after a 1-minute clean soak; writes the table.
#
#   bash bench/gpu_serve_hostile.sh [OUT]      # default OUT: bench/results/serve_hostile_soak_gpu.md
#
# Needs a CUDA torch in .venv (make venv TORCH_INDEX=https://download.pytorch.org/whl/cu128) and one GPU.
# Budget: checkpoint ~0.5 min, server start ~1 min, soaks 3 min, shutdown ~0.5 min: under 8 minutes.
# It fails (non-zero exit) if the engine process does not hold GPU memory, i.e. the model is not on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/serve_hostile_soak_gpu.md}
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d /tmp/rc-gpu-XXXXXX)
export RAY_TMPDIR=$WORK/ray RAY_AUTH_MODE=disabled
PORT=$($PY -c 'from raychat.ports import free_ports; print(free_ports(1)[0])')
URL=http://127.0.0.1:$PORT
SERVER=

health() {  # the /health JSON, or a non-zero exit while the server is not up
  $PY -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$URL/health', timeout=5).read().decode())" 2>/dev/null
}

cleanup() {
  if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
    kill -INT "$SERVER"; sleep 20; kill -9 "$SERVER" 2>/dev/null || true
  fi
}
trap cleanup EXIT

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY -c 'import torch; assert torch.cuda.is_available(), "torch has no CUDA here"; print("torch", torch.__version__, torch.version.cuda)'

echo "== a depth-12 random checkpoint (bench/serve_load.py's tiny_checkpoint: BPE 1024, max_seq_len 512)"
$PY -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from serve_load import tiny_checkpoint; tiny_checkpoint(Path('$WORK/ckpt'), 12)"

echo "== raychat serve --num-gpus 1 on port $PORT"
$PY -m raychat.cli serve --checkpoint "$WORK/ckpt" --num-gpus 1 --num-cpus 2 --max-slots 64 --port "$PORT" \
  > "$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
  if health > /dev/null; then break; fi
  kill -0 "$SERVER" || { tail -40 "$WORK/serve.log"; exit 1; }
  sleep 1
done
health | $PY -m json.tool

echo "== the engine process holds GPU memory (the model is on the GPU)"
PIDS=$(health | $PY -c 'import json, sys; print(" ".join(map(str, json.load(sys.stdin)["engine"]["child_pids"])))')
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee "$WORK/gpu_apps.csv"
ON_GPU=0
for pid in $PIDS; do grep -q "^$pid," "$WORK/gpu_apps.csv" && ON_GPU=1; done
[ "$ON_GPU" = 1 ] || { echo "no engine process ($PIDS) on the GPU"; exit 1; }

echo "== soaks: 1 min clean, 2 min with 10% hostile requests, 64 streams"
$PY bench/serve_hostile.py --url "$URL" --streams 64 --clean-s 60 --duration-s 120 --out "$OUT"
{ echo; echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); engine process GPU memory:";
  sed 's/^/    /' "$WORK/gpu_apps.csv"; echo "command: bash bench/gpu_serve_hostile.sh $*"; } >> "$OUT"
cat "$OUT"
