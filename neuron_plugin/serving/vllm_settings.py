"""The one adapter between vLLM's config and the pure settings resolution.

Settings flow one way:
1. `engine_limits` reads vLLM's values as the user left them (nothing rewritten yet);
2. `core.settings.resolve_settings` decides everything (layout, block size and count,
   grids, backend process), and `core.settings.engine_updates` says what vLLM must know;
3. `apply` writes those values into vLLM's config, logging each change once with its
   reason, and stores the settings in `additional_config`: the one channel vLLM carries
   to its engine processes, where the worker reads them back (`settings_from_vllm_config`),
   together with the name of the telemetry rendezvous directory.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

from neuron_plugin import BACKEND_ENV, BACKEND_PYTHON_ENV, plugin_logger
from neuron_plugin.core.checkpoint import safetensors_shapes
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    detect_instance_type,
    host_visible_core_ids,
    lnc,
    package_version,
)
from neuron_plugin.core.memory import (
    DTYPE_BYTES,
    SequenceBudget,
    checkpoint_parameters,
    sequence_budget,
)
from neuron_plugin.core.neuron_settings import FUSED_METHODS, KVTransferLimits
from neuron_plugin.core.prompt_logprobs import PROMPT_LOGPROBS_KEY
from neuron_plugin.core.quantization import Quantization, quantized_weight_bytes
from neuron_plugin.core.recurrent_state import state_geometry
from neuron_plugin.core.sampling import DISABLED_ENV as SAMPLING_DISABLED_ENV
from neuron_plugin.core.sampling import EXACT_SAMPLING_KEY
from neuron_plugin.core.settings import (
    EngineLimits,
    NeuronConfigError,
    NeuronSettings,
    engine_updates,
    resolve_settings,
)
from neuron_plugin.core.vision import (
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    VISION_ARCHITECTURES,
    VisionLimits,
    image_limits,
    image_processor_config,
)
from neuron_plugin.core.vllm_flags import VLLM_FLAGS
from neuron_plugin.core.vllm_neuron_env import NAMES as VLLM_NEURON_ENV
from neuron_plugin.core.vllm_neuron_env import environment_updates

logger = plugin_logger(__name__)

SETTINGS_KEY = "neuron_settings"
OVERRIDE_KEY = "override_neuron_config"
# The spelling of AWS's vLLM user guide (`--additional-config '{"override-neuron-config":
# ...}'`), accepted with a warning.
OVERRIDE_ALIAS = "override-neuron-config"
BUCKET_SET_KEY = "bucket_set"
BACKEND_PYTHON_KEY = "backend_python"
# Where the engines publish telemetry snapshots for the /metrics process: a name only;
# the first engine to publish creates it (serving.telemetry).
TELEMETRY_DIR_KEY = "neuron_telemetry_dir"
# Keys of `additional_config` this platform reads; anything else is a mistake.
ADDITIONAL_CONFIG_KEYS = (
    OVERRIDE_KEY,
    OVERRIDE_ALIAS,
    BACKEND_PYTHON_KEY,
    EXACT_SAMPLING_KEY,
    PROMPT_LOGPROBS_KEY,
    SETTINGS_KEY,
    TELEMETRY_DIR_KEY,
)
NXDI_DISTRIBUTION = "neuronx-distributed-inference"
_MISSING = object()

# The VllmConfig this process last resolved, for `validate_request`, which vLLM calls
# without a config. A weak reference to vLLM's object, not a copy of the settings.
_resolved_config: weakref.ReferenceType | None = None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def engine_limits(vllm_config: Any) -> EngineLimits:
    """vLLM's limits before the platform changes anything (vLLM fills in its default
    block size itself; only a block size the user chose counts)."""
    model, cache, sched = (
        vllm_config.model_config,
        vllm_config.cache_config,
        vllm_config.scheduler_config,
    )
    return EngineLimits(
        max_model_len=model.max_model_len,
        max_num_seqs=sched.max_num_seqs,
        max_num_seqs_is_default=sched.max_num_seqs in vllm_default_max_num_seqs(vllm_config),
        block_size=cache.block_size if cache.user_specified_block_size else None,
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        max_num_batched_tokens=sched.max_num_batched_tokens,
        dtype=_dtype_name(model.dtype),
        tp_degree=vllm_config.parallel_config.tensor_parallel_size,
        dp_degree=vllm_config.parallel_config.data_parallel_size_local,
        num_gpu_blocks_override=cache.num_gpu_blocks_override,
        vllm_flags=vllm_flag_values(vllm_config),
        **speculative_limits(vllm_config.speculative_config, model),
        **lora_limits(vllm_config.lora_config),
        kv_transfer=kv_transfer_limits(vllm_config.kv_transfer_config),
        vision=vision_limits(model),
        max_logprobs=model.max_logprobs,
        logprobs_mode=str(model.logprobs_mode),
        default_sampling=dict(model.get_diff_sampling_param()),
        state=state_geometry(model.hf_config.to_dict()),
    )


def vision_limits(model: Any) -> VisionLimits | None:
    """A vision-language model's image sizes from its processor's settings (the
    checkpoint's processor_config.json `image_processor`, else its
    preprocessor_config.json, read as vLLM reads them, under --mm-processor-kwargs;
    `core.vision.image_processor_config`); None for a text
    model, or a multimodal one served text-only (--language-model-only, or every
    --limit-mm-per-prompt 0: vLLM takes no images). A multimodal architecture whose
    vision tower the plugin does not run is refused here, before anything loads."""
    if not model.is_multimodal_model or not model.supports_multimodal_inputs:
        return None
    architecture = (model.architectures or ["unknown"])[0]
    if architecture not in VISION_ARCHITECTURES:
        raise NeuronConfigError(
            f"{architecture} is a multimodal model whose vision encoder this plugin does "
            f"not run (it runs {', '.join(sorted(VISION_ARCHITECTURES))}); pass "
            f"--language-model-only to serve its text model without images, or serve a "
            f"supported model."
        )
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    saved, source = image_processor_config(
        *(
            get_hf_file_to_dict(name, model.model, model.revision)
            for name in (PROCESSOR_FILE, PREPROCESSOR_FILE)
        )
    )
    kwargs = model.multimodal_config.mm_processor_kwargs or {}
    limits = image_limits(saved, kwargs, model.hf_config.vision_config.to_dict(), source)
    logger.info(
        "neuron platform: images of %d to %d patches (the image processor's settings in %s%s)",
        limits.min_patches,
        limits.max_patches,
        source,
        f", --mm-processor-kwargs {kwargs}" if kwargs else "",
    )
    return limits


def kv_transfer_limits(config: Any) -> KVTransferLimits | None:
    """vLLM's KVTransferConfig, the fields the platform checks (None without one)."""
    if config is None:
        return None
    return KVTransferLimits(
        connector=config.kv_connector,
        module_path=config.kv_connector_module_path,
        role=config.kv_role,
        extra=dict(config.kv_connector_extra_config or {}),
    )


