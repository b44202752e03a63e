#!/usr/bin/env bash
# Run `routeweaver train` on every worker of an EXISTING Cloud TPU VM slice (v5e-16, v5p-8, ...):
# sync the code, install the environment, start the same command on all workers at once.
# Creates nothing that costs money: no TPU, no bucket. See launch/README.md.
set -euo pipefail

PROG=launch/tpu_pod.sh
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/.." && pwd)

usage() {
  cat <<EOF
Usage: $PROG [ACTION] [options] [key=value ...]

Actions:
  run      sync + install + train (default)
  sync     copy (or git clone) the repository to every worker
  install  make install on every worker, then jax[tpu] at the lock's jax version; stage
           STAGE data; needs no CONFIG
  train    routeweaver train --config CONFIG out_dir=OUT_DIR [key=value ...] on all workers
  stop     stop the training processes this script started on the workers (by pid file)
  logs     print the last LOG_LINES lines of each worker's log of the latest run

Options (environment variable in brackets):
  --name NAME         TPU VM name [TPU_NAME] (required)
  --zone ZONE         its zone [TPU_ZONE] (required)
  --project ID        its project [TPU_PROJECT] (default: gcloud config's project)
  --config FILE       YAML config inside this repository [CONFIG] (required for train)
  --out-dir PATH      run directory on a filesystem every worker mounts at the same path (a
                      gcsfuse-mounted bucket, Filestore), written by all workers (orbax) and by
                      process 0 (logs, plots, HF exports) [OUT_DIR] (required for train)
  --sync MODE         copy (tracked + untracked, non-ignored files of this checkout), clone
                      (git clone REPO_URL at GIT_REF on the workers) or none [SYNC] (default copy)
  --repo-url URL      clone: repository URL the workers can fetch [REPO_URL]
  --ref REF           clone: commit, tag or branch (default: this checkout's HEAD) [GIT_REF]
  --remote-dir DIR    checkout on the workers, relative to the remote home
                      (default jax_routeweaver) [REMOTE_DIR]
  --log-dir DIR       local directory for per-worker logs (default runs/launch/tpu-NAME-TIME)
                      [LOG_DIR]
  --internal-ip       reach the workers by internal IP (from a VM in the same VPC)
                      [TPU_INTERNAL_IP=1]
  --detach            start training in the background on the workers and return
                      (follow with '$PROG logs'; stop with '$PROG stop') [DETACH=1]
  --dry-run           run 'routeweaver train --dry-run' instead of training [DRY_RUN=1]
  --skip-install      run: skip the install step [INSTALL=0]
  -h, --help          this text

Environment only:
  SECRET_ENV     "VAR=SECRET ..." : on each worker, VAR is exported from Google Secret Manager
                 secret SECRET (latest version, project TPU_PROJECT), read with the worker's
                 service account. The key never leaves Google Cloud. (recommended)
  FORWARD_ENV    "VAR ..." : VAR's value in this shell is sent to each worker over the ssh
                 session's standard input (one ssh per worker) and exported there; never
                 on a command line, in a file or in a log.
  REMOTE_ENV     "VAR=value ..." : non-secret environment for the workers (e.g.
                 JAX_COMPILATION_CACHE_DIR=gs://BUCKET/jax_cache); values without spaces.
  STAGE          "gs://SRC=DEST ...": install: copy each GCS directory to DEST on every worker
                 (gcloud storage rsync -r; DEST relative to the remote home), e.g. the
                 policy's HF checkpoint and the training records.
  REMOTE_PYTHON  interpreter for the venv (default python3.11, apt-installed if missing)
  JAX_TPU_SPEC   pip requirement replacing the TPU lock's jax (default: the lock's)
  TORCH_INDEX_URL  extra pip index for the lock's torch==...+cpu
                 (default https://download.pytorch.org/whl/cpu)
  LOG_LINES      lines shown by 'logs' (default 40)

Examples:
  $PROG run --name rw-v5e16 --zone us-west4-a --config configs/my_run.yaml \\
      --out-dir /mnt/runs/my_run model.path=../models/Qwen3-4B-Instruct-2507
  DRY_RUN=1 $PROG train --name rw-v5e16 --zone us-west4-a --config configs/my_run.yaml \\
      --out-dir /mnt/runs/my_run
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
note() { echo "$PROG: $*" >&2; }
need_arg() { (($# >= 2)) || die "option $1 needs a value (see -h)"; }

ACTION=run
case ${1:-} in run|sync|install|train|stop|logs) ACTION=$1; shift ;; esac

TPU_NAME=${TPU_NAME:-}
TPU_ZONE=${TPU_ZONE:-}
TPU_PROJECT=${TPU_PROJECT:-}
CONFIG=${CONFIG:-}
OUT_DIR=${OUT_DIR:-}
SYNC=${SYNC:-copy}
REPO_URL=${REPO_URL:-}
GIT_REF=${GIT_REF:-}
REMOTE_DIR=${REMOTE_DIR:-jax_routeweaver}
LOG_DIR=${LOG_DIR:-}
INTERNAL_IP=${TPU_INTERNAL_IP:-0}
DETACH=${DETACH:-0}
DRY_RUN=${DRY_RUN:-0}
INSTALL=${INSTALL:-1}
SECRET_ENV=${SECRET_ENV:-}
FORWARD_ENV=${FORWARD_ENV:-}
REMOTE_ENV=${REMOTE_ENV:-}
STAGE=${STAGE:-}
REMOTE_PYTHON=${REMOTE_PYTHON:-python3.11}
JAX_TPU_SPEC=${JAX_TPU_SPEC:-}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
LOG_LINES=${LOG_LINES:-40}
OVERRIDES=()

while (($#)); do
  if [[ $1 == --*=* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --name) need_arg "$@"; TPU_NAME=$2; shift 2 ;;
    --zone) need_arg "$@"; TPU_ZONE=$2; shift 2 ;;
    --project) need_arg "$@"; TPU_PROJECT=$2; shift 2 ;;
    --config) need_arg "$@"; CONFIG=$2; shift 2 ;;
    --out-dir) need_arg "$@"; OUT_DIR=$2; shift 2 ;;
    --sync) need_arg "$@"; SYNC=$2; shift 2 ;;
    --repo-url) need_arg "$@"; REPO_URL=$2; shift 2 ;;
    --ref) need_arg "$@"; GIT_REF=$2; shift 2 ;;
    --remote-dir) need_arg "$@"; REMOTE_DIR=$2; shift 2 ;;
    --log-dir) need_arg "$@"; LOG_DIR=$2; shift 2 ;;
    --internal-ip) INTERNAL_IP=1; shift ;;
    --detach) DETACH=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --skip-install) INSTALL=0; shift ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -*) die "unknown option $1 (see -h)" ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) die "unexpected argument '$1': actions come first, config overrides are key=value (see -h)" ;;
  esac
