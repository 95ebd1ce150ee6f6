"""The CPU reference backend: the NxD contract in PyTorch, same buckets, same KV layouts.

Each bucket is exported with `torch.export` to a fixed-shape graph at compile time, written
in a data-only format that cannot run code when loaded (`graph_file`: no pickles, only
allow-listed ATen calls), and loaded from the folder at start, so compile, cache and load
behave as on Neuron, and every call is padded to its bucket's shape, so cost follows the
bucket as it does there.

The KV cache is one tensor per K and V of shape [layers, slots, kv_heads, head_dim]:
- contiguous layout: slot = seq_id * max_model_len + position, i.e. a
  (max_num_seqs + 1, max_model_len) grid of rows; the extra row takes padding writes;
- block layout: slot = block * block_size + offset over vLLM's num_blocks blocks (block 0
  is vLLM's null block and takes padding writes).

A vision-language model (core.vision) adds one vision-tower graph per vision bucket
(`image_encoder`).

A hybrid model (Qwen3.5's gated DeltaNet layers, core.recurrent_state) also holds each
state layer's per-sequence state, its conv and recurrent state tensors mutated by the
graphs like the KV cache: in the contiguous layout a state slot per sequence slot
(slot = seq_id, the extra slot max_num_seqs takes padding rows), in the block layout a
state slot per vLLM block id (the block a request owns in its state layer's KV cache
group; block 0, vLLM's null block, takes padding rows), named per row by the call's
`state_slots` (core.inputs).

With LoRA the graphs take the adapter slots as inputs, like the weights (`lora_slots`);
with a fused draft model its decoder and cache come beside the target's (`draft`).
"""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import (
    AdapterLoading,
    GraphSpec,
    InlineCalls,
    Progress,
    StepOutput,
    artifact_record,
    check_artifact_record,
    graph_specs,
    with_draft_config,
    write_artifact_record,
)
from neuron_plugin.backends.kv_blocks import (
    KVGeometry,
    check_blocks_tensor,
    checked_block_ids,
    require_block_layout,
)
from neuron_plugin.backends.reference.decoder import (
    COMPUTATION,
    DecoderSpec,
    decoder_graph,
    load_weights,
    rope_tables,
    weight_shapes,
)
from neuron_plugin.backends.reference.draft import Draft
from neuron_plugin.backends.reference.eagle import (
    EagleDecodeGraph,
    EaglePrefillGraph,
    EagleState,
)
from neuron_plugin.backends.reference.graph_file import FORMAT as GRAPH_FORMAT
from neuron_plugin.backends.reference.graph_file import LoadedGraph, load_graph, save_graph
from neuron_plugin.backends.reference.image_encoder import image_encoder
from neuron_plugin.backends.reference.lora_slots import LoraSlots
from neuron_plugin.backends.reference.prompt_graph import PromptLogprobsGraph
from neuron_plugin.backends.reference.quantized import (
    load_quantized_weights,
    placeholders,
    quantized_modules,
    write_quantized_checkpoint,
)
from neuron_plugin.backends.reference.speculative import (
    DraftPrefillGraph,
    FusedDraftGraph,
    VerifyGraph,
)
from neuron_plugin.backends.reference.states import States
from neuron_plugin.core.adapters import BASE_SLOT, AdapterWeights
from neuron_plugin.core.checkpoint import read_hf_config, safetensors_shapes
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    PAD_SEQ_ID,
    ForwardInputs,
    decode_active,
    decode_width,
)
from neuron_plugin.core.lora import LoraGeometry
from neuron_plugin.core.prompt_logprobs import PromptLogprobs, scored_positions
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.speculation import NO_TOKEN
from neuron_plugin.core.vision import VISION_ENCODING, ImageInputs

logger = plugin_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported by the reference backend; use --dtype "
            f"float32, bfloat16 or float16."
        )
    return DTYPES[name]


