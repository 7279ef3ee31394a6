#!/usr/bin/env bash
# The GPU check on a machine that reaches no package registry (the H200 image: python3 3.12 with its
# own torch 2.11, transformers, triton, ...): install the carried wheels of `make gpu-bundle` next to
# the image's packages, never over them, and run `loongforge bench gpu-check` on the source tree.
#
#   bash infra/gpu/check.sh [gpu-check flags...]       # from the repository root, .gpu-bundle beside it
#
# BUNDLE (default .gpu-bundle), PYTHON (default python3: the image's, used as it is), SITE (where the
# wheels go, default /tmp/loongforge-site), RESULTS (default results/gpu). CHECK_ONLY=install stops
# after the install and the import check (the CPU rehearsal, make gpu-rehearse, runs that part).
# Where $OUT is set (the device tool), the results are copied there too.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
BUNDLE=${BUNDLE:-.gpu-bundle}
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/loongforge-site}
RESULTS=${RESULTS:-results/gpu}
t0=$(date +%s)

[ -f "$BUNDLE/MANIFEST.json" ] || { echo "check.sh: no $BUNDLE/MANIFEST.json: run \`make gpu-bundle\` on a machine with network first, then carry $BUNDLE with the tree" >&2; exit 2; }

# 1. The wheels, offline, without dependencies (the bundle names each one; the image has the rest).
rm -rf "$SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$SITE" "$BUNDLE"/wheels/*.whl

# 2. The source tree as the `loongforge` package, without building it (loongforge/__init__.py maps
# pyproject's package-dir layout of a checkout): the code in the tree is the code that runs.
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"  # deepspeed's launcher scripts

# 3. Everything imports under this python and torch before any GPU time is spent.
"$PYTHON" - <<'EOF'
import importlib, sys
import torch
mods = ["deepspeed", "pydantic", "hjson", "zstandard", "webdataset", "redis", "torchao.float8", "transformers",
        "safetensors", "numba", "loongforge.train.trainer", "loongforge.train.parallel.parallelize",
        "loongforge.benchmarks.micro.gpu_check"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as exc:  # noqa: BLE001 - reported, then the check stops
        bad.append(f"{m}: {type(exc).__name__}: {exc}")
print(f"check.sh: python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"{'a GPU' if torch.cuda.is_available() else 'no GPU'}), {len(mods) - len(bad)}/{len(mods)} imports")
if bad:
    sys.exit("check.sh: import failed:\n  " + "\n  ".join(bad))
EOF
echo "check.sh: installed in $(( $(date +%s) - t0 )) s"
[ "${CHECK_ONLY:-}" = install ] && exit 0

# 4. The check itself, on the bundle's shard root (no Beam, no PyAV here).
rc=0
"$PYTHON" -m loongforge bench gpu-check --out "$RESULTS" --shards "$BUNDLE/shards/gpu-check" "$@" || rc=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$RESULTS"/gpu-check-*.json "$RESULTS"/gpu-check-*.txt "$OUT"/ 2>/dev/null || true; fi
echo "check.sh: done in $(( $(date +%s) - t0 )) s, exit $rc"
exit $rc
