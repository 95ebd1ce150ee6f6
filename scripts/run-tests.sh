#!/usr/bin/env bash
# The test suite: set up vLLM's environment, run ruff (lint and format) and mypy, set up
# the backend runner's environment (the Neuron SDK's pins), then run pytest. Extra
# arguments go to pytest, e.g. scripts/run-tests.sh -k bucketing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-env.sh" cpu,test
venv="${VENV:-$root/.venv}"
cd "$root"
# The static checks first (before the SDK environment's set-up): any lint
# finding, format difference or type error fails the run. Their scope and rules are in
# pyproject.toml ([tool.ruff], [tool.mypy]).
"$venv/bin/ruff" check
"$venv/bin/ruff" format --check
"$venv/bin/mypy"
"$root/scripts/setup-backend-env.sh"
export NEURON_TEST_SDK_PYTHON="${VENV_SDK:-$root/.venv-sdk}/bin/python"
exec "$venv/bin/python" -m pytest "$@"
