# The README's two commands: `make demo` and `make test`. Both set themselves up
# on a fresh Debian machine: venv, pinned install, redis-server via apt-get.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(abspath $(VENV))/bin
STAMP  := $(VENV)/.installed
# NOTE: torch==2.13.0 is the CPU build on our machines; any other torch spec
# pulls a multi-GB CUDA build. GPU users: see README "GPU install".
TORCH  ?= torch==2.13.0
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: setup redis osmesa demo test test-full fit bench bench-quick parallel-full clean gpu-check gpu-bundle gpu-rehearse faults

setup: $(STAMP) redis osmesa

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (Debian package)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@redis-server --version

# MuJoCo's headless rendering for the simulator (`sample-data --sim`, `eval --env`): OSMesa, software OpenGL.
osmesa:
	@ldconfig -p | grep -q libOSMesa || { \
	  echo "installing libosmesa6 (Debian package: headless rendering of the simulator)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libosmesa6 >/dev/null; }

demo: setup
	PATH=$(BIN):$$PATH bash infra/demo.sh

# `make test` keeps pytest under 15 minutes on 2 cores: tests marked `full` (longer variants of
# behaviours the fast subset covers) run in `make test-full`. The 25 slowest are listed at the end.
# Two pytest-xdist workers, a test file each at a time (a file's module fixtures stay in one process;
# the session fixtures several files read are made once, tests/conftest.py once_per_session): the
# suite in one process keeps ~1.1 of the 2 cores busy (its launches wait on sockets, timeouts, disks).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -m "not full" -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

test-full: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fit test (tests/train/test_fit.py): tiny recipe, default schedule, GR00T-shaped data with binary
# hand commands; beats 0.5 x repeat-last and ridge-from-state on its training episodes. Minutes of CPU.
fit: setup
	$(BIN)/python -m pytest -q -s tests/train/test_fit.py $(PYTEST_ARGS)

# The 8-process TP x SP x DP correctness layouts (too heavy for `make test` on 2 cores).
parallel-full: setup
	LOONGFORGE_PARALLEL_FULL=1 $(BIN)/python -m pytest -q -m parallel_full tests/train/parallel $(PYTEST_ARGS)

# `loongforge bench` lists every benchmark (benchmarks/README.md); these are the data-path one.
bench: setup
	$(BIN)/loongforge bench data

bench-quick: setup
	$(BIN)/loongforge bench data --quick

# Fault-injection suite: each fault against a real 2-rank gloo run under `loongforge train --elastic`;
# table + JSON under results/ (README "Reliability"). Its tests: tests/train/resilience/test_faults.py.
faults: setup
	$(BIN)/loongforge bench faults
	$(BIN)/python -m pytest -q -m full tests/train/resilience/test_faults.py $(PYTEST_ARGS)

# The offline GPU path (README "GPU check"). Here, with network: `make gpu-bundle` writes .gpu-bundle/
# (the wheels the H200 image lacks, for its Python 3.12, and the check's shard root; sizes printed,
# 64 MiB with the working tree at most); there, with no network: `bash infra/gpu/check.sh` installs
# them next to the image's own torch 2.11 and runs the check. `make gpu-rehearse` does here what
# check.sh does there, in a Python 3.12 venv with torch 2.11 and the image's other packages (a CUDA
# build from PyPI, run on the CPU: ~5 GB once), plus every CPU-runnable part.
BUNDLE ?= .gpu-bundle
gpu-bundle: setup
	$(BIN)/python infra/gpu/bundle.py --out $(BUNDLE)

gpu-rehearse: gpu-bundle
	BUNDLE=$(BUNDLE) bash infra/gpu/rehearse.sh

# GPU box with network, this venv: the same torch pin, CUDA build, from GPU_TORCH_INDEX alone.
# pip's own configuration is set aside for that one install (PIP_CONFIG_FILE=/dev/null loads no config
# file; the PIP_* variables are unset): an empty PIP_FIND_LINKS does not override a pip.conf
# find-links, and a wheelhouse holding 2.13.0+cpu would win (`torch==2.13.0` matches it and the local
# version sorts higher). The [gpu] extra (flash-attn) only as a prebuilt wheel: PyPI has its sdist only
# and a source build takes far longer than the check; without a wheel for this torch its tests are
# reported as skipped, by name, in the JSON.
GPU_TORCH_INDEX ?= https://pypi.org/simple
GPU_PIP_ENV := env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null
gpu-check: setup
	@$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" || { \
	  echo "torch in $(VENV) is a CPU build: installing $(TORCH) (CUDA build) from $(GPU_TORCH_INDEX)"; \
	  $(BIN)/pip uninstall -q -y torch && $(GPU_PIP_ENV) $(BIN)/pip install -q --index-url $(GPU_TORCH_INDEX) '$(TORCH)'; }
	@$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'gpu-check: torch ' + torch.__version__ + ' is still a CPU build')"
	@$(BIN)/pip install -q --only-binary flash-attn -e '.[gpu]' || \
	  echo "gpu-check: no flash-attn wheel for this torch/CUDA/Python; its tests will be reported as skipped"
	$(BIN)/loongforge bench gpu-check

clean:
	rm -rf $(VENV) demo-out .pytest_cache $(BUNDLE) .gpu-rehearse