done

# ============================================================================ remote side
# These functions run on the workers: their source is sent inside the ssh command
# (declare -f), so they work whatever copy of this script the workers have.

rw_unpack() {  # DIR TARBALL: replace the checkout in DIR (keeping .venv and runs) by TARBALL
  set -euo pipefail
  local dir=$1 tarball=$2 marker=.routeweaver-sync
  cd "$HOME"
  case $dir in ""|.|..|/|"$HOME"|"$HOME"/) echo "refusing REMOTE_DIR='$dir'" >&2; exit 2 ;; esac
  if [[ -d $dir/.git ]]; then
    echo "$(hostname): $dir is a git clone; use SYNC=clone or another REMOTE_DIR" >&2; exit 2
  fi
  if [[ -d $dir && -n $(ls -A "$dir") && ! -e $dir/$marker ]]; then
    echo "$(hostname): $dir exists and was not made by $PROG ($marker missing); not overwriting it" >&2; exit 2
  fi
  mkdir -p "$dir"
  find "$dir" -mindepth 1 -maxdepth 1 ! -name .venv ! -name runs ! -name "$marker" -exec rm -rf {} +
  tar -xzf "$tarball" -C "$dir"
  touch "$dir/$marker"
  rm -f "$tarball"
  echo "$(hostname): synced $dir"
}

