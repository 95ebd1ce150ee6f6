# Sourced by the set-up scripts: a venv keeps a stamp, the digest of everything its
# install depends on, so a rerun with nothing changed skips pip entirely; and the one way
# they run pip.

# pip_install VENV ARG...: pip install ARG... into VENV, quietly. --no-cache-dir: a wheel
# cache would keep a second copy of the index's CUDA builds of torch (several GB each),
# and with it CI once ran out of disk. pip's up-front bytecode compilation stays on: with
# PYTHONDONTWRITEBYTECODE set (as on the test machines) Python writes no bytecode of its
# own, and a --no-compile install made every process compile each module it imports
# (a test run took minutes longer).
pip_install() {
  local venv="$1"; shift
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "$@"
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
