#!/usr/bin/env bash
# sagc-jax on a Cloud TPU VM slice (one host or a multi-host pod such as v5p-32 or v4-32).
#
# Every worker (host) of a slice runs the same `sagc-jax train` at the same time; the processes
# find each other through jax.distributed.initialize() (`--coordinator auto`), only process 0
# writes logs, and all of them read and write checkpoints in one run directory that every worker
# sees (a gcsfuse-mounted bucket, or NFS / Filestore). Settings are environment variables; see
# `launch/tpu_pod.sh --help`. DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<'EOF'
usage: [VAR=value ...] launch/tpu_pod.sh COMMAND

Commands (run them in this order; each is safe to repeat):
  create   create the TPU VM slice             (needs TPU_NAME, ZONE, ACCELERATOR_TYPE)
  setup    on every worker: get the code (git clone REPO_URL, or a copy of this working tree),
           mount GCS_BUCKET with gcsfuse, make a Python venv, pip install -e . "jax[tpu]",
           download HF_MODEL                   (needs TPU_NAME, ZONE)
  run      start `sagc-jax train --config $CONFIG --set logging.run_dir=$RUN_DIR
           --coordinator auto $EXTRA_ARGS` on every worker in the background; each worker
           appends to its own log $REMOTE_DIR/train.log   (needs TPU_NAME, ZONE, CONFIG, RUN_DIR)
  logs     follow the log of worker $WORKER (Ctrl-C stops following, not the run)
  stop     SIGTERM the run on every worker: the trainer writes a checkpoint and exits;
           waits up to STOP_TIMEOUT seconds, then SIGKILL. Resume: `run` again, same RUN_DIR
  delete   delete the TPU VM slice (gcloud asks for confirmation)

Variables:
  TPU_NAME          name of the TPU VM, e.g. sagc-v5p-32                           (required)
  ZONE              zone of the slice, e.g. us-east5-a (v5p), us-central2-b (v4)  (required)
  PROJECT           Google Cloud project (default: gcloud's configured project)
  ACCELERATOR_TYPE  create: slice type, e.g. v5p-32 or v4-32 (16 chips, 4 workers)
  RUNTIME_VERSION   create: TPU software version; default from ACCELERATOR_TYPE:
                    v5p -> v2-alpha-tpuv5, v5litepod -> v2-alpha-tpuv5-lite,
                    v6e -> v2-alpha-tpuv6e, v4 and older -> tpu-ubuntu2204-base
  SPOT              create: 1 makes a Spot slice (cheaper, can be preempted)
  REPO_URL          setup: git URL to clone on the workers (default: copy this working tree,
                    without .git, .venv, runs/ and checkpoints/; data/ goes along)
  REMOTE_DIR        where the code lives on the workers, relative to the home directory
                    (default: sagc-jax)
  GCS_BUCKET        setup: bucket (name without gs://) to mount at /mnt/$GCS_BUCKET on every
                    worker; run: RUN_DIR defaults to /mnt/$GCS_BUCKET/runs/<config name>
  HF_MODEL          setup: Hugging Face model to download on every worker into
                    $REMOTE_DIR/checkpoints/<name>, e.g. Qwen/Qwen2.5-3B-Instruct
  HF_TOKEN          setup: forwarded to the workers for gated models (meta-llama/...)
  CONFIG            run: config path relative to the repository, e.g.
                    configs/paper/qwen2.5-3b-grpo-tpu.yaml
  RUN_DIR           run: absolute run directory that every worker sees (bucket mount, NFS);
                    the same RUN_DIR resumes, a new one starts afresh
  EXTRA_ARGS        run: more arguments for sagc-jax train, split on spaces, e.g.
                    "--set controller.kind=fixed --set controller.group_size=8"
  WORKER            logs: which worker's log to follow (default: 0, the one that logs metrics)
  STOP_TIMEOUT      stop: seconds to wait for the checkpoint before SIGKILL (default: 300)
  DRY_RUN           1: print the commands (gcloud, tar) instead of running them

Example (a v5p-32 slice, runs in a bucket):
  export TPU_NAME=sagc-v5p-32 ZONE=us-east5-a ACCELERATOR_TYPE=v5p-32 GCS_BUCKET=my-bucket
  launch/tpu_pod.sh create
  HF_MODEL=Qwen/Qwen2.5-3B-Instruct launch/tpu_pod.sh setup
  CONFIG=configs/paper/qwen2.5-3b-grpo-tpu.yaml launch/tpu_pod.sh run
  launch/tpu_pod.sh logs
EOF
}

die() { # one-line error, exit 2 (bad input), like the sagc-jax CLI
  echo "error: $*" >&2
  exit 2
}

# require VAR "what it is": fail early, naming the variable.
require() {
  [[ -n "${!1:-}" ]] || die "$1 is not set ($2)"
}

# Quote one word for display so that a printed command can be pasted back into a shell.
shell_word() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Run a command, or print it under DRY_RUN=1 (HF_TOKEN masked).
run_cmd() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    local words=() word
    for word in "$@"; do words+=("$(shell_word "$word")"); done
    local line="+ ${words[*]}"
    [[ -n "${HF_TOKEN:-}" ]] && line="${line//"$HF_TOKEN"/***}"
    printf '%s\n' "$line"
  else
    "$@"
  fi
}

