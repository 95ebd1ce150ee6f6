"""The NxD Inference backend: the NxD contract fulfilled by an NxDI model on NeuronCores.

This is the only module that imports `neuronx_distributed_inference`, and only when a
backend is built, so everything else (explain-config, doctor, tests) runs without it.
It maps the checkpoint's architecture to an NxDI class (a built-in table over NxDI's
`MODEL_TYPES`, plus the entry-point group `neuron_plugin.nxdi_models` where NxDI contrib
models register a class under a Hugging Face architecture name), turns the resolved
`NeuronSettings` into NxDI's NeuronConfig/InferenceConfig, compiles into and loads from
a folder of the compile cache, and calls the model with the contract's arguments.

Choices that follow from NxDI's code (NxDI 0.7-0.9, neuronx-distributed's router):
- NxDI gets explicit bucket lists, always with `enable_bucketing=True`, so it compiles
  exactly the graphs the settings list (bucketing "off" is a one-bucket grid). NxDI adds
  prefix length 0 to the prefix grid itself, so it is not passed. The bucket a call runs
  is the one `neuron_plugin.core.inputs` chose: the settings follow NxDI's choice where
  the plugin cannot steer it (prefix caching), and the call steers it elsewhere.
- NxD's router looks every input up by its exact shape among the compiled graphs
  (neuronx-distributed trace/spmd.py NxDModel.router), batch rows included, so every
  call carries `sampling_params` with exactly its rows: NxDI's default has
  batch_size = max_num_seqs rows and matches no context-encoding graph.
- Context encoding: one row (ctx_batch_size=1). Contiguous layout: input ids and
  positions at the bucket's width with pads at position 0, the attention mask at the
  prompt's width: NxDI picks the bucket from the mask and takes the last hidden state at
  argmax(position_ids), which its own pads (position 1) would win for a one-token
  prompt. Block layout: the whole context [0, end) as input_ids (NxDI re-encodes the
  tail of the prefix into spare active slots) with the slots of the new tokens.
- Token generation: the bucket's whole batch, sorted by seq_id, pad rows for the missing
  seq_ids of range(batch) as NxDI completes a batch; their writes go nowhere (block
  layout: slot -1) or to the last position of their cache line (contiguous layout: NxDI
  writes every row's token into line seq_id, and its own padding, a copy of the first
  row, would overwrite a request prefilled earlier in the step).
  NxDI then has nothing to fill: its partial-batch handling (seq_ids completed from
  range(batch), which loses rows whose seq_id is not below the batch, and the
  prefix-caching return `logits[:n]` applied to the list [tokens, logits] when
  output_logits is on) never changes a call. Contiguous calls pass an
  attention mask whose width makes NxDI's length choice (first bucket > width in its 1-D
  path, >= width in the 0.8+ batch-bucketing path) the plugin's first fit.
- `run()` is the serving call: a token per row from NxDI's on-device sampler, fed the
  rows' `SamplingInputs`, and logits (`output_logits=True`) for the rows that need the
  host; the sampler is compiled with `dynamic=True`, without which it ignores per-row
  temperature and top-p (argmax unless do_sample). `forward()` is the logits-only call.
  A padding-only call (warm-up, measurement) runs a graph with a stand-in request that
  writes no KV block (see `padding_arguments`).
- Compiled artifacts hold no weights unless `save_sharded_checkpoint` is set (NxDI traces
  with `initialize_model_weights=False` and shards the checkpoint at load); the cache key
  includes a weights fingerprint only in that case.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import (
    Progress,
    StepOutput,
    artifact_record,
    check_artifact_record,
    graph_specs,
    write_artifact_record,
)
from neuron_plugin.core.checkpoint import read_hf_config, text_config
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    PAD_SLOT,
    ForwardInputs,
    context_encoding_inputs,
    context_encoding_need,
    token_generation_inputs,
)
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    check_tp_fits,
    detect_instance_type,
    host_visible_cores,
    lnc,
    package_version,
)
from neuron_plugin.patches import NxDIModules, apply_patches

logger = plugin_logger(__name__)

ENTRY_POINT_GROUP = "neuron_plugin.nxdi_models"
TASK = "causal-lm"
# Hugging Face architecture -> key of NxDI's utils.constants.MODEL_TYPES (text models).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DbrxForCausalLM": "dbrx",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3",
}
DISTRIBUTIONS = ("neuronx-cc", "neuronx-distributed", "neuronx-distributed-inference",
                 "torch-neuronx", "torch")
# Passed-through NeuronConfig keys the backend completes rather than replaces.
MERGED_KEYS = frozenset({"on_device_sampling_config"})


# -- architecture -> NxDI class ---------------------------------------------------------
def model_entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def describe_architecture(architecture: str,
                          entry_points: Iterable[importlib.metadata.EntryPoint]) -> str:
    """Which NxDI class would serve `architecture`, without importing NxDI."""
    for ep in entry_points:
        if ep.name == architecture:
            return f"{ep.value} (entry point {ENTRY_POINT_GROUP}:{ep.name})"
    if architecture in ARCHITECTURES:
        return f"NxDI MODEL_TYPES[{ARCHITECTURES[architecture]!r}][{TASK!r}]"
    raise NeuronConfigError(_unsupported(architecture))


def _unsupported(architecture: str) -> str:
    return (
        f"architecture {architecture!r} has no NxD Inference model: supported are "
        f"{', '.join(ARCHITECTURES)}; an NxDI contrib model can register its class "
        f"under this name in the {ENTRY_POINT_GROUP!r} entry-point group "
        f"({architecture} = \"package.module:NeuronClass\"), or serve on the CPU with "
        f"VLLM_NEURON_BACKEND=reference."
    )


def resolve_model_class(architecture: str, model_types: Mapping[str, Mapping[str, type]],
                        entry_points: Iterable[importlib.metadata.EntryPoint],
                        nxdi_version: str | None = None) -> type:
    """The NxDI application class for `architecture`; a registered entry point wins
    over the built-in table, so a contrib model can replace a built-in one."""
    for ep in entry_points:
        if ep.name == architecture:
            cls = ep.load()
            if not (hasattr(cls, "get_neuron_config_cls") and hasattr(cls, "get_config_cls")):
                raise NeuronConfigError(
                    f"entry point {ENTRY_POINT_GROUP}:{ep.name} = {ep.value} is not an NxDI "
                    f"application class (no get_neuron_config_cls/get_config_cls); point it "
                    f"at a NeuronBaseForCausalLM subclass."
                )
            logger.info("NxDI model for %s: %s (entry point)", architecture, ep.value)
            return cls
    if architecture not in ARCHITECTURES:
        raise NeuronConfigError(_unsupported(architecture))
    key = ARCHITECTURES[architecture]
    if key not in model_types or TASK not in model_types[key]:
        raise NeuronConfigError(
            f"the installed NxD Inference {nxdi_version or '(unknown version)'} has no "
            f"{key!r} model in MODEL_TYPES, needed for {architecture}; install a Neuron "
            f"SDK whose NxDI lists it (see README 'Running on inf2')."
        )
    return model_types[key][TASK]


# -- settings -> NeuronConfig keyword arguments -----------------------------------------
def neuron_config_kwargs(settings: NeuronSettings) -> dict[str, Any]:
    """NeuronConfig(**kwargs) for the settings (see the module docstring for why); a
    passed-through override_neuron_config key that the plugin sets differently is an
    error rather than a silent overwrite."""
    s = settings
    derived: dict[str, Any] = dict(
        tp_degree=s.tp_degree,
        batch_size=s.max_num_seqs,
        ctx_batch_size=s.ctx_batch_size,
        tkg_batch_size=s.max_num_seqs,
        # NxDI requires every token-generation bucket <= seq_len; in the block layout the
        # largest is max_model_len rounded up to whole KV blocks (settings.resolve_grids).
        seq_len=max(s.max_model_len, s.token_generation_buckets[-1]),
        max_context_length=s.max_context_length,
        torch_dtype=s.dtype,
        padding_side="right",
        is_continuous_batching=s.passthrough.get("is_continuous_batching",
                                                 s.max_num_seqs > 1),
        enable_bucketing=True,
        context_encoding_buckets=list(s.context_encoding_buckets),
        token_generation_buckets=list(s.token_generation_buckets),
        is_block_kv_layout=s.is_block_layout,
        is_prefix_caching=s.is_block_layout,
    )
    if s.is_block_layout:
        derived.update(prefix_buckets=[p for p in s.prefix_buckets if p != 0],
                       pa_num_blocks=s.num_blocks, pa_block_size=s.block_size)
    if batch_bucketing(s):
        derived["token_generation_batches"] = list(s.token_generation_batches)
    if s.on_device_sampling:
        derived["on_device_sampling_config"] = on_device_sampling_config(
            s.passthrough.get("on_device_sampling_config") or {}, s.global_topk)
        # Logits as well as tokens, so requests on-device sampling cannot serve are
        # sampled on the host from the same call.
        derived["output_logits"] = True
    clashes = sorted(k for k in derived if k in s.passthrough and k not in MERGED_KEYS
                     and s.passthrough[k] != derived[k])
    if clashes:
        raise NeuronConfigError(
            "; ".join(f"override_neuron_config.{k}={s.passthrough[k]!r} but the nxd backend "
                      f"needs {derived[k]!r}" for k in clashes)
            + "; remove the key(s) (output_logits must stay on with on-device sampling).")
    return {**s.passthrough, **derived}


def on_device_sampling_config(user: Mapping[str, Any], global_topk: int) -> dict[str, Any]:
    """The user's OnDeviceSamplingConfig fields with the resolved global_topk and
    `dynamic=True` (as vllm-neuron sets it): NxDI's Sampler is argmax unless do_sample
    or dynamic is set, and without dynamic it applies the temperature and top-p traced
    at compile time instead of each row's (NxDI modules/generation/sampling.py Sampler).
    `deterministic` stays the user's (default False: a fixed 0.5 draw otherwise)."""
    if user.get("dynamic", True) is not True:
        raise NeuronConfigError(
            f"override_neuron_config.on_device_sampling_config.dynamic="
            f"{user['dynamic']!r}: NxDI's on-device sampler then ignores each request's "
            f"temperature and top-p (greedy unless do_sample is set); remove dynamic "
            f"(the nxd backend sets it to true).")
    return {**user, "global_topk": global_topk, "dynamic": True,
            "deterministic": bool(user.get("deterministic", False))}