def lora_limits(lora: Any) -> dict[str, Any]:
    """vLLM's LoRAConfig (None without --enable-lora) as EngineLimits fields."""
    if lora is None:
        return {}
    targets = lora.target_modules
    return {
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": lora.max_cpu_loras or lora.max_loras,
        "lora_target_modules": tuple(targets) if targets else None,
        "lora_dtype": _dtype_name(lora.lora_dtype) if lora.lora_dtype else None,
        "fully_sharded_loras": bool(lora.fully_sharded_loras),
    }


def speculative_limits(speculative: Any, model: Any) -> dict[str, Any]:
    """vLLM's resolved --speculative-config (None without one) as EngineLimits fields,
    with the target's shape an EAGLE head must fit."""
    if speculative is None:
        return {}
    text = model.hf_text_config
    return {
        "speculative_method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        # ngram's draft "model" is the target itself; only a drafter checkpoint has one.
        "draft_model": speculative.model if speculative.method in FUSED_METHODS else None,
        "target_shape": (text.hidden_size, text.vocab_size, text.num_hidden_layers),
    }


def vllm_default_max_num_seqs(vllm_config: Any) -> set[int]:
    """The values vLLM itself gives max_num_seqs when the user does not (for `vllm
    serve`, `LLM` and other entry points), from its own table."""
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    parallel = vllm_config.parallel_config
    world_size = parallel.pipeline_parallel_size * parallel.tensor_parallel_size
    return {
        SchedulerConfig.DEFAULT_MAX_NUM_SEQS,
        *EngineArgs.get_batch_defaults(world_size)[1].values(),
    }


