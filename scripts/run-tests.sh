#!/usr/bin/env bash
# The test suite: set up the environment with the test extras, then run pytest.
# Extra arguments go to pytest, e.g. scripts/run-tests.sh -k bucketing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-env.sh" cpu,test
venv="${VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
