"""The NxD model contract every backend fulfils, written down once.

A backend compiles one graph per bucket into a folder, loads a folder of graphs plus the
checkpoint's weights, owns the KV cache, and runs calls with the contract's arguments
(`neuron_plugin.core.inputs.ForwardInputs`). A serving call (`run`) also carries each
real row's sampling values (`neuron_plugin.core.sampling.SamplingInputs`) and answers
with a token per row from the on-device sampler plus logits for only the rows whose
sampling needs the host, so at a 151,936-token vocabulary a device-sampled row costs a
few bytes instead of 600 KB; `forward` returns every real row's logits (warm-up,
measurement, host sampling when on-device sampling is off). A serving call can also be
split in two, `submit` then `collect`, so that the host prepares the next engine step
while the backend computes this one (vLLM's async scheduling): a backend in another
process (`runner/`) computes meanwhile; one in this process computes in `submit`
(`InlineCalls`). At most one call is in flight: nothing else is called between a
`submit` and its `collect`.
With LoRA (core.lora) every call carries each row's adapter slot and `set_adapter`
writes an adapter's weights into a slot between calls (never while one is in flight):
adapters are data the compiled graphs read, not graphs.
`nxd/` fulfils it with NxD Inference on Neuron devices; `reference/` in PyTorch on the
CPU, so everything above this seam is exercised without hardware.

Two Protocols, because a backend has two users: `LoadedBackend` is what the model runner
and the worker call once a model is loaded, wherever it runs (`runner.client.
RunnerBackend` serves it across a process boundary); `Backend` adds what the loader
drives in the process where the backend runs: compile graphs into a folder, load them
from one. mypy holds each implementation to its Protocol (`loader.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.core.adapters import AdapterWeights
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    TOKEN_GENERATION,
    ForwardInputs,
    padding_inputs,
)
from neuron_plugin.core.prompt_logprobs import NO_TARGET, PromptLogprobs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.vision import VISION_ENCODING, ImageInputs, padding_image

GRAPHS_FILE = "graphs.json"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class GraphSpec:
    """One compiled graph: its phase, the static shape it was compiled for, whether it
    is the logits graph of a token-generation shape whose other graph returns tokens
    alone (`NeuronSettings.token_generation_logits_shapes`), and whether it is the
    context encoding that also returns prompt logprobs (core.prompt_logprobs)."""

    phase: str
    shape: tuple[int, ...]
    logits: bool = False
    prompt_logprobs: bool = False

    @property
    def name(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        kind = {CONTEXT_ENCODING: "cte", VISION_ENCODING: "vision"}.get(self.phase, "tkg")
        variant = "_logits" if self.logits else "_plp" if self.prompt_logprobs else ""
        return f"{kind}{variant}_{dims}"

    @property
    def key(self) -> tuple[str, tuple[int, ...], bool]:
        """What a call selects it by: phase, bucket, and whether it scores the prompt."""
        return (self.phase, self.shape, self.prompt_logprobs)


def graph_specs(settings: NeuronSettings) -> list[GraphSpec]:
    """Every graph a configuration needs, in compile order."""
    return (
        [GraphSpec(CONTEXT_ENCODING, s) for s in settings.context_encoding_shapes()]
        + [GraphSpec(TOKEN_GENERATION, s) for s in settings.token_generation_shapes()]
        + [
            GraphSpec(TOKEN_GENERATION, s, logits=True)
            for s in settings.token_generation_logits_shapes()
        ]
        + [
            GraphSpec(CONTEXT_ENCODING, s, prompt_logprobs=True)
            for s in settings.prompt_logprobs_shapes()
        ]
        + [GraphSpec(VISION_ENCODING, s) for s in settings.vision_shapes()]
    )


def artifact_record(settings: NeuronSettings, extra: dict[str, Any]) -> dict[str, Any]:
    """What a compiled folder was built for: checked at load so a mismatch (e.g. a block
    count) is an error naming both values, never an out-of-bounds crash at run time."""
    return {
        "format": 1,
        "backend": settings.backend,
        "kv_layout": settings.kv_layout,
        "block_size": settings.block_size,
        "num_blocks": settings.num_blocks,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "graphs": [g.name for g in graph_specs(settings)],
        **extra,
    }


def with_draft_config(hf_config: dict[str, Any], settings: NeuronSettings) -> dict[str, Any]:
    """The model config a compile-cache key covers: the target's, and a fused draft
    model's under `speculative_draft` (its path changes no graph, its config does)."""
    if not settings.draft_model:
        return hf_config
    return {**hf_config, "speculative_draft": read_hf_config(settings.draft_model)}


