"""utils/hf_adapter.py: load_pretrained_config and HuggingFaceGenerationAdapter.

prepare_inputs_for_generation is NxDI's code per release: 0.7, 0.8 and 0.9 put
`tensor_capture_hook` into the model inputs without defining it (a NameError as
published), ef2731e reads it from kwargs; no release passes prefix-caching context
lengths. generate() is the greedy branch of transformers' GenerationMixin.generate ->
the adapter's _sample loop: prepare inputs, call the adapter (whose forward is the
model's forward), append the argmax token, extend the attention mask by one column."""

from types import SimpleNamespace

import torch
from transformers import AutoConfig, PretrainedConfig

from neuronx_distributed_inference._release import HOOK_FIXED
from neuronx_distributed_inference.models.config import to_torch_dtype


def load_pretrained_config(model_path_or_name=None, hf_config=None):
    def load_config(self):
        if (model_path_or_name is None and hf_config is None) or (
            model_path_or_name is not None and hf_config is not None
        ):
            raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
        if model_path_or_name is not None:
            config = AutoConfig.from_pretrained(model_path_or_name)
        else:
            config = hf_config
        config_dict = config.to_dict()
        hf_dtype = config_dict.get("dtype", config_dict.get("torch_dtype", None))
        if hf_dtype is not None:
            if self.neuron_config is not None and not self.neuron_config.overrides_torch_dtype:
                self.neuron_config.torch_dtype = hf_dtype
                if isinstance(self.neuron_config.torch_dtype, str):
                    self.neuron_config.torch_dtype = to_torch_dtype(self.neuron_config.torch_dtype)
            config_dict.pop("dtype", None)
            config_dict.pop("torch_dtype", None)
        for k, v in config_dict.items():
            if isinstance(getattr(config, k, None), PretrainedConfig):
                config_dict[k] = SimpleNamespace(**v)
        self.__dict__.update(config_dict)

    return load_config


def _model_inputs(self, input_ids, past_key_values, attention_mask, inputs_embeds,
                  sampling_params, adapter_ids, kwargs, tensor_capture_hook):
    """The body of NxDI's prepare_inputs_for_generation after the hook lookup."""
    accepted_indices = kwargs.get("accepted_indices", None)
    current_length = kwargs.get("current_length", None)
    medusa_mask = kwargs.get("medusa_mask", None)
    scatter_index = kwargs.get("scatter_index", None)
    position_ids = kwargs.get("position_ids", None)
    input_capture_hook = kwargs.get("input_capture_hook", None)

    if attention_mask is not None and position_ids is None:
        position_ids = attention_mask.long().cumsum(-1) - 1
        if self.input_start_offsets:
            position_ids += self.input_start_offsets[0]
        else:
            position_ids.masked_fill_(attention_mask == 0, 1)
        if self.neuron_model.kv_cache_populated:
            position_ids = torch.amax(position_ids, 1, keepdim=True)
            position_ids = position_ids + 1
    if inputs_embeds is not None and past_key_values is None:
        model_inputs = {"inputs_embeds": inputs_embeds}
    else:
        model_inputs = {"input_ids": input_ids}

    model_inputs.update(
        {
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache", False),
            "attention_mask": attention_mask,
            "medusa_args": (accepted_indices, current_length, medusa_mask, scatter_index),
            "sampling_params": sampling_params,
            "input_capture_hook": input_capture_hook,
            "tensor_capture_hook": tensor_capture_hook,
            "adapter_ids": adapter_ids,
        }
    )
    additional_kwargs = self.neuron_model.get_required_kwargs()
    for arg in additional_kwargs:
        model_inputs.update({arg: kwargs.get(arg, None)})
    return model_inputs


class HuggingFaceGenerationAdapter(torch.nn.Module):
    def __init__(self, model, input_start_offsets=None, capture_draft_logits=False):
        super().__init__()
        self.neuron_model = model
        self.neuron_config = model.config.neuron_config
        self.on_device_sampling = self.neuron_config.on_device_sampling_config is not None
        self.padding_side = self.neuron_config.padding_side
        self.sampler = None
        self.prev_kv_cache_populated = False
        self.input_start_offsets = input_start_offsets
        self.capture_draft_logits = capture_draft_logits
        self.forward = self.neuron_model.forward

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1):
        self.neuron_model.reset()
        model_kwargs = {"attention_mask": attention_mask}
        for _ in range(max_new_tokens):
            model_inputs = self.prepare_inputs_for_generation(input_ids, **model_kwargs)
            model_kwargs["attention_mask"] = model_inputs.get("attention_mask")
            outputs = self(**model_inputs, return_dict=True)
            next_tokens = outputs.logits[:, -1, :].argmax(dim=-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            model_kwargs = self._update_model_kwargs_for_generation(outputs, model_kwargs)
        return input_ids

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs,
                                            is_for_token_generation=None,
                                            is_encoder_decoder=False):
        if is_for_token_generation is None:
            is_for_token_generation = self.prev_kv_cache_populated
        if "attention_mask" in model_kwargs:
            attention_mask = model_kwargs["attention_mask"]
            if is_for_token_generation:
                if self.padding_side == "left":
                    attention_mask = torch.cat(
                        [attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))],
                        dim=-1)
                    attention_mask = attention_mask[:, 1:]
                else:
                    attention_mask = torch.cat(
                        [attention_mask.new_ones((attention_mask.shape[0], 1)), attention_mask],
                        dim=-1)
            model_kwargs["attention_mask"] = attention_mask
        return model_kwargs

    if HOOK_FIXED:
        def prepare_inputs_for_generation(self, input_ids, past_key_values=None,
                                          attention_mask=None, inputs_embeds=None,
                                          sampling_params=None, adapter_ids=None, **kwargs):
            self.prev_kv_cache_populated = self.neuron_model.kv_cache_populated
            if self.neuron_model.kv_cache_populated:
                input_ids = input_ids[:, -1:]
            tensor_capture_hook = kwargs.get("tensor_capture_hook", None)
            return _model_inputs(self, input_ids, past_key_values, attention_mask,
                                 inputs_embeds, sampling_params, adapter_ids, kwargs,
                                 tensor_capture_hook)
    else:
        def prepare_inputs_for_generation(self, input_ids, past_key_values=None,
                                          attention_mask=None, inputs_embeds=None,
                                          sampling_params=None, adapter_ids=None, **kwargs):
            self.prev_kv_cache_populated = self.neuron_model.kv_cache_populated
            if self.neuron_model.kv_cache_populated:
                input_ids = input_ids[:, -1:]
            return _model_inputs(self, input_ids, past_key_values, attention_mask,
                                 inputs_embeds, sampling_params, adapter_ids, kwargs,
                                 tensor_capture_hook)  # noqa: F821 (as published)
