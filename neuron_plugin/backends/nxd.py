"""The NxD Inference backend: the NxD contract fulfilled by an NxDI model on NeuronCores.

This is the only module that imports `neuronx_distributed_inference`, and only when a
backend is built, so everything else (explain-config, doctor, tests) runs without it.
It maps the checkpoint's architecture to an NxDI class (a built-in table over NxDI's
`MODEL_TYPES`, plus the entry-point group `neuron_plugin.nxdi_models` where NxDI contrib
models register a class under a Hugging Face architecture name), turns the resolved
`NeuronSettings` into NxDI's NeuronConfig/InferenceConfig, compiles into and loads from
a folder of the compile cache, and calls the model with the contract's arguments.

Choices that follow from NxDI's code:
- NxDI gets explicit bucket lists, always with `enable_bucketing=True`, so it compiles
  exactly the graphs the settings list (bucketing "off" is a one-bucket grid). NxDI adds
  prefix length 0 to the prefix grid itself, so it is not passed.
- The block layout runs NxDI's prefix-caching graphs (active tokens x prefix length);
  chunked prefill uses them too, one request's chunk per context-encoding call with the
  earlier chunks as its prefix.
- Pad rows and pad tokens of `ForwardInputs` are removed before the call: NxDI pads to
  its compiled shapes itself (with the `cte-exact-bucket` patch it picks the bucket this
  plugin picked). In the contiguous layout rows are sorted by seq_id before the call and
  restored after, as vllm-neuron does. A padding-only call (warm-up, measurement) runs
  the bucket's graph on zero rows (see `padding_arguments`).
- `run()` also serves on-device sampling (tokens for the requests it can serve, logits
  for all) and takes the request's token ids a block-layout context encoding after a
  cached prefix needs; `forward()` is the contract's logits-only call.
- Compiled artifacts hold no weights unless `save_sharded_checkpoint` is set (NxDI traces
  with `initialize_model_weights=False` and shards the checkpoint at load); the cache key
  includes a weights fingerprint only in that case.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import (
    Progress,
    artifact_record,
    check_artifact_record,
    graph_specs,
    write_artifact_record,
)
from neuron_plugin.backends.reference.decoder import read_hf_config
from neuron_plugin.config import NeuronConfigError, NeuronSettings
from neuron_plugin.inputs import CONTEXT_ENCODING, ForwardInputs
from neuron_plugin.instances import (
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
# Most top-k values NxDI's on-device sampler takes (OnDeviceSamplingConfig.global_topk).
DEFAULT_GLOBAL_TOPK = 256


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
        seq_len=s.max_model_len,
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
    if tuple(s.token_generation_batches) != (s.max_num_seqs,):
        derived["token_generation_batches"] = list(s.token_generation_batches)
    if s.on_device_sampling:
        # Logits as well as tokens, so requests on-device sampling cannot serve are
        # sampled on the host from the same call.
        derived["output_logits"] = True
    clashes = sorted(k for k in derived if k in s.passthrough and s.passthrough[k] != derived[k])
    if clashes:
        raise NeuronConfigError(
            "; ".join(f"override_neuron_config.{k}={s.passthrough[k]!r} but the nxd backend "
                      f"needs {derived[k]!r}" for k in clashes)
            + "; remove the key(s) (output_logits must stay on with on-device sampling).")
    return {**s.passthrough, **derived}


def unknown_kwargs(neuron_config: object, kwargs: Mapping[str, Any]) -> list[str]:
    """Keys NeuronConfig dropped (it logs and ignores unknown keys): an older NxDI
    would otherwise silently compile other graphs than the settings list."""
    return sorted(k for k in kwargs if not hasattr(neuron_config, k))


# -- forward arguments ------------------------------------------------------------------
def seq_order(seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order that sorts rows by seq_id, order that restores the original rows)."""
    order = np.argsort(seq_ids, kind="stable")
    return order, np.argsort(order, kind="stable")


