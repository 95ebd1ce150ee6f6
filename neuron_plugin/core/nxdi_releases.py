"""Which NxD Inference release an instance family runs, and which releases this plugin
has checked against real NxDI code.

NxDI 0.9 (Neuron SDK 2.29) and later support their models on Trn2 and newer only; the
SDK 2.29 release notes tell Inf2 and Trn1 users to pin SDK 2.28, i.e. NxDI 0.8 (so the
NKI kernels those chips need stay). Every release in `CHECKED` ran the plugin's `-m nxdi`
suite in NxDI's own CPU mode (docs/serving/cpu-mode.md): what the nxd backend serves per
architecture and feature was measured on it (backends/nxd/compat.py). One table, read by
`doctor`, `explain-config`, `validate` and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class NxDIRelease:
    """One NxD Inference release as a Neuron SDK ships it."""

    release: str  # "0.8": what `neuronx-distributed-inference` versions start with
    sdk: str  # the Neuron SDK release that ships it
    commit: str  # the public source the plugin was checked against

    def describe(self) -> str:
        return f"NxDI {self.release} (Neuron SDK {self.sdk}, {self.commit})"


# NeuronCore-v2 chips; from NxDI 0.9 (SDK 2.29) on, no release supports them.
V2_FAMILIES = ("inf2", "trn1")
V2_LAST_RELEASE = "0.8"

NXDI_0_8 = NxDIRelease("0.8", "2.28", "cd3abf3")
NXDI_0_9 = NxDIRelease("0.9", "2.29", "ef2731e")
# The releases the plugin's `-m nxdi` suite ran on, oldest first.
CHECKED = (NXDI_0_8, NXDI_0_9)


def release_of(version: str | None) -> str | None:
    """ "0.8" for "0.8.16251" or "0.8.0+cd3abf3"; None when unknown."""
    if not version:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    return f"{parsed.major}.{parsed.minor}"


def supports(version: str, target: str | None) -> bool:
    """Whether an NxDI version supports a chip target (unknown either way: True)."""
    release = release_of(version)
    if release is None or target not in V2_FAMILIES:
        return True
    return Version(release) <= Version(V2_LAST_RELEASE)


def checked(version: str | None) -> NxDIRelease | None:
    """The checked release an installed NxDI version belongs to, if any."""
    release = release_of(version)
    return next((r for r in CHECKED if r.release == release), None)


def for_family(target: str | None) -> NxDIRelease:
    """The newest checked release that supports a chip target (an unknown or absent
    target: the newest checked release)."""
    return [r for r in CHECKED if supports(r.release, target)][-1]


def assessment(version: str | None, target: str | None) -> dict[str, object]:
    """An installed NxDI against the chip target of the host, for reports: which checked
    release it is (None: not one), which release the family runs, whether it supports
    the family."""
    found = checked(version)
    return {
        "installed": version,
        "checked_release": found.describe() if found else None,
        "instance_family": target,
        "family_runs": for_family(target).describe(),
        "supports_family": version is not None and supports(version, target),
    }