class ReferenceBackend(InlineCalls):
    """See the module docstring."""

    name = "reference"
    # Adapters are graph inputs: any adapter the slots' shapes hold, at any time.
    adapter_loading = AdapterLoading(at_run_time=True)

    def __init__(self, settings: NeuronSettings, model_dir: str | Path):
        self.settings = settings
        self.model_dir = Path(model_dir)
        self.hf_config = read_hf_config(model_dir)
        self.spec = DecoderSpec.from_hf_config(self.hf_config)
        self.dtype = torch_dtype(settings.dtype)
        candidates = (
            min(settings.global_topk, self.spec.vocab_size) if settings.on_device_sampling else None
        )
        _refuse_features(settings, self.spec)
        self.quantization = settings.quantization
        self.quantized: frozenset[str] = frozenset()
        if self.quantization is not None:
            self.quantized = quantized_modules(
                self.spec, safetensors_shapes(model_dir), self.quantization
            )
        self.lora: LoraSlots | None = None
        if settings.max_loras:
            geometry = LoraGeometry.from_checkpoint(
                safetensors_shapes(model_dir), self.spec.num_layers, settings.lora_target_modules
            )
            self.lora = LoraSlots(settings, geometry, self.dtype)
        self.module = decoder_graph(
            self.spec,
            rope_tables(self.hf_config, self.spec),
            candidates,
            settings.lora_target_modules if self.lora else (),
            self.quantized,
        )
        self.draft: Draft | EagleState | None = None
        if settings.is_eagle:
            assert settings.speculation_method and settings.draft_model
            self.draft = EagleState(settings.speculation_method, settings.draft_model, self.module)
        elif settings.draft_model:
            self.draft = Draft(settings, self.spec)
        self.images = image_encoder(settings, self.spec, self.hf_config, self.model_dir, self.dtype)
        self.graphs: dict[tuple[str, tuple[int, ...], bool], LoadedGraph] = {}
        self.weights: list[torch.Tensor] = []
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # a hybrid model's per-sequence state (None for other models)
        self.states = (
            None if self.spec.state is None else States(settings, self.spec.state, self.dtype)
        )

    # -- geometry ------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        s = self.settings
        if s.is_block_layout:
            return s.num_blocks * s.block_size
        return (s.max_num_seqs + 1) * s.max_model_len

    def _cache_shape(self) -> tuple[int, int, int, int]:
        """K's (and V's) [rows, slots, kv heads, head dim] (DecoderSpec.cache_geometry)."""
        rows, kv_heads, head_dim = self.spec.cache_geometry
        return rows, self.num_slots, kv_heads, head_dim

    def _scratch_slot(self) -> int:
        s = self.settings
        return 0 if s.is_block_layout else s.max_num_seqs * s.max_model_len

    def _record(self) -> dict[str, Any]:
        return artifact_record(
            self.settings,
            {
                "architecture": self.spec.architecture,
                "dtype": self.settings.dtype,
                "kv_slots": self.num_slots,
                "torch": torch.__version__,
                "graph_format": GRAPH_FORMAT,
                "computation": COMPUTATION,
                "draft_architecture": self.draft.architecture if self.draft else None,
                # absent without LoRA / quantization, so other records stay put
                **({"lora_slots": self.lora.shapes()} if self.lora else {}),
                **({"quantized_modules": sorted(self.quantized)} if self.quantized else {}),
                **({"state_slots": self.states.slots} if self.states else {}),
            },
        )

    def _lora_inputs(self, adapter_slots: torch.Tensor) -> dict[str, Any]:
        """The graphs' LoRA keyword inputs (none without LoRA)."""
        return {} if self.lora is None else self.lora.inputs(adapter_slots)

    def _vision_inputs(
        self, phase: str, position_ids: np.ndarray, inputs: ForwardInputs | None = None
    ) -> dict[str, torch.Tensor]:
        """A vision-language model's extra decoder inputs (none for a text model)."""
        if self.images is None:
            return {}
        if inputs is None:
            return self.images.decoder_inputs(phase, position_ids, None, None, None)
        return self.images.decoder_inputs(
            phase,
            position_ids,
            inputs.rope_positions,
            inputs.vision_embeddings,
            inputs.vision_mask,
        )

    def cache_manifest_fields(self) -> dict[str, Any]:
        return {
            # make_manifest drops the keys that never change a graph (names, versions,
            # token ids); see compile_cache.manifest.VOLATILE_MODEL_KEYS. A fused draft
            # model's graphs depend on its config too.
            "model_config": with_draft_config(self.hf_config, self.settings),
            "target": {"device": "cpu", "machine": platform.machine()},
            # The artifact format is part of the key: entries of another format are
            # misses, never loaded.
            "versions": {
                "torch": torch.__version__,
                "reference-graph-format": GRAPH_FORMAT,
                "reference-computation": str(COMPUTATION),
            },
            "compiler_flags": [],
            # Graphs take weights as inputs, so they do not depend on the checkpoint.
            "weights_fingerprint": None,
        }

    # -- compile / load ------------------------------------------------------------
    def _graph_module(self, graph: GraphSpec) -> torch.nn.Module:
        """What a bucket's graph computes: a step of the target, or with speculation a
        verification (n-gram) or a fused draft-and-verify; with a draft model every
        context encoding also encodes the prompt with the draft (with an EAGLE head,
        `eagle`); a context encoding's prompt-logprobs twin its top-k per position."""
        if graph.prompt_logprobs:  # settings refuse them with a draft model or head
            assert self.settings.prompt_logprobs is not None
            return PromptLogprobsGraph(self.module, self.settings.prompt_logprobs)
        if isinstance(self.draft, EagleState):
            if graph.phase == CONTEXT_ENCODING:
                return EaglePrefillGraph(self.draft.module)
            return EagleDecodeGraph(self.draft.module, decode_width(self.settings))
        if graph.phase == CONTEXT_ENCODING:
            return (
                self.module
                if self.draft is None
                else DraftPrefillGraph(self.module, self.draft.module)
            )
        if self.draft is not None:
            return FusedDraftGraph(self.module, self.draft.module, decode_width(self.settings))
        if self.settings.speculation_length:
            return VerifyGraph(self.module)
        return self.module

    def _example_inputs(self, graph: GraphSpec, weights: list[torch.Tensor]) -> tuple:
        if graph.phase == CONTEXT_ENCODING:
            batch, active = 1, graph.shape[0]
            width = active + (graph.shape[1] if len(graph.shape) > 1 else 0)
            written, draws = active, 1
        else:
            batch, width = graph.shape
            active, written = decode_active(self.settings), decode_width(self.settings)
            draws = written
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64)  # noqa: E731
        cache = torch.zeros(self._cache_shape(), dtype=self.dtype)
        sampling = (
            ()
            if self.module.candidates is None
            else _sampling_tensors(SamplingInputs.greedy(batch, draws))
        )
        draft = () if self.draft is None else (self.draft.placeholders(self.dtype),)
        draft_caches = () if self.draft is None else self.draft.caches(self.num_slots, self.dtype)
        targets = (zeros(batch, active),) if graph.prompt_logprobs else ()
        return (
            weights,
            *draft,
            zeros(batch, active),
            zeros(batch, active),
            zeros(batch, written),
            zeros(batch, width),
            zeros(batch),
            zeros(batch),
            cache,
            cache.clone(),
            *draft_caches,
            *targets,
            *sampling,
        )

    def _weight_placeholders(self) -> list[torch.Tensor]:
        """Shapes from the safetensors headers: compiling needs no weight data (nor, for
        a quantized configuration, the quantized checkpoint)."""
        shapes = safetensors_shapes(self.model_dir)
        if self.quantization is not None:
            return placeholders(self.spec, shapes, self.quantized, self.quantization, self.dtype)
        return [torch.zeros(shape, dtype=self.dtype) for shape in weight_shapes(self.spec, shapes)]

    def _load_weights(self) -> list[torch.Tensor]:
        if self.quantization is None:
            return load_weights(self.model_dir, self.spec, self.dtype)
        return load_quantized_weights(
            str(self.model_dir),
            self.spec,
            safetensors_shapes(self.model_dir),
            self.quantized,
            self.quantization,
            self.dtype,
        )

    def quantize(self) -> dict[str, Any]:
        """Write the quantized checkpoint the settings name (`neuron-plugin quantize`)."""
        if self.quantization is None:
            raise NeuronConfigError(
                "neuron-plugin quantize needs override_neuron_config quantized: true and "
                "quantized_checkpoints_path (the folder to write)."
            )
        return write_quantized_checkpoint(
            self.model_dir, self.quantization.checkpoint, self.quantization
        )

    def _export(
        self, graph: GraphSpec, weights: list[torch.Tensor]
    ) -> torch.export.ExportedProgram:
        if graph.phase == VISION_ENCODING:
            assert self.images is not None  # image_encoder: no vision buckets otherwise
            return self.images.export(graph.shape[0])
        batch = 1 if graph.phase == CONTEXT_ENCODING else graph.shape[0]
        active = graph.shape[0] if graph.phase == CONTEXT_ENCODING else decode_active(self.settings)
        positions = np.zeros((batch, active), dtype=np.int64)
        return torch.export.export(
            self._graph_module(graph),
            self._example_inputs(graph, weights),
            kwargs={
                **self._lora_inputs(torch.zeros(batch, dtype=torch.int64)),
                **self._vision_inputs(graph.phase, positions),
                **(self.states.inputs(None, batch) if self.states else {}),
            },
        )

    def compile(self, folder: Path, progress: Progress | None = None) -> None:
        folder = Path(folder)
        (folder / "graphs").mkdir(parents=True, exist_ok=True)
        weights = self._weight_placeholders()
        if self.lora is not None:
            self.lora.clear()
        for graph in graph_specs(self.settings):
            save_graph(self._export(graph, weights), folder / "graphs", graph.name)
            if progress:
                progress(graph.name)
        write_artifact_record(folder, self._record())

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        check_artifact_record(folder, self._record())
        self.graphs = {
            g.key: load_graph(folder / "graphs", g.name) for g in graph_specs(self.settings)
        }
        self.weights = self._load_weights()
        if self.images is not None:
            self.images.load()
        self.k_cache = k_cache = torch.zeros(self._cache_shape(), dtype=self.dtype)
        self.v_cache = torch.zeros(self._cache_shape(), dtype=self.dtype)
        if self.lora is not None:
            self.lora.clear()
        if self.states is not None:
            self.states.load()
        if self.draft is not None:
            self.draft.load(self.num_slots, self.dtype)
        logger.info(
            "reference backend: loaded %d graphs from %s; KV cache %s layout, %d slots "
            "(%.1f MiB)%s",
            len(self.graphs),
            folder,
            self.settings.kv_layout,
            self.num_slots,
            2 * k_cache.numel() * k_cache.element_size() / 2**20,
            "" if self.states is None else f"; {self.states.describe()}",
        )

    # -- run -------------------------------------------------------------------------
    def _slots(self, inputs: ForwardInputs) -> tuple[np.ndarray, np.ndarray]:
        """Contract arrays -> (write slots of every position the call computes, read
        slots) for this cache layout; a position past a row's real tokens (or its draft
        budget) writes to scratch."""
        s = self.settings
        phase_width = sum(inputs.bucket) if inputs.phase == CONTEXT_ENCODING else inputs.bucket[1]
        key_pos = np.arange(phase_width, dtype=np.int64)
        scratch = self._scratch_slot()
        if s.is_block_layout:
            slot_mapping, block_table = inputs.block_arrays()
            write = np.where(slot_mapping < 0, scratch, slot_mapping)
            blocks = np.minimum(key_pos // s.block_size, block_table.shape[1] - 1)
            read = block_table[:, blocks] * s.block_size + key_pos % s.block_size
            return write, read
        rows = np.where(inputs.seq_ids == PAD_SEQ_ID, s.max_num_seqs, inputs.seq_ids)
        base = (rows * s.max_model_len)[:, None]
        written = (
            inputs.input_ids.shape[1]
            if inputs.phase == CONTEXT_ENCODING
            else decode_width(self.settings)
        )
        offsets = np.arange(written)[None, :]
        real = offsets < (inputs.full_context_lens - inputs.computed_context_lens)[:, None]
        write = np.where(real, base + inputs.computed_context_lens[:, None] + offsets, scratch)
        read = base + np.minimum(key_pos, s.max_model_len - 1)[None, :]
        return write, read

    def _call(
        self, inputs: ForwardInputs, sampling: SamplingInputs | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, PromptLogprobs | None]:
        """The bucket's graph on `inputs` (its prompt-logprob graph where the inputs
        carry prompt targets): logits, tokens where it samples, prompt logprobs where
        asked (their scored positions only)."""
        write, read = self._slots(inputs)
        last = np.maximum(inputs.full_context_lens - inputs.computed_context_lens - 1, 0)
        t = torch.from_numpy
        extra: tuple[torch.Tensor, ...] = ()
        if sampling is not None:
            draws = 1 if inputs.phase == CONTEXT_ENCODING else decode_width(self.settings)
            padded = sampling.padded(inputs.input_ids.shape[0])
            uniform = np.zeros((padded.rows, draws), dtype=np.float32)
            given = min(draws, padded.uniform.shape[1])
            uniform[:, :given] = padded.uniform[:, :given]
            extra = _sampling_tensors(dataclasses.replace(padded, uniform=uniform))
        draft = self.draft
        targets = inputs.prompt_targets
        graph = self.graphs[(inputs.phase, inputs.bucket, targets is not None)]
        with torch.inference_mode():
            out = graph(
                self.weights,
                *(() if draft is None else (draft.weights,)),
                t(inputs.input_ids),
                t(inputs.position_ids),
                t(np.ascontiguousarray(write)),
                t(np.ascontiguousarray(read)),
                t(inputs.full_context_lens),
                t(last),
                self.k_cache,
                self.v_cache,
                *(() if draft is None else draft.state),
                *(() if targets is None else (t(targets),)),
                *extra,
                *self._lora_inputs(self._row_slots(inputs)).values(),
                *self._vision_inputs(inputs.phase, inputs.position_ids, inputs).values(),
                *(self.states.inputs(inputs, len(inputs.seq_ids)) if self.states else {}).values(),
            )
        outputs = list(out) if isinstance(out, tuple) else [out]
        scored = None
        if targets is not None:
            ranks, logprobs, ids = outputs.pop(), outputs.pop(), outputs.pop()
            n = scored_positions(targets)
            scored = PromptLogprobs(
                ids[0, :n].numpy(), logprobs[0, :n].numpy(), ranks[0, :n].numpy()
            )
        return outputs[0], outputs[1] if len(outputs) > 1 else None, scored

    # -- vision-language models (core.vision) ------------------------------------------
    def encode_image(self, image: ImageInputs) -> np.ndarray:
        """The image's embeddings [embedding_tokens, embedding_width] float32 from the
        graph of its vision bucket (image_encoder.ImageEncoder.encode)."""
        if self.images is None:
            raise NeuronConfigError(
                f"{self.spec.architecture} is a text model: it has no vision encoder for images"
            )
        bucket = self.images.bucket(image)
        return self.images.encode(image, bucket, self.graphs[(VISION_ENCODING, (bucket,), False)])

    def _row_slots(self, inputs: ForwardInputs) -> torch.Tensor:
        slots = inputs.adapter_slots
        if slots is None:
            slots = np.full(inputs.input_ids.shape[0], BASE_SLOT, dtype=np.int64)
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))

    # -- adapters ----------------------------------------------------------------------
    def set_adapter(self, slot: int, adapter: AdapterWeights) -> None:
        """Write an adapter into slot `slot` between calls (lora_slots.LoraSlots.write)."""
        if self.lora is None:
            raise ValueError("set_adapter without LoRA slots (settings.max_loras is 0)")
        self.lora.write(slot, adapter)

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        sampling = (
            None if self.module.candidates is None else SamplingInputs.greedy(inputs.num_real)
        )
        return self._call(inputs, sampling)[0][: inputs.num_real]

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        """Tokens from the compiled sampler (a row's emitted tokens, padded with
        NO_TOKEN, with speculation); logits only of the rows that need them. Without
        on-device sampling (a prompt-logprob call) no token: every row needs logits."""
        on_device = self.module.candidates is not None
        logits, tokens, scored = self._call(inputs, sampling if on_device else None)
        wanted = torch.from_numpy(np.flatnonzero(sampling.needs_logits))
        if tokens is None:
            emitted = np.full((inputs.num_real, 1), NO_TOKEN, dtype=np.int32)
        else:
            emitted = tokens.reshape(tokens.shape[0], -1)[: inputs.num_real].numpy()
        return StepOutput(
            tokens=emitted.astype(np.int32),
            logits=logits.index_select(0, wanted),
            prompt_logprobs=scored,
        )

    # -- KV blocks (backends.kv_blocks) ----------------------------------------------
    def kv_geometry(self) -> KVGeometry:
        require_block_layout(self.settings)
        if self.draft is not None:
            raise NeuronConfigError(
                "KV blocks of a fused draft model's or EAGLE head's cache are not "
                "transferred; remove --speculative-config (or use method ngram) on a "
                "disaggregated server."
            )
        rows, kv_heads, head_dim = self.spec.cache_geometry
        return KVGeometry(
            rows,
            self.settings.block_size,
            kv_heads,
            head_dim,
            self.settings.dtype,
            computation=f"reference computation {COMPUTATION}",
        )

    def _block_slots(self, block_ids: np.ndarray) -> torch.Tensor:
        size = self.settings.block_size
        ids = checked_block_ids(block_ids, self.settings)
        return torch.from_numpy((ids[:, None] * size + np.arange(size)).reshape(-1))

    def read_kv_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        geometry = self.kv_geometry()
        slots = self._block_slots(block_ids)
        assert self.k_cache is not None and self.v_cache is not None  # loaded
        kv = torch.stack(
            (self.k_cache.index_select(1, slots), self.v_cache.index_select(1, slots)), dim=1
        )
        return kv.reshape(geometry.shape(slots.numel() // geometry.block_size))

    def write_kv_blocks(self, block_ids: np.ndarray, kv: torch.Tensor) -> None:
        geometry = self.kv_geometry()
        slots = self._block_slots(block_ids)
        check_blocks_tensor(geometry, slots.numel() // geometry.block_size, kv)
        assert self.k_cache is not None and self.v_cache is not None  # loaded
        rows = kv.reshape(geometry.layers, 2, slots.numel(), geometry.kv_heads, geometry.head_dim)
        self.k_cache.index_copy_(1, slots, rows[:, 0])
        self.v_cache.index_copy_(1, slots, rows[:, 1])


# A feature a family's own graph may not take (Architecture.refuses) -> the flag it comes from.
_FEATURE_FLAGS = {
    "lora": "--enable-lora",
    "quantization": "override_neuron_config quantized: true",
    "eagle": "--speculative-config method eagle/eagle3",
}


def _refuse_features(settings: NeuronSettings, spec: DecoderSpec) -> None:
    """Refuse what the architecture's graph does not take, naming the flag."""
    asked = {
        "lora": bool(settings.max_loras),
        "quantization": settings.quantization is not None,
        "eagle": settings.is_eagle,
    }
    refused = [f for f in spec.arch.refuses if asked[f]]
    if refused:
        flags = ", ".join(_FEATURE_FLAGS[f] for f in refused)
        raise NeuronConfigError(
            f"{spec.architecture} on the reference backend takes no {', '.join(refused)} "
            f"(its layers are its family's own graph, backends/reference/families/"
            f"{spec.family}.py, which has no adapter slots, int8 weights or EAGLE head "
            f"input); remove {flags}."
        )


def _sampling_tensors(sampling: SamplingInputs) -> tuple[torch.Tensor, ...]:
    """The graph's sampling inputs, in its argument order."""
    return tuple(
        torch.from_numpy(a)
        for a in (sampling.top_k, sampling.top_p, sampling.temperature, sampling.uniform)
    )
