"""models/model_base.py: NeuronBaseForCausalLM as the plugin drives it.

- __init__: default sampling_params with batch_size (max_num_seqs) rows, used when a
  call passes none; enable_context_encoding (batch ctx_batch_size, buckets from
  autobucketing.generate_buckets_for_cte) and one generation model (ef2731e lines
  3057-3068): with enable_fused_speculation the fused speculation model (batch
  tkg_batch_size, one active token, generate_buckets_for_fused_spec) and both wrappers
  run NeuronFusedSpecModel; else with speculation_length the speculation model (batch
  spec_batch_size, speculation_length active tokens, generate_buckets_for_speculation)
  and *no* token-generation model; else the token-generation model (batch
  tkg_batch_size, generate_buckets_for_tkg);
- forward: the exact parameter list of the release (tensor_capture_hook only in
  ef2731e), preprocess_inputs (attention mask inferred from position_ids when absent,
  seq_ids defaulted, sampling_params defaulted and, with on-device sampling, validated),
  _get_model_outputs (lines 3549-3735; prefix caching: context encoding iff more than
  one input token and position 0, else the fused model (11 arguments) or token
  generation (15); contiguous: context encoding iff position 0, else the fused model,
  else the speculation model iff speculation_length input tokens, else token
  generation, which a speculation model's NxDI lacks: AttributeError), and the output
  (_get_constructed_outputs, lines 3797-3830): tokens and logits with on-device sampling
  and output_logits (outputs[:2]) unless fused, else `fused_outputs` (fused) or tokens
  (on-device) or logits.
"""

from copy import deepcopy
from typing import Callable, List, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from neuronx_distributed_inference._release import (
    ACCEPTANCE_PADDING_TOKEN,
    DEFINES_CAPTURED_OFFSET,
    HAS_BATCH_BUCKETING,
    HOOK_FIXED,
)
from neuronx_distributed_inference.models.application_base import NeuronApplicationBase
from neuronx_distributed_inference.models.model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    FUSED_SPECULATION_MODEL_TAG,
    SPECULATION_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    ModelWrapper,
)
from neuronx_distributed_inference.modules import autobucketing
from neuronx_distributed_inference.modules.generation.sampling import (
    infer_sampling_params,
    prepare_sampling_params,
    validate_sampling_params,
)


class NeuronBaseModel(torch.nn.Module):
    """model_base.py NeuronBaseModel: the traced decoder a ModelWrapper compiles per
    bucket (an application's `_model_cls`), built from the submodel's config
    (model_wrapper.py DecoderModelInstance.load_module: `model_cls(config)`); what its
    graphs compute is _nxd_runtime's. NxD traces the module's forward on the example
    inputs, so a subclass that overrides forward is traced through it: _nxd_runtime
    builds such a module at load and runs its forward on each call, with NxDI's own
    parts as NxDI computes them:
    - get_model_output: every position's hidden state, final norm applied (ef2731e lines
      1216-1462); the double's hidden states are every position's logits, which its
      lm_head (the whole vocabulary, `gather_output`, no padding of its own) passes on;
    - forward: NeuronBaseModel.forward's outputs for the call (tokens and/or logits,
      lines 656-1045; the KV caches are aliased state), having called
      get_model_output once, as NxDI's does (line 935)."""

    def __init__(self, config, optimize_inference=True):
        super().__init__()
        self.config = config
        self.neuron_config = config.neuron_config
        self.lm_head = _WholeVocabularyHead()
        self.graph_hidden = None  # set by _nxd_runtime for each call
        self.graph_outputs = None

    def get_model_output(self, *args, **kwargs):
        return self.graph_hidden, []

    def forward(self, *args):
        self.get_model_output(*args)
        return list(self.graph_outputs)


class _WholeVocabularyHead(torch.nn.Module):
    """The double's lm_head: its hidden states are logits already (NeuronBaseModel)."""

    gather_output = True

    def forward(self, hidden_states):
        return hidden_states


class NeuronFusedSpecModel(torch.nn.Module):
    """model_base.py NeuronFusedSpecModel (ef2731e lines 1598-3021): the draft and target
    decoders traced into one graph per bucket, as both the context-encoding and the
    fused-speculation wrappers' model. What its graphs compute (the draft loop, the
    target's verification, `_cte_postprocessor` / `_tkg_postprocessor`) is
    _nxd_runtime's; the accepted tokens are padded with `acceptance_padding_token`."""

    acceptance_padding_token = ACCEPTANCE_PADDING_TOKEN

    @staticmethod
    def check(config):
        """NeuronFusedSpecModel.__init__'s EAGLE-3 checks (ef2731e lines 1655-1658, cd3abf3
        alike), run wherever NxDI builds the model (compile, load, to_cpu)."""
        if config.neuron_config.is_eagle3:
            assert not config.neuron_config.enable_token_tree, \
                "We do not yet support integration of EAGLE3 and token tree"
            assert not config.neuron_config.is_prefix_caching, \
                "We do not yet support integration of EAGLE3 and prefix caching"


