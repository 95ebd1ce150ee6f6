#!/usr/bin/env bash
# Disaggregated prefill and decode on one host, started by one command: a prefill server
# and a decode server (`vllm serve` on the Neuron platform, the tiny demo checkpoint,
# the plugin's NeuronKVConnector moving each prompt's KV blocks through a shared folder)
# behind vLLM's router in its prefill/decode mode. Send requests to the router; Ctrl-C
# stops all three. See docs/configuration/disaggregation.md.
#
#   scripts/serve-pd-demo.sh        # router :8000, prefill :8100, decode :8200
#
# Environment: PORT, PREFILL_PORT, DECODE_PORT (the three ports), KV_PATH (payload
# folder, default /dev/shm/neuron-kv-demo-<uid>), LOG_DIR (the servers' logs, default
# pd-demo-logs/), VENV, SKIP_SETUP=1 (use $VENV as it is). Extra arguments go to both
# `vllm serve` commands.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
[ "${SKIP_SETUP:-0}" = 1 ] || VENV="$venv" "$root/scripts/setup-env.sh" cpu,router
model="$root/models/tiny-llama"
"$venv/bin/python" "$root/scripts/build_tiny_model.py" --arch llama --out "$model"

port="${PORT:-8000}" prefill_port="${PREFILL_PORT:-8100}" decode_port="${DECODE_PORT:-8200}"
kv_path="${KV_PATH:-/dev/shm/neuron-kv-demo-$(id -u)}"
logs="${LOG_DIR:-$root/pd-demo-logs}"
mkdir -p "$logs"
kv_config='{"kv_connector": "NeuronKVConnector",
  "kv_connector_module_path": "neuron_plugin.kv_transfer.connector",
  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"path": "'"$kv_path"'"}}'
serve=("$venv/bin/vllm" serve "$model" --device neuron --host 127.0.0.1
       --config "$root/configs/serve-tiny.yaml" --max-model-len 1024 --max-num-seqs 4
       --enable-prefix-caching --block-size 32 --kv-transfer-config "$kv_config" "$@")

# Each server its half of the host's cores (torch threads of two servers that each take
# every core spin against each other; vLLM splits them the same way between engines).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) > 1 ? $(nproc) / 2 : 1 ))}"
"${serve[@]}" --port "$prefill_port" >"$logs/prefill.log" 2>&1 &
prefill=$!
"${serve[@]}" --port "$decode_port" >"$logs/decode.log" 2>&1 &
decode=$!
stop() { kill "$prefill" "$decode" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
trap 'exit 130' INT TERM

for name in prefill decode; do
  pid="${!name}" port_var="${name}_port"
  echo "waiting for the $name server (port ${!port_var}, log $logs/$name.log) ..."
  until curl -sf "http://127.0.0.1:${!port_var}/health" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "the $name server exited; the end of its log:" >&2
      tail -n 30 "$logs/$name.log" >&2
      exit 1
    fi
    sleep 2
  done
done

echo "prefill :$prefill_port and decode :$decode_port are up; the router listens on :$port"
echo "try: curl -s localhost:$port/v1/completions -H 'content-type: application/json' \\"
echo "       -d '{\"model\": \"$model\", \"prompt\": \"The scheduler\", \"max_tokens\": 16}'"
"$venv/bin/vllm-router" --host 127.0.0.1 --port "$port" --vllm-pd-disaggregation \
  --prefill "http://127.0.0.1:$prefill_port" --decode "http://127.0.0.1:$decode_port" \
  --policy round_robin