rw_clone() {  # DIR URL REF
  set -euo pipefail
  local dir=$1 url=$2 ref=$3
  cd "$HOME"
  command -v git >/dev/null || sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq git
  if [[ -d $dir/.git ]]; then
    git -C "$dir" fetch --quiet --tags origin
  elif [[ -e $dir && -n $(ls -A "$dir") ]]; then
    echo "$(hostname): $dir exists and is not a git clone; use SYNC=copy or another REMOTE_DIR" >&2; exit 2
  else
    git clone --quiet "$url" "$dir"
  fi
  git -C "$dir" checkout --quiet --detach "$ref" \
    || { echo "$(hostname): cannot check out $ref (pushed to $url?)" >&2; exit 2; }
  echo "$(hostname): $dir at $(git -C "$dir" rev-parse HEAD)"
}

rw_install() {  # DIR PYTHON JAX_SPEC TORCH_INDEX STAGE...
  set -euo pipefail
  local dir=$1 py=$2 jax_spec=$3 torch_index=$4
  shift 4
  cd "$HOME/$dir" || { echo "$(hostname): no $dir: sync first" >&2; exit 2; }
  local apt=(sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -qq)
  # Ubuntu splits venv/ensurepip into $py-venv; the images' own Python is often older than 3.11.
  if ! command -v "$py" >/dev/null || ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
    echo "$(hostname): installing $py and $py-venv (apt)"
    "${apt[@]}" update && "${apt[@]}" install -y "$py" "$py-venv"
  fi
  command -v make >/dev/null || "${apt[@]}" install -y make
  # requirements/tpu.lock: jax[tpu] with its libtpu, and the CPU torch from the index it names.
  PIP_EXTRA_INDEX_URL=$torch_index make install-tpu PYTHON="$py"
  # An explicit JAX_TPU_SPEC replaces the lock's jax build.
  [[ -z $jax_spec ]] || .venv/bin/python -m pip install --quiet "$jax_spec"
  echo "$(hostname): $(.venv/bin/python -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)'), libtpu $(.venv/bin/python -m pip show libtpu 2>/dev/null | sed -n 's/^Version: //p')"
  local pair src dest
  for pair in "$@"; do
    src=${pair%%=*}
    dest=${pair#*=}
    [[ $dest == /* ]] || dest=$HOME/$dest
    mkdir -p "$dest"
    gcloud storage rsync --recursive --quiet "$src" "$dest"
    echo "$(hostname): staged $src -> $dest"
  done
}

rw_train() {  # DIR CONFIG SHA RUN_ID DRY DETACH PROJECT SECRETS FORWARD REMOTE_ENV -- ARGS...
  set -euo pipefail
  local dir=$1 config=$2 sha=$3 run_id=$4 dry=$5 detach=$6 project=$7 secrets=$8 forward=$9
  local remote_env=${10}
  shift 10
  cd "$HOME/$dir" || { echo "$(hostname): no $dir: sync first" >&2; exit 2; }
  local worker
  worker=$(curl -fs --max-time 5 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null) \
    || worker=$(hostname)
  [[ -x .venv/bin/routeweaver ]] || { echo "worker $worker: no .venv/bin/routeweaver: run the install action" >&2; exit 2; }
  [[ -f $config ]] || { echo "worker $worker: no $config in $dir: sync first" >&2; exit 2; }
  local got
  got=$(sha256sum "$config" | cut -d' ' -f1)
  if [[ $got != "$sha" ]]; then
    echo "worker $worker: $config differs from the launcher's (sha256 $got, expected $sha): sync the code again" >&2
    exit 3
  fi
  # Keys: from standard input (FORWARD_ENV), then from Secret Manager (SECRET_ENV).
  local line name pair value
  if [[ -n $forward ]]; then
    while IFS= read -r line; do
      name=${line%%=*}
      [[ " $forward " == *" $name "* ]] || { echo "worker $worker: unexpected variable on stdin" >&2; exit 2; }
      export "$line"
    done
  fi
  for pair in $secrets; do
    name=${pair%%=*}
    value=$(gcloud secrets versions access latest --secret="${pair#*=}" --project="$project" 2>/dev/null) \
      || { echo "worker $worker: cannot read secret ${pair#*=} for $name (does the TPU's service account have roles/secretmanager.secretAccessor?)" >&2; exit 2; }
    export "$name=$value"
  done
  for pair in $remote_env; do export "${pair?}"; done
  local logdir=runs/launch/$run_id
  mkdir -p "$logdir"
  ln -sfn "$run_id" runs/launch/latest
  local log=$logdir/worker-$worker.log pidfile=runs/launch/train.pid
  local -a cmd=(.venv/bin/routeweaver train --config "$config")
  [[ $dry == 1 ]] && cmd+=(--dry-run)
  cmd+=("$@")
  echo "worker $worker ($(hostname)): ${cmd[*]}" | tee -a "$log"
  if [[ $detach == 1 ]]; then
    setsid nohup "${cmd[@]}" >>"$log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    echo "worker $worker: started pid $! in the background; log $dir/$log"
    return 0
  fi
  "${cmd[@]}" > >(tee -a "$log") 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$pidfile"
  local status=0
  wait "$pid" || status=$?
  rm -f "$pidfile"
  echo "worker $worker: exit status $status"
  return "$status"
}

rw_stop() {  # DIR
  set -euo pipefail
  local dir=$1 pidfile pid target waited=0
  pidfile=$HOME/$dir/runs/launch/train.pid
  [[ -f $pidfile ]] || { echo "$(hostname): no $pidfile: nothing to stop"; return 0; }
  pid=$(<"$pidfile")
  if ! kill -0 "$pid" 2>/dev/null; then echo "$(hostname): pid $pid is not running"; rm -f "$pidfile"; return 0; fi
  if ! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'routeweaver'; then
    echo "$(hostname): pid $pid is not a routeweaver process; not touching it" >&2; return 2
  fi
  target=$pid
  [[ $(ps -o pgid= -p "$pid" | tr -d ' ') == "$pid" ]] && target=-$pid
  kill -TERM -- "$target" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && ((waited < 60)); do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "$target" 2>/dev/null || true; fi
  rm -f "$pidfile"
  echo "$(hostname): stopped pid $pid"
}

rw_logs() {  # DIR LINES
  set -euo pipefail
  local f
  for f in "$HOME/$1"/runs/launch/latest/worker-*.log; do
    [[ -f $f ]] || { echo "$(hostname): no logs under $1/runs/launch/latest"; return 0; }
    echo "===== $(hostname): $f"
    tail -n "$2" "$f"
  done
}

# ============================================================================ local side
require() {  # VAR "what it is"
  [[ -n ${!1:-} ]] || die "$1 is not set: $2"
}

require TPU_NAME "the TPU VM's name (--name or env TPU_NAME)"
require TPU_ZONE "the TPU VM's zone (--zone or env TPU_ZONE)"
command -v gcloud >/dev/null || die "gcloud is not installed (Google Cloud CLI)"
if [[ -z $TPU_PROJECT ]]; then
  TPU_PROJECT=$(gcloud config get-value project 2>/dev/null || true)
  require TPU_PROJECT "the Google Cloud project (--project, env TPU_PROJECT or 'gcloud config set project')"
fi
case $SYNC in copy|clone|none) ;; *) die "SYNC=$SYNC: expected copy, clone or none" ;; esac
[[ $REMOTE_DIR != /* && $REMOTE_DIR != *..* && -n $REMOTE_DIR && $REMOTE_DIR != . ]] \
  || die "REMOTE_DIR=$REMOTE_DIR must be a directory below the remote home (e.g. jax_routeweaver)"

GC=(--zone="$TPU_ZONE" --project="$TPU_PROJECT")
SSH_OPTS=()
[[ $INTERNAL_IP == 1 ]] && SSH_OPTS+=(--internal-ip)
RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)
LOG_DIR=${LOG_DIR:-$REPO_DIR/runs/launch/tpu-$TPU_NAME-$RUN_ID}
TMP_DIR=""
TAIL_PID=""
cleanup() {
  [[ -n $TAIL_PID ]] && kill "$TAIL_PID" 2>/dev/null
  [[ -n $TMP_DIR ]] && rm -rf "$TMP_DIR"
  return 0
}
trap cleanup EXIT

describe_tpu() {
  local info
  if ! info=$(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GC[@]}" \
                --format='value(state,acceleratorType,networkEndpoints.len())' 2>&1); then
    die "cannot describe TPU '$TPU_NAME' in $TPU_ZONE/$TPU_PROJECT: $info
This script creates nothing. Create the slice first, e.g.
  gcloud compute tpus tpu-vm create $TPU_NAME --zone=$TPU_ZONE --project=$TPU_PROJECT \\
    --accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite    (v5p-8: --accelerator-type=v5p-8 --version=v2-alpha-tpuv5)"
  fi
  read -r TPU_STATE TPU_TYPE TPU_WORKERS <<<"$info"
  [[ $TPU_STATE == READY ]] || die "TPU '$TPU_NAME' is ${TPU_STATE:-in an unknown state}, not READY"
  [[ $TPU_WORKERS =~ ^[1-9][0-9]*$ ]] || die "cannot tell how many workers TPU '$TPU_NAME' has (gcloud said: $info)"
  note "TPU $TPU_NAME: $TPU_TYPE, $TPU_WORKERS worker(s), $TPU_STATE"
  if ((TPU_WORKERS > 1)) && ! ssh-add -l >/dev/null 2>&1; then
    note "warning: no key in ssh-agent; with several workers gcloud wants 'ssh-add ~/.ssh/google_compute_engine' first"
  fi
}

remote_all() {  # FUNCTION ARGS... : run a remote function on all workers at once
  local fn=$1
  shift
  local cmd
  cmd="$(declare -f "$fn"); PROG=$(printf '%q' "$PROG") $fn $(printf '%q ' "$@")"
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GC[@]}" "${SSH_OPTS[@]}" --worker=all \
    --command="$cmd" </dev/null
}

do_sync() {
  case $SYNC in
    none) note "sync: skipped (SYNC=none)" ;;
    copy)
      git -C "$REPO_DIR" rev-parse --git-dir >/dev/null 2>&1 || die "SYNC=copy lists files with git, but $REPO_DIR is not a git checkout"
      TMP_DIR=$(mktemp -d)
      local tarball=$TMP_DIR/routeweaver-src.tar.gz
      (cd "$REPO_DIR" && git ls-files -z -co --exclude-standard \
        | while IFS= read -r -d '' f; do if [[ -e $f || -L $f ]]; then printf '%s\0' "$f"; fi; done \
        | tar -czf "$tarball" --null -T -)
      note "sync: copying $(du -h "$tarball" | cut -f1) (tracked and untracked, non-ignored files) to all workers"
      gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:routeweaver-src.tar.gz" \
        "${GC[@]}" "${SSH_OPTS[@]}" --worker=all </dev/null
      remote_all rw_unpack "$REMOTE_DIR" routeweaver-src.tar.gz
      ;;
    clone)
      require REPO_URL "SYNC=clone needs the repository URL the workers can fetch (--repo-url or env REPO_URL)"
      if [[ -z $GIT_REF ]]; then
        GIT_REF=$(git -C "$REPO_DIR" rev-parse HEAD)
        [[ -z $(git -C "$REPO_DIR" status --porcelain) ]] \
          || note "warning: this checkout has uncommitted changes; the workers get commit $GIT_REF without them"
      fi
      note "sync: cloning $REPO_URL at $GIT_REF on all workers"
      remote_all rw_clone "$REMOTE_DIR" "$REPO_URL" "$GIT_REF"
      ;;
  esac
}

do_install() {
  local -a stage=()
  local pair
  for pair in $STAGE; do
    [[ $pair == gs://*=* ]] || die "STAGE entry '$pair' is not gs://SRC=DEST"
    stage+=("$pair")
  done
  note "install: make install-tpu (requirements/tpu.lock)${JAX_TPU_SPEC:+ + $JAX_TPU_SPEC} on all workers"
  remote_all rw_install "$REMOTE_DIR" "$REMOTE_PYTHON" "$JAX_TPU_SPEC" "$TORCH_INDEX_URL" "${stage[@]}"
}

do_train() {
  require CONFIG "the YAML config (--config or env CONFIG)"
  require OUT_DIR "the run directory, a path every worker mounts (--out-dir or env OUT_DIR)"
  local abs rel sha
  [[ -f $CONFIG ]] || die "CONFIG=$CONFIG: no such file"
  abs=$(realpath "$CONFIG")
  [[ $abs == "$REPO_DIR"/* ]] || die "CONFIG=$CONFIG is outside the repository; it must be synced to the workers with the code"
  rel=${abs#"$REPO_DIR"/}
  sha=$(sha256sum "$abs" | cut -d' ' -f1)
  # routeweaver train writes out_dir with local file APIs (config, logs, tokenizer, exports the
  # vLLM sidecar reads): a gs:// URL would become a local directory named "gs:".
  [[ $OUT_DIR == gs://* ]] && die "OUT_DIR=$OUT_DIR: routeweaver train needs a filesystem path every worker mounts (mount the bucket with gcsfuse at the same path on all workers, or use Filestore), not a gs:// URL"
  [[ $OUT_DIR == /* ]] || die "OUT_DIR=$OUT_DIR must be an absolute path (the same on every worker)"
  local name pair
  for name in $FORWARD_ENV; do
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "FORWARD_ENV entry '$name' is not a variable name"
    [[ -n ${!name:-} ]] || die "$name is not set in this shell (listed in FORWARD_ENV)"
  done
  for pair in $SECRET_ENV $REMOTE_ENV; do
    [[ $pair =~ ^[A-Za-z_][A-Za-z0-9_]*=.+$ ]] || die "'$pair' in SECRET_ENV/REMOTE_ENV is not VAR=value"
  done
  mkdir -p "$LOG_DIR"
  local -a args=("$REMOTE_DIR" "$rel" "$sha" "$RUN_ID" "$DRY_RUN" "$DETACH" "$TPU_PROJECT"
                 "$SECRET_ENV" "$FORWARD_ENV" "$REMOTE_ENV" "out_dir=$OUT_DIR" "${OVERRIDES[@]}")
  local cmd
  cmd="$(declare -f rw_train); rw_train $(printf '%q ' "${args[@]}")"
  local what=training
  [[ $DRY_RUN == 1 ]] && what="dry run"
  note "$what: routeweaver train --config $rel out_dir=$OUT_DIR ${OVERRIDES[*]}"
  note "per-worker logs: $LOG_DIR/<worker>.log (local), $REMOTE_DIR/runs/launch/$RUN_ID/ (workers)"
  if [[ $DETACH != 1 ]]; then
    touch "$LOG_DIR/0.log"
    tail -n +1 -F "$LOG_DIR/0.log" 2>/dev/null &
    TAIL_PID=$!
  fi
  local status=0
  if [[ -z $FORWARD_ENV ]]; then
    gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GC[@]}" "${SSH_OPTS[@]}" --worker=all \
      --command="$cmd" --output-directory="$LOG_DIR" </dev/null || status=$?
  else
    # One ssh per worker, each with the keys on its standard input.
    local i
    local -a pids=()
    for ((i = 0; i < TPU_WORKERS; i++)); do
      for name in $FORWARD_ENV; do printf '%s=%s\n' "$name" "${!name}"; done \
        | gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GC[@]}" "${SSH_OPTS[@]}" --worker="$i" \
            --command="$cmd" >"$LOG_DIR/$i.log" 2>&1 &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}" || { note "worker $i failed (see $LOG_DIR/$i.log)"; status=1; }
    done
  fi
  ((status == 0)) || die "$what failed on at least one worker (logs: $LOG_DIR)"
  if [[ $DETACH == 1 ]]; then
    note "$what started in the background on all workers: '$PROG logs' to follow, '$PROG stop' to stop"
  else
    note "$what finished on all workers (logs: $LOG_DIR)"
  fi
}

describe_tpu
case $ACTION in
  run)
    do_sync
    if [[ $INSTALL == 1 ]]; then do_install; else note "install: skipped (INSTALL=0)"; fi
    do_train
    ;;
  sync) do_sync ;;
  install) do_install ;;
  train) do_train ;;
  stop) remote_all rw_stop "$REMOTE_DIR" ;;
  logs) remote_all rw_logs "$REMOTE_DIR" "$LOG_LINES" ;;
esac
