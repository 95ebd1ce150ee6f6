"""config.json as the plugin's own NxDI classes read it (families/gemma4,
families/qwen3_5): the SDK's transformers 4.57 knows neither architecture, so the class
hands NxDI a `load_config` hook of its own instead of transformers' AutoConfig."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronx_distributed_inference.models.config import InferenceConfig, to_torch_dtype

from neuron_plugin.core.checkpoint import text_config

# config.json keys not copied onto the InferenceConfig (the towers of a multimodal
# checkpoint; dtype goes to the NeuronConfig as NxDI's own loader does)
_NOT_COPIED = ("text_config", "vision_config", "audio_config", "dtype", "torch_dtype")
# what transformers' PretrainedConfig adds to every config, which NxDI's forward reads
# (model_base.py NeuronBaseForCausalLM._setup_func_config)
_PRETRAINED_DEFAULTS = {
    "output_attentions": False,
    "output_hidden_states": False,
    "return_dict": True,
}


def json_config_loader(
    model_path: str | os.PathLike[str],
    check: Callable[[Mapping[str, Any]], object],
    keep_as: str,
) -> Callable[[InferenceConfig], None]:
    """The `load_config` hook NxDI's InferenceConfig calls (as its
    utils/hf_adapter.load_pretrained_config's), reading config.json itself: `check`
    raises, by name, for a config the class cannot serve; the text model's keys (a
    multimodal checkpoint's `text_config` over its outer keys) become attributes and the
    attribute `keep_as`; the checkpoint's dtype the NeuronConfig's unless it sets its
    own."""

    def load_config(self: InferenceConfig) -> None:
        raw = json.loads((Path(model_path) / "config.json").read_text())
        text = text_config(raw)
        check(raw)
        dtype = raw.get("dtype", raw.get("torch_dtype", text.get("dtype")))
        neuron_config = self.neuron_config
        if (
            dtype is not None
            and neuron_config is not None
            and not neuron_config.overrides_torch_dtype
        ):
            neuron_config.torch_dtype = to_torch_dtype(dtype) if isinstance(dtype, str) else dtype
        attributes = {k: v for k, v in text.items() if k not in _NOT_COPIED}
        self.__dict__.update(_PRETRAINED_DEFAULTS)
        self.__dict__.update(attributes)
        setattr(self, keep_as, attributes)
        self._name_or_path = str(model_path)

    return load_config


# the tensors of a multimodal checkpoint's language model, after NxDI's loader took
# "model." off (application_base.get_state_dict)
_LANGUAGE_MODEL = "language_model."


def language_model_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language model tensors named as a text checkpoint's
    (its towers left out, lm_head kept); a text checkpoint's as they are."""
    if not any(k.startswith(_LANGUAGE_MODEL) for k in state_dict):
        return state_dict
    found = {
        k[len(_LANGUAGE_MODEL) :]: v for k, v in state_dict.items() if k.startswith(_LANGUAGE_MODEL)
    }
    if "lm_head.weight" in state_dict:
        found["lm_head.weight"] = state_dict["lm_head.weight"]
    return found
