#!/usr/bin/env bash
# Create (or update) a second environment with the Neuron SDK's pins and no vLLM, where
# the backend runner runs: torch 2.9 (what torch-neuronx is built for) and transformers
# 4.57 (what NxDI 0.7-0.9 pin), plus this plugin's backend side (`[backend]` extra).
# On an inf2/trn host, use the SDK's own venv instead (docs/serving/inf2.md).
# Usage: scripts/setup-backend-env.sh   (VENV_SDK=path to choose the folder)
# A rerun with nothing changed is a stamp check, as in setup-env.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV_SDK:-$root/.venv-sdk}"
python="${PYTHON:-python3}"
pins=("torch==2.9.1" "transformers==4.57.*")
source "$root/scripts/stamp.sh"
digest="$(inputs_digest "${pins[@]}" -- "${BASH_SOURCE[0]}" "$root/pyproject.toml")"
if is_current "$venv" "$digest"; then
  echo "backend environment $venv is up to date"
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
rm -f "$venv/.setup-stamp"  # an interrupted install must not look complete
pip_install "$venv" "${pins[@]}"
pip_install "$venv" -e "$root[backend]"
"$venv/bin/python" - <<'PY'
import importlib.util, sys
import torch, transformers
assert importlib.util.find_spec("vllm") is None, "the backend environment must not have vLLM"
print("backend environment ready:", sys.executable, "torch", torch.__version__,
      "transformers", transformers.__version__)
PY
mark_current "$venv" "$digest"
