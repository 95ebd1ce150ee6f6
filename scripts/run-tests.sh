#!/usr/bin/env bash
# The test suite: set up vLLM's test environment (the CPU build), run ruff (lint and
# format) and the documentation site's strict build, then pytest with mypy beside it.
# Two more environments install in the background from the start, beside the first (pip
# uses one core, so the other would idle), each with its own stamp (a rerun with nothing
# changed skips pip):
#   .venv-sdk  the backend runner's (the Neuron SDK's pins: torch 2.9, transformers 4.57,
#              no vLLM; scripts/setup-backend-env.sh),
#   .venv-host a Neuron host's vLLM environment (the `vllm` wheel of the newest supported
#              release from the package index, pip's machine-local settings off, as a host
#              installs it; scripts/setup-host-env.sh), which tests/e2e/test_deployment_build.py
#              serves from.
# All three install without pip's wheel cache (scripts/stamp.sh says why). Tests that
# need one wait for its set-up (tests/environments.py). Extra arguments go to pytest, e.g.
# scripts/run-tests.sh -k bucketing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
cd "$root"

logs="$root/.test-setup"
mkdir -p "$logs"
export NEURON_TEST_SETUP_DIR="$logs"
# in_background NAME COMMAND...: run it, its output in NAME.log, its exit status in
# NAME.status once done.
in_background() {
  local name="$1"; shift
  rm -f "$logs/$name.status"
  ( set +e; "$@" > "$logs/$name.log" 2>&1; echo $? > "$logs/$name.status" ) &
}
in_background sdk "$root/scripts/setup-backend-env.sh"
in_background host env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$root/scripts/setup-host-env.sh"
# Never leave an install half done (a stamp-less venv would install again next time).
trap 'wait' EXIT
"$root/scripts/setup-env.sh" cpu,test
export NEURON_TEST_SDK_PYTHON="${VENV_SDK:-$root/.venv-sdk}/bin/python"
export NEURON_TEST_HOST_PYTHON="${VENV_HOST:-$root/.venv-host}/bin/python"

# The static checks (any lint finding, format difference or type error fails the run);
# their scope and rules are in pyproject.toml ([tool.ruff], [tool.mypy]).
"$venv/bin/ruff" check
"$venv/bin/ruff" format --check
# The documentation site: a broken link or anchor fails the build (mkdocs.yml, strict).
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet --site-dir "$logs/site"
# mypy runs beside pytest (from a fresh clone it takes 73 s of one core, and pytest
# starts that much sooner); its verdict comes after pytest's.
"$venv/bin/mypy" > "$logs/mypy.log" 2>&1 &
mypy_pid=$!
# Two workers (NEURON_TEST_WORKERS), each file's tests on one (tests/xdist_schedule.py),
# so e2e files' engine start-ups overlap: pytest took 30.5 min instead of 35.1 min from a
# fresh clone on a 2-core machine (2026-11-27).
workers="${NEURON_TEST_WORKERS:-2}"
# torch's threads per process: the cores shared among the workers (at least one). With
# torch's default, one per core, each worker's engines and oracle would contend with the
# other worker's for every core: on 2 cores, five of the e2e and plugin files took
# 159-163 s with one thread and 186-215 s without (2026-11-28).
cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores > workers ? cores / workers : 1 ))}"
tests=0
"$venv/bin/python" -m pytest -n "$workers" "$@" || tests=$?
types=0
wait "$mypy_pid" || types=$?
echo "mypy:"
cat "$logs/mypy.log"
if (( tests != 0 || types != 0 )); then
  echo "failed: pytest exit status $tests, mypy exit status $types" >&2
  exit $(( tests != 0 ? tests : types ))
fi
