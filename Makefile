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

# The main job: the CPU demo. The SFT warm start is reused when runs/demo/sft already has it
# with the same config (an interrupted one resumes; a changed config is refused: retrain it with
# `make train SFT_FLAGS=--force`); every GRPO run gets a fresh directory (point logging.run_dir
# at an old one to resume it).
DEMO := configs/demo.yaml
SFT_FLAGS ?=
train: $(STAMP)
	$(VENV)/bin/sagc-jax sft --config $(DEMO) --set logging.run_dir=runs/demo/sft $(SFT_FLAGS)
	$(VENV)/bin/sagc-jax train --config $(DEMO) --set train.init_checkpoint=runs/demo/sft \
		--set logging.run_dir=runs/demo/grpo-sagc-$$(date +%Y%m%d-%H%M%S)

# The simulator study of the calibrated workload (no model, a few seconds).
simulate: $(STAMP)
	$(VENV)/bin/sagc-jax simulate --config configs/sim/reasoning_drift.yaml

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check sagc_jax tests benchmarks
	$(VENV)/bin/ruff format --check sagc_jax tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache runs
