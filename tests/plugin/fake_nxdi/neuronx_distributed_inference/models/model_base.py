"""NeuronBaseForCausalLM: forward() with the exact parameter list of the release (0.7/0.8
without tensor_capture_hook, 0.9 with it), the preprocess/attention-mask inference,
the prefix-caching `full_context_lens - computed_context_lens`, the routing between
context encoding and token generation, and the output construction."""

from copy import deepcopy
from typing import Callable, List, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from neuronx_distributed_inference._release import FORWARD_TAKES_HOOK
from neuronx_distributed_inference.models.application_base import NeuronApplicationBase
from neuronx_distributed_inference.models.model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    ModelWrapper,
)
from neuronx_distributed_inference.modules.generation.sampling import (
    prepare_sampling_params,
    validate_sampling_params,
)


class NeuronBaseForCausalLM(NeuronApplicationBase):
    _model_cls = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_config = self.config.get_text_config()
        self.vocab_size = self.text_config.vocab_size
        self.padding_side = self.neuron_config.padding_side
        self.kv_cache_populated = False
        self.default_sampling_params = prepare_sampling_params(
            batch_size=self.neuron_config.batch_size, top_k=[1], top_p=[1.0], temperature=[1.0])
        self.enable_context_encoding()
        self.enable_token_generation()

    def _submodel(self, tag, buckets):
        config = deepcopy(self.config)
        config.neuron_config.buckets = buckets
        model = ModelWrapper(config, self._model_cls, tag=tag)
        self.models.append(model)
        return model

    def enable_context_encoding(self):
        c = self.neuron_config
        cte = c.context_encoding_buckets or [c.max_context_length]
        if c.is_prefix_caching:
            buckets = [[n, p] for n in cte for p in [0] + list(c.prefix_buckets or [])]
        else:
            buckets = list(cte)
        self.context_encoding_model = self._submodel(CONTEXT_ENCODING_MODEL_TAG, buckets)

    def enable_token_generation(self):
        c = self.neuron_config
        tkg = c.token_generation_buckets or [c.max_length]
        batches = getattr(c, "token_generation_batches", None)
        if c.is_prefix_caching:
            buckets = [[1, n] for n in tkg]
        elif batches:
            buckets = [[b, n] for b in batches for n in tkg]
        else:
            buckets = list(tkg)
        self.token_generation_model = self._submodel(TOKEN_GENERATION_MODEL_TAG, buckets)

    def get_required_kwargs(self) -> List[str]:
        return []

    def reset(self):
        self.kv_cache_populated = False

    def _infer_attention_mask(self, position_ids, full_context_lens=None,
                              computed_context_lens=None):
        assert position_ids is not None, \
            "need to call forward with position_ids if attention_mask is not provided"
        batch_size, seq_len = position_ids.shape
        if position_ids.shape[-1] != 1:
            seq_len = position_ids.shape[-1]
            position_ids_to_compare = position_ids
        else:
            seq_len = torch.max(position_ids)
            position_ids_to_compare = position_ids.expand(batch_size, seq_len) - 1
        mask = torch.arange(seq_len).view(1, -1).expand(batch_size, seq_len)
        return (position_ids_to_compare >= mask).to(dtype=position_ids.dtype)

    def _forward(self, input_ids, seq_ids, attention_mask, position_ids, sampling_params,
                 slot_mapping, block_table, full_context_lens, computed_context_lens):
        if attention_mask is None:
            attention_mask = self._infer_attention_mask(position_ids, full_context_lens,
                                                        computed_context_lens)
        if seq_ids is None:
            seq_ids = torch.arange(input_ids.shape[0])
        sampling_params = (self.default_sampling_params if sampling_params is None
                           else sampling_params)
        if self.on_device_sampling:
            validate_sampling_params(sampling_params, self.neuron_config.on_device_sampling_config)
        empty = torch.empty(0)
        if self.neuron_config.is_prefix_caching:
            num_queries = full_context_lens - computed_context_lens
            batch_size, _ = num_queries.shape
            is_context_encoding = input_ids.shape[-1] > 1 and not position_ids.min().item()
            model = self.context_encoding_model if is_context_encoding else self.token_generation_model
            logits = model(input_ids, attention_mask, position_ids, seq_ids, sampling_params,
                           empty, empty, empty, empty, empty, empty, slot_mapping, block_table,
                           num_queries, computed_context_lens)
        elif position_ids.min().item() == 0:
            logits = self.context_encoding_model(input_ids, attention_mask, position_ids,
                                                 seq_ids, sampling_params)
            self.kv_cache_populated = True
        else:
            logits = self.token_generation_model(input_ids, attention_mask, position_ids,
                                                 seq_ids, sampling_params)
        if self.on_device_sampling and self.neuron_config.output_logits:
            output = CausalLMOutputWithPast(logits=logits, hidden_states=[], attentions=None)
            output.tokens = logits[:, -1, :].argmax(dim=-1)
            return output
        output = CausalLMOutputWithPast(logits=None if self.on_device_sampling else logits,
                                        hidden_states=logits, attentions=None)
        output.tokens = logits
        return output

    if FORWARD_TAKES_HOOK:
        def forward(
            self,
            input_ids: torch.LongTensor = None,
            seq_ids: Optional[torch.LongTensor] = None,
            attention_mask: Optional[torch.Tensor] = None,
            position_ids: Optional[torch.LongTensor] = None,
            past_key_values: Optional[List[torch.FloatTensor]] = None,
            inputs_embeds: Optional[torch.FloatTensor] = None,
            sampling_params: Optional[torch.FloatTensor] = None,
            prev_hidden: Optional[torch.FloatTensor] = None,
            labels: Optional[torch.LongTensor] = None,
            use_cache: Optional[bool] = None,
            output_attentions: Optional[bool] = None,
            output_hidden_states: Optional[bool] = None,
            adapter_ids: Optional[torch.LongTensor] = None,
            medusa_args=None,
            return_dict: Optional[bool] = None,
            llava_args: Optional[List] = [],
            input_capture_hook: Optional[Callable] = None,
            tensor_capture_hook: Optional[Callable] = None,
            slot_mapping: Optional[torch.LongTensor] = None,
            block_table: Optional[torch.LongTensor] = None,
            full_context_lens: Optional[torch.LongTensor] = None,
            computed_context_lens: Optional[torch.LongTensor] = None,
            tf_args: Optional[List[torch.Tensor]] = None,
        ):
            return self._forward(input_ids, seq_ids, attention_mask, position_ids,
                                 sampling_params, slot_mapping, block_table,
                                 full_context_lens, computed_context_lens)
    else:
        def forward(
            self,
            input_ids: torch.LongTensor = None,
            seq_ids: Optional[torch.LongTensor] = None,
            attention_mask: Optional[torch.Tensor] = None,
            position_ids: Optional[torch.LongTensor] = None,
            past_key_values: Optional[List[torch.FloatTensor]] = None,
            inputs_embeds: Optional[torch.FloatTensor] = None,
            sampling_params: Optional[torch.FloatTensor] = None,
            prev_hidden: Optional[torch.FloatTensor] = None,
            labels: Optional[torch.LongTensor] = None,
            use_cache: Optional[bool] = None,
            output_attentions: Optional[bool] = None,
            output_hidden_states: Optional[bool] = None,
            adapter_ids: Optional[torch.LongTensor] = None,
            medusa_args=None,
            return_dict: Optional[bool] = None,
            llava_args: Optional[List] = [],
            input_capture_hook: Optional[Callable] = None,
            slot_mapping: Optional[torch.LongTensor] = None,
            block_table: Optional[torch.LongTensor] = None,
            full_context_lens: Optional[torch.LongTensor] = None,
            computed_context_lens: Optional[torch.LongTensor] = None,
            tf_args: Optional[List[torch.Tensor]] = None,
        ):
            return self._forward(input_ids, seq_ids, attention_mask, position_ids,
                                 sampling_params, slot_mapping, block_table,
                                 full_context_lens, computed_context_lens)