def device_budget(vllm_config: Any) -> SequenceBudget | None:
    """The HBM an engine of this instance has for KV cache; None off a Neuron instance
    or when the checkpoint's size is unknown."""
    instance = detect_instance_type()
    model = vllm_config.model_config
    if instance is None or not Path(model.model).is_dir():
        return None
    dtype = _dtype_name(model.dtype)
    quantization = Quantization.from_override(override_neuron_config(vllm_config))
    weight_bytes = None
    if quantization is not None:
        weight_bytes = quantized_weight_bytes(
            safetensors_shapes(model.model), quantization, DTYPE_BYTES[dtype]
        )[1]
    return sequence_budget(
        model.hf_config.to_dict(),
        checkpoint_parameters(model.model),
        dtype,
        vllm_config.parallel_config.tensor_parallel_size,
        INSTANCE_TYPES[instance].memory_per_core(lnc()),
        instance,
        weight_bytes,
    )


def vllm_flag_values(vllm_config: Any) -> dict[str, Any]:
    """The value vLLM holds for each flag of `core.vllm_flags.VLLM_FLAGS` (a flag this
    vLLM does not have is left out); an attention backend vLLM's own model hook chose is
    no flag of the user's (`_hook_chose_attention_backend`)."""
    values = {}
    for flag in VLLM_FLAGS:
        value = functools.reduce(
            lambda obj, name: getattr(obj, name, _MISSING), flag.path.split("."), vllm_config
        )
        if value is not _MISSING:
            values[flag.flag] = value
    if values.get("--attention-backend") is not None and _hook_chose_attention_backend(vllm_config):
        values["--attention-backend"] = None
    return values


def _hook_chose_attention_backend(vllm_config: Any) -> bool:
    """Whether vLLM's Gemma 4 config hook chose the attention backend vLLM holds
    (model_executor/models/config.py Gemma4Config.verify_and_update_config forces
    TRITON_ATTN for layers of unequal head sizes when no backend is set and FA4 is
    unavailable; it touches nothing but attention_config): the hook run again from an
    unset backend. An explicit --attention-backend of the same value cannot be told
    apart; either does nothing on Neuron (attention runs in the compiled graphs), so the
    choice is logged and not refused."""
    from vllm.model_executor.models import config as model_hooks

    architecture = getattr(vllm_config.model_config, "architecture", "")
    hook = model_hooks.MODELS_CONFIG_MAP.get(architecture)
    if hook is None or hook.__name__ != "Gemma4Config":
        return False
    attention = vllm_config.attention_config
    chosen, version = attention.backend, attention.flash_attn_version
    attention.backend = None
    try:
        hook.verify_and_update_config(vllm_config)
        ours = attention.backend == chosen
    finally:
        attention.backend, attention.flash_attn_version = chosen, version
    if ours:
        logger.info(
            "attention backend %s is vLLM's choice for %s (its config hook); attention runs "
            "in the compiled Neuron graphs, so it is not used",
            getattr(chosen, "name", chosen),
            architecture,
        )
    return ours


def vllm_neuron_environment() -> dict[str, str]:
    """The vllm-neuron variables set in this process (`core.vllm_neuron_env`)."""
    return {name: os.environ[name] for name in VLLM_NEURON_ENV if name in os.environ}


def with_bucket_set(override: dict[str, Any]) -> dict[str, Any]:
    """Expand `bucket_set: FILE` (a `neuron-buckets tune -o` or configs/buckets/ file)
    into its bucket keys. A key given both inline and in the file is a contradiction."""
    if BUCKET_SET_KEY not in override:
        return override
    from bucketing.files import load_bucket_set

    path = override[BUCKET_SET_KEY]
    loaded = load_bucket_set(path)
    both = sorted(set(loaded) & set(override))
    if both:
        raise NeuronConfigError(
            f"override_neuron_config sets {', '.join(both)} both inline and in "
            f"{BUCKET_SET_KEY}={path}; keep one of them."
        )
    merged = {k: v for k, v in override.items() if k != BUCKET_SET_KEY}
    merged.update(loaded)
    return merged


def additional_config(vllm_config: Any) -> dict[str, Any]:
    """`additional_config`, with unknown keys refused (a typo would otherwise be
    silently ignored)."""
    additional = vllm_config.additional_config or {}
    unknown = sorted(set(additional) - set(ADDITIONAL_CONFIG_KEYS))
    if unknown:
        raise NeuronConfigError(
            f"--additional-config has unknown key(s) {', '.join(map(repr, unknown))}; the "
            f"Neuron platform reads {OVERRIDE_KEY!r} (NxDI settings), "
            f"{BACKEND_PYTHON_KEY!r} (the backend's interpreter) and "
            f"{EXACT_SAMPLING_KEY!r} (true: sample requests without top_k on the host), "
            f"{PROMPT_LOGPROBS_KEY!r} (true: serve prompt_logprobs and echo with logprobs): "
            f"fix or remove them."
        )
    return additional