def write_artifact_record(folder: Path, record: dict[str, Any]) -> None:
    (folder / GRAPHS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))


def check_artifact_record(folder: Path, expected: dict[str, Any]) -> None:
    """Refuse artifacts compiled for another configuration."""
    path = folder / GRAPHS_FILE
    if not path.exists():
        raise NeuronConfigError(
            f"{folder} holds no {GRAPHS_FILE}: it is not a compiled-artifact folder of "
            f"this plugin; remove it or point the compile cache elsewhere."
        )
    found = json.loads(path.read_text())
    differing = sorted(k for k in expected if found.get(k) != expected[k])
    if differing:
        details = "; ".join(
            f"{k}: compiled {found.get(k)!r}, configured {expected[k]!r}" for k in differing
        )
        raise NeuronConfigError(
            f"compiled artifacts in {folder} do not match this configuration ({details}); "
            f"recompile (remove the folder) or restore the settings they were built with."
        )


@dataclass(frozen=True)
class StepOutput:
    """A serving call's answer: `tokens[i]` are the tokens real row i emits from the
    on-device sampler (meaningful where the call's `needs_logits[i]` is false): one, or
    with speculation the accepted drafts and the target's own token, padded with
    `core.speculation.NO_TOKEN`; `logits` holds the rows whose `needs_logits` is true, in
    row order (a speculative call's first position: such a row takes no drafts)."""

    tokens: np.ndarray  # [num_real, 1 or speculation_length] int32
    logits: torch.Tensor  # [needs_logits.sum(), vocab] float32
    # The backend's own time for the call where it reports it (a runner process does),
    # apart from the process boundary and from what the host did meanwhile.
    backend_s: float | None = None
    # A call whose inputs carry `prompt_targets`: its scored positions' prompt logprobs
    # at settings.prompt_logprobs, O(k) per position (core.prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class AdapterLoading:
    """Which LoRA adapters a loaded backend can take into its slots: any, at run time,
    or (an NxDI that cannot load at run time) only those it loaded at start, by name ->
    folder, `why` saying what stops run-time loading."""

    at_run_time: bool = True
    at_start: Mapping[str, str] = field(default_factory=dict)
    why: str = ""

    def refusal(self, name: str, path: str) -> str | None:
        """The error for adapter `name` at `path`, None when the backend takes it."""
        if self.at_run_time:
            return None
        known = self.at_start.get(name)
        if known is not None and os.path.realpath(known) == os.path.realpath(path):
            return None
        listed = ", ".join(f"{n}={p}" for n, p in self.at_start.items()) or "none"
        return (
            f"LoRA adapter {name!r} ({path}): the backend cannot load adapters at run time "
            f"({self.why}) and serves only those given at start ({listed}); add "
            f'"{name}": "{path}" to override_neuron_config.lora_config.lora_ckpt_paths and '
            f"restart."
        )

    def to_dict(self) -> dict[str, object]:
        return {"at_run_time": self.at_run_time, "at_start": dict(self.at_start), "why": self.why}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> AdapterLoading:
        at_start = data.get("at_start") or {}
        assert isinstance(at_start, dict)  # the runner's own JSON reply
        return cls(bool(data.get("at_run_time")), dict(at_start), str(data.get("why", "")))


