#!/usr/bin/env bash
# Start (or stop) the two local worker LLMs of configs/channels/reference.yaml:
#   worker_1  Qwen3-8B               served as "qwen3-8b"    on port 8012
#   worker_2  Llama-3.1-8B-Instruct  served as "llama3.1-8b" on port 8010
# from local model directories (nothing is downloaded), and wait until both answer /health.
# See launch/README.md.
set -euo pipefail

PROG=launch/vllm_workers.sh
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/.." && pwd)

usage() {
  cat <<EOF
Usage: $PROG [start] --qwen3-8b DIR --llama3.1-8b DIR [options] [-- EXTRA_VLLM_ARGS...]
       $PROG stop   [--log-dir DIR]
       $PROG status [--log-dir DIR]

start   launches both servers in the background (own process groups, pid files and logs in
        --log-dir), waits for /health, checks that each answers a chat request under the
        served name the channel file uses (a wrong name is a 404 for every worker call), and
        returns. Qwen3-8B needs no server flag for thinking off: the channel sends
        chat_template_kwargs {enable_thinking: false} with every request (extra_body).
stop    stops the servers started from --log-dir (by their recorded process ids).
status  prints which of them run and whether /health answers.

Options (environment variable in brackets):
  --qwen3-8b DIR            local HF directory of Qwen/Qwen3-8B (worker_1) [QWEN3_8B_DIR]
  --llama3.1-8b DIR         local HF directory of meta-llama/Llama-3.1-8B-Instruct (worker_2)
                            [LLAMA31_8B_DIR]
  --only WORKER             start only worker_1 or worker_2
  --qwen-gpus LIST          CUDA_VISIBLE_DEVICES of worker_1 (default 0) [QWEN3_8B_GPUS]
  --llama-gpus LIST         CUDA_VISIBLE_DEVICES of worker_2 (default 1) [LLAMA31_8B_GPUS]
                            (several GPUs: tensor parallel over them; the same GPU for both:
                            utilization is capped at 0.45 each unless set)
  --gpu-memory-utilization F  per server (default 0.90, or 0.45 when both share a GPU)
                            [WORKERS_GPU_MEMORY_UTILIZATION]
  --max-model-len N         context of each server (default 16384: payload + 4096 answer
                            tokens) [WORKERS_MAX_MODEL_LEN]
  --host ADDR               bind address (default 127.0.0.1, what the channel file calls;
                            use a private address when the trainer runs elsewhere) [WORKERS_HOST]
  --qwen-port N             default 8012 [QWEN3_8B_PORT]
  --llama-port N            default 8010 [LLAMA31_8B_PORT]
  --channel FILE            channel file to check names and ports against
                            (default configs/channels/reference.yaml; "none": no check)
                            [WORKERS_CHANNEL]
  --python PY               Python with the GPU build of vLLM (default .venv/bin/python)
                            [WORKERS_PYTHON]
  --log-dir DIR             logs and pid files (default runs/vllm_workers) [WORKERS_LOG_DIR]
  --timeout S               seconds to wait for each /health (default 900) [WORKERS_TIMEOUT]
  --no-smoke                skip the chat request after start-up
  -h, --help                this text

DRY_RUN=1 prints both commands and starts nothing.

Example (two GPUs):
  $PROG --qwen3-8b /models/Qwen3-8B --llama3.1-8b /models/Llama-3.1-8B-Instruct \\
        --qwen-gpus 0 --llama-gpus 1
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
note() { echo "$PROG: $*" >&2; }
need_arg() { (($# >= 2)) || die "option $1 needs a value (see -h)"; }

ACTION=start
case ${1:-} in start|stop|status) ACTION=$1; shift ;; esac

QWEN_DIR=${QWEN3_8B_DIR:-}
LLAMA_DIR=${LLAMA31_8B_DIR:-}
QWEN_GPUS=${QWEN3_8B_GPUS:-0}
LLAMA_GPUS=${LLAMA31_8B_GPUS:-1}
GPU_UTIL=${WORKERS_GPU_MEMORY_UTILIZATION:-}
MAX_MODEL_LEN=${WORKERS_MAX_MODEL_LEN:-16384}
HOST=${WORKERS_HOST:-127.0.0.1}
QWEN_PORT=${QWEN3_8B_PORT:-8012}
LLAMA_PORT=${LLAMA31_8B_PORT:-8010}
CHANNEL=${WORKERS_CHANNEL:-$REPO_DIR/configs/channels/reference.yaml}
PY=${WORKERS_PYTHON:-$REPO_DIR/.venv/bin/python}
LOG_DIR=${WORKERS_LOG_DIR:-$REPO_DIR/runs/vllm_workers}
TIMEOUT=${WORKERS_TIMEOUT:-900}
DRY_RUN=${DRY_RUN:-0}
ONLY=""
SMOKE=1
EXTRA=()

while (($#)); do
  if [[ $1 == --*=* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --qwen3-8b) need_arg "$@"; QWEN_DIR=$2; shift 2 ;;
    --llama3.1-8b) need_arg "$@"; LLAMA_DIR=$2; shift 2 ;;
    --only) need_arg "$@"; ONLY=$2; shift 2 ;;
    --qwen-gpus) need_arg "$@"; QWEN_GPUS=$2; shift 2 ;;
    --llama-gpus) need_arg "$@"; LLAMA_GPUS=$2; shift 2 ;;
    --gpu-memory-utilization) need_arg "$@"; GPU_UTIL=$2; shift 2 ;;
    --max-model-len) need_arg "$@"; MAX_MODEL_LEN=$2; shift 2 ;;
    --host) need_arg "$@"; HOST=$2; shift 2 ;;
    --qwen-port) need_arg "$@"; QWEN_PORT=$2; shift 2 ;;
    --llama-port) need_arg "$@"; LLAMA_PORT=$2; shift 2 ;;
    --channel) need_arg "$@"; CHANNEL=$2; shift 2 ;;
    --python) need_arg "$@"; PY=$2; shift 2 ;;
    --log-dir) need_arg "$@"; LOG_DIR=$2; shift 2 ;;
    --timeout) need_arg "$@"; TIMEOUT=$2; shift 2 ;;
    --no-smoke) SMOKE=0; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument '$1' (vLLM flags go after --; see -h)" ;;
  esac