class NeuronBaseForCausalLM(NeuronApplicationBase):
    _model_cls = None

    @staticmethod
    def update_state_dict_for_tied_weights(state_dict):
        """What every NxDI decoder with tied weights defines (llama/modeling_llama.py
        line 1322, qwen3/modeling_qwen3.py line 285, qwen2, mistral, gemma3, ...)."""
        state_dict["lm_head.weight"] = state_dict["embed_tokens.weight"].clone()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_config = self.config.get_text_config()
        self.vocab_size = self.text_config.vocab_size
        self.padding_side = self.neuron_config.padding_side
        self.kv_cache_populated = False
        self.default_sampling_params = prepare_sampling_params(
            batch_size=self.neuron_config.batch_size, top_k=[1], top_p=[1.0], temperature=[1.0])
        if self.neuron_config.enable_fused_speculation:
            self._model_cls = NeuronFusedSpecModel
            self.enable_context_encoding()
            self.enable_fused_spec()
        else:
            self.enable_context_encoding()
            if self.neuron_config.speculation_length > 0:
                self.enable_speculation()
            else:
                self.enable_token_generation()

    def enable_context_encoding(self):
        new_config = deepcopy(self.config)
        new_config.neuron_config.batch_size = self.neuron_config.ctx_batch_size
        if self.neuron_config.enable_fused_speculation:
            new_config.fused_spec_config.draft_config.neuron_config.batch_size = (
                self.neuron_config.ctx_batch_size)
        new_config.neuron_config.n_active_tokens = self.neuron_config.max_context_length
        new_config.neuron_config.bucket_n_active_tokens = True
        new_config.neuron_config.buckets = autobucketing.generate_buckets_for_cte(new_config)
        self.context_encoding_model = ModelWrapper(new_config, self._model_cls,
                                                   tag=CONTEXT_ENCODING_MODEL_TAG)
        self.models.append(self.context_encoding_model)

    def enable_token_generation(self):
        new_config = deepcopy(self.config)
        new_config.neuron_config.batch_size = self.neuron_config.tkg_batch_size
        new_config.neuron_config.n_active_tokens = 1
        new_config.neuron_config.bucket_n_active_tokens = False
        new_config.neuron_config.buckets = autobucketing.generate_buckets_for_tkg(new_config)
        self.token_generation_model = ModelWrapper(new_config, self._model_cls,
                                                   tag=TOKEN_GENERATION_MODEL_TAG)
        self.models.append(self.token_generation_model)

    def enable_fused_spec(self):
        """model_base.py enable_fused_spec (ef2731e lines 3078-3105)."""
        new_config = deepcopy(self.config)
        new_config.neuron_config.batch_size = self.neuron_config.tkg_batch_size
        draft = new_config.fused_spec_config.draft_config.neuron_config
        draft.batch_size = self.neuron_config.tkg_batch_size
        draft.n_active_tokens = 1
        new_config.neuron_config.n_active_tokens = 1
        new_config.neuron_config.bucket_n_active_tokens = False
        new_config.neuron_config.buckets = autobucketing.generate_buckets_for_fused_spec(
            new_config)
        self.fused_spec_model = ModelWrapper(new_config, self._model_cls,
                                             tag=FUSED_SPECULATION_MODEL_TAG)
        self.models.append(self.fused_spec_model)

    def enable_speculation(self):
        """model_base.py enable_speculation (ef2731e lines 3155-3179)."""
        new_config = deepcopy(self.config)
        new_config.neuron_config.batch_size = self.neuron_config.spec_batch_size
        new_config.neuron_config.n_active_tokens = self.neuron_config.speculation_length
        new_config.neuron_config.bucket_n_active_tokens = False
        new_config.neuron_config.buckets = autobucketing.generate_buckets_for_speculation(
            new_config)
        self.speculation_model = ModelWrapper(new_config, self._model_cls,
                                              tag=SPECULATION_MODEL_TAG)
        self.models.append(self.speculation_model)

    def get_generation_model(self):
        """model_base.py get_generation_model (ef2731e lines 3203-3211), without Medusa."""
        if self.neuron_config.enable_fused_speculation:
            return self.fused_spec_model
        if self.neuron_config.speculation_length > 0:
            return self.speculation_model
        return self.token_generation_model

    def get_required_kwargs(self) -> List[str]:
        return []

    def reset(self):
        self.kv_cache_populated = False

    def _infer_attention_mask(self, position_ids):
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
                 adapter_ids, slot_mapping, block_table, full_context_lens,
                 computed_context_lens):
        # ef2731e model_base.py 3347-3356: run-time adapters swap into the device weights
        # at each context encoding, their CPU ids becoming device positions
        lora = self.neuron_config.lora_config
        is_context_encoding = input_ids.shape[-1] > 1 and not position_ids.min().item()
        if lora and lora.dynamic_multi_lora and is_context_encoding:
            adapter_ids = self.lora_model_manager.dynamic_update_weights_for_lora(
                self.context_encoding_model.model.nxd_model.weights, adapter_ids)
        # preprocess_inputs
        if attention_mask is None:
            attention_mask = self._infer_attention_mask(position_ids)
        if seq_ids is None:
            seq_ids = torch.arange(input_ids.shape[0])
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        if self.on_device_sampling:
            validate_sampling_params(sampling_params, self.neuron_config.on_device_sampling_config)
        sampling_params = infer_sampling_params(sampling_params)
        outputs = self._get_model_outputs(input_ids, attention_mask, position_ids, seq_ids,
                                          sampling_params, adapter_ids, slot_mapping,
                                          block_table, full_context_lens,
                                          computed_context_lens)
        if (self.on_device_sampling and self.neuron_config.output_logits
                and not self.neuron_config.enable_fused_speculation):
            tokens_and_logits = outputs[:2]
            return self._construct_output_with_tokens_and_logits(tokens_and_logits[0],
                                                                 tokens_and_logits[1])
        return self._construct_output(outputs)

    def _get_model_outputs(self, input_ids, attention_mask, position_ids, seq_ids,
                           sampling_params, adapter_ids, slot_mapping, block_table,
                           full_context_lens, computed_context_lens):
        c = self.neuron_config
        if c.is_prefix_caching:
            num_queries = full_context_lens - computed_context_lens
            is_context_encoding = input_ids.shape[-1] > 1 and not position_ids.min().item()
            if is_context_encoding:
                model = self.context_encoding_model
            elif c.enable_fused_speculation:
                model = self.fused_spec_model
            else:  # a speculation model's NxDI has none: AttributeError, as in NxDI
                model = self.token_generation_model
            empty = torch.empty(0)
            adapter = adapter_ids if HAS_BATCH_BUCKETING else empty
            if c.enable_fused_speculation:
                return model(input_ids, attention_mask, position_ids, seq_ids,
                             sampling_params, empty, adapter, slot_mapping, block_table,
                             num_queries, computed_context_lens)
            return model(input_ids, attention_mask, position_ids, seq_ids, sampling_params,
                         empty, adapter, empty, empty, empty, empty, slot_mapping,
                         block_table, num_queries, computed_context_lens)
        if position_ids.min().item() == 0:
            outputs = self.context_encoding_model(input_ids, attention_mask, position_ids,
                                                  seq_ids, sampling_params, None, adapter_ids)
            self.kv_cache_populated = True
            return outputs
        if c.enable_fused_speculation:
            return self.fused_spec_model(input_ids, attention_mask, position_ids, seq_ids,
                                         sampling_params, None, adapter_ids)
        if input_ids.shape[-1] == c.speculation_length:
            return self.speculation_model(input_ids, attention_mask, position_ids, seq_ids,
                                          sampling_params, None, adapter_ids)
        return self.token_generation_model(input_ids, attention_mask, position_ids, seq_ids,
                                           sampling_params, None, adapter_ids)

    def _copy_past_key_values(self, outputs):
        """The CPU mode's KV copy without fused speculation (cd3abf3 model_base.py
        3806-3840, ef2731e 3761-3795, v0.7.14366 3990-4024): the cache tensors follow the
        tokens (and logits) and the captured tensors; every release asks
        _get_captured_tensors_offset() how many of those there are."""
        if self.neuron_config.output_logits and self.neuron_config.on_device_sampling_config:
            new_past_key_values = outputs[2 + self._get_captured_tensors_offset():]
        else:
            new_past_key_values = outputs[1 + self._get_captured_tensors_offset():]
        for i, new_past_key_value in enumerate(new_past_key_values):
            self.token_generation_model.model.kv_mgr.past_key_values[i].data = (
                new_past_key_value)
            self.context_encoding_model.model.kv_mgr.past_key_values[i].data = (
                new_past_key_value)

    if DEFINES_CAPTURED_OFFSET:
        def _get_captured_tensors_offset(self):
            """ef2731e model_base.py 3816-3819."""
            if self.neuron_config.tensor_capture_config:
                return self.neuron_config.tensor_capture_config.get_offset()
            return 0

    def _construct_output_with_tokens_and_logits(self, next_tokens, logits):
        output = CausalLMOutputWithPast(logits=logits, hidden_states=[], attentions=None)
        output.tokens = next_tokens
        return output

    def _construct_output(self, logits_or_next_tokens):
        output = CausalLMOutputWithPast(
            logits=None if self.on_device_sampling else logits_or_next_tokens,
            hidden_states=logits_or_next_tokens, attentions=None)
        if self.neuron_config.enable_fused_speculation:
            output.fused_outputs = logits_or_next_tokens
        else:
            output.tokens = logits_or_next_tokens
        return output

    if HOOK_FIXED:
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
                                 sampling_params, adapter_ids, slot_mapping, block_table,
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
                                 sampling_params, adapter_ids, slot_mapping, block_table,
                                 full_context_lens, computed_context_lens)
