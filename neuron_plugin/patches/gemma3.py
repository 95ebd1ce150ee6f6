"""Patches `gemma3-config`, `gemma3-rope`, `gemma3-window`, `gemma3-norms`,
`gemma3-scale` and `gemma3-cpu-norm`: NxDI's Gemma3 (models/gemma3/modeling_gemma3.py)
computing what transformers' Gemma3ForCausalLM computes. NxDI 0.9 (ef2731e) lists the
module in MODEL_TYPES; 0.8 (cd3abf3) ships an earlier one without listing it, which the
architecture table names (`models.table`). Each probe runs the installed release's code:
0.9 has the first four defects, 0.8 the first three (its norms are float32) and the last
two. Measured with NxDI 0.9's CPU mode on a tiny Gemma3: logits off by 4.46 at 20 tokens
in the shape NxDI expects, a checkpoint of another vocabulary (Gemma-3-1B has 262,144)
failing to load; with the patches, transformers' greedy tokens on 0.8 and 0.9
(tests/e2e/test_nxdi_architectures.py). Line numbers below are 0.9's unless 0.8 is named.

- gemma3-config: `Gemma3InferenceConfig.__init__` replaces the checkpoint's values by
  fixed ones after loading them (lines 129-137: vocab_size 262208, both RoPE bases, a
  linear RoPE factor of 8, max_position_embeddings, pad_token_id, rms_norm_eps,
  hidden_act), and `get_updated_configs` makes every sixth layer global (line 85)
  whatever the checkpoint's `layer_types`. Fixed: the checkpoint's values are put back
  (transformers' `rope_theta` is the global base, `rope_local_base_freq` the local one,
  `rope_scaling` the global layers' linear factor or none), and the layers follow
  `layer_types` (or transformers' `sliding_window_pattern` rule where it is absent).
- gemma3-rope: `NeuronGemma3DecoderLayer.forward` returns its attention's cos/sin (line
  271), `NeuronBaseModel.get_model_output` hands them to the next layer (model_base.py
  ~1394), and `NeuronAttentionBase.apply_rotary_embedding` computes RoPE only when none
  is given (attention_base.py ~476): every layer used layer 0's (a local base). Fixed:
  each layer computes its own.
- gemma3-window: `NeuronGemma3TextModel.setup_attr_for_model` never sets the model's
  `sliding_window` (lines 278-285), so `NeuronBaseModel.forward` builds no local mask
  (model_base.py ~794), and the local layers' attention, built with a window, takes
  `windowed_attention_forward` (attention_base.py ~1635), which keeps the last window - 1
  keys of a prefill for a cache that is full length. Fixed the way the reference backend
  does it: local layers attend over the full-length cache (NxDI's standard attention, in
  both KV layouts) through masks that hide keys `window` or more positions back
  (transformers' `sliding_window_overlay`), built per layer from the call's masks and
  positions; their prefill takes no flash-attention kernel, which would not read the
  mask (`get_flash_attention_strategy` NONE).
- gemma3-norms: `NeuronGemma3RMSNorm` declares its weight bfloat16 (line 49) and
  `convert_hf_to_neuron_state_dict` adds Gemma's 1 to norm weights in the checkpoint's
  dtype (lines 374-398), so 1 + w is rounded to bfloat16 where transformers computes
  `1.0 + weight.float()` in float32. Fixed: float32 weights, 1 added in float32. (0.8
  declares them float32 and adds 1 in the norm's forward, 0.8 lines 44-58: not needed.)
- gemma3-scale (0.8): `NeuronGemma3Attention` hands `NeuronAttentionBase` no score scale
  (0.8 lines 172-186: "TODO: Enable this" for `query_pre_attn_scalar`), and 0.8's
  attention divides every score by `math.sqrt(self.head_dim)` (attention_base.py lines
  533, 649, 788, 954, 1062-1066, ...), where transformers scales by
  `query_pre_attn_scalar ** -0.5` (Gemma-3-27B: head_dim 128, query_pre_attn_scalar 168).
  Fixed: the query, after its norm, is multiplied by sqrt(head_dim /
  query_pre_attn_scalar), so every attention path (and the plugin's prefix-prefill-mask
  replacement, which divides as the release does) computes transformers' scores. 0.9
  passes `softmax_scale=query_pre_attn_scalar ** 0.5` (lines 174-186): not needed.
- gemma3-cpu-norm (0.8, NxDI's CPU mode only): `get_rmsnorm_cls` returns transformers'
  `Gemma3RMSNorm` when `cpu_mode()` (0.8 lines 61-65), whose constructor takes `dim`,
  while the attention builds its q/k norms with `hidden_size=` (0.8 lines 188-189): every
  Gemma3 fails to build on the CPU (TypeError). Fixed: the CPU mode builds NxDI's own
  `NeuronGemma3RMSNorm` (plain torch, the same math), as a device does; no compiled graph
  changes (`traced=False`). 0.9 returns it on the CPU too (lines 62-66): not needed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Mapping
from types import ModuleType, SimpleNamespace
from typing import Any

from neuron_plugin.patches.base import NxDIModules, Patch, replace_method, unpatched

NAME_CONFIG, NAME_ROPE, NAME_WINDOW, NAME_NORMS, NAME_SCALE, NAME_CPU_NORM = (
    "gemma3-config",
    "gemma3-rope",
    "gemma3-window",
    "gemma3-norms",
    "gemma3-scale",
    "gemma3-cpu-norm",
)
SLIDING, FULL = "sliding_attention", "full_attention"
LOCAL_WINDOW = "_neuron_plugin_local_window"  # a local layer's window (patch gemma3-window)
Q_SCALE = "_neuron_plugin_q_scale"  # the query norm's output factor (patch gemma3-scale)


def _gemma3(modules: NxDIModules) -> ModuleType:
    """NxDI's Gemma3 module, which a probe found defective before its patch applies."""
    if modules.gemma3 is None:
        raise RuntimeError("a gemma3 patch applied without NxDI's Gemma3 module: a plugin bug")
    return modules.gemma3


