#!/usr/bin/env bash
# `make demo`: the main job end to end on built-in sample data. No downloads, no
# cloud account, no GPU needed (uses one when present). Output: demo-out/ (git-ignored).
#   1 generate a LeRobot-v2 sample dataset (real H.264 mp4 + parquet) of the learnable task, in the
#     keys of GR00T N1.6's registered oxe_droid embodiment: actions are a known function of the
#     state and of what the frames show, so the eval at the end scores the policy against the
#     trivial baselines (predict-the-mean, repeat-last) and a ridge regression from the state
#   2 preprocess it into NV12 shards + global index (Beam, local runner; every frame once in
#     zstd blocks; shared/FORMAT.md) with the oxe_droid modality config: N1.6's statistics, the
#     joint actions relative to the state, 32-step chunks
#   3 inspect and hash-verify the shards
#   4 start a private Redis and the cache daemon
#   5 train the `tiny` recipe on 2 DeepSpeed ranks through the cache, launched by the elastic
#     supervisor (`loongforge train --elastic`: torchrun on a free port, one line for a fault or a
#     Ctrl-C instead of launcher tracebacks; train/resilience/elastic/)
#   6 print the step-time breakdown and write the chart; open-loop eval on held-out episodes
#   7 shut everything down (also on failure or Ctrl-C)
set -euo pipefail
OUT=${DEMO_OUT:-demo-out}
# tiny N1.6: ~0.13 s a step on 2 CPU cores. At 480 steps it has learned the (absolute) gripper but not yet
# oxe_droid's 32-step relative joint chunks (README, "make demo"); DEMO_STEPS=1440 gets further.
STEPS=${DEMO_STEPS:-480}
RANKS=${DEMO_RANKS:-2}
rm -rf "$OUT"; mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REDIS_PORT=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
SOCK="$OUT/cache.sock"
CACHE_PID=""

cleanup() {
  set +e
  if [ -n "$CACHE_PID" ] && kill -0 "$CACHE_PID" 2>/dev/null; then
    loongforge cache stop --socket "$SOCK" >/dev/null 2>&1 || kill "$CACHE_PID"
    wait "$CACHE_PID" 2>/dev/null
  fi
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1
}
trap cleanup EXIT INT TERM

step() { printf '\n== %s\n' "$*"; }

step "1/6 generate sample data"
loongforge sample-data "$OUT/dataset" --preset oxe-droid --episodes 16 --frames 60 90 --task learnable

step "2/6 preprocess (Beam, local runner)"
loongforge preprocess --input "$OUT/dataset" --output "$OUT/shards" --workers 2 --shard-size 256KB \
  --val-episodes 25% --embodiment-tag oxe_droid

step "3/6 inspect + verify"
loongforge inspect "$OUT/shards" --verify

step "4/6 start Redis (port $REDIS_PORT) and the cache daemon"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --logfile "$OUT/redis.log" --dir "$OUT"
loongforge cache serve --origin "$OUT/shards" --socket "$SOCK" --ram-dir "$OUT/cache-ram" \
  --ram-budget 256MiB --ssd-dir "$OUT/cache-ssd" --ssd-budget 1GiB \
  --redis-url "redis://127.0.0.1:$REDIS_PORT/0" --node-id demo-node > "$OUT/cache.log" 2>&1 &
CACHE_PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$SOCK" ] || { echo "cache daemon did not start; see $OUT/cache.log"; cat "$OUT/cache.log"; exit 1; }

GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [ "$GPUS" -gt 0 ] && python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  [ "$GPUS" -lt "$RANKS" ] && RANKS=$GPUS   # one rank per GPU
else
  export DS_ACCELERATOR=cpu                 # gloo ranks on the CPU
fi
# The supervisor picks a free port for each launch: another job on torchrun's or DeepSpeed's default
# port (29500) does not stop the demo.
step "5/6 train tiny recipe, $RANKS ranks, $STEPS steps (${DS_ACCELERATOR:-cuda})"
loongforge train --elastic --min-ranks "$RANKS" --max-ranks "$RANKS" \
  --data "$OUT/shards" --run-dir "$OUT/run" --recipe tiny --steps "$STEPS" \
  --cache-socket "$SOCK" --workers 1 --no-ds-breakdown --eval-every $(( STEPS < 100 ? STEPS : 100 )) --log-every 50

step "6/6 step-time breakdown"
loongforge profile "$OUT/run"
loongforge cache stats --socket "$SOCK"

step "open-loop eval on the held-out episodes"
loongforge eval "$OUT/run" --data "$OUT/shards"
echo
echo "demo finished: shards in $OUT/shards, run in $OUT/run"
if [ -d "$OUT/run/tensorboard" ]; then
  echo "watch it: tensorboard --logdir $OUT/run/tensorboard   (then open http://localhost:6006)"
else
  echo "watch it: pip install 'loongforge[track]' and rerun for TensorBoard curves (--report-to, README \"Watch a run\")"
fi
