"""A LoRA adapter read once, checked, and kept as it was checked.

An adapter's folder is read once: when the adapter is loaded (vLLM's add_lora:
--lora-modules, /v1/load_lora_adapter) or, for an offline request naming one that was
never added, in the step that first needs it. Its two files are read into memory
(`adapter_config.json`, `adapter_model.safetensors`; links are followed, as a Hugging
Face cache snapshot needs, but a link loop, a FIFO or a device is refused by name, and
so is a file larger than the compiled slots can hold), every check runs on those bytes,
and the bytes are kept as a private verified copy: a folder named by their SHA-256 in
this worker's private directory (`adapter_copies`), written only once every check has
passed.

After that the adapter's own folder is never read again. When the host cache
(--max-cpu-loras) has evicted an adapter a later step needs, it is rebuilt from its
private copy, whose digest is checked first; the nxd backend hands NxDI the private
copy's path (NxDI reads an adapter's files again at every re-add). An adapter changed,
swapped or deleted on disk after it was loaded therefore never reaches a slot: its name
serves the weights checked at load until it is loaded again (load_inplace) or under
another name.

The checks reuse vLLM's own (`PEFTHelper.from_dict` + `validate_legal`: rank above
--max-lora-rank, DoRA, biases, PEFT variants vLLM does not serve;
`LoRAModel.from_lora_tensors`: tensor names), then refuse what the Neuron slots cannot
hold or should not serve: `target_modules` none of which the base model has (PEFT's
NoMatchingPeftModuleError; the config's patterns are matched with bounded work,
`adapter_patterns`, and one that cannot be is refused naming its field), modules outside
the compiled target modules, a lora_A or lora_B missing, shapes of another base model (a
transposed lora_A named as such), a rank above --max-lora-rank, and weights holding NaN
or Inf (they would reach the KV cache). Only safetensors is read: a folder with pickled
weights alone (.bin, .pt) is refused, since loading a pickle can run code. Every refusal
names the adapter, its path, the value and the fix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuron_plugin.core.adapters import AdapterError, AdapterWeights, LayerWeights, build_adapter
from neuron_plugin.core.checkpoint import pickle_files
from neuron_plugin.core.lora import MODULE_PARENTS, LoraGeometry
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.serving import adapter_patterns as patterns

CONFIG = "adapter_config.json"
SAFETENSORS = "adapter_model.safetensors"
CONFIG_LIMIT = 1 << 20
# room for a safetensors header (tensor names, shapes, offsets) beside the weights
HEADER_ALLOWANCE = 1 << 20
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's two files, as read."""

    config: bytes
    weights: bytes

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.config, self.weights):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()


class _Unreadable(Exception):
    """Why a file of an adapter was not read: (problem, fix)."""


def _read_file(path: Path, limit: int, limit_text: str, limit_fix: str) -> bytes:
    """`path`'s bytes (at most `limit`), without blocking on a FIFO or device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unreadable(
                f"{path.name} is a symbolic link loop", "point the link at the file"
            ) from None
        raise _Unreadable(
            f"{path.name} cannot be read ({exc.strerror})", "check the folder"
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _Unreadable(f"{path.name} is not a regular file", f"save {path.name} again")
        if info.st_size > limit:
            raise _Unreadable(
                f"{path.name} is {info.st_size:,} bytes, more than {limit_text} ({limit:,} bytes)",
                limit_fix,
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _Unreadable(f"{path.name} grew while it was read", "load the adapter again")
    return data


def read_folder(
    name: str, given: str, weights_limit: int, limit_text: str, limit_fix: str
) -> AdapterFiles:
    """The adapter's files from its folder (module docstring); vLLM's own not-found error
    (HTTP 404 from its API server) when the folder holds no adapter_config.json."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    folder = Path(given).expanduser()
    config_path, weights_path = folder / CONFIG, folder / SAFETENSORS
    if not os.path.lexists(config_path):
        raise LoRAAdapterNotFoundError(name, given)
    if not os.path.lexists(weights_path):
        pickles = pickle_files(folder)
        held = f"holds {', '.join(pickles)}" if pickles else "holds no weights file"
        raise AdapterError(
            f"LoRA adapter {name!r} ({given}): the folder {held}, and only {SAFETENSORS} "
            f"is read (a pickled .bin/.pt can run code when loaded); convert it with "
            f"safetensors.torch.save_file, or PEFT's save_pretrained "
            f"(safe_serialization=True)."
        )
    try:
        return AdapterFiles(
            config=_read_file(config_path, CONFIG_LIMIT, "an adapter config needs", "fix it"),
            weights=_read_file(weights_path, weights_limit, limit_text, limit_fix),
        )
    except _Unreadable as exc:
        problem, fix = exc.args
        raise AdapterError(f"LoRA adapter {name!r} ({given}): {problem}; {fix}.") from None