# The zone and project flags of every gcloud call, in the array LOCATION.
set_location() {
  LOCATION=("--zone=$ZONE")
  [[ -z "${PROJECT:-}" ]] || LOCATION+=("--project=$PROJECT")
}

# gcloud compute tpus tpu-vm SUBCOMMAND with the name, zone and project of this slice.
tpu_vm() {
  local sub=$1
  shift
  run_cmd gcloud compute tpus tpu-vm "$sub" "$TPU_NAME" "${LOCATION[@]}" "$@"
}

# ssh WORKER SCRIPT: run a bash script on one worker (0, 1, ...) or on all of them at once.
tpu_ssh() {
  tpu_vm ssh "--worker=$1" "--command=$2"
}

check_common() {
  require TPU_NAME "the TPU VM name, e.g. sagc-v5p-32"
  require ZONE "the zone of the slice, e.g. us-east5-a"
  if [[ "${DRY_RUN:-0}" != 1 ]] && ! command -v gcloud >/dev/null; then
    die "gcloud not found; install the Google Cloud CLI (https://cloud.google.com/sdk) or use DRY_RUN=1"
  fi
  set_location
  REMOTE_DIR="${REMOTE_DIR:-sagc-jax}"
  # Paths inside remote scripts are quoted with %q; a leading ~ would not expand there.
  [[ "$REMOTE_DIR" != "~"* ]] || die "REMOTE_DIR=$REMOTE_DIR: give it relative to the home directory, without ~"
}

q() { printf '%q' "$1"; } # quote a value for a remote bash script

# ------------------------------------------------------------------------------ commands

cmd_create() {
  require ACCELERATOR_TYPE "the slice type, e.g. v5p-32 or v4-32"
  if [[ -z "${RUNTIME_VERSION:-}" ]]; then
    case "$ACCELERATOR_TYPE" in
      v5p-*) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
      v5litepod-*) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
      v6e-*) RUNTIME_VERSION=v2-alpha-tpuv6e ;;
      v2-* | v3-* | v4-*) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
      *) die "RUNTIME_VERSION is not set and ACCELERATOR_TYPE=$ACCELERATOR_TYPE has no default (see https://cloud.google.com/tpu/docs/runtimes)" ;;
    esac
  fi
  local extra=()
  [[ "${SPOT:-0}" == 1 ]] && extra+=(--spot)
  # ${a[@]+"${a[@]}"}: an empty array under set -u, also in bash 3.2 (macOS)
  tpu_vm create "--accelerator-type=$ACCELERATOR_TYPE" "--version=$RUNTIME_VERSION" ${extra[@]+"${extra[@]}"}
}