done

# Worker table: id, served name, port, model dir, GPUs, channel backend label.
WORKERS=(worker_1 worker_2)
declare -A NAME=([worker_1]=qwen3-8b [worker_2]=llama3.1-8b)
declare -A BACKEND=([worker_1]=qwen3_8b [worker_2]=llama31_8b)
declare -A PORT=([worker_1]=$QWEN_PORT [worker_2]=$LLAMA_PORT)
declare -A DIR=([worker_1]=$QWEN_DIR [worker_2]=$LLAMA_DIR)
declare -A DIRVAR=([worker_1]="QWEN3_8B_DIR (--qwen3-8b)" [worker_2]="LLAMA31_8B_DIR (--llama3.1-8b)")
declare -A GPUS=([worker_1]=$QWEN_GPUS [worker_2]=$LLAMA_GPUS)
case $ONLY in
  "") ;;
  worker_1|worker_2) WORKERS=("$ONLY") ;;
  *) die "--only $ONLY: expected worker_1 or worker_2" ;;
esac

PROBE_HOST=$HOST
case $HOST in 0.0.0.0|::|"[::]") PROBE_HOST=127.0.0.1 ;; esac

is_vllm() {  # pid -> true if it is a vLLM process (vLLM may retitle it, e.g. "VLLM::...")
  [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qi 'vllm'
}

healthy() {  # port
  curl -fsS -o /dev/null --max-time 2 "http://$PROBE_HOST:$1/health" 2>/dev/null
}

stop_one() {  # worker id
  local w=$1 pidfile=$LOG_DIR/$1.pid pid target waited=0
  [[ -f $pidfile ]] || { note "$w: no $pidfile (not started from here)"; return 0; }
  pid=$(<"$pidfile")
  if ! [[ $pid =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null; then
    note "$w: not running; removing $pidfile"
    rm -f "$pidfile"
    return 0
  fi
  is_vllm "$pid" || die "$w: pid $pid in $pidfile is not a vLLM server; not touching it"
  target=$pid
  [[ $(ps -o pgid= -p "$pid" | tr -d ' ') == "$pid" ]] && target=-$pid
  kill -TERM -- "$target" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && ((waited < 30)); do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    note "$w: still running after 30 s; sending SIGKILL"
    kill -KILL -- "$target" 2>/dev/null || true
  fi
  rm -f "$pidfile"
  note "$w: stopped (pid $pid)"
}

if [[ $ACTION == stop ]]; then
  for w in "${WORKERS[@]}"; do stop_one "$w"; done
  exit 0
fi

if [[ $ACTION == status ]]; then
  for w in "${WORKERS[@]}"; do
    state="not started from $LOG_DIR"
    if [[ -f $LOG_DIR/$w.pid ]]; then
      pid=$(<"$LOG_DIR/$w.pid")
      if kill -0 "$pid" 2>/dev/null; then state="running (pid $pid)"; else state="exited (stale pid file)"; fi
    fi
    if healthy "${PORT[$w]}"; then health=healthy; else health="no /health answer"; fi
    echo "$w (${NAME[$w]}, port ${PORT[$w]}): $state, $health"
  done
  exit 0
fi

# ----------------------------------------------------------------------------- start: checks
[[ -x $PY ]] || die "no Python at $PY: set WORKERS_PYTHON (or --python) to a Python with the GPU build of vLLM"
[[ $MAX_MODEL_LEN =~ ^[0-9]+$ ]] || die "WORKERS_MAX_MODEL_LEN=$MAX_MODEL_LEN is not a positive integer"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "WORKERS_TIMEOUT=$TIMEOUT is not a number of seconds"
for w in "${WORKERS[@]}"; do
  [[ -n ${DIR[$w]} ]] || die "${DIRVAR[$w]} is not set: the local model directory of $w (${NAME[$w]})"
  [[ -f ${DIR[$w]}/config.json ]] || die "${DIRVAR[$w]}=${DIR[$w]} is not a Hugging Face model directory (no config.json); pass a local path, nothing is downloaded"
  DIR[$w]=$(cd "${DIR[$w]}" && pwd)
  [[ ${PORT[$w]} =~ ^[0-9]+$ ]] || die "$w: port ${PORT[$w]} is not a number"
  [[ -n ${GPUS[$w]} ]] || die "$w: empty GPU list (--qwen-gpus / --llama-gpus)"
done
if [[ ${#WORKERS[@]} == 2 && ${PORT[worker_1]} == "${PORT[worker_2]}" ]]; then
  die "worker_1 and worker_2 cannot share port ${PORT[worker_1]}"
fi

SHARED_GPU=0
if [[ ${#WORKERS[@]} == 2 ]]; then
  IFS=, read -r -a g1 <<<"${GPUS[worker_1]}"
  IFS=, read -r -a g2 <<<"${GPUS[worker_2]}"
  for a in "${g1[@]}"; do for b in "${g2[@]}"; do [[ $a == "$b" ]] && SHARED_GPU=1; done; done
fi
if [[ -z $GPU_UTIL ]]; then
  if ((SHARED_GPU)); then GPU_UTIL=0.45; else GPU_UTIL=0.90; fi
fi
awk -v u="$GPU_UTIL" 'BEGIN { exit !(u + 0 > 0 && u + 0 <= 1) }' || die "WORKERS_GPU_MEMORY_UTILIZATION=$GPU_UTIL must be in (0, 1]"
if ((SHARED_GPU)) && awk -v u="$GPU_UTIL" 'BEGIN { exit !(2 * u > 0.95) }'; then
  die "both workers share a GPU but each asks for $GPU_UTIL of it: use --gpu-memory-utilization <= 0.45"
fi

# The channel file is the contract: check its names and ports (and pick up a mismatch before a
# training run sends thousands of requests to a 404).
if [[ $CHANNEL != none ]]; then
  [[ -f $CHANNEL ]] || die "channel file $CHANNEL not found (--channel FILE, or --channel none)"
  for w in "${WORKERS[@]}"; do
    if ! out=$("$PY" - "$CHANNEL" "$w" <<'PYCHAN'
import sys
from urllib.parse import urlparse

import yaml

path, worker = sys.argv[1], sys.argv[2]
entry = ((yaml.safe_load(open(path)) or {}).get("workers") or {}).get(worker)
if not isinstance(entry, dict):
    sys.exit(f"{path}: no workers.{worker} entry")
url = urlparse(str(entry.get("base_url", "")))
print(entry.get("model", ""), url.port or "", url.hostname or "", entry.get("backend", ""))
PYCHAN
    ); then
      die "cannot read $w from $CHANNEL (a Python with PyYAML is needed: --python, or --channel none)"
    fi
    read -r c_model c_port c_host c_backend <<<"$out"
    [[ $c_model == "${NAME[$w]}" ]] || die "$CHANNEL: workers.$w.model is '$c_model' but this script serves '${NAME[$w]}'"
    [[ $c_port == "${PORT[$w]}" ]] || die "$CHANNEL: workers.$w.base_url uses port $c_port but $w would listen on ${PORT[$w]} (--qwen-port / --llama-port)"
    [[ -z $c_backend || $c_backend == "${BACKEND[$w]}" ]] || die "$CHANNEL: workers.$w.backend is '$c_backend', not ${BACKEND[$w]}: this is not the model this script starts for $w"
    case $c_host in
      127.*|localhost) [[ $HOST == 127.* || $HOST == localhost || $HOST == 0.0.0.0 ]] || note "warning: $CHANNEL calls $w on $c_host but the server binds $HOST" ;;
    esac
  done
fi

LOG_DIR=$(realpath -m "$LOG_DIR")

command_for() {  # worker id -> CMD array
  local w=$1 tp
  IFS=, read -r -a _gpus <<<"${GPUS[$w]}"
  tp=${#_gpus[@]}
  CMD=("$PY" -m vllm.entrypoints.openai.api_server --model "${DIR[$w]}"
       --served-model-name "${NAME[$w]}" --host "$HOST" --port "${PORT[$w]}"
       --dtype auto --max-model-len "$MAX_MODEL_LEN"
       --gpu-memory-utilization "$GPU_UTIL" --tensor-parallel-size "$tp"
       "${EXTRA[@]}")
}

if [[ $DRY_RUN == 1 ]]; then
  for w in "${WORKERS[@]}"; do
    command_for "$w"
    echo "# $w: CUDA_VISIBLE_DEVICES=${GPUS[$w]} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1"
    printf '%q ' "${CMD[@]}"
    echo
  done
  exit 0
fi

mkdir -p "$LOG_DIR"
declare -A PID
start_one() {  # worker id
  local w=$1 log=$LOG_DIR/$1.log
  if [[ -f $LOG_DIR/$w.pid ]] && kill -0 "$(<"$LOG_DIR/$w.pid")" 2>/dev/null; then
    die "$w is already running (pid $(<"$LOG_DIR/$w.pid")); $PROG stop --log-dir $LOG_DIR first"
  fi
  healthy "${PORT[$w]}" && die "something already answers on port ${PORT[$w]} ($w's port)"
  command_for "$w"
  echo "=== start $(date -u +%Y-%m-%dT%H:%M:%SZ) (CUDA_VISIBLE_DEVICES=${GPUS[$w]}): ${CMD[*]}" >>"$log"
  CUDA_VISIBLE_DEVICES=${GPUS[$w]} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    setsid nohup "${CMD[@]}" >>"$log" 2>&1 </dev/null &
  PID[$w]=$!
  echo "${PID[$w]}" >"$LOG_DIR/$w.pid"
  note "$w: started ${NAME[$w]} (pid ${PID[$w]}, GPUs ${GPUS[$w]}, port ${PORT[$w]}, log $log)"
}

wait_one() {  # worker id
  local w=$1 started=$SECONDS log=$LOG_DIR/$1.log
  until healthy "${PORT[$w]}"; do
    if ! kill -0 "${PID[$w]}" 2>/dev/null; then
      rm -f "$LOG_DIR/$w.pid"
      echo "----- last lines of $log -----" >&2
      tail -n 40 "$log" >&2
      die "$w exited while starting (see $log)"
    fi
    if ((SECONDS - started > TIMEOUT)); then
      echo "----- last lines of $log -----" >&2
      tail -n 40 "$log" >&2
      stop_one "$w"
      die "$w was not healthy after ${TIMEOUT}s (see $log)"
    fi
    sleep 3
  done
  note "$w: healthy on http://$PROBE_HOST:${PORT[$w]}/v1 after $((SECONDS - started))s"
}

smoke_one() {  # worker id: one short chat request under the served name, as the pool sends it
  local w=$1 body reply
  body="{\"model\": \"${NAME[$w]}\", \"messages\": [{\"role\": \"user\", \"content\": \"Reply with the single word OK.\"}], \"max_tokens\": 16, \"temperature\": 0.2, \"seed\": 42"
  [[ $w == worker_1 ]] && body+=", \"chat_template_kwargs\": {\"enable_thinking\": false}"
  body+="}"
  if ! reply=$(curl -fsS --max-time 120 -H 'Content-Type: application/json' -d "$body" \
                 "http://$PROBE_HOST:${PORT[$w]}/v1/chat/completions" 2>&1); then
    die "$w: the chat request as '${NAME[$w]}' failed: $reply (the servers keep running; $PROG stop --log-dir $LOG_DIR)"
  fi
  if [[ $w == worker_1 && $reply == *"<think>"* ]]; then
    note "warning: $w answered with a <think> block although enable_thinking is false"
  fi
  note "$w: answers chat requests as '${NAME[$w]}'"
}

# Two servers on one GPU: start them one after the other, so that the second one's memory
# profiling sees the first one's allocation.
if ((SHARED_GPU)); then
  for w in "${WORKERS[@]}"; do start_one "$w"; wait_one "$w"; done
else
  for w in "${WORKERS[@]}"; do start_one "$w"; done
  for w in "${WORKERS[@]}"; do wait_one "$w"; done
fi
if ((SMOKE)); then
  for w in "${WORKERS[@]}"; do smoke_one "$w"; done
fi
note "all up; stop them with: $PROG stop --log-dir $LOG_DIR"
