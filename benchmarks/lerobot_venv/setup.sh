#!/usr/bin/env bash
# The real lerobot 0.6.1, for the parity check and the baseline benchmark only (benchmarks/README.md,
# "Parity with lerobot"): its own Python 3.12 venv, never the project's (it pulls torch 2.11 and av 15,
# which do not install beside our pins). Not a project dependency; `make test` does not need it.
#
#   bash benchmarks/lerobot_venv/setup.sh /work/lerobot-venv
set -euo pipefail
venv=${1:?usage: setup.sh VENV_PATH}
PYENV_VERSION=${PYENV_VERSION:-3.12.1} python -m venv "$venv"
"$venv/bin/pip" install -q "lerobot[dataset]==0.6.1"
"$venv/bin/python" -c "import lerobot, torch, av, datasets; print('lerobot', lerobot.__version__, 'torch', torch.__version__, 'av', av.__version__)"
