"""models/config.py: NeuronConfig / InferenceConfig / OnDeviceSamplingConfig /
ChunkedPrefillConfig / FusedSpecNeuronConfig with NxDI 0.7's constructor signatures,
defaults and validations for the keys the plugin sets (0.8+: token_generation_batches,
sorted, at most tkg_batch_size, refused with speculation or the block layout by
_validate_batch_bucketing_compatibility); any other key NxDI 0.7 knows is stored as
given, and unknown keys are logged and dropped exactly as NeuronConfig.__init__ does.

Speculation keys (ef2731e config.py lines 243-256): speculation_length (0),
spec_batch_size (batch_size), enable_fused_speculation (False), enable_eagle_speculation
(False; True turns fused speculation on). FusedSpecNeuronConfig (lines 1045-1061) holds
the fused draft: worker_cls (the target's NeuronBaseModel class, also the draft's when
draft_model_cls is None), draft_config, draft_model_path, draft_model_cls."""

import inspect
import json
import logging
import os

import torch

from neuronx_distributed_inference._release import HAS_BATCH_BUCKETING, RELEASE

CONFIG_FILE = "neuron_config.json"

# Every key NeuronConfig.__init__ of NxDI 0.7 pops (read from its source).
KNOWN_KEYS = frozenset("""
activation_quantization_type allow_input_truncation apply_seq_ids_mask async_mode
attention_dp_degree attention_dtype attn_block_cte_nki_kernel_enabled
attn_block_tkg_nki_kernel_cache_update attn_block_tkg_nki_kernel_cascaded_attention
attn_block_tkg_nki_kernel_enabled attn_block_tkg_nki_kernel_use_online_softmax
attn_cls attn_kernel_enabled attn_tkg_builtin_kernel_enabled
attn_tkg_nki_kernel_enabled batch_size bucket_n_active_tokens buckets cast_type
cc_pipeline_tiling_factor chunked_prefill_config context_encoding_buckets cp_degree
draft_model_modules_to_not_convert
ctx_batch_size disable_kv_cache_tiling enable_bucketing enable_cte_modular_flow
enable_eagle_draft_input_norm enable_eagle_speculation enable_fused_speculation
enable_spill_reload_dge ep_degree expert_mlp_nki_kernel_enabled
flash_decoding_enabled fused_qkv fused_rmsnorm_skip_gamma is_block_kv_layout
is_continuous_batching is_eagle3 is_eagle_draft is_full_model_shuffled is_medusa
is_mxfp4_compute is_prefix_caching k_cache_transposed kv_cache_batch_size
kv_cache_padding_size kv_cache_quant layer_boundary_markers lm_head_pad
lm_head_pad_alignment_size local_ranks_size logical_nc_config logical_neuron_cores
lora_config max_batch_size max_context_length max_length max_new_tokens
medusa_speculation_length medusa_tree mlp_cp_degree mlp_kernel_enabled
mlp_kernel_fuse_residual_add mlp_tkg_nki_kernel_enabled modules_to_not_convert
moe_fused_nki_kernel_enabled n_active_tokens n_positions num_medusa_heads on_cpu
on_device_sampling_config out_proj_kernel_enabled output_logits
overrides_torch_dtype pa_block_size pa_num_blocks padded_hidden_size
padded_intermediate_size padding_side pp_degree pre_rope_rmsnorm prefix_buckets
qk_layernorm qkv_cte_nki_kernel_fuse_rope qkv_kernel_enabled
qkv_kernel_fuse_residual_add qkv_kernel_nbsd_layout qkv_nki_kernel_enabled
quantization_block_axis quantization_block_size quantization_dtype
quantization_scale_dtype quantization_type quantize_clamp_bound quantized
quantized_checkpoints_path quantized_mlp_kernel_enabled
rmsnorm_quantize_kernel_enabled router_topk_nki_kernel_enabled rpl_reduce_dtype
save_sharded_checkpoint scratchpad_page_size seq_len seq_len_threshold_for_cc_tiling
sequence_parallel_enabled shared_mlp_nki_kernel_enabled skip_sharding skip_warmup
spec_batch_size speculation_length start_rank_id
strided_context_parallel_kernel_enabled switch_cc target tensor_capture_config
tensor_replacement_config tkg_batch_size token_generation_buckets token_tree_config
torch_dtype tp_degree vocab_parallel weight_gather_seq_len_threshold
windowed_context_encoding_size world_size
""".split()) | ({"token_generation_batches"} if HAS_BATCH_BUCKETING else frozenset())


