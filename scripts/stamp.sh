# Sourced by the set-up scripts: a venv keeps a stamp, the digest of everything its
# install depends on, so a rerun with nothing changed skips pip entirely.

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
