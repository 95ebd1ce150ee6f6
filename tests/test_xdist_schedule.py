"""The suite's two workers take whole files (tests/xdist_schedule.py): a file's
module-scoped engines start once, not once per worker, with the pytest and pytest-xdist
the test command installs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.xdist_schedule import SESSION_SERVER, SESSION_SERVER_FILES, work_unit

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import os
import pytest

@pytest.fixture(scope="module")
def engine():
    with open(os.environ["SETUPS"], "a") as log:
        log.write(f"{__name__} {os.getpid()}\\n")

def test_one(engine): pass
def test_two(engine): pass
@pytest.mark.parametrize("n", range(4))
def test_many(engine, n): pass
'''


def test_a_file_is_one_unit_and_the_session_server_files_are_one():
    assert work_unit("tests/e2e/test_vision.py::test_x[one]") == "tests/e2e/test_vision.py"
    assert work_unit("tests/e2e/test_vision.py::Group::test_y") == "tests/e2e/test_vision.py"
    assert {work_unit(f"{path}::test_z") for path in SESSION_SERVER_FILES} == {SESSION_SERVER}
    missing = [path for path in SESSION_SERVER_FILES if not (ROOT / path).is_file()]
    assert not missing, f"renamed or removed; update tests/xdist_schedule.py: {missing}"


def test_each_files_module_fixture_is_set_up_once_across_two_workers(tmp_path):
    """Six tests per file over two workers: with files split between workers (what
    `--dist loadgroup` does under pytest 9.2) each module fixture runs twice."""
    files = ["test_alpha", "test_beta", "test_gamma"]
    for name in files:
        (tmp_path / f"{name}.py").write_text(MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    setups = tmp_path / "setups.log"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.xdist_schedule",
         "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SETUPS": str(setups)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "18 passed" in run.stdout, run.stdout
    modules = sorted(line.split()[0] for line in setups.read_text().splitlines())
    assert modules == files, setups.read_text()
