"""The environments scripts/run-tests.sh sets up beside the test one (in the background),
as the tests that need them find them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def environment(name: str, python_var: str, setup_script: str,
                timeout: float = 45 * 60) -> str | None:
    """The interpreter of an environment scripts/run-tests.sh sets up in the background
    (NAME.status and NAME.log in $NEURON_TEST_SETUP_DIR), once its set-up is done; the
    test fails with the log's tail if it failed. Outside run-tests.sh: the interpreter
    $python_var names, or None when that is unset."""
    python = os.environ.get(python_var)
    setup_dir = os.environ.get("NEURON_TEST_SETUP_DIR")
    if setup_dir:
        status = Path(setup_dir) / f"{name}.status"
        deadline = time.monotonic() + timeout
        while not status.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"{setup_script} still running after {timeout:.0f} s")
            time.sleep(2)
        if status.read_text().strip() != "0":
            log = (Path(setup_dir) / f"{name}.log").read_text(errors="replace")
            pytest.fail(f"{setup_script} failed:\n{log[-4000:]}")
    if python is not None and not os.access(python, os.X_OK):
        pytest.fail(f"{python_var}={python} is not an interpreter: run {setup_script} "
                    f"(scripts/run-tests.sh does)")
    return python
