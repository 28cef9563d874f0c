#!/usr/bin/env bash
# Trainers and rollout engines as processes on one machine (rollout.engine: vllm_server).
#
#   bash examples/launch/served.sh [CONFIG ...] [alignlit fit arguments ...]
#   bash examples/launch/served.sh configs/quickstart/grpo.yaml configs/served/grpo.yaml --trainer.limit_train_batches 4
# The leading arguments that are not options are the config files, stacked in order (default: the two above).
#
# 1. starts ENGINES vLLM engines, `alignlit serve POLICY --port PORT+k`, each in a process group of its own
#    (on CPU each bound to core k mod the number of cores), logs in LOGS/engine-k.log;
# 2. waits until every engine answers /health (an engine that exits first fails the script, naming its log);
# 3. runs `alignlit fit --config CONFIG ... --trainer.devices TRAINERS` with rollout.endpoints set to the engines;
# 4. stops the engines whatever happened (also on Ctrl-C), and exits with alignlit fit's status.
# Engines and trainers share one API key (every engine route but /health needs it): ALIGNLIT_API_KEY if set,
# else a fresh random one, exported to the engines and the trainers and never printed.
# A run stopped by a failed engine resumes from its last checkpoint: run the script again with
# `--ckpt_path out/quickstart/checkpoints/<name>/last.ckpt`.
#
# Environment (defaults): POLICY (out/quickstart/sft: the directory the engines load; the trainer pushes its
# own weights before the first rollout), ENGINES (2), TRAINERS (2), HOST (127.0.0.1), PORT (8001), LOGS
# (out/launch), ENGINE_ARGS (extra `vllm serve` arguments, default "--max-model-len 512"), READY_S (900).
set -euo pipefail

configs=()
while [ $# -gt 0 ] && [[ "$1" != -* ]]; do configs+=("$1"); shift; done
[ ${#configs[@]} -gt 0 ] || configs=(configs/quickstart/grpo.yaml configs/served/grpo.yaml)
config_args=()
for config in "${configs[@]}"; do
    [ -f "$config" ] || { echo "served.sh: no config $config" >&2; exit 2; }
    config_args+=(--config "$config")
done
POLICY="${POLICY:-out/quickstart/sft}"
ENGINES="${ENGINES:-2}"
TRAINERS="${TRAINERS:-2}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8001}"
LOGS="${LOGS:-out/launch}"
ENGINE_ARGS="${ENGINE_ARGS:---max-model-len 512}"
READY_S="${READY_S:-900}"
PYTHON="${PYTHON:-python}"

[ -f "$POLICY/config.json" ] || { echo "served.sh: $POLICY is not an exported model directory (no config.json)" >&2; exit 2; }
mkdir -p "$LOGS"
if [ -z "${ALIGNLIT_API_KEY:-}" ]; then
    ALIGNLIT_API_KEY=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')
fi
export ALIGNLIT_API_KEY  # alignlit serve and alignlit fit read it
cores=$(nproc)
pids=()
urls=()

stop_engines() {
    for pid in "${pids[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
}
trap stop_engines EXIT
trap 'exit 130' INT TERM

for k in $(seq 0 $((ENGINES - 1))); do
    port=$((PORT + k))
    # shellcheck disable=SC2086  # ENGINE_ARGS is a list of arguments
    VLLM_CPU_OMP_THREADS_BIND="$((k % cores))" setsid "$PYTHON" -m alignlit.cli serve "$POLICY" --host "$HOST" \
        --port "$port" -- $ENGINE_ARGS >"$LOGS/engine-$k.log" 2>&1 &
    pids+=("$!")
    urls+=("http://$HOST:$port")
    echo "served.sh: engine $k at http://$HOST:$port (pid $!, log $LOGS/engine-$k.log)"
done

for k in "${!urls[@]}"; do
    "$PYTHON" - "${urls[$k]}" "${pids[$k]}" "$READY_S" "$LOGS/engine-$k.log" <<'EOF'
import os, sys, time, urllib.request

url, pid, ready_s, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
deadline = time.time() + ready_s
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        tail = open(log, errors="replace").read()[-3000:]
        sys.exit(f"served.sh: the engine at {url} exited before it was ready; its log {log} ends:\n{tail}")
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            if answer.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"served.sh: the engine at {url} was not ready within {ready_s:.0f} s (log {log})")
EOF
    echo "served.sh: engine $k ready"
done

endpoints="[$(printf '"%s",' "${urls[@]}" | sed 's/,$//')]"
status=0
"$PYTHON" -m alignlit.cli fit "${config_args[@]}" --trainer.devices "$TRAINERS" \
    --model.init_args.rollout.endpoints "$endpoints" "$@" || status=$?
exit "$status"