def to_torch_dtype(dtype_str: str) -> torch.dtype:
    dtype_mapping = {"float32": torch.float32, "float16": torch.float16,
                     "bfloat16": torch.bfloat16}
    assert dtype_str in dtype_mapping, f"Unsupported dtype: {dtype_str}"
    return dtype_mapping[dtype_str]


def to_dict(obj):
    if type(obj) is dict:
        return {k: to_dict(v) for k, v in obj.items()}
    elif type(obj) is list:
        return [to_dict(v) for v in obj]
    elif inspect.isclass(obj):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    elif hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    elif type(obj) is torch.dtype:
        return str(obj).split(".")[1]
    else:
        return obj


class NeuronConfig:
    def __init__(self, **kwargs) -> None:
        self.batch_size = kwargs.pop("batch_size", 1)
        self.padding_side = kwargs.pop("padding_side", "right")
        self.allow_input_truncation = kwargs.pop("allow_input_truncation", False)
        self.seq_len = kwargs.pop("seq_len", 128)
        self.output_logits = kwargs.pop("output_logits", False)
        self.n_active_tokens = kwargs.pop("n_active_tokens", self.seq_len)  # ef2731e :99-101
        self.n_positions = kwargs.pop("n_positions", self.seq_len)
        if "torch_dtype" in kwargs:
            self.torch_dtype = kwargs.pop("torch_dtype")
            if isinstance(self.torch_dtype, str):
                self.torch_dtype = to_torch_dtype(self.torch_dtype)
            self.overrides_torch_dtype = kwargs.pop("overrides_torch_dtype", True)
        else:
            self.torch_dtype = torch.bfloat16
            self.overrides_torch_dtype = False
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        self.max_length = kwargs.pop("max_length", self.seq_len)
        assert self.max_context_length <= self.max_length, "max_context_length cannot be more than max_length"
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)
        self.kv_cache_batch_size = kwargs.pop("kv_cache_batch_size", self.batch_size)
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", None)
        if type(self.on_device_sampling_config) is dict:
            self.on_device_sampling_config = OnDeviceSamplingConfig(**self.on_device_sampling_config)
        self.async_mode = kwargs.pop("async_mode", False)
        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.buckets = kwargs.pop("buckets", [self.seq_len])
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.prefix_buckets = kwargs.pop("prefix_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:
            self.context_encoding_buckets.sort()
            assert self.context_encoding_buckets[-1] <= self.max_context_length, \
                f"Context bucket {self.context_encoding_buckets[-1]} should be <= {self.max_context_length}"
        if self.token_generation_buckets is not None:
            self.token_generation_buckets.sort()
            assert self.token_generation_buckets[-1] <= self.max_length, \
                f"Token generation bucket {self.token_generation_buckets[-1]} should be <= {self.max_length}"
        if HAS_BATCH_BUCKETING:
            self.token_generation_batches = kwargs.pop("token_generation_batches", None)
            if self.token_generation_batches is not None:
                if not isinstance(self.token_generation_batches, list):
                    self.token_generation_batches = [self.token_generation_batches]
                self.token_generation_batches.sort()
                assert self.token_generation_batches[-1] <= self.tkg_batch_size, (
                    f"Token generation batch buckets {self.token_generation_batches} "
                    f"should be <= token generation batch size ({self.tkg_batch_size})")
        self.quantized = kwargs.pop("quantized", False)
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        if self.quantized is True:
            assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"
        # ef2731e config.py 216-238 (0.7: 198-221): NxDI's defaults
        self.quantization_type = kwargs.pop("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = kwargs.pop("quantization_dtype", "int8")
        self.modules_to_not_convert = kwargs.pop("modules_to_not_convert", None)
        # the fused draft's modules_to_not_convert, copied there by the caller
        # (inference_demo.py lines 505-510; the plugin's draft_neuron_config)
        self.draft_model_modules_to_not_convert = kwargs.pop(
            "draft_model_modules_to_not_convert", None)
        self.speculation_length = kwargs.pop("speculation_length", 0)
        self.spec_batch_size = kwargs.pop("spec_batch_size", self.batch_size)
        self.enable_fused_speculation = kwargs.pop("enable_fused_speculation", False)
        self.enable_eagle_speculation = kwargs.pop("enable_eagle_speculation", False)
        if self.enable_eagle_speculation:
            self.enable_fused_speculation = True
        # ef2731e config.py 247-250 (cd3abf3 alike)
        self.is_eagle3 = kwargs.pop("is_eagle3", False)
        self.is_eagle_draft = kwargs.pop("is_eagle_draft", False)
        self.enable_eagle_draft_input_norm = kwargs.pop("enable_eagle_draft_input_norm", False)
        # line 265: token_tree_config, which the double does not reproduce (the plugin
        # never sets one), turns the token tree on
        self.enable_token_tree = kwargs.get("token_tree_config") is not None
        self.is_medusa = kwargs.pop("is_medusa", False)
        self.is_block_kv_layout = kwargs.pop("is_block_kv_layout", False)
        self.pa_num_blocks = kwargs.pop("pa_num_blocks", self.batch_size)
        self.pa_block_size = kwargs.pop("pa_block_size", self.seq_len)
        self.is_prefix_caching = kwargs.pop("is_prefix_caching", False)
        self.chunked_prefill_config = kwargs.pop("chunked_prefill_config", None)
        if type(self.chunked_prefill_config) is dict:
            self.chunked_prefill_config = ChunkedPrefillConfig(**self.chunked_prefill_config)
        self.is_chunked_prefill = self.chunked_prefill_config is not None
        if self.is_chunked_prefill:
            assert self.is_block_kv_layout, "is_block_kv_layout has to be true for chunked prefill because it depends on block KV"
        self.tensor_replacement_config = kwargs.pop("tensor_replacement_config", None)
        # config.py 334-336 (0.8 and ef2731e): a dict becomes a TensorCaptureConfig, which
        # the double does not reproduce (the plugin never sets one)
        self.tensor_capture_config = kwargs.pop("tensor_capture_config", None)
        # ef2731e config.py 356-358: a dict becomes a LoraServingConfig
        self.lora_config = kwargs.pop("lora_config", None)
        if type(self.lora_config) is dict:
            from neuronx_distributed_inference.modules.lora_serving import LoraServingConfig

            self.lora_config = LoraServingConfig(**self.lora_config)
        self.tp_degree = kwargs.pop("tp_degree", 1)
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        self.start_rank_id = kwargs.pop("start_rank_id", 0)
        self.local_ranks_size = kwargs.pop("local_ranks_size", self.tp_degree)
        self.skip_warmup = kwargs.pop("skip_warmup", False)
        # ef2731e config.py lines 102, 285, 450, 452.
        self.on_cpu = kwargs.pop("on_cpu", False)
        self.windowed_context_encoding_size = kwargs.pop("windowed_context_encoding_size", None)
        self.attn_tkg_nki_kernel_enabled = kwargs.pop("attn_tkg_nki_kernel_enabled", False)
        self.attn_tkg_builtin_kernel_enabled = kwargs.pop("attn_tkg_builtin_kernel_enabled",
                                                          False)
        self.attn_block_tkg_nki_kernel_enabled = kwargs.pop("attn_block_tkg_nki_kernel_enabled",
                                                            False)
        self.qkv_kernel_enabled = kwargs.pop("qkv_kernel_enabled", False)
        # ef2731e config.py lines 152 and 436: defaults the state-dict conversion reads
        self.fused_qkv = kwargs.pop("fused_qkv", False)
        self.quantized_mlp_kernel_enabled = kwargs.pop("quantized_mlp_kernel_enabled", False)
        # 0.9 (ef2731e config.py lines 452-466): the block kernel needs a QKV kernel, and
        # the deprecated TKG kernel switches turn it on.
        if RELEASE.startswith("0.9") and self.attn_block_tkg_nki_kernel_enabled:
            assert self.qkv_kernel_enabled or kwargs.get("qkv_nki_kernel_enabled"), \
                "When attn-block-tkg-nki-kernel-enabled, self.qkv_kernel_enabled or " \
                "self.qkv_nki_kernel_enabled is also required."
        if RELEASE.startswith("0.9") and (self.attn_tkg_nki_kernel_enabled
                                          or self.attn_tkg_builtin_kernel_enabled):
            self.attn_block_tkg_nki_kernel_enabled = True
        for key in [k for k in kwargs if k in KNOWN_KEYS]:
            setattr(self, key, kwargs.pop(key))
        if kwargs:
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: {kwargs}")
        self._validate_batch_bucketing_compatibility()

    def _validate_batch_bucketing_compatibility(self):
        """0.8+ (ef2731e config.py lines 645-690), for the features the plugin sets."""
        if getattr(self, "token_generation_batches", None) is None:
            return
        incompatible = []
        if self.speculation_length > 0:
            incompatible.append(f"speculative decoding ({self.speculation_length=})")
        if self.enable_fused_speculation:
            incompatible.append("fused speculation (enable_fused_speculation=True)")
        if self.is_prefix_caching:
            incompatible.append("prefix caching (is_prefix_caching=True)")
        if self.is_block_kv_layout:
            incompatible.append("block KV layout (is_block_kv_layout=True)")
        if incompatible:
            raise ValueError(
                f"Batch bucketing (token_generation_batches={self.token_generation_batches}) "
                f"is not currently supported with the following features: "
                f"{', '.join(incompatible)}. Please disable batch bucketing or the "
                f"incompatible features.")


class InferenceConfig:
    attribute_map = {}

    def __init__(self, neuron_config, fused_spec_config=None, load_config=None,
                 metadata=None, **kwargs):
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def add_derived_config(self):
        self.num_cores_per_group = 1

    def load_config(self):
        pass

    def get_required_attributes(self):
        return []

    def validate_config(self):
        missing_attributes = [x for x in self.get_required_attributes() if not hasattr(self, x)]
        assert len(missing_attributes) == 0, f"Config must define {missing_attributes}"

    def save(self, model_path):
        if not os.path.exists(model_path):
            os.makedirs(model_path)
        with open(os.path.join(model_path, CONFIG_FILE), "w", encoding="utf-8") as writer:
            writer.write(self.to_json_string() + "\n")

    def to_json_string(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    def get_text_config(self):
        if hasattr(self, "text_config") and self.text_config is not None:
            return self.text_config
        return self

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs):
        self.do_sample = kwargs.pop("do_sample", False)
        self.top_k = kwargs.pop("top_k", 1)
        self.top_p = kwargs.pop("top_p", 1.0)
        self.temperature = kwargs.pop("temperature", 1.0)
        self.dynamic = kwargs.pop("dynamic", False)
        self.deterministic = kwargs.pop("deterministic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", True)
        self.top_k_kernel_enabled = kwargs.pop("top_k_kernel_enabled", False)


class ChunkedPrefillConfig:
    def __init__(self, **kwargs):
        self.max_num_seqs = kwargs.pop("max_num_seqs", 0)
        self.tkg_model_enabled = kwargs.pop("tkg_model_enabled", True)
        self.kernel_q_tile_size = kwargs.pop("kernel_q_tile_size", 128)
        self.kernel_kv_tile_size = kwargs.pop("kernel_kv_tile_size", 1024)


class FusedSpecNeuronConfig:
    """config.py FusedSpecNeuronConfig (ef2731e lines 1045-1061, the same in 0.7/0.8)."""

    def __init__(self, worker_cls, draft_config=None, draft_model_path=None,
                 draft_model_cls=None):
        self.worker_cls = worker_cls
        self.draft_model_cls = draft_model_cls
        self.draft_config = draft_config
        self.draft_model_path = draft_model_path
