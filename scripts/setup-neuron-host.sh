#!/usr/bin/env bash
# Set up an inf2/trn1 host (or the container image, configs/container/Containerfile) for
# serving with the same scripts the test suite runs:
#   1. scripts/setup-host-env.sh: the vLLM environment (the `vllm` wheel of the newest
#      supported release and this plugin, `pip install -e '.[neuron]'`; the test suite
#      serves from exactly this, tests/e2e/test_deployment_build.py), and vLLM's router;
#   2. scripts/setup-backend-env.sh: the backend runner's environment (no vLLM), then the
#      Neuron SDK's Python packages into it from AWS's package index.
# The Neuron driver (host) and runtime libraries come from AWS's apt/yum repository (the
# Containerfile shows the steps); `neuron-plugin doctor` checks the result on the host.
# Usage: scripts/setup-neuron-host.sh
#   VENV_HOST (default .venv-host), VENV_SDK (default .venv-sdk), PYTHON, VLLM_VERSION:
#   as in those scripts;
#   NEURON_SDK_PACKAGES: the SDK release's packages (default: Neuron 2.28, the last
#   release with NxD Inference models for inf2/trn1, see docs/serving/versions.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV_HOST:-$root/.venv-host}"
sdk="${VENV_SDK:-$root/.venv-sdk}"
packages="${NEURON_SDK_PACKAGES:-neuronx-cc==2.23.* neuronx-distributed==0.17.* neuronx-distributed-inference==0.8.* torch-neuronx==2.9.*}"
router="vllm-router==0.1.17"  # the version pyproject.toml's test extra runs the fleet test with

"$root/scripts/setup-host-env.sh"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$router"
"$root/scripts/setup-backend-env.sh"
# shellcheck disable=SC2086  # the package list is words on purpose
"$sdk/bin/python" -m pip install --quiet --disable-pip-version-check \
  --extra-index-url https://pip.repos.neuron.amazonaws.com $packages
"$sdk/bin/python" -c "import neuronx_distributed_inference, torch_neuronx; print('Neuron SDK ready in', '$sdk')"
echo "serve with: VLLM_NEURON_BACKEND_PYTHON=$sdk/bin/python $venv/bin/vllm serve MODEL --device neuron"
