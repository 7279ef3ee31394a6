#!/usr/bin/env bash
# Launch `loongforge.train` with torchrun (elastic rendezvous), one node or many.
#   NNODES=1 NPROC=2 infra/train/launch_torchrun.sh --data shards --run-dir runs/a --recipe tiny
# Multi-node: run the same command on every node with NNODES, NODE_RANK and
# MASTER_ADDR (the rendezvous host) set, e.g.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=gpu-node-0 NPROC=8 infra/train/launch_torchrun.sh --data ... --zero 3
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC=${NPROC:-$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L | wc -l || echo 2)}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# One node: a free port of the kernel's choosing (torchrun's c10d rendezvous on localhost:0), so another
# job on 29500 (or a MASTER_PORT left in the environment) does not stop this one. Several nodes must
# agree on one: MASTER_PORT, default 29500.
if [ "$NNODES" = 1 ]; then
  RDZV=(--standalone)
else
  RDZV=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}")
fi
command -v nvidia-smi >/dev/null 2>&1 || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# Config errors (unknown recipe, batch not divisible by the ranks, no index under --data, a run dir that
# holds checkpoints without --resume/--overwrite) exit 2 here, in seconds, before any rank or process
# group: torchrun itself returns 1 for any failed rank.
WORLD_SIZE=$((NNODES * NPROC)) "${PYTHON:-python}" -m loongforge.train --check-config "$@"
exec torchrun "${RDZV[@]}" --nproc_per_node "$NPROC" -m loongforge.train "$@"
