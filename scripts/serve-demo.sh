#!/usr/bin/env bash
# The main job: set up the environment, build the tiny checkpoint, and serve it through
# vLLM on the Neuron platform (the CPU reference backend on a host without Neuron devices).
# Extra arguments go to `vllm serve`, e.g. scripts/serve-demo.sh --port 8001
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-env.sh" cpu
venv="${VENV:-$root/.venv}"
model="$root/models/tiny-llama"
"$venv/bin/python" "$root/scripts/build_tiny_model.py" --arch llama --out "$model"
exec "$venv/bin/vllm" serve "$model" --device neuron --max-model-len 1024 \
  --max-num-seqs 4 --config "$root/configs/serve-tiny.yaml" "$@"