def unknown_kwargs(neuron_config: object, kwargs: Mapping[str, Any]) -> list[str]:
    """Keys NeuronConfig dropped (it logs and ignores unknown keys): an older NxDI
    would otherwise silently compile other graphs than the settings list."""
    return sorted(k for k in kwargs if not hasattr(neuron_config, k))


# -- forward arguments ------------------------------------------------------------------
def batch_bucketing(settings: NeuronSettings) -> bool:
    """Whether NxDI gets token_generation_batches (its 0.8+ 2-D token-generation path)."""
    return tuple(settings.token_generation_batches) != (settings.max_num_seqs,)


def model_arguments(settings: NeuronSettings, inputs: ForwardInputs
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The NxDI forward arguments for `inputs` (see the module docstring) and, for each
    real row of `inputs`, the row of NxDI's output that answers it."""
    if inputs.phase == CONTEXT_ENCODING:
        return _context_arguments(settings, inputs), np.zeros(1, dtype=np.int64)
    return _decode_arguments(settings, inputs)


def _context_arguments(settings: NeuronSettings, inputs: ForwardInputs) -> dict[str, np.ndarray]:
    end, start = int(inputs.full_context_lens[0]), int(inputs.computed_context_lens[0])
    args = {
        "seq_ids": inputs.seq_ids[:1],
        "full_context_lens": inputs.full_context_lens[:1].reshape(1, 1),
        "computed_context_lens": inputs.computed_context_lens[:1].reshape(1, 1),
    }
    if not settings.is_block_layout:
        # Pads keep position 0, so argmax(position_ids) stays on the last prompt token;
        # the mask's width (the prompt's) is what NxDI picks the bucket from.
        args.update(input_ids=inputs.input_ids[:1], position_ids=inputs.position_ids[:1],
                    attention_mask=np.ones((1, end - start), dtype=np.int64))
        return args
    args.update(input_ids=np.asarray(inputs.context_ids[:end], dtype=np.int64)[None, :],
                position_ids=np.arange(end, dtype=np.int64)[None, :],
                slot_mapping=inputs.slot_mapping[:1, :end - start],
                block_table=inputs.block_table[:1])
    return args


def _decode_arguments(settings: NeuronSettings, inputs: ForwardInputs
                      ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rows, real = inputs.bucket[0], inputs.num_real
    seq = inputs.seq_ids[:real]
    missing = np.setdiff1d(np.arange(rows), seq)
    if missing.size != rows - real:
        raise ValueError(
            f"decode rows with seq_ids {seq.tolist()} do not fit the batch bucket {rows} "
            f"(NxDI serves seq_ids 0..{rows - 1} with it); this is a plugin bug, please "
            f"report it with your --max-num-seqs and token_generation_batches.")
    seq_ids = np.concatenate([seq, missing])
    order = np.argsort(seq_ids, kind="stable")
    pad = order >= real
    source = np.where(pad, 0, order)
    args = {
        "input_ids": inputs.input_ids[source],
        "position_ids": inputs.position_ids[source],
        "seq_ids": seq_ids[order],
        "full_context_lens": inputs.full_context_lens[source].reshape(-1, 1),
        "computed_context_lens": inputs.computed_context_lens[source].reshape(-1, 1),
    }
    if settings.is_block_layout:
        args["slot_mapping"] = np.where(pad[:, None], PAD_SLOT, inputs.slot_mapping[source])
        args["block_table"] = inputs.block_table[source]
        return args, np.argsort(order)[:real]
    # A pad row writes its token into the cache line of its seq_id, which may hold a
    # request outside this batch (one prefilled this step): at the last position, which
    # no request reads before writing it itself (NxDI's own garbage position,
    # kv_cache_manager.update_kv_by_layer_id), rather than at a copied row's position.
    last = settings.max_model_len - 1
    args["input_ids"][pad] = 0
    args["position_ids"][pad] = last
    args["full_context_lens"][pad] = last + 1
    args["computed_context_lens"][pad] = last
    positions = np.where(pad, 0, args["position_ids"][:, 0])
    width = int(positions.max()) + int(batch_bucketing(settings))
    args["attention_mask"] = (np.arange(width)[None, :] < positions[:, None]).astype(np.int64)
    return args, np.argsort(order)[:real]


def padding_arguments(settings: NeuronSettings,
                      inputs: ForwardInputs) -> dict[str, np.ndarray]:
    """Arguments that make NxDI run the graph of `inputs.bucket` for a padding-only call
    (warm-up, measurement): NxDI has no padding calls, so a stand-in request of zeros
    whose need runs that graph. In the block layout it writes no KV (slot -1); the
    contiguous layout has no scratch line, so it writes sequence lines 0.. (call it
    before serving only)."""
    block = settings.is_block_layout
    if inputs.phase == CONTEXT_ENCODING:
        new, cached = context_encoding_need(settings, inputs.bucket)
        stand_in = context_encoding_inputs(settings, np.zeros(new + cached, dtype=np.int64),
                                           cached, 0, [])
    else:
        rows, length = inputs.bucket
        stand_in = token_generation_inputs(
            settings, np.zeros(rows, dtype=np.int64), np.full(rows, length - 1, dtype=np.int64),
            np.arange(rows, dtype=np.int64), [[]] * rows if block else None)
    if stand_in.bucket != tuple(inputs.bucket):
        raise ValueError(f"no request runs the {inputs.phase} graph {inputs.bucket} (a "
                         f"stand-in runs {stand_in.bucket}); it is not one of the settings' "
                         f"graph shapes")
    args, _ = model_arguments(settings, stand_in)
    if block:
        args["slot_mapping"] = np.full_like(args["slot_mapping"], PAD_SLOT)
    return args


# -- the backend ------------------------------------------------------------------------
@dataclass(frozen=True)
class NxDI:
    """The parts of NxD Inference this backend calls."""

    model_types: Mapping[str, Mapping[str, type]]
    load_pretrained_config: Callable
    prepare_sampling_params: Callable
    version: str | None


def import_nxdi() -> NxDI:
    """Import NxD Inference and apply the patches its installed version needs."""
    try:
        from neuronx_distributed_inference.models import model_base, model_wrapper
        from neuronx_distributed_inference.modules.generation.sampling import (
            prepare_sampling_params,
        )
        from neuronx_distributed_inference.utils import hf_adapter
        from neuronx_distributed_inference.utils.constants import MODEL_TYPES
    except ImportError as exc:
        raise NeuronConfigError(
            f"VLLM_NEURON_BACKEND=nxd needs NxD Inference, which cannot be imported by "
            f"{sys.executable} ({exc}). NxDI pins torch 2.9 and transformers 4.5x, which "
            f"current vLLM cannot share an environment with: point "
            f"VLLM_NEURON_BACKEND_PYTHON at the Neuron SDK's interpreter (e.g. "
            f"/opt/aws_neuronx_venv_pytorch_2_9/bin/python) so the backend runs there as a "
            f"runner process (README 'Running on inf2'; check with `neuron-plugin "
            f"doctor`), or set VLLM_NEURON_BACKEND=reference."
        ) from exc
    apply_patches(NxDIModules(model_base, model_wrapper, hf_adapter))
    return NxDI(MODEL_TYPES, hf_adapter.load_pretrained_config, prepare_sampling_params,
                package_version("neuronx-distributed-inference"))


def _target() -> dict[str, Any]:
    """What the compiled graphs are specific to: the chip generation (the compiler's
    target) and the logical-core grouping; not the instance size, so graphs compiled on
    an inf2.xlarge serve an inf2.48xlarge at the same TP degree."""
    detected = detect_instance_type()
    target = (INSTANCE_TYPES[detected].chip.target if detected
              else os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "unknown"))
    return {"device": "neuron", "platform": target, "lnc": lnc()}


class NxDBackend:
    """See the module docstring."""

    name = "nxd"

    def __init__(self, settings: NeuronSettings, model_dir: str | Path):
        self.settings = settings
        self.model_dir = Path(model_dir)
        self.hf_config = read_hf_config(model_dir)
        check_tp_fits(settings.tp_degree, *host_visible_cores())
        self.nxdi = import_nxdi()
        self.model_cls = resolve_model_class(settings.architecture, self.nxdi.model_types,
                                             model_entry_points(), self.nxdi.version)
        self.model: torch.nn.Module | None = None

    @property
    def module(self) -> torch.nn.Module | None:
        return self.model

    @property
    def vocab_size(self) -> int:
        return text_config(self.hf_config)["vocab_size"]

    def _record(self) -> dict[str, Any]:
        return artifact_record(self.settings, {
            "architecture": self.settings.architecture,
            "dtype": self.settings.dtype,
            "tp_degree": self.settings.tp_degree,
            "nxdi_model": f"{self.model_cls.__module__}.{self.model_cls.__qualname__}",
        })

    def cache_manifest_fields(self) -> dict[str, Any]:
        from compile_cache.weights import weights_fingerprint

        embeds_weights = bool(self.settings.passthrough.get("save_sharded_checkpoint"))
        return {
            # make_manifest drops the keys that never change a graph (names, versions,
            # token ids); see compile_cache.manifest.VOLATILE_MODEL_KEYS.
            "model_config": self.hf_config,
            "target": _target(),
            "versions": {d: package_version(d) for d in DISTRIBUTIONS},
            "compiler_flags": os.environ.get("NEURON_CC_FLAGS", "").split(),
            "weights_fingerprint": (weights_fingerprint(self.model_dir) if embeds_weights
                                    else None),
        }

    def _new_model(self) -> torch.nn.Module:
        kwargs = neuron_config_kwargs(self.settings)
        neuron_config = self.model_cls.get_neuron_config_cls()(**kwargs)
        ignored = unknown_kwargs(neuron_config, kwargs)
        if ignored:
            raise NeuronConfigError(
                f"the installed NxD Inference {self.nxdi.version or ''} does not know "
                f"{', '.join(ignored)} (its NeuronConfig would ignore them and compile "
                f"other graphs); remove them from override_neuron_config or install a "
                f"newer Neuron SDK."
            )
        config = self.model_cls.get_config_cls()(
            neuron_config, load_config=self.nxdi.load_pretrained_config(str(self.model_dir)))
        return self.model_cls(str(self.model_dir), config)

    def compile(self, folder: Path, progress: Progress | None = None) -> None:
        from compile_cache.neuronx_cc import configure_compiler_cache
        from compile_cache.stores import open_store

        logger.info("neuronx-cc graph cache: %s", configure_compiler_cache(open_store()))
        model = self._new_model()
        if model.neuron_config.quantized:
            self.model_cls.save_quantized_state_dict(str(self.model_dir), model.config)
        model.compile(str(folder))
        write_artifact_record(Path(folder), self._record())
        if progress:
            for graph in graph_specs(self.settings):
                progress(graph.name)

    def load(self, folder: Path) -> None:
        check_artifact_record(Path(folder), self._record())
        model = self._new_model()
        # The loader warms every graph up through forward() unless skip_warmup is set.
        model.load(str(folder), skip_warmup=True)
        self.model = model

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """The KV cache as NxDI holds it on the device: each state tensor of the
        context-encoding model, for every TP rank in turn (vllm-neuron's order)."""
        state = self.model.context_encoding_model.model.nxd_model.state
        names = list(state[0])
        return [rank_state[name] for name in names for rank_state in state]

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        if inputs.num_real == 0:
            self._call(padding_arguments(self.settings, inputs))
            return torch.zeros((0, self.vocab_size))
        args, answer = model_arguments(self.settings, inputs)
        return self._logits(self._call(args), answer)

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        """One serving call: NxDI's on-device sampler draws every real row's token with
        the row's values (NxDI draws its own random numbers, `sampling.uniform` is not
        used); the logits come back for the rows that need the host only."""
        if not self.settings.on_device_sampling:
            raise ValueError("run() needs on-device sampling compiled in "
                             "(settings.on_device_sampling); call forward() instead")
        args, answer = model_arguments(self.settings, inputs)
        output = self._call(args, sampling, answer)
        width = int(args["seq_ids"].shape[0])
        tokens = output.tokens.reshape(width, -1)[torch.from_numpy(answer), -1]
        return StepOutput(tokens=tokens.numpy().astype(np.int32),
                          logits=self._logits(output, answer[sampling.needs_logits]))

    def _logits(self, output: Any, rows: np.ndarray) -> torch.Tensor:
        """The logits of NxDI output `rows` at the last position, vocabulary padding cut."""
        logits = output.logits
        if logits.dim() == 3:
            logits = logits[:, -1, :]
        return logits[torch.from_numpy(rows), : self.vocab_size].float()

    def _call(self, args: Mapping[str, np.ndarray], sampling: SamplingInputs | None = None,
              answer: np.ndarray | None = None) -> Any:
        """The model call with `sampling_params` of exactly the call's rows: `sampling`'s
        values at the `answer` rows, greedy elsewhere (pads, or no sampling asked)."""
        width = int(args["seq_ids"].shape[0])
        columns = [np.ones(width, dtype=np.float32) for _ in range(3)]  # top_k, top_p, temp
        if sampling is not None:
            for column, values in zip(columns, (sampling.top_k, sampling.top_p,
                                                sampling.temperature)):
                column[answer] = values
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items()}
        tensors["sampling_params"] = self.nxdi.prepare_sampling_params(
            width, *(column.tolist() for column in columns))
        with torch.inference_mode():
            return self.model(tensors.pop("input_ids"),
                              attention_mask=tensors.pop("attention_mask", None), **tensors)
