#!/usr/bin/env bash
# Run `loongforge preprocess` on Google Cloud Dataflow.
#
#   PROJECT=my-proj TEMP=gs://my-bkt/tmp infra/dataflow/launch.sh \
#       gs://my-bkt/lerobot/gr1_pick gs://my-bkt/shards/gr1_pick [--block-frames 16 ...] [-- BEAM FLAGS]
#
# Flags before `--` are job flags (see `loongforge preprocess --help`); flags
# after it are extra Beam/Dataflow options (e.g. --max_num_workers=64).
#
# Packaging: Beam builds an sdist of this repo from pyproject.toml
# (--setup_file, via `python -m build --no-isolation`), so workers import the
# same loongforge code as the launcher; the preprocess extra's packages come
# from requirements.txt beside this script. The launcher needs
# `pip install 'loongforge[preprocess]' build gcsfs` and gcloud credentials
# (application-default login or a service account).
#
# Environment: PROJECT (required), TEMP (required, gs:// temp/staging prefix),
# REGION (us-central1), MACHINE_TYPE (n2-standard-8), MAX_WORKERS (32),
# SDK_IMAGE (optional custom container, e.g. with FFmpeg/PyAV preinstalled).
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,8p' "$0"; exit 2; }
: "${PROJECT:?set PROJECT=<gcp project>}"
: "${TEMP:?set TEMP=gs://<bucket>/tmp}"
REGION=${REGION:-us-central1}
MACHINE_TYPE=${MACHINE_TYPE:-n2-standard-8}
MAX_WORKERS=${MAX_WORKERS:-32}
INPUT=$1 OUTPUT=$2
shift 2

JOB_ARGS=() BEAM_ARGS=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; BEAM_ARGS=("$@"); break; fi
  JOB_ARGS+=("$1"); shift
done

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
"$PY" -c 'import build, gcsfs' 2>/dev/null || {
  echo "launcher needs the 'build' and 'gcsfs' packages: $PY -m pip install build gcsfs" >&2; exit 1; }

IMAGE_ARGS=()
[ -n "${SDK_IMAGE:-}" ] && IMAGE_ARGS=(--sdk_container_image="$SDK_IMAGE")

cd "$REPO"
# Dataflow runs one SDK process per vCPU; each decodes one episode at a time
# single-threaded, the same shape as the local runner's one process per core.
exec "$PY" -m loongforge.preprocess.pipeline \
  --input "$INPUT" --output "$OUTPUT" "${JOB_ARGS[@]}" \
  --runner=DataflowRunner \
  --project="$PROJECT" --region="$REGION" \
  --temp_location="$TEMP/temp" --staging_location="$TEMP/staging" \
  --job_name="loongforge-preprocess-$(date -u +%Y%m%d-%H%M%S)" \
  --setup_file="$REPO/pyproject.toml" \
  --requirements_file="$REPO/infra/dataflow/requirements.txt" \
  --machine_type="$MACHINE_TYPE" --max_num_workers="$MAX_WORKERS" \
  "${IMAGE_ARGS[@]}" "${BEAM_ARGS[@]}"