cmd_setup() {
  local dir script=""
  dir=$(q "$REMOTE_DIR")
  script+="set -euo pipefail"$'\n'
  if [[ -n "${REPO_URL:-}" ]]; then
    script+="if [ -d $dir/.git ]; then git -C $dir pull --ff-only; else git clone $(q "$REPO_URL") $dir; fi"$'\n'
  else
    # A tarball rather than `scp --recurse`: it leaves out .git, the local venv, runs and
    # downloaded weights, and it is one file to send to each worker.
    TARBALL="${TMPDIR:-/tmp}/sagc-jax-src.$$.tar.gz"
    [[ "${DRY_RUN:-0}" == 1 ]] || trap 'rm -f "$TARBALL"' EXIT
    run_cmd tar -C "$REPO_ROOT" --exclude=./.git --exclude=./.venv --exclude=./runs \
      --exclude=./checkpoints --exclude=__pycache__ --exclude=./.pytest_cache \
      --exclude=./.ruff_cache --exclude="*.egg-info" -czf "$TARBALL" .
    run_cmd gcloud compute tpus tpu-vm scp "$TARBALL" "$TPU_NAME:sagc-jax-src.tar.gz" \
      --worker=all "${LOCATION[@]}"
    script+="mkdir -p $dir && tar -xzf sagc-jax-src.tar.gz -C $dir && rm sagc-jax-src.tar.gz"$'\n'
  fi
  if [[ -n "${GCS_BUCKET:-}" ]]; then
    local bucket mnt
    bucket=$(q "$GCS_BUCKET")
    mnt=$(q "/mnt/$GCS_BUCKET")
    # gcsfuse from Google's apt repository. --rename-dir-limit: Orbax writes each checkpoint
    # into a temporary directory and renames it when complete, which gcsfuse refuses by default.
    script+=$(
      cat <<EOF
if ! command -v gcsfuse >/dev/null; then
  echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  sudo apt-get update -qq && sudo apt-get install -y -qq gcsfuse
fi
sudo mkdir -p $mnt && sudo chown "\$(id -u):\$(id -g)" $mnt
mountpoint -q $mnt || gcsfuse --implicit-dirs --rename-dir-limit=200000 $bucket $mnt
EOF
    )$'\n'
  fi
  # Python >= 3.11 (TPU VM images ship 3.10): uv finds one on the machine or downloads it.
  script+=$(
    cat <<EOF
cd $dir
export PATH="\$HOME/.local/bin:\$PATH"
command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
[ -x .venv/bin/python ] || uv venv --seed --python 3.12 .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e . "jax[tpu]"
EOF
  )$'\n'
  if [[ -n "${HF_MODEL:-}" ]]; then
    [[ -n "${HF_TOKEN:-}" ]] && script+="export HF_TOKEN=$(q "$HF_TOKEN")"$'\n'
    script+=".venv/bin/python -c 'import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], local_dir=sys.argv[2])' $(q "$HF_MODEL") $(q "checkpoints/${HF_MODEL##*/}")"$'\n'
  fi
  # shellcheck disable=SC2016 # expanded on the worker
  script+='echo "$(hostname): ready, $(.venv/bin/python -c "import jax; print(jax.__version__)")"'
  tpu_ssh all "$script"
}

cmd_run() {
  require CONFIG "a config path relative to the repository, e.g. configs/paper/qwen2.5-3b-grpo-tpu.yaml"
  [[ -f "$REPO_ROOT/$CONFIG" ]] || die "CONFIG=$CONFIG: no such file in $REPO_ROOT (give it relative to the repository)"
  if [[ -z "${RUN_DIR:-}" ]]; then
    [[ -n "${GCS_BUCKET:-}" ]] || die "RUN_DIR is not set (an absolute run directory every worker sees, e.g. /mnt/BUCKET/runs/NAME; or set GCS_BUCKET)"
    RUN_DIR="/mnt/$GCS_BUCKET/runs/$(basename "$CONFIG" .yaml)"
  fi
  [[ "$RUN_DIR" == /* ]] || die "RUN_DIR=$RUN_DIR must be an absolute path that every worker sees (a bucket mount, NFS)"
  local dir config_q run_dir script
  dir=$(q "$REMOTE_DIR")
  config_q=$(q "$CONFIG")
  run_dir=$(q "$RUN_DIR")
  # EXTRA_ARGS is inserted unquoted on purpose: it is a list of arguments split on spaces.
  script=$(
    cat <<EOF
set -euo pipefail
cd $dir
if [ -f train.pid ] && kill -0 "\$(cat train.pid)" 2>/dev/null; then
  echo "error: \$(hostname): a run is going (pid \$(cat train.pid)); stop it first" >&2; exit 1
fi
[ -f $config_q ] || { echo "error: \$(hostname): $config_q not found in ~/$dir; run setup again" >&2; exit 2; }
EOF
  )$'\n'
  if [[ -n "${GCS_BUCKET:-}" ]]; then
    local mnt
    mnt=$(q "/mnt/$GCS_BUCKET")
    script+="mountpoint -q $mnt || { echo \"error: \$(hostname): $mnt is not mounted (after a reboot?); run setup again\" >&2; exit 2; }"$'\n'
  fi
  script+=$(
    cat <<EOF
mkdir -p $run_dir
echo "=== \$(date -u +%FT%TZ) sagc-jax train --config $config_q --set logging.run_dir=$run_dir ${EXTRA_ARGS:-}" >> train.log
nohup .venv/bin/sagc-jax train --config $config_q --set logging.run_dir=$run_dir --coordinator auto ${EXTRA_ARGS:-} >> train.log 2>&1 < /dev/null &
echo \$! > train.pid
echo "\$(hostname): started pid \$!, log ~/$dir/train.log"
EOF
  )
  tpu_ssh all "$script"
  [[ "${DRY_RUN:-0}" == 1 ]] || echo "follow it with: launch/tpu_pod.sh logs   (run directory: $RUN_DIR)"
}

cmd_logs() {
  local worker="${WORKER:-0}"
  [[ "$worker" =~ ^[0-9]+$ ]] || die "WORKER=$worker must be a worker number (0, 1, ...)"
  tpu_ssh "$worker" "tail -n 200 -F $(q "$REMOTE_DIR")/train.log"
}

cmd_stop() {
  local timeout="${STOP_TIMEOUT:-300}"
  [[ "$timeout" =~ ^[0-9]+$ ]] || die "STOP_TIMEOUT=$timeout must be a number of seconds"
  # SIGTERM lets the trainer finish its step and write a checkpoint. A worker whose peer died
  # can hang in a collective and never see the signal, hence SIGKILL after the timeout; Orbax
  # never leaves a half-written checkpoint (it renames a complete temporary directory).
  local script
  script=$(
    cat <<EOF
cd $(q "$REMOTE_DIR") 2>/dev/null || { echo "\$(hostname): no $(q "$REMOTE_DIR") here"; exit 0; }
if ! { [ -f train.pid ] && kill -0 "\$(cat train.pid)" 2>/dev/null; }; then
  echo "\$(hostname): no run going"; rm -f train.pid; exit 0
fi
pid=\$(cat train.pid)
kill -TERM "\$pid"
echo "\$(hostname): sent SIGTERM to pid \$pid, waiting up to $timeout s for the checkpoint"
for _ in \$(seq $timeout); do
  kill -0 "\$pid" 2>/dev/null || { echo "\$(hostname): stopped"; rm -f train.pid; exit 0; }
  sleep 1
done
kill -KILL "\$pid" 2>/dev/null || true
rm -f train.pid
echo "\$(hostname): still running after $timeout s, sent SIGKILL (resume uses the last complete checkpoint)"
EOF
  )
  tpu_ssh all "$script"
}

cmd_delete() {
  tpu_vm delete
}

# ------------------------------------------------------------------------------ main

case "${1:-}" in
  -h | --help | help)
    usage
    ;;
  "")
    usage >&2 # no command: the usage on stderr, and a failing status
    exit 2
    ;;
  create | setup | run | logs | stop | delete)
    [[ $# -eq 1 ]] || die "$1 takes no arguments; settings are environment variables (see --help)"
    check_common
    "cmd_$1"
    ;;
  *)
    die "unknown command '$1'; choose one of create, setup, run, logs, stop, delete (see --help)"
    ;;
esac
