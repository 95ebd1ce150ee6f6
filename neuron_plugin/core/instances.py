"""Neuron instance types, NeuronCores and device memory: what a host offers a model.

The table follows AWS's Neuron architecture pages (Inf2, Trn1, Trn2): an Inferentia2 or
Trainium chip has two NeuronCore-v2 and 32 GiB of HBM shared by them, read at 820 GB/s;
a Trainium2 chip has eight NeuronCore-v3 and 96 GiB at 2.9 TB/s (the NKI architecture
guide), exposed by default (LNC=2) as four logical cores.
The number of cores a process may use is what `NEURON_RT_VISIBLE_CORES` names, or every
core of every device in `/dev/neuron*`. Data-parallel engines on one host split those
cores into disjoint runs of `tensor_parallel_size` (`core_slices`); the runtime reserves
every core a process can see, so each engine must see only its own run. Reading the host
is separated from the pure arithmetic so both are tested here without a device.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from neuron_plugin import neuron_devices
from neuron_plugin.core.errors import NeuronConfigError

GIB = 1 << 30
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
PRODUCT_NAME_FILE = Path("/sys/devices/virtual/dmi/id/product_name")


@dataclass(frozen=True)
class Chip:
    """One Neuron device as the runtime sees it."""

    name: str
    target: str  # the compiler's platform target (neuronx-cc --target)
    physical_cores: int
    hbm_bytes: int
    hbm_bytes_per_s: float
    default_lnc: int = 1

    def logical_cores(self, lnc: int | None = None) -> int:
        return self.physical_cores // (lnc or self.default_lnc)

    def bandwidth_per_core(self, lnc: int | None = None) -> float:
        """HBM bytes a logical core reads per second: the chip's shared by its cores."""
        return self.hbm_bytes_per_s / self.logical_cores(lnc)


INFERENTIA2 = Chip("Inferentia2", "inf2", 2, 32 * GIB, 820e9)
TRAINIUM = Chip("Trainium", "trn1", 2, 32 * GIB, 820e9)
TRAINIUM2 = Chip("Trainium2", "trn2", 8, 96 * GIB, 2.9e12, default_lnc=2)


@dataclass(frozen=True)
class InstanceType:
    name: str
    chip: Chip
    chips: int

    def cores(self, lnc: int | None = None) -> int:
        return self.chips * self.chip.logical_cores(lnc)

    def memory_per_core(self, lnc: int | None = None) -> int:
        """HBM a logical NeuronCore can use: the chip's HBM shared by its cores."""
        return self.chip.hbm_bytes // self.chip.logical_cores(lnc)


INSTANCE_TYPES: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType("inf2.xlarge", INFERENTIA2, 1),
        InstanceType("inf2.8xlarge", INFERENTIA2, 1),
        InstanceType("inf2.24xlarge", INFERENTIA2, 6),
        InstanceType("inf2.48xlarge", INFERENTIA2, 12),
        InstanceType("trn1.2xlarge", TRAINIUM, 1),
        InstanceType("trn1.32xlarge", TRAINIUM, 16),
        InstanceType("trn1n.32xlarge", TRAINIUM, 16),
        InstanceType("trn2.3xlarge", TRAINIUM2, 1),
        InstanceType("trn2.48xlarge", TRAINIUM2, 16),
        InstanceType("trn2u.48xlarge", TRAINIUM2, 16),
    )
}


