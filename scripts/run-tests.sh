#!/usr/bin/env bash
# The test suite: set up both environments (vLLM's, and the backend runner's with the
# Neuron SDK's pins), then run pytest. Extra arguments go to pytest, e.g.
# scripts/run-tests.sh -k bucketing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-env.sh" cpu,test
"$root/scripts/setup-backend-env.sh"
venv="${VENV:-$root/.venv}"
export NEURON_TEST_SDK_PYTHON="${VENV_SDK:-$root/.venv-sdk}/bin/python"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