# -- gemma3-config ---------------------------------------------------------------------
def checkpoint_values(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma3InferenceConfig attributes NxDI fixes, as the checkpoint's config (as
    NxDI's load_config read it, the text config's where nested) gives them. RoPE as
    transformers 4.x reads it (`rope_theta` global, `rope_local_base_freq` local,
    `rope_scaling` global) or 5.x (`rope_parameters` per layer type); NxDI's
    `rope_scaling` is the global layers' linear factor (None: unscaled)."""
    nested = loaded.get("text_config")
    text = vars(nested) if nested is not None else loaded
    renamed = {
        "vocab_size": "vocab_size",
        "max_position_embeddings": "max_position_embeddings",
        "pad_token_id": "pad_token_id",
        "rms_norm_eps": "rms_norm_eps",
        "hidden_act": "hidden_activation",
        "global_rope_theta": "rope_theta",
        "local_rope_theta": "rope_local_base_freq",
    }
    values = {ours: text[theirs] for ours, theirs in renamed.items() if theirs in text}
    scaling = text.get("rope_scaling")
    per_type = text.get("rope_parameters") or {}
    if isinstance(per_type.get(SLIDING), dict) and isinstance(per_type.get(FULL), dict):
        values["local_rope_theta"] = per_type[SLIDING]["rope_theta"]
        values["global_rope_theta"] = per_type[FULL]["rope_theta"]
        scaling = per_type[FULL] if per_type[FULL].get("rope_type") == "linear" else None
    values["rope_scaling"] = scaling.get("factor") if scaling else None
    return values