def override_neuron_config(vllm_config: Any) -> dict[str, Any]:
    """`additional_config.override_neuron_config` (or its hyphenated spelling), with a
    `bucket_set` file expanded."""
    additional = additional_config(vllm_config)
    if OVERRIDE_ALIAS in additional:
        if OVERRIDE_KEY in additional:
            raise NeuronConfigError(
                f"--additional-config has both {OVERRIDE_KEY!r} and {OVERRIDE_ALIAS!r}; "
                f"keep one ({OVERRIDE_KEY!r})."
            )
        logger.warning(
            "neuron platform: --additional-config key %r read as %r; write %r "
            "(the spelling vLLM plugins read).",
            OVERRIDE_ALIAS,
            OVERRIDE_KEY,
            OVERRIDE_KEY,
        )
    override = additional.get(OVERRIDE_KEY, additional.get(OVERRIDE_ALIAS)) or {}
    if not isinstance(override, dict):
        raise NeuronConfigError(
            f"additional_config.{OVERRIDE_KEY} must be a JSON object, got "
            f"{type(override).__name__}; pass e.g. --additional-config "
            f'\'{{"{OVERRIDE_KEY}": {{"enable_bucketing": true}}}}\'.'
        )
    return with_bucket_set(override)


def backend_python(vllm_config: Any) -> str | None:
    """The interpreter to run the backend in: `additional_config.backend_python`, else
    `VLLM_NEURON_BACKEND_PYTHON`, else None (in-process). Checked here so a wrong path
    fails before the engine starts."""
    given = additional_config(vllm_config).get(BACKEND_PYTHON_KEY)
    source = f"additional_config.{BACKEND_PYTHON_KEY}"
    if not given:
        given, source = os.environ.get(BACKEND_PYTHON_ENV, "").strip(), BACKEND_PYTHON_ENV
    if not given:
        return None
    if not (os.path.isfile(given) and os.access(given, os.X_OK)):
        raise NeuronConfigError(
            f"{source}={given!r} is not an executable file; point it at the Python of "
            f"the environment that has the backend installed (e.g. the Neuron SDK venv's "
            f"bin/python with `pip install 'vllm-neuron-plugin[backend]'`), or unset it "
            f"to run the backend inside vLLM's process."
        )
    return given


