#!/usr/bin/env bash
# `make gpu-rehearse`: the offline GPU check as far as a CPU allows, before any GPU time is spent.
#  1. a venv like the H200 image: Python 3.12, torch 2.11 (PyPI's CUDA build: it runs on the CPU) and
#     the image's other packages the project imports (infra/gpu/image-rehearse.txt), made once;
#  2. the bundle installed exactly as infra/gpu/check.sh installs it there (same script, CHECK_ONLY=install:
#     --no-index --no-deps --target, the tree on PYTHONPATH), and its import check;
#  3. every GPU test imported and collected (`pytest -m gpu --collect-only`: none may error);
#  4. the check's CPU-runnable parts: its bookkeeping tests, the bundle's contents test, the CPU tests
#     of the first-GPU-run defects (ZeRO-3 dtype and persistence, top-k decode order, no host sync in
#     the step, fusion policy) and its training runs (tiny, and tiny with --zero 3
#     --grad-compression topk) on the bundle's shards on the CPU, through train_run, which must fail
#     only on what a GPU provides;
#  5. check.sh end to end, which on a CPU must get as far as the check and be refused there.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
BUNDLE=${BUNDLE:-.gpu-bundle}
WORK=${REHEARSE_DIR:-.gpu-rehearse}
VENV=$WORK/venv
PY312=${PY312:-$(PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || command -v python3.12 || true)}
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ] || [ infra/gpu/image-rehearse.txt -nt "$VENV/.installed" ]; then
  [ -n "$PY312" ] || { echo "rehearse.sh: no Python 3.12 here (pyenv install 3.12, or set PY312)" >&2; exit 2; }
  "$PY312" -m venv "$VENV"
  # NOTE: torch==2.11.0 from PyPI is its CUDA build (~5 GB with its nvidia-* libraries): once.
  "$VENV/bin/pip" install -q -r infra/gpu/image-rehearse.txt
  touch "$VENV/.installed"
fi
PY=$(cd "$VENV/bin" && pwd)/python
SITE=$(mkdir -p "$WORK" && cd "$WORK" && pwd)/site

# 2. exactly what check.sh does on the GPU box, up to the check itself
PYTHON=$PY SITE=$SITE BUNDLE=$BUNDLE CHECK_ONLY=install bash infra/gpu/check.sh
export PYTHONPATH="$SITE:$REPO" PATH="$SITE/bin:$PATH" CUDA_VISIBLE_DEVICES=""

# 3. every GPU test imports and collects under this python, torch and the bundle, as the check collects them
"$PY" - <<'EOF'
import sys
from loongforge.benchmarks.micro import gpu_check

ids, error = gpu_check.collect_gpu_tests()
if error or not ids:
    sys.exit(f"rehearse.sh: collecting the GPU tests failed ({len(ids)} collected):\n{error}")
files = gpu_check.groups_of(ids)
print(f"rehearse.sh: {len(ids)} GPU tests in {len(files)} files collected (every one imports): "
      + ", ".join(f"{f.split('/')[-1]} {len(n)}" for f, n in files))
EOF

# 4. the check's CPU-runnable parts, and the first-GPU-run defects' CPU tests, under torch 2.11
"$PY" -m pytest -q -p no:cacheprovider tests/benchmarks/test_gpu_check.py tests/benchmarks/test_gpu_bundle.py \
  tests/train/test_first_gpu_run.py tests/train/parallel/test_compression.py tests/train/parallel/test_zero.py \
  -k "not plumbing and not close_mid_epoch and not zero3_ranks_hold and not tp_sp_matches and not 2_ranks"
"$PY" -m pytest -q -p no:cacheprovider tests/train/kernels/test_fusion.py -k "policy or auto_fusion"
"$PY" - "$BUNDLE" <<'EOF'
import sys, tempfile
from loongforge.benchmarks.micro import gpu_check

shards = f"{sys.argv[1]}/shards/gpu-check"
flags = tuple(gpu_check.write_shards(shards))  # the bundle's root, read as it is
with tempfile.TemporaryDirectory() as work:
    for extra in ((), gpu_check.TOPK):
        res = gpu_check.train_run("tiny", shards, work, 4, 300, device="cpu", extra=extra, data_flags=flags)
        gpu_only = [p for p in res.get("problems", []) if "CUDA-event" in p or "no GPU trace" in p]
        label = res["recipe"]
        if res["exit_code"] != 0 or res.get("problems") != gpu_only:
            sys.exit(f"rehearse.sh: the {label} run failed: {res.get('problems')}\n{res.get('log_tail', '')}")
        print(f"rehearse.sh: {label} on CPU: trained {res['seconds']} s, profiled; only the GPU-only checks "
              f"failed ({len(gpu_only)})")
EOF
# 5. check.sh end to end: on a CPU its last step, the check, must refuse clearly (exit 2, no result)
rc=0
PYTHON=$PY SITE=$SITE BUNDLE=$BUNDLE RESULTS=$WORK/results bash infra/gpu/check.sh > "$WORK/check.log" 2>&1 || rc=$?
if [ "$rc" != 2 ] || ! grep -q "sees no CUDA device" "$WORK/check.log"; then
  tail -20 "$WORK/check.log"; echo "rehearse.sh: check.sh did not reach the check (exit $rc)" >&2; exit 1
fi
echo "rehearse.sh: check.sh ran through to the check, which refused the CPU (exit 2) as it must"
echo "rehearse.sh: passed in $(( $(date +%s) - t0 )) s"
