#!/usr/bin/env bash
# sagc-jax on one machine with NVIDIA GPUs (one process; the mesh spans the visible GPUs).
# Settings are environment variables; see `launch/gpu.sh --help`. DRY_RUN=1 prints the commands
# instead of running them.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Configs name their data and weights relative to the repository root, so run from there.
cd "$REPO_ROOT"

usage() {
  cat <<'EOF'
usage: [VAR=value ...] launch/gpu.sh COMMAND

Commands:
  setup   create the venv $VENV (if absent) and pip install -e . "jax[cuda12]" into it
          (the CUDA 12 libraries come from pip; the machine needs an NVIDIA driver >= 525)
  run     sagc-jax train --config $CONFIG [--set logging.run_dir=$RUN_DIR] $EXTRA_ARGS

Variables:
  CONFIG                 run: config file, e.g. configs/paper/qwen2.5-3b-grpo-gpu80.yaml (required)
                         (relative paths here and in the config are to the repository root)
  RUN_DIR                run: run directory; an existing one is resumed from its last checkpoint
                         (default: runs/train-<config name>-<time>, a new one each time)
  EXTRA_ARGS             run: more arguments for sagc-jax train, split on spaces, e.g.
                         "--set controller.kind=fixed --set controller.group_size=8"
  CUDA_VISIBLE_DEVICES   run: which GPUs the run may use, e.g. 0 (default: all)
  XLA_PYTHON_CLIENT_MEM_FRACTION
                         run: share of GPU memory JAX preallocates (default here: 0.95;
                         JAX's own default, 0.75, wastes 20 GB of an 80 GB GPU)
  VENV                   the virtual environment (default: .venv in the repository)
  PYTHON                 setup: interpreter that creates the venv, Python >= 3.11
                         (default: the first of python3.13, python3.12, python3.11, python3)
  DRY_RUN                1: print the commands instead of running them

Examples:
  launch/gpu.sh setup
  CONFIG=configs/paper/qwen2.5-3b-grpo-gpu80.yaml RUN_DIR=runs/qwen-grpo-sagc launch/gpu.sh run
  CONFIG=configs/paper/qwen2.5-3b-grpo-gpu80.yaml RUN_DIR=runs/qwen-grpo-g8 \
    EXTRA_ARGS="--set controller.kind=fixed --set controller.group_size=8" launch/gpu.sh run
EOF
}

die() { # one-line error, exit 2 (bad input), like the sagc-jax CLI
  echo "error: $*" >&2
  exit 2
}

# Run a command, or print it under DRY_RUN=1.
run_cmd() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

VENV="${VENV:-$REPO_ROOT/.venv}"

# Is $1 a Python >= 3.11 that runs? (pyenv shims exist for versions that are not selected.)
python_ok() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    python_ok "$PYTHON" || die "PYTHON=$PYTHON does not run or is older than Python 3.11"
    echo "$PYTHON"
    return
  fi
  local candidate
  for candidate in python3.13 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null && python_ok "$candidate"; then
      echo "$candidate"
      return
    fi
  done
  die "no Python >= 3.11 found; install one (e.g. uv python install 3.12) and set PYTHON=/path/to/python3.12"
}

cmd_setup() {
  if [[ ! -x "$VENV/bin/python" ]]; then
    local python
    python=$(find_python)
    run_cmd "$python" -m venv "$VENV"
  fi
  run_cmd "$VENV/bin/python" -m pip install --upgrade pip
  run_cmd "$VENV/bin/python" -m pip install -e "$REPO_ROOT" "jax[cuda12]"
  command -v nvidia-smi >/dev/null ||
    echo "warning: nvidia-smi not found; \`run\` needs an NVIDIA driver" >&2
}

cmd_run() {
  [[ -n "${CONFIG:-}" ]] || die "CONFIG is not set (a config file, e.g. configs/paper/qwen2.5-3b-grpo-gpu80.yaml)"
  [[ -f "$CONFIG" ]] || die "CONFIG=$CONFIG: no such file (relative paths are to $REPO_ROOT)"
  if [[ "${DRY_RUN:-0}" != 1 ]]; then
    command -v nvidia-smi >/dev/null ||
      die "nvidia-smi not found: no NVIDIA driver on this machine (for CPU runs use sagc-jax train directly)"
    nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi -L failed: the driver sees no GPU ($(nvidia-smi -L 2>&1 | head -n 1))"
    [[ -x "$VENV/bin/sagc-jax" ]] || die "$VENV/bin/sagc-jax not found; run \`launch/gpu.sh setup\` first (or set VENV)"
  fi
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
  local args=(train --config "$CONFIG")
  [[ -n "${RUN_DIR:-}" ]] && args+=(--set "logging.run_dir=$RUN_DIR")
  # EXTRA_ARGS is a list of arguments split on spaces (unquoted on purpose).
  # shellcheck disable=SC2206
  [[ -n "${EXTRA_ARGS:-}" ]] && args+=($EXTRA_ARGS)
  echo "GPUs: ${CUDA_VISIBLE_DEVICES:-all}, XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION" >&2
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    run_cmd "$VENV/bin/sagc-jax" "${args[@]}"
  else
    # exec: a SIGTERM sent to this script reaches the trainer, which checkpoints and exits.
    exec "$VENV/bin/sagc-jax" "${args[@]}"
  fi
}

case "${1:-}" in
  -h | --help | help)
    usage
    ;;
  "")
    usage >&2 # no command: the usage on stderr, and a failing status
    exit 2
    ;;
  setup | run)
    [[ $# -eq 1 ]] || die "$1 takes no arguments; settings are environment variables (see --help)"
    "cmd_$1"
    ;;
  *)
    die "unknown command '$1'; choose setup or run (see --help)"
    ;;
esac