def model_arguments(settings: NeuronSettings, inputs: ForwardInputs
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The NxDI forward arguments for the real rows and tokens of `inputs`, and the
    index that puts the model's output rows back into the order of `inputs`.

    NxDI's prefix-caching context encoding takes the whole context [0, end) as
    input_ids (it re-encodes the tail of the prefix into spare bucket slots) with the
    slots of the new tokens only; `inputs.context_ids` carries those token ids."""
    rows = inputs.num_real
    full = inputs.full_context_lens[:rows]
    computed = inputs.computed_context_lens[:rows]
    tokens = int(full[0] - computed[0]) if inputs.phase == CONTEXT_ENCODING else 1
    args = {
        "input_ids": inputs.input_ids[:rows, :tokens],
        "position_ids": inputs.position_ids[:rows, :tokens],
        "seq_ids": inputs.seq_ids[:rows],
        "full_context_lens": full.reshape(-1, 1),
        "computed_context_lens": computed.reshape(-1, 1),
    }
    if not settings.is_block_layout:
        if inputs.phase == CONTEXT_ENCODING:
            # Explicit, because NxDI infers a width-0 mask for a one-token prompt.
            args["attention_mask"] = np.ones((rows, tokens), dtype=np.int64)
        order, restore = seq_order(args["seq_ids"])
        return {k: v[order] for k, v in args.items()}, restore
    args["slot_mapping"] = inputs.slot_mapping[:rows, :tokens]
    args["block_table"] = inputs.block_table[:rows]
    if inputs.phase == CONTEXT_ENCODING and computed[0] > 0:
        end = int(full[0])
        args["input_ids"] = np.asarray(inputs.context_ids[:end], dtype=np.int64)[None, :]
        args["position_ids"] = np.arange(end, dtype=np.int64)[None, :]
    return args, np.arange(rows)


def padding_arguments(settings: NeuronSettings,
                      inputs: ForwardInputs) -> dict[str, np.ndarray]:
    """Arguments that make NxDI run the graph of `inputs.bucket` for a padding-only call
    (warm-up, measurement): NxDI has no padding rows, so the rows are real-looking
    zeros. In the block layout they write nowhere (slot -1); the contiguous layout has
    no scratch row, so they write sequence slots 0.. (call it before serving only)."""
    block = settings.is_block_layout
    if inputs.phase == CONTEXT_ENCODING:
        active, prefix = inputs.bucket[0], sum(inputs.bucket[1:])
        rows, width, end = 1, prefix + active, prefix + active
        positions = np.arange(end, dtype=np.int64)[None, :]
        computed = np.array([[prefix]], dtype=np.int64)
    else:
        rows, end = inputs.bucket
        width, active = 1, 1
        positions = np.full((rows, 1), end - 1, dtype=np.int64)
        computed = np.full((rows, 1), end - 1, dtype=np.int64)
    args = {
        "input_ids": np.zeros((rows, width), dtype=np.int64),
        "position_ids": positions,
        "seq_ids": np.arange(rows, dtype=np.int64),
        "full_context_lens": np.full((rows, 1), end, dtype=np.int64),
        "computed_context_lens": computed,
    }
    if block:
        args["slot_mapping"] = np.full((rows, active), -1, dtype=np.int64)
        args["block_table"] = np.zeros((rows, settings.max_blocks_per_seq), dtype=np.int64)
    elif inputs.phase == CONTEXT_ENCODING:
        args["attention_mask"] = np.ones((rows, width), dtype=np.int64)
    return args


# -- on-device sampling -----------------------------------------------------------------
def on_device_refusal(params: Any, global_topk: int = DEFAULT_GLOBAL_TOPK) -> str | None:
    """Why NxDI's on-device sampler cannot serve a request (None: it can). It applies
    temperature, top-k (at most `global_topk`) and top-p only; anything else needs the
    host sampler and therefore the logits."""
    checks = (
        (getattr(params, "presence_penalty", 0.0) != 0.0, "presence_penalty"),
        (getattr(params, "frequency_penalty", 0.0) != 0.0, "frequency_penalty"),
        (getattr(params, "repetition_penalty", 1.0) != 1.0, "repetition_penalty"),
        (getattr(params, "min_p", 0.0) != 0.0, "min_p"),
        (bool(getattr(params, "logit_bias", None)), "logit_bias"),
        (bool(getattr(params, "allowed_token_ids", None)), "allowed_token_ids"),
        (bool(getattr(params, "bad_words", None)), "bad_words"),
        (getattr(params, "logprobs", None) is not None, "logprobs"),
        (getattr(params, "prompt_logprobs", None) is not None, "prompt_logprobs"),
        (getattr(params, "seed", None) is not None, "seed"),
        (getattr(params, "min_tokens", 0) > 0, "min_tokens"),
        (getattr(params, "structured_outputs", None) is not None, "structured_outputs"),
    )
    for refused, name in checks:
        if refused:
            return f"{name} needs the host sampler"
    greedy = params.temperature == 0.0
    if not greedy and not 0 < params.top_k <= global_topk:
        return (f"top_k={params.top_k} samples beyond the on-device sampler's "
                f"global_topk={global_topk}")
    return None


def sampling_rows(params: Sequence[Any],
                  global_topk: int) -> tuple[list[int], list[float], list[float]]:
    """(top_k, top_p, temperature) per row for NxDI's prepare_sampling_params; greedy is
    top-k 1 at temperature 1 and top-k is kept within [1, global_topk], as vllm-neuron
    encodes them (rows the host samples get a valid value whose token is not used)."""
    top_k, top_p, temperature = [], [], []
    for p in params:
        greedy = p.temperature == 0.0
        top_k.append(1 if greedy else p.top_k if 0 < p.top_k <= global_topk else global_topk)
        top_p.append(p.top_p)
        temperature.append(1.0 if greedy else p.temperature)
    return top_k, top_p, temperature


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
            f"VLLM_NEURON_BACKEND=nxd needs NxD Inference, which cannot be imported here "
            f"({exc}); install the Neuron SDK packages (README 'Running on inf2', check "
            f"with `neuron-plugin doctor`) or set VLLM_NEURON_BACKEND=reference."
        ) from exc
    apply_patches(NxDIModules(model_base, model_wrapper, hf_adapter))
    return NxDI(MODEL_TYPES, hf_adapter.load_pretrained_config, prepare_sampling_params,
                package_version("neuronx-distributed-inference"))


@dataclass(frozen=True)
class StepOutput:
    """One call's logits [num_real, vocab] and, where on-device sampling served a row,
    its token (`on_device[i]` says whether `tokens[i]` is meaningful)."""

    logits: torch.Tensor
    tokens: torch.Tensor | None
    on_device: np.ndarray


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
        return self.hf_config.get("text_config", self.hf_config)["vocab_size"]

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

    def run(self, inputs: ForwardInputs, params: Sequence[Any] | None = None) -> StepOutput:
        """One call. With `params` (one per real row) and on-device sampling compiled
        in, rows the on-device sampler can serve also get a token."""
        rows = inputs.num_real
        if rows == 0:
            self._call(padding_arguments(self.settings, inputs))
            return StepOutput(torch.zeros((0, self.vocab_size)), None,
                              np.zeros(0, dtype=bool))
        args, restore = model_arguments(self.settings, inputs)
        on_device = np.zeros(rows, dtype=bool)
        sampling = None
        if params is not None and self.settings.on_device_sampling:
            global_topk = self.model.neuron_config.on_device_sampling_config.global_topk
            on_device = np.array([on_device_refusal(p, global_topk) is None
                                  for p in params], dtype=bool)
            order = np.argsort(restore)
            top_k, top_p, temperature = sampling_rows([params[i] for i in order], global_topk)
            sampling = self.nxdi.prepare_sampling_params(
                rows, top_k=top_k, top_p=top_p, temperature=temperature)
        output = self._call(args, sampling)
        back = torch.from_numpy(restore)
        logits = output.logits
        if logits.dim() == 3:
            logits = logits[:, -1, :]
        logits = logits[back, : self.vocab_size].float()
        tokens = None
        if self.settings.on_device_sampling:
            tokens = output.tokens.reshape(rows, -1)[back, -1]
        return StepOutput(logits, tokens, on_device)

    def _call(self, args: Mapping[str, np.ndarray], sampling: torch.Tensor | None = None):
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items()}
        if sampling is not None:
            tensors["sampling_params"] = sampling
        with torch.inference_mode():
            return self.model(tensors.pop("input_ids"),
                              attention_mask=tensors.pop("attention_mask", None), **tensors)

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        return self.run(inputs).logits