class LoadedBackend(Protocol):
    """What the model runner and the worker need from a loaded backend."""

    name: str
    settings: NeuronSettings

    @property
    def adapter_loading(self) -> AdapterLoading:
        """Which LoRA adapters `set_adapter` takes (meaningful with settings.max_loras)."""

    @property
    def module(self) -> torch.nn.Module | None:
        """The model as a torch module, for vLLM's `get_model` (None where it has none)."""

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """Logits [inputs.num_real, vocab] for the last real token of each real row."""

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        """One serving call with on-device sampling (`sampling` has a row per real row).
        A context encoding whose inputs carry `prompt_targets` runs the bucket's
        prompt-logprob graph and answers its prompt logprobs too (with on-device
        sampling off too: then every row needs its logits)."""

    def submit(self, inputs: ForwardInputs, sampling: SamplingInputs) -> None:
        """Start the serving call `run` makes; its answer comes from `collect`."""

    def collect(self) -> StepOutput:
        """The answer of the call `submit` started (waiting for it if need be)."""

    def encode_image(self, image: ImageInputs) -> np.ndarray:
        """A vision-language model's embeddings of one image, [image.embedding_tokens,
        embedding_width] float32 (Qwen3-VL's DeepStack features after the embedding),
        from the vision graph of its bucket (core.vision); never while a submitted call
        is in flight."""

    def set_adapter(self, slot: int, adapter: AdapterWeights) -> None:
        """Write a LoRA adapter into slot `slot` (1..settings.max_loras), replacing the
        one there; rows whose `adapter_slots` name the slot use it from the next call."""

    # KV blocks (prefill/decode disaggregation, `kv_blocks`): block layout only, and
    # never while a submitted call is in flight.
    def kv_geometry(self) -> KVGeometry:
        """What one KV block holds (layers, block size, stored KV heads, head dim, dtype)."""

    def read_kv_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        """The blocks `block_ids`, every layer's K and V in one layer-major tensor
        `kv_geometry().shape(len(block_ids))` (a runner's is a view of its KV arena,
        valid until the next call)."""

    def write_kv_blocks(self, block_ids: np.ndarray, kv: torch.Tensor) -> None:
        """Overwrite the blocks `block_ids` with `kv`, laid out as `read_kv_blocks`
        answers them."""


class InlineCalls:
    """`submit`/`collect` for a backend whose calls complete in the caller's thread:
    `submit` runs the call, `collect` hands its answer back."""

    _submitted: StepOutput | None = None

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        raise NotImplementedError  # the backend's own

    def submit(self, inputs: ForwardInputs, sampling: SamplingInputs) -> None:
        if self._submitted is not None:
            raise RuntimeError("a backend call is already in flight: collect it first")
        self._submitted = self.run(inputs, sampling)

    def collect(self) -> StepOutput:
        out, self._submitted = self._submitted, None
        if out is None:
            raise RuntimeError("collect() without a submitted backend call")
        return out


class Backend(LoadedBackend, Protocol):
    """A backend in this process: what the loader needs to compile and load it through
    the compile cache."""

    def cache_manifest_fields(self) -> dict[str, Any]:
        """Everything besides the settings that changes the compiled graphs."""

    def compile(self, folder: Path, progress: Progress | None = None) -> None:
        """Write one graph per bucket (and the artifact record) into an empty folder."""

    def load(self, folder: Path) -> None:
        """Load compiled graphs and weights; allocate the KV cache."""

    def quantize(self) -> dict[str, Any]:
        """Write the quantized checkpoint the settings' quantization keys name (NxDI's
        layout, core.quantization); what was written."""


def run_graph_once(backend: LoadedBackend, graph: GraphSpec) -> None:
    """One padding-only call of `graph` (warm-up, timing): `forward` runs the graphs
    that return logits, `run` without a host row the token-generation graphs that
    return tokens alone and, with targets that score nothing, the prompt-logprob ones,
    `encode_image` a vision graph."""
    settings = backend.settings
    if graph.phase == VISION_ENCODING:
        backend.encode_image(padding_image(graph.shape[0]))
        return
    inputs = padding_inputs(settings, graph.phase, graph.shape)
    tokens_only = settings.token_generation_logits_shapes() and not graph.logits
    if graph.prompt_logprobs:
        targets = np.full(inputs.input_ids.shape, NO_TARGET, dtype=np.int64)
        backend.run(replace(inputs, prompt_targets=targets), SamplingInputs.greedy(inputs.num_real))
    elif graph.phase == TOKEN_GENERATION and tokens_only:
        backend.run(inputs, SamplingInputs.greedy(inputs.num_real))
    else:
        backend.forward(inputs)
