#!/usr/bin/env bash
# Launch `loongforge.train` with the DeepSpeed launcher, one node or many.
#   infra/train/launch_deepspeed.sh [--hostfile FILE] [--gpus N] -- TRAIN ARGS...
# Examples:
#   DS_ACCELERATOR=cpu infra/train/launch_deepspeed.sh --gpus 2 -- --data shards --run-dir runs/a --recipe tiny
#   infra/train/launch_deepspeed.sh --hostfile infra/train/hostfile -- --data s3://b/shards --run-dir /shared/runs/b \
#       --recipe gr00t-n1.6 --zero 3 --batch-size 256 --workers 6 --cache-socket /run/loongforge/cache.sock
# The batch size is GLOBAL (all ranks); it must divide by ranks x --grad-accum.
set -euo pipefail
HOSTFILE=""; GPUS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile) HOSTFILE=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (train args go after --)" >&2; exit 2 ;;
  esac
done
ARGS=()
[ -n "$HOSTFILE" ] && ARGS+=(--hostfile "$HOSTFILE")
# One node: a free port, not DeepSpeed's fixed 29500 (another job there, or a MASTER_PORT left in the
# environment, would stop this one). With a hostfile every node must agree on one: MASTER_PORT, default 29500.
if [ -z "$HOSTFILE" ]; then
  MASTER_PORT=$("${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
ARGS+=(--master_port "${MASTER_PORT:-29500}")
[ -n "$GPUS" ] && ARGS+=(--num_gpus "$GPUS")
if [ -z "$GPUS" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}   # CPU/gloo: DeepSpeed cannot detect a device count
  ARGS+=(--num_gpus 1)
fi
# Config errors exit 2 here, before the launcher starts any rank (ranks would exit 2 too, later).
if [ -n "$HOSTFILE" ]; then
  WORLD=$(awk '!/^ *#/ && match($0, /slots=[0-9]+/) {n += substr($0, RSTART + 6, RLENGTH - 6)} END {print n + 0}' "$HOSTFILE")
elif [ -n "$GPUS" ]; then WORLD=$GPUS
elif command -v nvidia-smi >/dev/null 2>&1; then WORLD=$(nvidia-smi -L | wc -l)
else WORLD=1; fi
WORLD_SIZE=$WORLD "${PYTHON:-python}" -m loongforge.train --check-config "$@"
# --module: each rank runs `python -m loongforge.train` (the same entry torchrun uses).
exec deepspeed "${ARGS[@]}" --module loongforge.train "$@"
