"""Which class the nxd backend builds for a checkpoint: the architecture table's source
for the installed NxDI release (`models.table`: NxDI's MODEL_TYPES, a module NxDI ships
unlisted, a class of the plugin's own, or a refusal), or a class registered under the
entry-point group of `models.third_party`, which wins over the table."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from neuron_plugin import plugin_logger
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.settings import NeuronConfigError
from neuron_plugin.models.table import (
    TABLE,
    TASK,
    NxDIModelType,
    NxDIModule,
    NxDSource,
    PluginClass,
    Refused,
    ThirdPartyClass,
    nxd_architectures,
)
from neuron_plugin.models.third_party import ENTRY_POINT_GROUP, registered

logger = plugin_logger(__name__)
NXDI_PACKAGE = "neuronx_distributed_inference"


class NxDIModelClass(Protocol):
    """What the backend calls on an NxDI application class (NeuronBaseForCausalLM)."""

    __module__: str
    __qualname__: str

    def get_neuron_config_cls(self) -> Callable[..., Any]: ...

    def get_config_cls(self) -> Callable[..., Any]: ...

    def save_quantized_state_dict(self, model_path: str, config: Any) -> None: ...

    def __call__(self, model_path: str, config: Any) -> Any: ...


def release_for(nxdi_version: str | None) -> nxdi_releases.NxDIRelease:
    """The checked release whose table row applies to an installed NxDI: its own, the
    newest checked one below a newer release, the oldest for an older (or unknown) one."""
    found = nxdi_releases.checked(nxdi_version)
    if found:
        return found
    release = nxdi_releases.release_of(nxdi_version)
    older = [r for r in nxdi_releases.CHECKED if release and _key(r.release) < _key(release)]
    return older[-1] if older else nxdi_releases.CHECKED[0]


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def source(
    architecture: str,
    release: nxdi_releases.NxDIRelease,
    entry_points: Iterable[importlib.metadata.EntryPoint],
) -> NxDSource:
    """Where `architecture`'s class comes from with `release` (an entry point first)."""
    found = registered(architecture, entry_points)
    if found:
        return found[0]
    row = TABLE.get(architecture)
    if row is None or release.release not in row.nxd:
        raise NeuronConfigError(_unsupported(architecture, release))
    return row.nxd[release.release]


def describe_architecture(
    architecture: str,
    entry_points: Iterable[importlib.metadata.EntryPoint],
    release: nxdi_releases.NxDIRelease,
) -> str:
    """Which class would serve `architecture` with `release`, without importing NxDI."""
    found = source(architecture, release, entry_points)
    if isinstance(found, Refused):
        raise NeuronConfigError(_refusal(architecture, release, found))
    return found.describe()


def resolve_model_class(
    architecture: str,
    model_types: Mapping[str, Mapping[str, NxDIModelClass]],
    entry_points: Iterable[importlib.metadata.EntryPoint],
    nxdi_version: str | None = None,
) -> NxDIModelClass:
    """The class for `architecture` with the installed NxDI (`nxdi_version`)."""
    release = release_for(nxdi_version)
    found = source(architecture, release, entry_points)
    if isinstance(found, Refused):
        raise NeuronConfigError(_refusal(architecture, release, found))
    if isinstance(found, NxDIModelType):
        if found.key not in model_types or TASK not in model_types[found.key]:
            raise NeuronConfigError(
                f"the installed NxD Inference {nxdi_version or '(unknown version)'} has no "
                f"{found.key!r} model in MODEL_TYPES, needed for {architecture}; serve it on "
                f"a host whose Neuron SDK lists it (docs/serving/architectures.md), register "
                f"an NxDI contrib class under the {ENTRY_POINT_GROUP!r} entry point, or serve "
                f"on the CPU with VLLM_NEURON_BACKEND=reference."
            )
        return model_types[found.key][TASK]
    path = f"{NXDI_PACKAGE}.{found.path}" if isinstance(found, NxDIModule) else found.path
    cls = _import(path, found)
    logger.info("NxD model class for %s: %s", architecture, found.describe())
    return cls


def _import(path: str, found: NxDIModule | PluginClass | ThirdPartyClass) -> NxDIModelClass:
    module_name, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise NeuronConfigError(f"{found.describe()} cannot be imported: {exc}") from exc
    if not (hasattr(cls, "get_neuron_config_cls") and hasattr(cls, "get_config_cls")):
        raise NeuronConfigError(
            f"{found.describe()} is not an NxDI application class (no "
            f"get_neuron_config_cls/get_config_cls); point it at a NeuronBaseForCausalLM "
            f"subclass."
        )
    model_class: NxDIModelClass = cls
    return model_class


def _refusal(architecture: str, release: nxdi_releases.NxDIRelease, refused: Refused) -> str:
    row = TABLE.get(architecture)
    what = (
        "is a vision-language model the nxd backend does not serve"
        if row and row.vision
        else ("is not served by the nxd backend")
    )
    fix = (
        "serve it with VLLM_NEURON_BACKEND=reference"
        if row and row.reference
        else "the reference backend does not serve it either"
    )
    return (
        f"architecture {architecture!r} {what} on {release.describe()}: {refused.reason} "
        f"(docs/serving/architectures.md); {fix}, "
        f"or register an NxDI class for it under the {ENTRY_POINT_GROUP!r} entry point."
    )


def _unsupported(architecture: str, release: nxdi_releases.NxDIRelease) -> str:
    return (
        f"architecture {architecture!r} has no NxD Inference model: supported on "
        f"{release.describe()} are {', '.join(nxd_architectures(release.release))}; an NxDI "
        f"contrib model can register its class under this name in the {ENTRY_POINT_GROUP!r} "
        f'entry-point group ({architecture} = "package.module:NeuronClass"), or serve on '
        f"the CPU with VLLM_NEURON_BACKEND=reference."
    )
