"""When the platform activates, and with which backend (`neuron_plugin.register`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from neuron_plugin import asks_for_neuron, choose_backend


@pytest.mark.parametrize("env,argv,devices,expected", [
    ({}, ["vllm", "serve", "m"], [], None),                                  # plain CPU host
    ({}, ["vllm", "serve", "m", "--device", "cuda"], [], None),              # someone else's
    ({}, ["vllm", "serve", "m", "--device", "neuron"], [], "reference"),
    ({}, ["vllm", "serve", "m", "--device=neuron"], [], "reference"),
    ({}, ["vllm", "serve", "m", "--device", "neuron"], ["/dev/neuron0"], "nxd"),
    ({}, ["python", "app.py"], ["/dev/neuron0"], "nxd"),                     # Neuron host
    ({"VLLM_NEURON_BACKEND": "reference"}, ["python"], ["/dev/neuron0"], "reference"),
    ({"VLLM_NEURON_BACKEND": "NXD"}, ["python"], [], "nxd"),
    ({"VLLM_NEURON_BACKEND": " "}, ["python"], [], None),
])
def test_choose_backend(env, argv, devices, expected):
    assert choose_backend(env, argv, devices) == expected


def test_a_host_where_vllm_has_no_platform_gets_the_reference_backend():
    """The `vllm` wheel without a GPU: vLLM alone would fail ("Device string must not be
    empty"); an explicit choice or a Neuron device still decides first."""
    def none() -> bool:
        return False

    assert choose_backend({}, ["python", "app.py"], [], none) == "reference"
    assert choose_backend({}, ["python", "app.py"], ["/dev/neuron0"], none) == "nxd"
    assert choose_backend({"VLLM_NEURON_BACKEND": "nxd"}, ["python"], [], none) == "nxd"
    assert choose_backend({}, ["python", "app.py"], [], lambda: True) is None


def test_vllm_platform_found_is_vllms_own_detection():
    from neuron_plugin import vllm_platform_found

    # the test environment is vLLM's CPU build, whose CPU platform activates anywhere
    assert vllm_platform_found()


def test_unknown_backend_names_the_variable_and_choices():
    with pytest.raises(ValueError, match=r"VLLM_NEURON_BACKEND='gpu'.*'nxd'.*'reference'"):
        choose_backend({"VLLM_NEURON_BACKEND": "gpu"}, [], [])


def test_device_flag_value_must_be_neuron():
    assert not asks_for_neuron(["--device"])
    assert not asks_for_neuron(["--device", "cpu", "neuron"])
    assert asks_for_neuron(["serve", "--device", "neuron", "--port", "1"])


def _resolve_platform(env: dict, argv: list[str]) -> str:
    code = ("import sys; sys.argv = " + repr(argv) + "\n"
            "from vllm.platforms import current_platform\n"
            "print(type(current_platform).__module__ + '.' + type(current_platform).__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    return result.stdout.strip().splitlines()[-1]


def test_vllm_selects_this_platform_only_when_asked(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NEURON_")}
    assert _resolve_platform(env, ["vllm", "serve", "m"]) == "vllm.platforms.cpu.CpuPlatform"
    assert _resolve_platform(env, ["vllm", "serve", "m", "--device", "neuron"]) == \
        "neuron_plugin.platform.NeuronPlatform"
    assert _resolve_platform({**env, "VLLM_NEURON_BACKEND": "reference"}, ["python"]) == \
        "neuron_plugin.platform.NeuronPlatform"
