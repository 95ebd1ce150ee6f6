# Sourced by the set-up scripts: a venv keeps a stamp, the digest of everything its
# install depends on, so a rerun with nothing changed skips pip entirely; and the one way
# they run pip.

# pip_install VENV ARG...: pip install ARG... into VENV, quietly. --no-cache-dir: a wheel
# cache would keep a second copy of the index's CUDA builds of torch (several GB each),
# and with it CI once ran out of disk. SETUP_LAZY_BYTECODE=1 (the test command sets it)
# adds --no-compile: Python then compiles a module's bytecode on its first import instead
# of pip compiling all of torch, transformers and vLLM up front (about 70,000 files over
# the three environments, minutes of CPU on a 2-core machine); installs for a Neuron host
# keep pip's default.
pip_install() {
  local venv="$1"; shift
  local flags=(--quiet --disable-pip-version-check --no-cache-dir)
  [ "${SETUP_LAZY_BYTECODE:-}" != 1 ] || flags+=(--no-compile)
  "$venv/bin/python" -m pip install "${flags[@]}" "$@"
}

# inputs_digest WORD... -- FILE...: sha256 of the words and the files' contents.
inputs_digest() {
  local words=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do words+=("$1"); shift; done
  shift
  (printf '%s\n' "${words[@]}"; cat "$@") | sha256sum | cut -d' ' -f1
}

# is_current VENV DIGEST: the venv exists and was completed with these inputs.
is_current() {
  [ -x "$1/bin/python" ] && [ "$(cat "$1/.setup-stamp" 2>/dev/null)" = "$2" ]
}

# mark_current VENV DIGEST: the install finished; a rerun may skip it.
mark_current() {
  echo "$2" > "$1/.setup-stamp"
}