def package_version(distribution: str) -> str | None:
    """The installed version of a Python distribution, None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_instance_type(product_file: Path = PRODUCT_NAME_FILE) -> str | None:
    """The EC2 instance type from DMI (no metadata service call), or None off EC2."""
    try:
        name = product_file.read_text().strip()
    except OSError:
        return None
    return name if name in INSTANCE_TYPES else None


def parse_core_list(value: str) -> list[int]:
    """`NEURON_RT_VISIBLE_CORES` syntax: "3", "0-3" or "0,2,4-5" -> core ids."""
    cores: list[int] = []
    for part in value.split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(
                f"{VISIBLE_CORES_ENV}={value!r} is not a core list; write core ids and "
                f"ranges such as 0-1 or 0,2,4-5."
            )
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(
                f"{VISIBLE_CORES_ENV}={value!r}: range {part} runs backwards; write {last}-{first}."
            )
        cores.extend(range(first, last + 1))
    return sorted(set(cores))


def lnc(environ: Mapping[str, str] = os.environ) -> int | None:
    value = environ.get(LNC_ENV)
    return int(value) if value and value.isdigit() else None


def format_core_list(cores: Sequence[int]) -> str:
    """The `NEURON_RT_VISIBLE_CORES` value naming exactly `cores`: a range ("4-5") when
    they are consecutive, else a comma list ("2,5"), the two forms the runtime documents
    (the Kubernetes device plugin writes the second)."""
    ordered = sorted(cores)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def visible_core_ids(
    environ: Mapping[str, str], devices: Sequence[str], instance: InstanceType | None
) -> tuple[list[int] | None, str]:
    """(the NeuronCore ids this process may use, where they come from); None when
    neither the environment nor the host tells."""
    value = environ.get(VISIBLE_CORES_ENV)
    if value:
        return parse_core_list(value), f"{VISIBLE_CORES_ENV}={value}"
    if devices and instance is not None:
        return (
            list(range(len(devices) * instance.chip.logical_cores(lnc(environ)))),
            f"{len(devices)} device(s) of {instance.name}",
        )
    if devices:
        return None, f"{len(devices)} device(s) of an unknown instance type"
    return None, "no Neuron devices (/dev/neuron*)"


def visible_cores(
    environ: Mapping[str, str], devices: Sequence[str], instance: InstanceType | None
) -> tuple[int | None, str]:
    """(number of NeuronCores this process may use, where that number comes from);
    None when neither the environment nor the host tells."""
    ids, source = visible_core_ids(environ, devices, instance)
    return (None if ids is None else len(ids)), source


def host_visible_core_ids(environ: Mapping[str, str] = os.environ) -> tuple[list[int] | None, str]:
    """`visible_core_ids` for this host."""
    detected = detect_instance_type()
    return visible_core_ids(
        environ, neuron_devices(), INSTANCE_TYPES[detected] if detected else None
    )


def host_visible_cores(environ: Mapping[str, str] = os.environ) -> tuple[int | None, str]:
    """`visible_cores` for this host."""
    ids, source = host_visible_core_ids(environ)
    return (None if ids is None else len(ids)), source


def rank_cores(tp_degree: int, rank: int, visible: Sequence[int], source: str) -> list[int]:
    """The NeuronCores of data-parallel engine `rank` on this host: the rank-th run of
    `tp_degree` visible cores, in the order they are visible (so a user's range is
    respected and ranks never share a core)."""
    cores = list(visible[rank * tp_degree : (rank + 1) * tp_degree])
    if len(cores) < tp_degree:
        raise NeuronConfigError(
            f"data-parallel rank {rank} needs NeuronCores {rank * tp_degree} to "
            f"{(rank + 1) * tp_degree - 1} of the visible ones (--tensor-parallel-size "
            f"{tp_degree} per engine) but only {len(visible)} are visible ({source}); "
            f"{_fewer_engines(tp_degree, len(visible))}"
        )
    return cores


def core_slices(
    tp_degree: int, dp_degree: int, visible: Sequence[int], source: str
) -> list[list[int]]:
    """Each data-parallel rank's NeuronCores (`rank_cores` for ranks 0..dp-1), refused
    as a whole with the arithmetic when TP x DP exceeds the visible cores."""
    needed = tp_degree * dp_degree
    if needed > len(visible):
        raise NeuronConfigError(
            f"--tensor-parallel-size {tp_degree} x --data-parallel-size {dp_degree} needs "
            f"{needed} NeuronCores ({dp_degree} engine(s) of {tp_degree}) but "
            f"{len(visible)} are visible ({source}); "
            f"{_fewer_engines(tp_degree, len(visible))}"
        )
    return [rank_cores(tp_degree, rank, visible, source) for rank in range(dp_degree)]


def _fewer_engines(tp_degree: int, visible: int) -> str:
    """The fix for too few cores, as the end of an error message."""
    more = (
        f"or make more cores visible ({VISIBLE_CORES_ENV}, or a larger "
        f"aws.amazon.com/neuroncore request on Kubernetes)."
    )
    if visible >= tp_degree:
        return f"lower --data-parallel-size to at most {visible // tp_degree}, {more}"
    return f"lower --tensor-parallel-size to at most {visible}, {more}"


def check_tp_fits(tp_degree: int, cores: int | None, source: str) -> None:
    """A TP degree above the visible cores fails inside NxDI with a KeyError; say why
    and how to fix it before anything compiles."""
    if cores is None:
        raise NeuronConfigError(
            f"tensor_parallel_size={tp_degree} needs {tp_degree} NeuronCore(s) but "
            f"none are visible ({source}); run on an inf2/trn host with the Neuron "
            f"driver, or set VLLM_NEURON_BACKEND=reference to serve on the CPU."
        )
    if tp_degree > cores:
        raise NeuronConfigError(
            f"tensor_parallel_size={tp_degree} needs {tp_degree} NeuronCores but only "
            f"{cores} are visible ({source}); lower --tensor-parallel-size to at most "
            f"{cores} or make more cores visible (e.g. {VISIBLE_CORES_ENV}=0-"
            f"{tp_degree - 1})."
        )
