#!/usr/bin/env bash
# A multi-host run on one machine: NUM_PROCESSES CPU processes of `sagc-jax train` that meet
# through jax.distributed (coordinator on localhost), each with DEVICES_PER_PROCESS fake CPU
# devices. It exercises the multi-process code paths (process 0 logs, sharded data, global mesh,
# checkpoints written by every process) without a pod. See `launch/local_multiprocess.sh --help`.
set -euo pipefail

# Configs name their data and weights relative to the repository root, so run from there.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
  cat <<'EOF'
usage: [VAR=value ...] launch/local_multiprocess.sh

Starts NUM_PROCESSES processes of
  $PYTHON -m sagc_jax train --config $CONFIG --set logging.run_dir=$RUN_DIR \
    --coordinator localhost:$PORT --num-processes $NUM_PROCESSES --process-id I $EXTRA_ARGS
on the CPU, each writing $RUN_DIR/process-I.log (process 0's log is also shown here). Waits for
all of them; when one fails, stops the others and exits with its status. Ctrl-C sends SIGTERM to
every process (the trainer checkpoints and exits); running it again with the same RUN_DIR resumes.

Variables:
  CONFIG               config file, e.g. configs/demo.yaml                             (required)
                       (relative paths here and in the config are to the repository root)
  RUN_DIR              run directory shared by the processes, e.g. runs/mp-demo       (required)
  NUM_PROCESSES        how many processes (default: 2)
  DEVICES_PER_PROCESS  CPU devices per process, through
                       XLA_FLAGS=--xla_force_host_platform_device_count (default: 1)
  PORT                 coordinator port on localhost (default: a free port)
  EXTRA_ARGS           more arguments for sagc-jax train, split on spaces, e.g.
                       "--set train.steps=5 --set mesh.data=2"
  PYTHON               interpreter with sagc_jax installed (default: python of the active venv)
  DRY_RUN              1: print the commands instead of running them

Example (2 processes x 2 devices = a 4-device mesh):
  source .venv/bin/activate
  CONFIG=configs/demo.yaml RUN_DIR=runs/mp-demo DEVICES_PER_PROCESS=2 \
    EXTRA_ARGS="--set train.steps=5" launch/local_multiprocess.sh
EOF
}

die() { # one-line error, exit 2 (bad input), like the sagc-jax CLI
  echo "error: $*" >&2
  exit 2
}

case "${1:-}" in
  -h | --help | help)
    usage
    exit 0
    ;;
  "") ;;
  *) die "unexpected argument '$1'; settings are environment variables (see --help)" ;;
esac

# ------------------------------------------------------------------------------ checks

[[ -n "${CONFIG:-}" ]] || die "CONFIG is not set (a config file, e.g. configs/demo.yaml)"
[[ -f "$CONFIG" ]] || die "CONFIG=$CONFIG: no such file (relative paths are to $PWD)"
[[ -n "${RUN_DIR:-}" ]] || die "RUN_DIR is not set (the run directory all processes share, e.g. runs/mp-demo)"
NUM_PROCESSES="${NUM_PROCESSES:-2}"
DEVICES_PER_PROCESS="${DEVICES_PER_PROCESS:-1}"
[[ "$NUM_PROCESSES" =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES=$NUM_PROCESSES must be a positive integer"
[[ "$DEVICES_PER_PROCESS" =~ ^[1-9][0-9]*$ ]] || die "DEVICES_PER_PROCESS=$DEVICES_PER_PROCESS must be a positive integer"
PYTHON="${PYTHON:-python}"
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  "$PYTHON" -c 'import jax, sagc_jax' >/dev/null 2>&1 ||
    die "PYTHON=$PYTHON cannot import sagc_jax; activate the venv (source .venv/bin/activate) or set PYTHON=.venv/bin/python"
fi
if [[ -z "${PORT:-}" ]]; then
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PORT=12355 # no interpreter needed to print the commands
  else
    # Bind port 0 and let the OS choose; it stays free until the coordinator binds it (a race
    # with other programs is possible but unlikely).
    PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fi
fi
[[ "$PORT" =~ ^[0-9]+$ ]] || die "PORT=$PORT must be a port number"

# ------------------------------------------------------------------------------ start

# CPU only, K fake devices per process; a caller's XLA_FLAGS are kept.
export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES_PER_PROCESS"

command_for() { # the argv of process $1
  # EXTRA_ARGS is a list of arguments split on spaces (unquoted on purpose).
  # shellcheck disable=SC2206
  local extra=(${EXTRA_ARGS:-})
  CMD=("$PYTHON" -m sagc_jax train --config "$CONFIG" --set "logging.run_dir=$RUN_DIR"
    --coordinator "localhost:$PORT" --num-processes "$NUM_PROCESSES" --process-id "$1"
    ${extra[@]+"${extra[@]}"})
}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    command_for "$i"
    printf '+ JAX_PLATFORMS=cpu XLA_FLAGS=%q' "$XLA_FLAGS"
    printf ' %q' "${CMD[@]}"
    printf ' > %q 2>&1 &\n' "$RUN_DIR/process-$i.log"
  done
  exit 0
fi

mkdir -p "$RUN_DIR"
PIDS=()
for ((i = 0; i < NUM_PROCESSES; i++)); do
  command_for "$i"
  "${CMD[@]}" >"$RUN_DIR/process-$i.log" 2>&1 &
  PIDS+=($!)
done
echo "started $NUM_PROCESSES processes x $DEVICES_PER_PROCESS CPU devices (pids ${PIDS[*]}), coordinator localhost:$PORT, logs $RUN_DIR/process-*.log" >&2

tail -n +1 -F "$RUN_DIR/process-0.log" 2>/dev/null &
TAIL_PID=$!

# stop_all SIGNAL: send SIGNAL to every process still running; SIGKILL those left after 30 s
# (a process whose peer died can hang in a collective and never act on SIGTERM).
stop_all() {
  local pid _
  for pid in "${PIDS[@]}"; do kill "-$1" "$pid" 2>/dev/null || true; done
  for _ in $(seq 30); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
finish() {
  kill "$TAIL_PID" 2>/dev/null || true
}
trap finish EXIT
trap 'echo "interrupted: sending SIGTERM to every process" >&2; stop_all TERM; exit 130' INT TERM

# Wait for all; on the first failure stop the rest and exit with that status. Polling (rather
# than `wait -n`) works in any bash; `wait PID` returns the status of an exited child.
remaining=$NUM_PROCESSES
declare -a FINISHED
while ((remaining > 0)); do
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    [[ -z "${FINISHED[i]:-}" ]] || continue
    kill -0 "${PIDS[i]}" 2>/dev/null && continue
    status=0
    wait "${PIDS[i]}" || status=$?
    FINISHED[i]=1
    remaining=$((remaining - 1))
    if ((status != 0)); then
      sleep 1 # let tail print the end of process 0's log
      echo "error: process $i exited with status $status; stopping the others (log: $RUN_DIR/process-$i.log):" >&2
      tail -n 5 "$RUN_DIR/process-$i.log" | sed 's/^/  | /' >&2
      stop_all TERM
      exit "$status"
    fi
  done
  sleep 1
done
sleep 1 # let tail print the end of process 0's log
echo "all $NUM_PROCESSES processes finished; run directory: $RUN_DIR" >&2