@functools.cache
def runner_package_version(python: str, distribution: str) -> str | None:
    """The version of `distribution` in the environment of the interpreter `python` (a
    backend runner's), None where it is not installed or cannot be asked. Reads package
    metadata only: a fraction of a second."""
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    try:
        done = subprocess.run(
            [python, "-c", code, distribution],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def selected_backend() -> str:
    """The backend `register()` chose when it activated the platform."""
    return os.environ.get(BACKEND_ENV, "nxd")


def resolve_from_vllm_config(vllm_config: Any, backend: str | None = None) -> NeuronSettings:
    architecture = (vllm_config.model_config.architectures or ["unknown"])[0]
    python = backend_python(vllm_config)
    cores, cores_source = host_visible_core_ids()
    backend = backend or selected_backend()
    return resolve_settings(
        engine_limits(vllm_config),
        override_neuron_config(vllm_config),
        backend=backend,
        architecture=architecture,
        backend_python=python,
        on_device_sampling_disabled=os.environ.get(SAMPLING_DISABLED_ENV),
        exact_sampling=additional_config(vllm_config).get(EXACT_SAMPLING_KEY),
        prompt_logprobs=additional_config(vllm_config).get(PROMPT_LOGPROBS_KEY),
        environ=vllm_neuron_environment(),
        # A runner's NxDI lives in its own environment: asked of its interpreter.
        nxdi_version=(
            runner_package_version(python, NXDI_DISTRIBUTION)
            if python and backend == "nxd"
            else package_version(NXDI_DISTRIBUTION)
        ),
        visible_cores=cores,
        cores_source=cores_source,
        budget=device_budget(vllm_config),
    )


def apply(settings: NeuronSettings, vllm_config: Any) -> None:
    """Write what vLLM must know of `settings` into its config (each change logged once
    with its reason) and store the settings for the engine processes."""
    for update in engine_updates(settings):
        target = getattr(vllm_config, update.section)
        old = getattr(target, update.name)
        if old != update.value:
            setattr(target, update.name, update.value)
            logger.info(
                "neuron platform: %s %r -> %r (%s)", update.name, old, update.value, update.reason
            )
    for name, value, reason in environment_updates(vllm_neuron_environment()):
        if os.environ.get(name) != value:
            os.environ[name] = value
            logger.info("neuron platform: %s=%s (%s)", name, value, reason)
    if settings.vision_buckets:
        host_normalized_pixels(vllm_config.model_config.multimodal_config)
        images_only(vllm_config.model_config.multimodal_config)
    scheduler = vllm_config.scheduler_config
    if settings.max_loras and scheduler.scheduler_cls is None:
        from neuron_plugin.serving.request_errors import scheduler_class

        # a step that cannot write a request's adapter ends that request, not the engine
        scheduler.scheduler_cls = scheduler_class(bool(scheduler.async_scheduling))
        logger.info(
            "neuron platform: scheduler_cls -> %s (vLLM's scheduler; a request whose LoRA "
            "adapter a step cannot write ends with an error, the engine serving on)",
            scheduler.scheduler_cls,
        )
    if vllm_config.additional_config is None:
        vllm_config.additional_config = {}
    if OVERRIDE_ALIAS in vllm_config.additional_config:  # read (and warned about) once
        vllm_config.additional_config[OVERRIDE_KEY] = vllm_config.additional_config.pop(
            OVERRIDE_ALIAS
        )
    vllm_config.additional_config[SETTINGS_KEY] = settings.to_dict()
    vllm_config.additional_config.setdefault(
        TELEMETRY_DIR_KEY,
        os.path.join(tempfile.gettempdir(), f"vllm-neuron-telemetry-{uuid.uuid4().hex}"),
    )
    global _resolved_config
    _resolved_config = weakref.ref(vllm_config)


def host_normalized_pixels(multimodal: Any) -> None:
    """The processor rescales and normalizes the pixels (vLLM 0.33 otherwise hands a
    model that supports it raw uint8 pixels to normalize on its device,
    `mm_device_do_normalize`): the vision graphs take the processor's output as
    transformers computes it."""
    if getattr(multimodal, "mm_device_do_normalize", False):
        multimodal.mm_device_do_normalize = False
        logger.info(
            "neuron platform: mm_device_do_normalize True -> False (the vision encoder's "
            "graphs take the pixels the processor normalized)"
        )


def images_only(multimodal: Any) -> None:
    """The vision graphs encode images, not videos: vLLM refuses a video item with a
    400 before processing it (its limit per prompt 0: "At most 0 video(s) may be
    provided in one prompt") instead of serving its placeholders without embeddings. A
    video limit the user asked for is an error."""
    from vllm.config.multimodal import VideoDummyOptions

    video = multimodal.limit_per_prompt.get("video")
    if video is not None and video.count > 0:
        raise NeuronConfigError(
            f"--limit-mm-per-prompt video={video.count}: the neuron platform runs this "
            f"model's vision encoder on images only (video is not supported); set video "
            f"to 0 or leave it out of --limit-mm-per-prompt."
        )
    if video is None:
        multimodal.limit_per_prompt["video"] = VideoDummyOptions(
            count=0, num_frames=None, width=None, height=None
        )
        logger.info(
            "neuron platform: limit_mm_per_prompt video -> 0 (the vision encoder's graphs "
            "take images only)"
        )


def settings_from_vllm_config(vllm_config: Any) -> NeuronSettings:
    stored = (vllm_config.additional_config or {}).get(SETTINGS_KEY)
    if stored is None:
        raise RuntimeError(
            "the Neuron platform did not resolve its settings for this VllmConfig; the "
            "neuron_plugin worker must run under the Neuron platform (check that "
            "'Platform plugin neuron is activated' appears in the log)."
        )
    return NeuronSettings.from_dict(stored)


def resolved_settings() -> NeuronSettings | None:
    """The settings of the VllmConfig this process resolved last (None if none is
    alive), read from its `additional_config`."""
    config = _resolved_config() if _resolved_config is not None else None
    return settings_from_vllm_config(config) if config is not None else None


def resolved_kv_transfer_config() -> Any:
    """vLLM's KVTransferConfig of the VllmConfig this process resolved last (None without
    one, or if none is alive)."""
    config = _resolved_config() if _resolved_config is not None else None
    return None if config is None else config.kv_transfer_config
