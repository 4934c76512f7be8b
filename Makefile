# Two commands do all the setup: `make train` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test simulate lint clean

# (Re)install when pyproject.toml changes; the venv is created on first use.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The main job. Until the trainer lands it is the simulator study of the calibrated workload.
train: $(STAMP)
	$(VENV)/bin/sagc-jax simulate --config configs/sim/reasoning_drift.yaml

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check sagc_jax tests benchmarks
	$(VENV)/bin/ruff format --check sagc_jax tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache runs
