#!/usr/bin/env bash
# Create (or update) the vLLM environment of an inf2/trn host: the `vllm` wheel from the
# package index (the build published for every vLLM release) and this plugin, through
# the `neuron` extra: `pip install -e '.[neuron]'`. The Neuron SDK lives in a second
# environment (scripts/setup-backend-env.sh, or the DLAMI's venv) where the backend runs
# as a runner process; scripts/setup-neuron-host.sh sets up both.
# Usage: scripts/setup-host-env.sh
#   VENV_HOST: the folder (default .venv-host); PYTHON: the interpreter to build it with;
#   VLLM_VERSION: pin one supported release (e.g. 0.32.0; default: the newest supported).
# A rerun with nothing changed is a stamp check, as in setup-env.sh. The test suite runs
# this script with pip's machine-local settings off (PIP_CONFIG_FILE=/dev/null), so that
# it installs exactly what a Neuron host gets from the index.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV_HOST:-$root/.venv-host}"
python="${PYTHON:-python3}"
pin=()
[ -z "${VLLM_VERSION:-}" ] || pin=("vllm==$VLLM_VERSION")
source "$root/scripts/stamp.sh"
digest="$(inputs_digest "${pin[@]}" -- "${BASH_SOURCE[0]}" "$root/pyproject.toml")"
if is_current "$venv" "$digest"; then
  echo "host environment $venv is up to date"
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
rm -f "$venv/.setup-stamp"  # an interrupted install must not look complete
pip_install "$venv" -e "$root[neuron]" "${pin[@]}"
"$venv/bin/python" -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'ready in', '$venv')"
mark_current "$venv" "$digest"
