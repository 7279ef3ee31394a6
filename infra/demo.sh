#!/usr/bin/env bash
# `make demo`: the main job end to end on built-in sample data. No downloads,
# no cloud account. Everything lands in demo-out/ (git-ignored).
set -euo pipefail
OUT=${DEMO_OUT:-demo-out}
rm -rf "$OUT"; mkdir -p "$OUT"
echo "== demo: placeholder until the services land"