@dataclass(frozen=True)
class AdapterChecks:
    """What an adapter is checked against (module docstring)."""

    settings: NeuronSettings
    geometry: LoraGeometry
    lora_config: Any  # vLLM's LoRAConfig
    max_position_embeddings: int | None
    base_modules: frozenset[str]  # the base checkpoint's module names

    @property
    def slot_bytes_limit(self) -> int:
        return self.geometry.slot_bytes(self.settings.max_lora_rank) + HEADER_ALLOWANCE

    @property
    def limit_fix(self) -> str:
        s = self.settings
        return (
            f"serve an adapter of rank <= {s.max_lora_rank} (--max-lora-rank) on "
            f"{', '.join(s.lora_target_modules)} only"
        )

    def read(self, name: str, given: str) -> AdapterFiles:
        text = (
            f"a float32 adapter of rank --max-lora-rank {self.settings.max_lora_rank} over "
            f"every compiled target module can hold with its header"
        )
        return read_folder(name, given, self.slot_bytes_limit, text, self.limit_fix)

    def verify(
        self, files: AdapterFiles, name: str, adapter_id: int, given: str, path: str
    ) -> AdapterWeights:
        """The adapter in the slot layout, every check passed on `files`; `path` is
        where the backend finds these files."""
        import torch
        from safetensors import SafetensorError
        from safetensors.torch import load as load_tensors
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        settings = self.settings

        def refuse(problem: str, fix: str) -> AdapterError:
            return AdapterError(f"LoRA adapter {name!r} ({given}) {problem}; {fix}.")

        try:
            config = json.loads(files.config)
        except ValueError as exc:
            raise refuse(f"has an unreadable {CONFIG} ({exc})", "save the adapter again") from None
        if not isinstance(config, dict):
            raise refuse(f"has a {CONFIG} that is not an object", "save the adapter again")
        try:
            helper = PEFTHelper.from_dict(
                {**config, "vllm_max_position_embeddings": self.max_position_embeddings}
            )
            helper.validate_legal(self.lora_config)
        except (ValueError, TypeError, KeyError) as exc:
            raise refuse(
                f"is refused by vLLM's adapter checks: {exc} (limits: --max-lora-rank "
                f"{settings.max_lora_rank}; DoRA, adapter biases and PEFT variants vLLM does "
                f"not serve are refused)",
                "fix the adapter or restart with a larger --max-lora-rank",
            ) from exc
        if helper.modules_to_save:
            raise refuse(
                f"trains whole modules (modules_to_save={helper.modules_to_save}), which the "
                f"Neuron graphs do not carry",
                "serve it merged into the base model instead",
            )
        if settings.backend == "nxd" and (helper.rank_pattern or helper.alpha_pattern):
            raise refuse(
                "sets rank_pattern/alpha_pattern, which NxDI's loader ignores (it scales "
                "every module by lora_alpha / r)",
                "retrain it with one rank and alpha, or use the reference backend",
            )
        budget = patterns.Budget()
        targets = config.get("target_modules")
        try:
            found = targets is None or patterns.targets_match(targets, self.base_modules, budget)
        except patterns.PatternError as exc:
            raise refuse(
                f"has an {CONFIG} whose {exc.field} cannot be used: {exc.problem}",
                "fix the adapter's config",
            ) from None
        if not found:
            raise refuse(
                f"names target_modules {targets!r}, none of which is a module of the base "
                f"model (PEFT refuses it: NoMatchingPeftModuleError)",
                "use an adapter trained for this base model",
            )
        try:
            tensors = load_tensors(files.weights)
        except SafetensorError as exc:
            raise refuse(
                f"has an {SAFETENSORS} that is not a readable safetensors file ({exc})",
                "save the adapter again",
            ) from exc
        self._resolve_patterns(helper, tensors, budget, refuse)
        try:
            model = LoRAModel.from_lora_tensors(
                lora_model_id=adapter_id,
                tensors=tensors,
                peft_helper=helper,
                device="cpu",
                dtype=torch.float32,
            )
        except ValueError as exc:
            raise refuse(
                f"does not fit the compiled LoRA slots: {exc}",
                f"restart with --lora-target-modules covering its modules (compiled: "
                f"{', '.join(settings.lora_target_modules)})",
            ) from exc
        layers = [self._layer(module, w, refuse) for module, w in model.loras.items()]
        return build_adapter(name, adapter_id, path, layers, self.geometry, settings.max_lora_rank)

    @staticmethod
    def _resolve_patterns(
        helper: Any, tensors: dict[str, Any], budget: patterns.Budget, refuse: Any
    ) -> None:
        """Resolve rank_pattern/alpha_pattern for the adapter's modules within the
        budget, and hand vLLM the result as the modules' own names, so vLLM never runs
        the adapter's expressions (`adapter_patterns`)."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        if not helper.rank_pattern and not helper.alpha_pattern:
            return
        names = sorted({parse_fine_tuned_lora_name(name)[0] for name in tensors})
        try:
            for field in ("rank_pattern", "alpha_pattern"):
                resolved = patterns.resolve_pattern(field, getattr(helper, field), names, budget)
                setattr(helper, field, patterns.literal_patterns(resolved))
        except patterns.PatternError as exc:
            raise refuse(
                f"has an {CONFIG} whose {exc.field} cannot be used: {exc.problem}",
                "fix the adapter's config",
            ) from None
        except ValueError as exc:  # vLLM's name parser: a tensor that is no LoRA weight
            raise refuse(
                f"holds a tensor that is not a LoRA weight ({exc})", "save the adapter again"
            ) from None

    @staticmethod
    def _layer(module_name: str, weights: Any, refuse: Any) -> LayerWeights:
        match = _MODULE.match(module_name)
        if match is None or MODULE_PARENTS.get(match[3]) != match[2]:
            raise refuse(
                f"trains {module_name}, not a projection of a decoder layer "
                f"({', '.join(MODULE_PARENTS)})",
                "the Neuron graphs carry LoRA slots for those only",
            )
        if weights.lora_a is None or weights.lora_b is None:
            half = "lora_B" if weights.lora_a is not None else "lora_A"
            raise refuse(
                f"has no {half} weight for {module_name} (a LoRA module needs both lora_A "
                f"and lora_B)",
                "save the adapter again",
            )
        a = weights.lora_a.numpy().astype(np.float32)
        b = weights.lora_b.numpy().astype(np.float32)
        for half, array in (("lora_A", a), ("lora_B", b)):
            if not np.isfinite(array).all():
                raise refuse(
                    f"holds NaN or Inf in {module_name}.{half} "
                    f"({int((~np.isfinite(array)).sum())} values), which would reach the KV "
                    f"cache",
                    "retrain or repair the adapter",
                )
        return LayerWeights(
            layer=int(match[1]),
            module=match[3],
            lora_a=a,
            lora_b=b,
            scaling=float(weights.scaling),
        )
