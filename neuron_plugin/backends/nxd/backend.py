"""The NxD Inference backend: the NxD contract fulfilled by an NxDI model on NeuronCores,
or by NxDI's own CPU mode (`override_neuron_config` `"on_cpu": true`, see `cpu_mode`).

It turns the resolved `NeuronSettings` into NxDI's NeuronConfig/InferenceConfig
(`neuron_config`), compiles into and loads from a folder of the compile cache (each
compile in a work folder of its own, `work_dir`), and calls
the model with the contract's arguments (`arguments`).
- `run()` is the serving call: a token per row from NxDI's on-device sampler, fed the
  rows' `SamplingInputs`, and logits for the rows that need the host; the sampler is
  compiled with `dynamic=True`, without which it ignores per-row temperature and top-p
  (argmax unless do_sample). A decode whose rows are all device-sampled runs a
  token-generation graph compiled without logits, one with a host row its logits
  variant; a prefill's graph returns its one row of logits (`graphs`). `forward()` is
  the logits-only call. A padding-only call (warm-up, measurement) runs a graph with a
  stand-in request that writes no KV block (see `arguments.padding_arguments`).
- Compiled artifacts hold no weights unless `save_sharded_checkpoint` is set (NxDI traces
  with `initialize_model_weights=False` and shards the checkpoint at load); the cache key
  includes a weights fingerprint only in that case, of the model's weights, a fused
  draft's and the LoRA adapters NxDI loads at start (sharded with them; run-time adapter
  loading is refused with it, core.lora).
- Speculative decoding (core.speculation): the NeuronConfig keys and the fused draft
  model's config (`neuron_config`), the speculative calls' arguments (`arguments`) and
  their answers (`outputs`). A fused draft's config is in the cache key, and its weights'
  fingerprint where the artifacts embed weights. An EAGLE head is NxDI's fused EAGLE
  draft, checked and written in NxDI's layout first (`eagle`).
- Quantized weights (core.quantization): `quantize()` writes NxDI's quantized checkpoint
  through NxDI's own `save_quantized_state_dict` (`neuron-plugin quantize`), into an
  existing folder so NxDI writes safetensors (application_base.py 756-770; a path that
  is not a folder would get a `torch.save` pickle); loading reads it from
  `quantized_checkpoints_path` (checkpoint_loader_fn), refused unless it is such a
  folder. Compiling never writes it. A tied lm_head is loaded as the checkpoint holds
  it, not from the embedding, and a fused draft with quantized weights is refused
  (`quantized`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import (
    AdapterLoading,
    InlineCalls,
    Progress,
    StepOutput,
    artifact_record,
    check_artifact_record,
    graph_specs,
    with_draft_config,
    write_artifact_record,
)
from neuron_plugin.backends.kv_blocks import KVGeometry, checked_block_ids, require_block_layout
from neuron_plugin.backends.nxd import compat, cpu_mode, graphs, image_to_text, prompt_graphs
from neuron_plugin.backends.nxd.arguments import model_arguments, padding_arguments
from neuron_plugin.backends.nxd.eagle import check_eagle, write_nxdi_head
from neuron_plugin.backends.nxd.kv_state import NxDKVState
from neuron_plugin.backends.nxd.lora import NxDAdapters, start_adapters_fingerprint
from neuron_plugin.backends.nxd.models import NxDIModelClass, resolve_model_class
from neuron_plugin.backends.nxd.neuron_config import (
    check_speculation_models,
    draft_neuron_config,
    neuron_config_kwargs,
    unknown_kwargs,
)
from neuron_plugin.backends.nxd.nxdi import import_nxdi
from neuron_plugin.backends.nxd.outputs import (
    call_budget,
    emitted_tokens,
    first_position_logits,
)
from neuron_plugin.backends.nxd.quantized import (
    check_quantized_head,
    complete_for_fused_qkv,
    refuse_quantized_draft,
    untie_quantized_head,
)
from neuron_plugin.backends.nxd.vision_arguments import (
    VisionExample,
    examples_by_width,
    vision_arguments,
)
from neuron_plugin.backends.nxd.work_dir import compile_work_dir
from neuron_plugin.core.adapters import AdapterWeights
from neuron_plugin.core.checkpoint import read_hf_config, text_config
from neuron_plugin.core.inputs import CONTEXT_ENCODING, ForwardInputs
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    check_tp_fits,
    detect_instance_type,
    host_visible_cores,
    lnc,
    package_version,
)
from neuron_plugin.core.nxdi_cpu_mode import sharded_sampler_problem
from neuron_plugin.core.quantization import check_checkpoint_folder
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.speculation import NO_TOKEN
from neuron_plugin.core.vision import ImageInputs, vision_bucket
from neuron_plugin.models.third_party import entry_points

logger = plugin_logger(__name__)

DISTRIBUTIONS = (
    "neuronx-cc",
    "neuronx-distributed",
    "neuronx-distributed-inference",
    "torch-neuronx",
    "torch",
)


def _target(on_cpu: bool) -> dict[str, Any]:
    """What the compiled graphs are specific to: the chip generation (the compiler's
    target) and the logical-core grouping; not the instance size, so graphs compiled on
    an inf2.xlarge serve an inf2.48xlarge at the same TP degree."""
    if on_cpu:
        return {"device": "cpu"}
    detected = detect_instance_type()
    target = (
        INSTANCE_TYPES[detected].chip.target
        if detected
        else os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "unknown")
    )
    return {"device": "neuron", "platform": target, "lnc": lnc()}


class NxDBackend(InlineCalls):
    """See the module docstring."""

    name = "nxd"

    def __init__(self, settings: NeuronSettings, model_dir: str | Path):
        self.settings = settings
        self.model_dir = Path(model_dir)
        self.hf_config = read_hf_config(model_dir)
        self.on_cpu = cpu_mode.requested(settings)
        if not self.on_cpu:
            check_tp_fits(settings.tp_degree, *host_visible_cores())
        self.nxdi = import_nxdi()
        self.model_cls = resolve_model_class(
            settings.architecture, self.nxdi.model_types, entry_points(), self.nxdi.version
        )
        # NxDI's image-to-text application (a vision-language model: image_to_text)
        self.image_to_text = image_to_text.is_image_to_text(
            self.model_cls, self.nxdi.image_to_text_model_base
        )
        if self.image_to_text:
            image_to_text.refuse_unsupported(settings)
            image_to_text.check_vision_fits(settings, self.hf_config)
            image_to_text.encoder_for(settings.architecture)
        elif settings.vision_buckets:
            raise NeuronConfigError(
                f"vision_buckets={list(settings.vision_buckets)}: the nxd backend serves no "
                f"vision encoder ({settings.architecture} is served as a text model); "
                f"remove vision_buckets from override_neuron_config."
            )
        # A fused draft model: its config and NxDI class (None: the model's own class).
        self.draft_config: dict[str, Any] | None = None
        self.draft_cls: NxDIModelClass | None = None
        if settings.draft_model:
            self.draft_config = read_hf_config(settings.draft_model)
            # an EAGLE head is built with the model's own class (nxd.eagle)
            if not settings.is_eagle:
                self.draft_cls = self._draft_class(self.draft_config)
        check_speculation_models(settings, self.hf_config, self.draft_config)
        self.eagle_head = check_eagle(settings, self.hf_config)
        self._head_dir: Path | None = None  # the head in NxDI's layout (_draft_dir)
        refuse_quantized_draft(settings)
        found = compat.problems(settings, self.hf_config, self.nxdi.version, self.nxdi.patch_status)
        if found:
            raise NeuronConfigError(" ".join(found))
        self.model: Any = None  # the NxDI application (NeuronBaseForCausalLM) once loaded
        # an image-to-text model's image-input examples: context encoding by input width,
        # and token generation's (load)
        self._context_examples: dict[int, VisionExample] = {}
        self._decode_example: VisionExample | None = None
        self.tied_head = False  # NxDI's tie of a quantized lm_head undone (_new_model)
        self._kv: NxDKVState | None = None  # KV blocks of the loaded model (_kv_state)
        self.adapters: NxDAdapters | None = None
        if settings.max_loras:
            self.adapters = NxDAdapters(settings, self.nxdi.lora, self.nxdi.version or "(unknown)")

    @property
    def adapter_loading(self) -> AdapterLoading:
        return self.adapters.loading if self.adapters is not None else AdapterLoading()

    @property
    def module(self) -> torch.nn.Module | None:
        return self.model

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.hf_config)["vocab_size"])

    def _draft_class(self, draft_config: dict[str, Any]) -> NxDIModelClass | None:
        """The NxDI class of a fused draft of another architecture (FusedSpecNeuronConfig
        `draft_model_cls`, model_base.py NeuronFusedSpecModel.__init__, ef2731e lines
        1627-1630), None for a draft of the model's own (NxDI then builds it with the
        model's class, as vllm-neuron always does)."""
        architectures = draft_config.get("architectures") or []
        if not architectures:
            raise NeuronConfigError(
                f"--speculative-config model={self.settings.draft_model}: its config.json "
                f"names no architectures, so NxDI has no class to build the draft with; "
                f"use a Hugging Face checkpoint whose config.json lists its architecture."
            )
        if architectures[0] == self.settings.architecture:
            return None
        return resolve_model_class(
            architectures[0], self.nxdi.model_types, entry_points(), self.nxdi.version
        )

    def _record(self) -> dict[str, Any]:
        draft = self.draft_config
        return artifact_record(
            self.settings,
            {
                "architecture": self.settings.architecture,
                "dtype": self.settings.dtype,
                "tp_degree": self.settings.tp_degree,
                "nxdi_model": f"{self.model_cls.__module__}.{self.model_cls.__qualname__}",
                "on_cpu": self.on_cpu,
                "draft_architecture": (draft.get("architectures") or [None])[0] if draft else None,
            },
        )

    def cache_manifest_fields(self) -> dict[str, Any]:
        from compile_cache.weights import weights_fingerprint

        embeds_weights = bool(self.settings.passthrough.get("save_sharded_checkpoint"))
        quantization = self.settings.quantization
        weights = Path(quantization.checkpoint) if quantization else self.model_dir
        fingerprint = None
        if embeds_weights:
            fingerprint = weights_fingerprint(weights)
            if self.settings.draft_model:  # the draft's weights are embedded too
                draft = weights_fingerprint(self.settings.draft_model)
                fingerprint = hashlib.sha256(f"{fingerprint}+{draft}".encode()).hexdigest()
            if self.adapters is not None and self.adapters.start:  # and the start adapters
                adapters = start_adapters_fingerprint(self.adapters.start)
                fingerprint = hashlib.sha256(f"{fingerprint}+lora:{adapters}".encode()).hexdigest()
        return {
            # make_manifest drops the keys that never change a graph (names, versions,
            # token ids); see compile_cache.manifest.VOLATILE_MODEL_KEYS. A fused draft
            # model's graphs depend on its config too.
            "model_config": with_draft_config(self.hf_config, self.settings),
            "target": _target(self.on_cpu),
            "versions": {
                **{d: package_version(d) for d in DISTRIBUTIONS},
                "nxdi_patches": ",".join(self.nxdi.patches_for(self.settings.architecture)),
            },
            "compiler_flags": os.environ.get("NEURON_CC_FLAGS", "").split(),
            "weights_fingerprint": fingerprint,
        }

    def _new_model(self) -> Any:
        if self.image_to_text:
            return self._new_image_to_text()
        kwargs = neuron_config_kwargs(self.settings)
        if self.adapters is not None:
            kwargs["lora_config"] = self.adapters.config_kwargs()
        neuron_config = self.model_cls.get_neuron_config_cls()(**kwargs)
        ignored = unknown_kwargs(neuron_config, kwargs)
        if ignored:
            batches = (
                " (token_generation_batches are the decode batch buckets, on by default: "
                "override_neuron_config max_batch_buckets: 1 compiles one decode batch size)"
                if "token_generation_batches" in ignored
                else ""
            )
            raise NeuronConfigError(
                f"the installed NxD Inference {self.nxdi.version or ''} does not know "
                f"{', '.join(ignored)} (its NeuronConfig would ignore them and compile "
                f"other graphs){batches}; remove them from override_neuron_config or "
                f"install a newer Neuron SDK."
            )
        config = self.model_cls.get_config_cls()(neuron_config, load_config=self._config_loader())
        self.tied_head = untie_quantized_head(config, self.settings)
        complete_for_fused_qkv(neuron_config, config.num_hidden_layers, "modules_to_not_convert")
        for key, value in compat.config_adjustments(self.settings, self.hf_config).items():
            setattr(config, key, value)
        if self.settings.is_fused_speculation:
            # Attached after construction, as vllm-neuron does (a model's own config class
            # may not take the keyword).
            config.fused_spec_config = self._fused_spec_config(neuron_config)
        model = self.model_cls(str(self.model_dir), config)
        graphs.add_logits_graphs(model, self.settings)
        prompt_graphs.add_prompt_logprobs_graphs(model, self.settings, self.nxdi.model_base)
        return model

    def _new_image_to_text(self) -> Any:
        """NxDI's image-to-text application (nxd.image_to_text), every wrapper run on
        the host side. Its decode graphs keep their logits (no logits-free split,
        `graphs`; NeuronSettings.token_generation_logits_shapes has none for a vision
        model): NxDI's Qwen3-VL text wrapper traces inputs for its own two tags only
        (modeling_qwen3_vl_text.py input_generator raises for any other)."""
        model = image_to_text.new_image_to_text(
            self.model_cls,
            self.settings,
            neuron_config_kwargs(self.settings),
            self._config_loader(),
            str(self.model_dir),
            self.hf_config,
        )
        image_to_text.run_wrappers_on_the_host(model)
        return model

    def _config_loader(self) -> Any:
        """The `load_config` hook NxDI's InferenceConfig runs: NxDI's own (transformers'
        AutoConfig of the SDK's transformers), or the class's `config_loader` where it
        reads config.json itself (a class of the plugin's own for an architecture that
        transformers 4.57 does not know, e.g. Gemma 4)."""
        own = getattr(self.model_cls, "config_loader", None)
        if own is not None:
            return own(str(self.model_dir))
        return self.nxdi.load_pretrained_config(str(self.model_dir))

    def _fused_spec_config(self, neuron_config: Any) -> Any:
        """A fused draft model's FusedSpecNeuronConfig as vllm-neuron builds it
        (`_init_fused_spec_config`): the draft's config from its folder around a copy of
        the model's NeuronConfig (`draft_neuron_config`), the model's NeuronBaseModel
        class as NxDI's worker class, the draft's folder for its weights."""
        draft_dir = self._draft_dir()
        worker_cls = getattr(self.model_cls, "_model_cls", None)
        if worker_cls is None:
            raise NeuronConfigError(
                f"--speculative-config with a draft model: the NxDI class "
                f"{self.model_cls.__qualname__} names no NeuronBaseModel (_model_cls), "
                f"which NxDI's fused speculation builds target and draft with; use a "
                f"model class that sets _model_cls, or remove --speculative-config."
            )
        config_cls = (self.draft_cls or self.model_cls).get_config_cls()
        draft_config = config_cls(
            draft_neuron_config(neuron_config),
            load_config=self.nxdi.load_pretrained_config(draft_dir),
        )
        own = getattr(neuron_config, "draft_model_modules_to_not_convert", None)
        complete_for_fused_qkv(
            draft_config.neuron_config,
            draft_config.num_hidden_layers,
            "draft_model_modules_to_not_convert" if own else "modules_to_not_convert",
        )
        return self.nxdi.fused_spec_config(
            worker_cls,
            draft_config=draft_config,
            draft_model_path=draft_dir,
            draft_model_cls=self.draft_cls,
        )

    def _draft_dir(self) -> str:
        """The folder NxDI loads the fused drafter from: the draft model's, or an EAGLE
        head written in NxDI's layout (nxd.eagle.write_nxdi_head) into a temporary folder
        of this backend, once."""
        draft_dir = self.settings.draft_model
        if draft_dir is None:
            raise ValueError(
                "fused speculation with settings.draft_model None: a plugin bug, please "
                "report it with your --speculative-config."
            )
        if self.eagle_head is None:
            return draft_dir
        if self._head_dir is None:
            folder = Path(tempfile.mkdtemp(prefix="nxdi-eagle-head-"))
            weakref.finalize(self, shutil.rmtree, folder, True)
            self._head_dir = write_nxdi_head(
                self.eagle_head, draft_dir, str(self.model_dir), folder
            )
        return str(self._head_dir)

    def compile(self, folder: Path, progress: Progress | None = None) -> None:
        if self.on_cpu:
            # NxDI's CPU mode runs its modules eagerly: nothing to compile, the folder
            # records what it is for so a device configuration never loads it.
            write_artifact_record(Path(folder), self._record())
            return
        from compile_cache.neuronx_cc import configure_compiler_cache
        from compile_cache.stores import open_store

        logger.info("neuronx-cc graph cache: %s", configure_compiler_cache(open_store()))
        # NxDI reads the work folder when it builds the model, NxD when it compiles
        with compile_work_dir():
            model = self._new_model()
            if model.neuron_config.save_sharded_checkpoint:  # compiling reads the weights
                self._quantized_folder()
            model.compile(str(folder))
        write_artifact_record(Path(folder), self._record())
        if progress:
            for graph in graph_specs(self.settings):
                progress(graph.name)

    def _quantized_folder(self) -> Path | None:
        """The quantized checkpoint's folder (None unquantized), checked before NxDI
        reads it (after _new_model): safetensors in a folder, nothing it would unpickle,
        and a tied model's quantized lm_head (nxd.quantized)."""
        quantization = self.settings.quantization
        if quantization is None:
            return None
        folder = check_checkpoint_folder(quantization, str(self.model_dir))
        if self.tied_head:
            check_quantized_head(quantization, folder, str(self.model_dir))
        return folder

    def quantize(self) -> dict[str, Any]:
        """NxDI's quantized checkpoint of the model, written by NxDI's own
        save_quantized_state_dict into quantized_checkpoints_path (a folder, created
        first, so NxDI writes safetensors), then checked as loading checks it."""
        quantization = self.settings.quantization
        if quantization is None:
            raise NeuronConfigError(
                "neuron-plugin quantize needs override_neuron_config quantized: true and "
                "quantized_checkpoints_path (the folder to write)."
            )
        folder = Path(quantization.checkpoint)
        if folder.is_file():
            raise NeuronConfigError(
                f"override_neuron_config.quantized_checkpoints_path={str(folder)!r} is a "
                f"file; NxDI would torch.save a pickle there: name a folder."
            )
        folder.mkdir(parents=True, exist_ok=True)
        model = self._new_model()
        self.model_cls.save_quantized_state_dict(str(self.model_dir), model.config)
        self._quantized_folder()
        return {
            "path": str(folder),
            "quantization": quantization.describe(),
            "bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        }

    def load(self, folder: Path) -> None:
        check_artifact_record(Path(folder), self._record())
        model = self._new_model()
        self._quantized_folder()
        if self.on_cpu:
            cpu_mode.refuse_quantized(self.settings)
            if self.image_to_text:
                cpu_mode.load_image_to_text(model, self.nxdi.layer_boundary_marker)
            else:
                cpu_mode.load(model, self.nxdi.layer_boundary_marker)
        else:
            # The loader warms every graph up (run_graph_once) unless skip_warmup is set.
            model.load(str(folder), skip_warmup=True)
            graphs.route_by_tag(model)
        if self.image_to_text:
            self._context_examples = examples_by_width(model.context_encoding_model)
            self._decode_example = next(
                iter(examples_by_width(model.token_generation_model).values())
            )
        self.model = model

    def set_adapter(self, slot: int, adapter: AdapterWeights) -> None:
        """The plugin's slot `slot` holds `adapter` from the next call (nxd/lora.py)."""
        if self.adapters is None:
            raise ValueError("set_adapter without LoRA slots (settings.max_loras is 0)")
        self.adapters.set(self.model, slot, adapter)

    def encode_image(self, image: ImageInputs) -> np.ndarray:
        """An image's embeddings from the vision graph of its vision bucket (a padding
        image: the bucket it fills), by the architecture's encoder (nxd.image_to_text)."""
        if not self.image_to_text:  # text models have no vision buckets (__init__)
            raise NeuronConfigError(
                f"{self.settings.architecture} takes no images on the nxd backend; this is "
                f"a plugin bug, please report it."
            )
        bucket = (
            int(image.pixel_values.shape[0])
            if image.is_padding
            else vision_bucket(self.settings.vision_buckets, image.patches)
        )
        encode = image_to_text.encoder_for(self.settings.architecture)
        return encode(self.model.vision_encoder_model, image, bucket)

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """The KV cache as NxDI holds it: on the device each state tensor of the
        context-encoding model, for every TP rank in turn (vllm-neuron's order); in the
        CPU mode the eager model's cache manager's tensors."""
        if self.on_cpu:
            return cpu_mode.kv_cache_tensors(self.model)
        state = self.model.context_encoding_model.model.nxd_model.state
        names = list(state[0])
        return [rank_state[name] for name in names for rank_state in state]

    # -- KV blocks (backends.kv_blocks, nxd.kv_state) ------------------------------------
    def _kv_state(self) -> NxDKVState:
        require_block_layout(self.settings)
        if self.model is None:
            raise RuntimeError("KV blocks of an NxD backend that is not loaded")
        if self._kv is None or self._kv.model is not self.model:
            self._kv = NxDKVState(
                self.model, self.settings, self.on_cpu, self.hf_config, self._computation()
            )
        return self._kv

    def kv_geometry(self) -> KVGeometry:
        return self._kv_state().geometry()

    def _computation(self) -> str:
        """How this backend computes KV values: NxDI, with the patches in effect that
        change this architecture's graphs (`NxDI.patches_for`)."""
        patches = self.nxdi.patches_for(self.settings.architecture)
        return f"nxd, patches: {', '.join(patches) or 'none'}"

    def read_kv_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        state = self._kv_state()
        return state.read(checked_block_ids(block_ids, self.settings))

    def write_kv_blocks(self, block_ids: np.ndarray, kv: torch.Tensor) -> None:
        state = self._kv_state()
        state.write(checked_block_ids(block_ids, self.settings), kv)

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        if inputs.num_real == 0:
            # the shape's logits graph where it has one, else its only graph (no row
            # comes back either way)
            self._padding_call(
                inputs, tuple(inputs.bucket) in self.settings.token_generation_logits_shapes()
            )
            return torch.zeros((0, self.vocab_size))
        if self.settings.is_fused_speculation:
            raise NeuronConfigError(
                "forward() asks for logits, which the nxd backend's fused speculation "
                "graphs do not return (core.speculation.host_sampling_refusal); serve with "
                "run(), or use n-gram speculation where logits are needed."
            )
        args, answer = model_arguments(self.settings, inputs, logits=True)
        images = self._image_arguments(inputs, args)
        return self._logits(self._call(args, inputs.phase, True, images=images), answer)

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        """One serving call: NxDI's on-device sampler draws every real row's token with
        the row's values (NxDI draws its own random numbers, `sampling.uniform` is not
        used); the logits come back for the rows that need the host only, and a decode
        without such rows runs a graph that returns none (`graphs`). A context encoding
        with `prompt_targets` runs the prompt-logprob submodel (`prompt_graphs`), with
        on-device sampling off too (its row then needs its logits)."""
        targets = inputs.prompt_targets
        on_device = self.settings.on_device_sampling
        problem = sharded_sampler_problem(self.settings) if on_device else None
        if problem:
            raise NeuronConfigError(problem)
        if not on_device and targets is None:
            raise ValueError(
                "run() needs on-device sampling compiled in "
                "(settings.on_device_sampling); call forward() instead"
            )
        prompt = targets is not None
        no_logits = torch.zeros((0, self.vocab_size))
        if inputs.num_real == 0:
            self._padding_call(inputs, logits=False, prompt=prompt)
            return StepOutput(tokens=np.zeros((0, 1), dtype=np.int32), logits=no_logits)
        needs = bool(sampling.needs_logits.any())
        args, answer = model_arguments(self.settings, inputs, needs)
        output = self._call(
            args,
            inputs.phase,
            needs,
            sampling if on_device else None,
            answer,
            prompt,
            self._image_arguments(inputs, args),
        )
        scored = None
        if targets is not None:
            start = int(inputs.computed_context_lens[0])
            scored = prompt_graphs.scored_answer(
                prompt_graphs.prompt_answer(self.model),
                targets,
                start,
                int(inputs.full_context_lens[0]),
                self._logits(output, answer)[0],
            )
        if on_device:
            budget = call_budget(inputs, answer, int(args["seq_ids"].shape[0]))
            tokens = emitted_tokens(self.settings, inputs, args, output, budget)[answer]
        else:
            tokens = np.full((inputs.num_real, 1), NO_TOKEN, dtype=np.int32)
        return StepOutput(
            tokens=tokens,
            logits=self._logits(output, answer[sampling.needs_logits]) if needs else no_logits,
            prompt_logprobs=scored,
        )

    def _padding_call(self, inputs: ForwardInputs, logits: bool, prompt: bool = False) -> None:
        args = padding_arguments(self.settings, inputs, logits)
        images = self._image_arguments(inputs, args)
        self._call(args, inputs.phase, logits, prompt=prompt, images=images)

    def _image_arguments(
        self, inputs: ForwardInputs, args: Mapping[str, np.ndarray]
    ) -> dict[str, torch.Tensor]:
        """An image-to-text model's image inputs of the call (nxd.vision_arguments),
        in the shapes of the graph the call runs; none for a text model."""
        if not self.image_to_text:
            return {}
        positions = np.asarray(args["position_ids"])
        if inputs.phase == CONTEXT_ENCODING:
            example = self._context_examples.get(int(positions.shape[-1]))
        else:
            example = self._decode_example
        if example is None:
            raise ValueError(
                f"a {inputs.phase} call of width {positions.shape[-1]} has no image-to-text "
                f"graph (context widths {sorted(self._context_examples)}); this is a "
                f"plugin bug, please report it with your override_neuron_config."
            )
        hidden = int(text_config(self.hf_config)["hidden_size"])
        return vision_arguments(inputs, positions, example, hidden)

    def _logits(self, output: Any, rows: np.ndarray) -> torch.Tensor:
        """The logits of NxDI output `rows` at their first computed position (the only
        one without speculation), vocabulary padding cut."""
        logits = first_position_logits(self.settings, output)
        return logits[torch.from_numpy(rows), : self.vocab_size].float()

    def _call(
        self,
        args: Mapping[str, np.ndarray],
        phase: str,
        logits: bool,
        sampling: SamplingInputs | None = None,
        answer: np.ndarray | None = None,
        prompt: bool = False,
        images: Mapping[str, torch.Tensor] | None = None,
    ) -> Any:
        """The model call of `phase` (`logits`: a decode runs the logits variant;
        `prompt`: a context encoding runs the prompt-logprob submodel) with
        `sampling_params` of exactly the call's rows: `sampling`'s values at the
        `answer` rows, greedy elsewhere (pads, or no sampling asked). An image-to-text
        application is called through NeuronBaseForImageToText.forward with its
        `images` inputs: the models' own forward computes on the host what the plugin
        already has (positions, encoder runs) and orders its arguments differently."""
        width = int(args["seq_ids"].shape[0])
        if self.adapters is not None:  # the rows' plugin slots as NxDI's adapter_ids
            args = {
                **args,
                "adapter_ids": self.adapters.adapter_ids(args.get("adapter_ids"), width),
            }
        columns = [np.ones(width, dtype=np.float32) for _ in range(3)]  # top_k, top_p, temp
        if sampling is not None:
            for column, values in zip(
                columns, (sampling.top_k, sampling.top_p, sampling.temperature), strict=True
            ):
                column[answer] = values
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items()}
        tensors["sampling_params"] = self.nxdi.prepare_sampling_params(
            width, *(column.tolist() for column in columns)
        )
        with graphs.selected(self.model, phase, logits, prompt), torch.inference_mode():
            if self.image_to_text and self.nxdi.image_to_text_model_base is not None:
                forward = self.nxdi.image_to_text_model_base.NeuronBaseForImageToText.forward
                return forward(
                    self.model,
                    input_ids=tensors.pop("input_ids"),
                    attention_mask=tensors.pop("attention_mask", None),
                    **tensors,
                    **(images or {}),
                )
            return self.model(
                tensors.pop("input_ids"),
                attention_mask=tensors.pop("attention_mask", None),
                **tensors,
            )
