"""The container recipe (configs/container/Containerfile) installs with the scripts the
test suite runs, ships what those scripts and the package need, and provides every
command the Kubernetes recipe runs. (Building the image needs AWS's Neuron repositories,
which this suite cannot reach; these checks keep the recipe and the tested set-up from
drifting apart.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "configs" / "container" / "Containerfile"
HOST_SETUP = ROOT / "scripts" / "setup-neuron-host.sh"


def _instructions() -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _runs_scripts(path: Path) -> list[str]:
    """The project scripts a shell script runs ("$root/scripts/NAME")."""
    return re.findall(r'"\$root/scripts/([\w.-]+)"', path.read_text())


def test_the_image_installs_with_the_scripts_the_tests_run():
    runs = [args for instruction, args in _instructions() if instruction == "RUN"]
    assert any("scripts/setup-neuron-host.sh" in r for r in runs)
    tested = set(_runs_scripts(ROOT / "scripts" / "run-tests.sh"))
    host = set(_runs_scripts(HOST_SETUP))
    # the host's vLLM environment (the `vllm` wheel) and the backend's, both tested
    assert host == {"setup-host-env.sh", "setup-backend-env.sh"}
    assert host <= tested
    subprocess.run(["bash", "-n", str(HOST_SETUP)], check=True)
    assert HOST_SETUP.stat().st_mode & 0o111


def test_the_image_holds_what_the_install_needs():
    copied = {source.rstrip("/") for instruction, args in _instructions()
              if instruction == "COPY" for source in shlex.split(args)[:-1]}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"][
        "include"]}
    assert packages | {"pyproject.toml", pyproject["project"]["readme"], "scripts",
                       "configs"} <= copied
    assert all((ROOT / s).exists() for s in copied)


def test_the_router_is_the_version_the_fleet_test_runs():
    pins = [r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"] if r.startswith("vllm-router")]
    assert pins and f'router="{pins[0]}"' in HOST_SETUP.read_text()


def test_the_backend_runs_in_the_sdk_environment_of_the_image():
    run = next(args for instruction, args in _instructions()
               if instruction == "RUN" and "setup-neuron-host.sh" in args)
    sdk = re.search(r"VENV_SDK=(\S+)", run).group(1)
    env = " ".join(args for instruction, args in _instructions() if instruction == "ENV")
    assert f"VLLM_NEURON_BACKEND_PYTHON={sdk}/bin/python" in env
    venv = re.search(r"VENV_HOST=(\S+)", run).group(1)
    assert f"PATH={venv}/bin:" in env


def test_every_command_of_the_kubernetes_recipe_is_installed():
    """The manifests run `vllm`, `neuron-plugin` and `vllm-router`; the environment the
    same set-up built for these tests has each of them."""
    commands = set()
    for path in (ROOT / "configs" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "Job"):
                commands |= {c["command"][0] for c in doc["spec"]["template"]["spec"][
                    "containers"]}
    assert commands == {"vllm", "neuron-plugin", "vllm-router"}
    for command in commands:
        assert Path(sys.executable).with_name(command).exists(), command