def layer_kinds(config: Any) -> list[str]:
    """Each layer's attention kind as transformers' Gemma3TextConfig decides it:
    `layer_types`, else every `sliding_window_pattern`-th layer (default 6) global."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)[: config.num_hidden_layers]
    pattern = getattr(config, "sliding_window_pattern", 6) or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def layer_configs(config: Any) -> list[Any]:
    """One config per layer, without a window for the global layers (what NxDI's
    get_updated_configs returns, with the checkpoint's layer kinds)."""
    configs = []
    for kind in layer_kinds(config):
        layer = copy.deepcopy(config)
        if kind != SLIDING:
            layer.sliding_window = None
        configs.append(layer)
    return configs


_PROBE_VALUES = {
    "head_dim": 2,
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 2,
    "sliding_window": 4,
    "vocab_size": 5,
    "rope_theta": 7.0,
    "layer_types": [FULL, SLIDING],
}


def probe_config(modules: NxDIModules) -> str | None:
    """Build NxDI's Gemma3 config from a stand-in checkpoint (vocabulary 5, RoPE base 7,
    first layer global) and split it into layers: both must keep the checkpoint's."""
    module = modules.gemma3
    if module is None:
        return None
    cls = module.Gemma3InferenceConfig
    config = cls.__new__(cls)
    unpatched(cls.__init__)(
        config,
        SimpleNamespace(windowed_context_encoding_size=None, seq_len=8),
        load_config=lambda c: c.__dict__.update(copy.deepcopy(_PROBE_VALUES)),
    )
    found = []
    if (config.vocab_size, config.global_rope_theta) != (5, 7.0):
        found.append(
            f"Gemma3InferenceConfig replaces the checkpoint's vocab_size 5 and rope_theta "
            f"7.0 by {config.vocab_size} and {config.global_rope_theta}"
        )
    windows = [c.sliding_window for c in unpatched(module.get_updated_configs)(config)]
    if windows != [None, 4]:
        found.append(
            f"get_updated_configs gives layer_types {_PROBE_VALUES['layer_types']} the "
            f"windows {windows}"
        )
    return "; ".join(found) or None


def apply_config(modules: NxDIModules) -> bool:
    module = _gemma3(modules)

    def make_init(original: Callable) -> Callable:
        def __init__(self, neuron_config, fused_spec_config=None, load_config=None):
            loaded: dict[str, Any] = {}

            def load_and_keep(config: Any) -> None:
                if load_config is not None:
                    load_config(config)
                else:
                    config.load_config()
                loaded.update(vars(config))

            original(self, neuron_config, fused_spec_config, load_and_keep)
            for key, value in checkpoint_values(loaded).items():
                setattr(self, key, value)

        return __init__

    changed = replace_method(module.Gemma3InferenceConfig, "__init__", NAME_CONFIG, make_init)
    layers = replace_method(
        module, "get_updated_configs", NAME_CONFIG, lambda original: lambda c: layer_configs(c)
    )
    return changed or layers


# -- gemma3-rope -----------------------------------------------------------------------
class _Recorder:
    """A stand-in attention that records its keyword arguments and returns RoPE tables."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def __call__(self, hidden_states: Any, **kwargs: Any) -> tuple[Any, ...]:
        self.kwargs = kwargs
        return hidden_states, None, "cos", "sin"


def _stand_in_layer(window: int | None) -> SimpleNamespace:
    def same(x: Any) -> Any:
        return x

    return SimpleNamespace(
        is_sliding_window_attention=window is not None,
        layer_idx=1,
        hidden_size=4,
        query_pre_attn_scalar=2,
        self_attn=_Recorder(),
        mlp=lambda x: (x,),
        input_layernorm=same,
        post_attention_layernorm=same,
        pre_feedforward_layernorm=same,
        post_feedforward_layernorm=same,
    )


def probe_rope(modules: NxDIModules) -> str | None:
    """Run NxDI's decoder layer on a stand-in with the previous layer's cos/sin: its
    attention must not be handed them."""
    import torch

    module = modules.gemma3
    if module is None:
        return None
    layer = _stand_in_layer(None)
    outputs = unpatched(module.NeuronGemma3DecoderLayer.forward)(
        layer, torch.zeros(1, 1, 4), cos_cache="previous", sin_cache="previous"
    )
    if layer.self_attn.kwargs.get("cos_cache") != "previous" or outputs[2] is None:
        return None
    return (
        "NeuronGemma3DecoderLayer hands its RoPE tables to the next layer, which uses them: "
        "global layers rotate with the local layers' base"
    )


def apply_rope(modules: NxDIModules) -> bool:
    module = _gemma3(modules)

    def make(original: Callable) -> Callable:
        def forward(self, *args, **kwargs):
            kwargs.update(cos_cache=None, sin_cache=None)
            outputs = original(self, *args, **kwargs)
            return (outputs[0], outputs[1], None, None, *outputs[4:])

        return forward

    return replace_method(module.NeuronGemma3DecoderLayer, "forward", NAME_ROPE, make)


# -- gemma3-window ---------------------------------------------------------------------
def window_masks(
    attention_mask: Any, active_mask: Any, position_ids: Any, window: int
) -> tuple[Any, Any]:
    """A local layer's (attention mask, active mask): NxDI's, without the keys `window`
    or more positions before each query. Cached keys sit at their position (a contiguous
    cache line, or a block table read in order); a prefill over a cached prefix has a
    [batch, prefix] mask of its cached keys and an active mask over its own tokens, whose
    positions are `position_ids`."""
    import torch

    queries = position_ids.long()[:, None, :, None]
    prior = attention_mask.bool()
    if prior.dim() == 2:
        prior = prior[:, None, None, :]
    cached = torch.arange(prior.shape[-1], device=prior.device)
    prior = prior & (queries - cached < window)
    if active_mask is None or position_ids.shape[-1] == 1:
        return prior, active_mask
    active = active_mask.bool() & (queries - position_ids.long()[:, None, None, :] < window)
    return prior, active


def probe_window(modules: NxDIModules) -> str | None:
    """Set a stand-in model's attributes with NxDI's Gemma3 model code for a windowed
    checkpoint: it must give the model its window."""
    module = modules.gemma3
    if module is None:
        return None
    model = SimpleNamespace()
    neuron_config = SimpleNamespace(
        on_device_sampling_config=None, tp_degree=1, max_batch_size=1, buckets=[8]
    )
    config = SimpleNamespace(
        neuron_config=neuron_config,
        hidden_size=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
    )
    unpatched(module.NeuronGemma3TextModel.setup_attr_for_model)(model, config)
    if getattr(model, "sliding_window", None) is not None:
        return None
    return (
        "NeuronGemma3TextModel leaves the model's sliding_window unset: no local mask, the "
        "local layers attend every position"
    )


def apply_window(modules: NxDIModules) -> bool:
    module = _gemma3(modules)

    def make_init(original: Callable) -> Callable:
        def __init__(self, config, layer_idx):
            original(self, config, layer_idx)
            window = config.sliding_window
            setattr(self, LOCAL_WINDOW, window)
            if window is not None:  # NxDI's standard attention over the full cache
                attention = self.self_attn
                attention.sliding_window = None
                attention.k_cache_transposed = bool(
                    getattr(config.neuron_config, "k_cache_transposed", False)
                )
                attention.attn_kernel_enabled = False

        return __init__

    def make_forward(original: Callable) -> Callable:
        def forward(
            self,
            hidden_states,
            attention_mask=None,
            local_mask=None,
            position_ids=None,
            past_key_value=None,
            adapter_ids=None,
            **kwargs,
        ):
            window = getattr(self, LOCAL_WINDOW, None)
            if window is not None and attention_mask is not None and position_ids is not None:
                attention_mask, active = window_masks(
                    attention_mask, kwargs.get("active_mask"), position_ids, window
                )
                if active is not None:
                    kwargs["active_mask"] = active
                local_mask = None
            return original(
                self,
                hidden_states,
                attention_mask,
                local_mask,
                position_ids,
                past_key_value,
                adapter_ids,
                **kwargs,
            )

        return forward

    layer = module.NeuronGemma3DecoderLayer
    changed = replace_method(layer, "__init__", NAME_WINDOW, make_init)
    return replace_method(layer, "forward", NAME_WINDOW, make_forward) or changed


# -- gemma3-norms ----------------------------------------------------------------------
def probe_norms(modules: NxDIModules) -> str | None:
    import torch

    module = modules.gemma3
    if module is None:
        return None
    norm = module.NeuronGemma3RMSNorm.__new__(module.NeuronGemma3RMSNorm)
    unpatched(module.NeuronGemma3RMSNorm.__init__)(norm, 2)
    if norm.weight.dtype == torch.float32:
        return None
    return f"NeuronGemma3RMSNorm declares its weight {norm.weight.dtype}: 1 + w is rounded"


def float32_norms(state_dict: dict[str, Any]) -> None:
    """Norm weights in float32 before NxDI adds Gemma's 1 to them."""
    for name in [n for n in state_dict if n.endswith("norm.weight")]:
        state_dict[name] = state_dict[name].float()


def apply_norms(modules: NxDIModules) -> bool:
    module = _gemma3(modules)

    def make_init(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.weight.data = self.weight.data.float()

        return __init__

    def make_convert(original: Callable) -> Callable:
        # NxDI calls it on the class (application_base.py get_state_dict), so a plain
        # function in place of the staticmethod receives the same arguments.
        def convert_hf_to_neuron_state_dict(state_dict, config):
            float32_norms(state_dict)
            return original(state_dict, config)

        return convert_hf_to_neuron_state_dict

    changed = replace_method(module.NeuronGemma3RMSNorm, "__init__", NAME_NORMS, make_init)
    converted = replace_method(
        module.NeuronGemma3ForCausalLM, "convert_hf_to_neuron_state_dict", NAME_NORMS, make_convert
    )
    return changed or converted


# -- gemma3-scale ----------------------------------------------------------------------
class _Recorded(Exception):
    """Stops a stand-in attention's construction once its base was called."""


def attention_base_kwargs(module: ModuleType, config: Any) -> dict[str, Any]:
    """The keywords NxDI's `NeuronGemma3Attention.__init__` hands `NeuronAttentionBase`
    for `config`: run on a stand-in whose next class in line records them and stops
    (nothing of NxDI's attention is built)."""
    recorded: dict[str, Any] = {}
    base: Any = module.NeuronAttentionBase
    attention: Any = module.NeuronGemma3Attention

    class Recorder(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            recorded.update(kwargs)
            raise _Recorded

    class StandIn(attention, Recorder):
        pass

    with contextlib.suppress(_Recorded):
        unpatched(attention.__init__)(StandIn.__new__(StandIn), config)
    return recorded


_SCALE_PROBE = {"head_dim": 2, "query_pre_attn_scalar": 8}


def probe_scale(modules: NxDIModules) -> str | None:
    """Build NxDI's Gemma3 attention for a stand-in config whose query_pre_attn_scalar
    (8) is not head_dim (2): its base must be given the score scale sqrt(8)."""
    module = modules.gemma3
    if module is None:
        return None
    config = SimpleNamespace(
        **_SCALE_PROBE,
        hidden_size=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
        local_rope_theta=10.0,
        global_rope_theta=10.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        sliding_window=None,
        neuron_config=SimpleNamespace(),
    )
    scale = attention_base_kwargs(module, config).get("softmax_scale")
    if scale is not None:
        return None
    return (
        f"NeuronGemma3Attention gives NeuronAttentionBase no softmax_scale: scores are "
        f"divided by sqrt(head_dim={_SCALE_PROBE['head_dim']}), not by "
        f"sqrt(query_pre_attn_scalar={_SCALE_PROBE['query_pre_attn_scalar']})"
    )


def query_scale(head_dim: int, query_pre_attn_scalar: float) -> float:
    """The factor on the query that turns scores / sqrt(head_dim) into transformers'
    scores / sqrt(query_pre_attn_scalar)."""
    return math.sqrt(head_dim / query_pre_attn_scalar)


def _scale_output(norm: Any, inputs: Any, output: Any) -> Any:
    return output * getattr(norm, Q_SCALE)


def apply_scale(modules: NxDIModules) -> bool:
    module = _gemma3(modules)

    def make_init(original: Callable) -> Callable:
        def __init__(self, config, *args, **kwargs):
            original(self, config, *args, **kwargs)
            factor = query_scale(self.head_dim, config.query_pre_attn_scalar)
            if factor != 1.0:  # the query after its norm (before RoPE: both are linear)
                setattr(self.q_layernorm, Q_SCALE, factor)
                self.q_layernorm.register_forward_hook(_scale_output)

        return __init__

    return replace_method(module.NeuronGemma3Attention, "__init__", NAME_SCALE, make_init)


# -- gemma3-cpu-norm -------------------------------------------------------------------
def probe_cpu_norm(modules: NxDIModules) -> str | None:
    """The norm class NxDI's Gemma3 builds in this process (NxDI's CPU mode or not) must
    take the `hidden_size=` keyword its attention passes."""
    module = modules.gemma3
    if module is None:
        return None
    cls = unpatched(module.get_rmsnorm_cls)()
    try:
        inspect.signature(cls).bind(hidden_size=2, eps=1e-6)
    except TypeError:
        return (
            f"get_rmsnorm_cls gives {cls.__module__}.{cls.__qualname__}, which takes no "
            f"hidden_size: NeuronGemma3Attention cannot build its q/k norms"
        )
    return None


def apply_cpu_norm(modules: NxDIModules) -> bool:
    module = _gemma3(modules)

    def make(original: Callable) -> Callable:
        def get_rmsnorm_cls(*args, **kwargs):
            return module.NeuronGemma3RMSNorm

        return get_rmsnorm_cls

    return replace_method(module, "get_rmsnorm_cls", NAME_CPU_NORM, make)


GEMMA3 = frozenset({"Gemma3ForCausalLM"})
PATCHES = (
    Patch(
        NAME_CONFIG,
        "Gemma3's config hard-coded (vocabulary, RoPE, layer pattern)",
        probe_config,
        apply_config,
        GEMMA3,
    ),
    Patch(NAME_ROPE, "Gemma3's global layers reuse the local RoPE", probe_rope, apply_rope, GEMMA3),
    Patch(
        NAME_WINDOW,
        "Gemma3's local layers attend every position",
        probe_window,
        apply_window,
        GEMMA3,
    ),
    Patch(
        NAME_NORMS, "Gemma3's norm weights rounded to bfloat16", probe_norms, apply_norms, GEMMA3
    ),
    Patch(
        NAME_SCALE,
        "Gemma3's scores scaled by head_dim, not query_pre_attn_scalar",
        probe_scale,
        apply_scale,
        GEMMA3,
    ),
    Patch(
        NAME_CPU_NORM,
        "Gemma3's CPU-mode norms cannot be built",
        probe_cpu_norm,
        apply_cpu_norm,
        GEMMA3,
        traced=False,
    ),
)
