"""models/model_wrapper.py: ModelWrapper as NxDI runs a call (the non-async,
non-speculative code paths), per release (see _release):
- input_generator: the example inputs each bucket is traced with (their shapes are what
  NxD's router accepts);
- forward: _process_args, int64 -> int32, pad_inputs, then the compiled batch as is,
  or a smaller batch through _forward_with_pad;
- get_target_bucket: the 1-D first fit with a strict `<` (the largest bucket only on
  equality); 0.8+ splits it and, with token_generation_batches, picks token-generation
  [batch, length] buckets with `<=` (_get_batch_and_seq_bucket);
- get_target_2d_bucket_for_prefix_caching / _pad_prefix_caching_inputs (identical in
  0.7-0.9 but for 0.9's block-table pad value): the prefix tail shifted into spare
  active slots, (512, 0) for 256 < total <= 512, block tables cropped to
  bucket // pa_block_size;
- _forward_with_pad: seq_ids completed from range(batch) and sorted (not with prefix
  caching), rows padded with the first row (slots with -1), and the return of a
  prefix-caching call cut with `[: seq_ids.shape[0]]`, which cuts the list
  [tokens, logits] rather than the tensors when output_logits is on.
With speculation (ef2731e model_wrapper.py): the speculation model's examples have
speculation_length active tokens with positions of ones, the fused model's one
(input_generator, lines 205-362); with prefix caching and fused speculation every call
has 11 arguments (slot mapping at 7, block table at 8, num_queries at 9, computed
context lengths at 10; the fused model's slot mapping is [batch, speculation_length],
_get_input_shape_for_prefix_caching, lines 364-455), which _pad_prefix_caching_inputs,
_forward_with_pad and the 2-D bucket choice index accordingly (lines 574-704, 923-1143);
the fused and speculation models' buckets must exceed the need plus speculation_length
(get_target_bucket, get_target_2d_bucket_for_prefix_caching); a fused model's outputs
are a list, padded batches cut or reordered per tensor (lines 687-699, 1431-1436).
The double runs one prompt per context-encoding call; NxDI's multi-prompt path
(vllm_cte_repadding) is not reproduced and raises NotImplementedError.
"""

import os

import torch
import torch.nn.functional as F

from neuronx_distributed_inference._release import HAS_BATCH_BUCKETING, RELEASE

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
SPECULATION_MODEL_TAG = "speculation_model"
MEDUSA_MODEL_TAG = "medusa_speculation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"


class ModelWrapper(torch.nn.Module):
    def __init__(self, config, model_cls=None, tag="", compiler_args=None,
                 priority_model_idx=None, pipeline_execution=False,
                 return_ranked_to_cpu=False, model_init_kwargs={}):
        super().__init__()
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_cls = model_cls
        self.tag = tag
        # the compiler arguments NxDI derives from the tag are not reproduced
        self.compiler_args = compiler_args
        self.priority_model_idx = priority_model_idx
        self.pipeline_execution = pipeline_execution
        self.return_ranked_to_cpu = return_ranked_to_cpu
        self.model_init_kwargs = model_init_kwargs
        # ef2731e lines 82-83: read when the wrapper is built
        self.compiler_workdir = os.path.join(
            os.environ.get("BASE_COMPILE_WORK_DIR", "/tmp/nxd_model/"), tag)
        self.model = None
        self.async_mode = False
        self.is_block_kv_layout = self.neuron_config.is_block_kv_layout
        self.is_prefix_caching = self.neuron_config.is_prefix_caching
        if HAS_BATCH_BUCKETING:
            self.is_batch_bucketing = self.neuron_config.token_generation_batches is not None

    def is_neuron(self):
        return True

    @property
    def selected_buckets(self):
        """Test instrumentation, not NxDI: the buckets of this tag's graphs that ran."""
        return [bucket for tag, bucket in self.model.ran if tag == self.tag]

    # -- ModelWrapper.input_generator ------------------------------------------------------
    def input_generator(self):
        c = self.neuron_config
        inputs = []
        for bucket in c.buckets:
            batch_size = c.batch_size
            if (isinstance(bucket, list) and getattr(self, "is_batch_bucketing", False)
                    and not c.is_prefix_caching):
                batch_size, length = bucket
                n_active = length if c.bucket_n_active_tokens else c.n_active_tokens
                attention_mask = torch.ones((batch_size, length), dtype=torch.int32)
            elif isinstance(bucket, list) and c.is_prefix_caching:
                n_active = bucket[0] if c.bucket_n_active_tokens else c.n_active_tokens
                prefix_size = bucket[1]
                attention_mask = (torch.zeros(1, dtype=torch.int32) if prefix_size == 0 else
                                  torch.ones((batch_size, prefix_size), dtype=torch.int32))
            else:
                n_active = bucket if c.bucket_n_active_tokens else c.n_active_tokens
                attention_mask = torch.ones((batch_size, bucket), dtype=torch.int32)
            input_ids = torch.ones((batch_size, n_active), dtype=torch.int32)
            if self.tag != CONTEXT_ENCODING_MODEL_TAG:
                position_ids = torch.ones((batch_size, n_active), dtype=torch.int32)
            else:
                position_ids = torch.arange(n_active, dtype=torch.int32).unsqueeze(0)
                position_ids = position_ids.repeat(batch_size, 1)
            seq_ids = torch.arange(batch_size, dtype=torch.int32)
            sampling_params = torch.ones((batch_size, 3), dtype=torch.float32)
            adapter_ids = torch.zeros((batch_size), dtype=torch.int32)
            if c.is_prefix_caching:
                slot_width = (c.speculation_length if c.enable_fused_speculation
                              and self.tag == FUSED_SPECULATION_MODEL_TAG else n_active)
                slot_mapping = torch.zeros((batch_size, slot_width), dtype=torch.int32)
                num_blocks = prefix_size // c.pa_block_size
                block_table = (torch.zeros(1, dtype=torch.int32) if num_blocks == 0 else
                               torch.zeros((batch_size, num_blocks), dtype=torch.int32))
                num_queries = torch.full((batch_size, 1), n_active, dtype=torch.int32)
                computed = torch.full((batch_size, 1), prefix_size, dtype=torch.int32)
                adapter = adapter_ids if HAS_BATCH_BUCKETING else torch.empty(0)
                if c.enable_fused_speculation:
                    inputs.append((input_ids, attention_mask, position_ids, seq_ids,
                                   sampling_params, torch.empty(0), adapter, slot_mapping,
                                   block_table, num_queries, computed))
                    continue
                inputs.append((
                    input_ids, attention_mask, position_ids, seq_ids, sampling_params,
                    torch.empty(0),
                    # 0.8+ _get_input_shape_for_prefix_caching takes adapter_ids
                    adapter_ids if HAS_BATCH_BUCKETING else torch.empty(0),
                    torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0),
                    slot_mapping, block_table,
                    torch.full((batch_size, 1), n_active, dtype=torch.int32),
                    torch.full((batch_size, 1), prefix_size, dtype=torch.int32)))
            else:
                hidden_states = torch.zeros((batch_size), dtype=torch.int32)
                inputs.append((input_ids, attention_mask, position_ids, seq_ids,
                               sampling_params, hidden_states, adapter_ids))
        return inputs

    # -- ModelWrapper.forward --------------------------------------------------------------
    def _process_args(self, *args):
        input_batch_size = args[3].shape[0]
        if args[5] is None:
            args = (*args[:5], torch.zeros((input_batch_size), dtype=torch.int32), *args[6:])
        if args[6] is None:
            args = (*args[:6], torch.zeros((input_batch_size), dtype=torch.int32), *args[7:])
        return args

    def convert_int64_to_int32(self, *args):
        return [t.to(torch.int32) if t.dtype == torch.int64 else t for t in args]

    def forward(self, *args, pad_type="first_fit"):
        if self.model is None:
            raise RuntimeError(
                "Forward called before load. Run load() or load_state_dict() making calling forward")
        args = self._process_args(*args)
        args = tuple(arg for arg in args if isinstance(arg, torch.Tensor))
        args = self.convert_int64_to_int32(*args)
        args = self.pad_inputs(*args, pad_type=pad_type)
        input_batch_size = args[3].shape[0]
        batch_size = self.neuron_config.batch_size
        if input_batch_size == batch_size:
            return self._forward(*args)
        if input_batch_size > batch_size:
            raise NotImplementedError(
                f"the NxDI double does not reproduce {self.tag} calls with more rows "
                f"({input_batch_size}) than the compiled batch ({batch_size})")
        # The loop over batch_size chunks in ModelWrapper.forward runs once here.
        output_logits = [self._forward_with_pad(*args)]
        c = self.neuron_config
        if c.enable_fused_speculation or (c.on_device_sampling_config and c.output_logits
                                          and c.is_continuous_batching):
            return [torch.cat(x, dim=0) for x in zip(*output_logits)]
        return torch.cat(output_logits, dim=0)

    def _forward(self, *args):
        return self.model(*args)

    def _pad_helper(self, tensor, pad_type="fill_0", batch_sort_indices=None):
        """pad_helper (0.7, inside _forward_with_pad) / _pad_helper (0.8+): up to the
        compiled batch_size rows, then reordered by the sorted seq_ids."""
        if tensor is None or tensor.shape[0] == self.neuron_config.batch_size:
            return tensor
        padded_shape = [self.neuron_config.batch_size, *tensor.shape[1:]]
        if pad_type == "repeat_first_batchline":
            padded = tensor[:1].expand(padded_shape).clone()
        else:
            padded = torch.full(padded_shape, fill_value=int(pad_type[len("fill_"):]),
                                dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        if batch_sort_indices is not None:
            padded = torch.index_select(padded, 0, batch_sort_indices)
        return padded

    def _forward_with_pad(self, *args):
        seq_ids = args[3]
        sampling_params = args[4]
        medusa_args = None if self.is_block_kv_layout or len(args) <= 5 else args[5:8]
        fused = self.neuron_config.enable_fused_speculation
        if self.is_prefix_caching:
            first_slot = 7 if fused else 11
            block_kv_empty_args = args[5:first_slot]
            block_kv_slot_mapping = args[first_slot]
            block_kv_args = args[first_slot + 1:first_slot + 4]
        reorder_seq_ids = not self.is_prefix_caching
        seq_ids_list = seq_ids.tolist()
        target_batch_size = self.neuron_config.max_batch_size
        if (HAS_BATCH_BUCKETING and self.is_batch_bucketing
                and self.tag == TOKEN_GENERATION_MODEL_TAG):
            target_bucket = self.get_target_bucket(*args, strategy="first_fit")
            if isinstance(target_bucket, list):
                target_batch_size = target_bucket[0]
        padded_seq_ids = torch.tensor(
            seq_ids_list + [x for x in range(target_batch_size) if x not in seq_ids_list],
            dtype=seq_ids.dtype)
        padded_seq_ids, indices = (torch.sort(padded_seq_ids) if reorder_seq_ids
                                   else (padded_seq_ids, None))
        padded_args = [self._pad_helper(arg, "repeat_first_batchline", indices)
                       for arg in args[0:3]]
        padded_args.append(padded_seq_ids[:target_batch_size])
        padded_args.append(self._pad_helper(sampling_params, "repeat_first_batchline", indices))
        if medusa_args is not None:
            padded_args.extend(self._pad_helper(arg, batch_sort_indices=indices)
                               for arg in medusa_args)
        if self.is_prefix_caching:
            padded_args.extend(block_kv_empty_args)
            if HAS_BATCH_BUCKETING:  # 0.8+: adapter_ids padded like the other rows
                padded_args[6] = self._pad_helper(args[6], pad_type="fill_0").view(-1)
            padded_args.append(self._pad_helper(block_kv_slot_mapping, pad_type="fill_-1"))
            padded_args.extend(self._pad_helper(arg, pad_type="repeat_first_batchline")
                               for arg in block_kv_args)
        logits = self._forward(*padded_args)
        if self.is_prefix_caching:
            if fused:
                return [logit[: seq_ids.shape[0]] for logit in logits]
            return logits[: seq_ids.shape[0]]
        c = self.neuron_config
        if fused or (c.on_device_sampling_config and c.output_logits
                     and c.is_continuous_batching):
            return [torch.index_select(logit, 0, seq_ids) for logit in logits]
        return torch.index_select(logits, 0, seq_ids)

    # -- ModelWrapper.pad_inputs -----------------------------------------------------------
    def pad_inputs(self, *args, pad_type="first_fit"):
        c = self.neuron_config
        if isinstance(c.buckets[-1], list) and c.is_prefix_caching:
            return self._pad_prefix_caching_inputs(*args, pad_type=pad_type)
        target_bucket = self.get_target_bucket(*args, strategy=pad_type)
        pad_length = (target_bucket[1] if isinstance(target_bucket, list)
                      and getattr(self, "is_batch_bucketing", False) else target_bucket)
        if self.tag == CONTEXT_ENCODING_MODEL_TAG:
            to_pad = args[:3]
            pad_lengths = [pad_length - arg.shape[1] for arg in to_pad]
            if any(pad_len < 0 for pad_len in pad_lengths):
                raise ValueError(
                    f"Inputs supplied ({to_pad[1].shape[1]} tokens) are longer than "
                    f"max_context_length ({c.max_context_length} tokens). To truncate "
                    f"inputs, set allow_input_truncation=True.")
            padded = [F.pad(arg, (0, pad_len), "constant", value)
                      for arg, value, pad_len in zip(to_pad, [self.config.pad_token_id, 0, 1],
                                                     pad_lengths)]
            return (*padded, *args[3:])
        input_ids, attention_mask, *rest = args
        pad_len = pad_length - attention_mask.shape[1]
        if pad_len < 0:
            raise ValueError(
                f"Attention mask supplied (length={attention_mask.shape[1]}) is longer than "
                f"max_length ({c.max_length} tokens). To truncate attention mask, set "
                f"allow_input_truncation=True.")
        return (input_ids, F.pad(attention_mask, (0, pad_len), "constant", 0), *rest)

    # -- ModelWrapper.get_target_bucket ----------------------------------------------------
    if RELEASE == "0.7":
        def get_target_bucket(self, *args, strategy="first_fit"):
            input_len = args[1].shape[1]
            buckets = self.neuron_config.buckets
            speculation_length = (
                self.neuron_config.speculation_length
                if self.tag in (FUSED_SPECULATION_MODEL_TAG, SPECULATION_MODEL_TAG) else 0)
            largest_bucket_idx = len(buckets) - 1
            for i, bucket in enumerate(buckets):
                if strategy == "first_fit":
                    if input_len + speculation_length < bucket:
                        return bucket
                elif strategy == "second_fit":
                    if input_len < bucket:
                        return buckets[min(i + 1, largest_bucket_idx)]
            largest_bucket = buckets[largest_bucket_idx]
            if input_len + speculation_length == largest_bucket:
                return largest_bucket
            elif self.neuron_config.allow_input_truncation:
                return largest_bucket
            raise ValueError(
                f"Input len {input_len} exceeds largest bucket ({largest_bucket}) for {self.tag}")
    else:
        def get_target_bucket(self, *args, strategy="first_fit"):
            input_len = args[1].shape[1]  # attention_mask
            buckets = self.neuron_config.buckets
            speculation_length = (
                self.neuron_config.speculation_length
                if self.tag in (FUSED_SPECULATION_MODEL_TAG, SPECULATION_MODEL_TAG) else 0)
            if self.is_batch_bucketing and self.tag == TOKEN_GENERATION_MODEL_TAG:
                input_batch_size = args[3].shape[0]  # seq_ids
                return self._get_batch_and_seq_bucket(
                    buckets, input_batch_size, input_len, speculation_length, strategy)
            return self._get_seq_bucket(buckets, input_len, speculation_length, strategy)

        def _get_batch_and_seq_bucket(self, buckets, input_batch_size, input_len,
                                      speculation_length, strategy):
            if strategy != "first_fit":
                raise ValueError(f"{strategy=} is currently not supported for batch bucketing.")
            required_len = input_len + speculation_length
            smallest_fitting = None
            largest_overall = None
            for bucket in buckets:
                batch_size, seq_len = bucket
                if (largest_overall is None or batch_size > largest_overall[0]
                        or (batch_size == largest_overall[0] and seq_len > largest_overall[1])):
                    largest_overall = bucket
                if input_batch_size <= batch_size and required_len <= seq_len:
                    if (smallest_fitting is None or batch_size < smallest_fitting[0]
                            or (batch_size == smallest_fitting[0]
                                and seq_len < smallest_fitting[1])):
                        smallest_fitting = bucket
            if smallest_fitting is not None:
                return smallest_fitting
            if (self.neuron_config.allow_input_truncation
                    and largest_overall[0] >= input_batch_size):
                return largest_overall
            raise ValueError(
                f"Input batch_size={input_batch_size}, seq_len={input_len} exceeds largest "
                f"bucket batch_size={largest_overall[0]}, seq_len={largest_overall[1]} for "
                f"{self.tag}. Available buckets are {buckets}.")

        def _get_seq_bucket(self, buckets, input_len, speculation_length, strategy):
            required_len = input_len + speculation_length
            largest = buckets[-1]
            for i, bucket in enumerate(buckets):
                if strategy == "first_fit" and required_len < bucket:
                    return bucket
                if strategy == "second_fit" and input_len < bucket:
                    return buckets[min(i + 1, len(buckets) - 1)]
            if required_len == largest or self.neuron_config.allow_input_truncation:
                return largest
            raise ValueError(
                f"Input len {input_len} exceeds largest bucket ({largest}) for {self.tag}")

    # -- prefix caching --------------------------------------------------------------------
    def get_target_2d_bucket_for_prefix_caching(self, *args, strategy="first_fit"):
        buckets = torch.tensor(self.neuron_config.buckets, dtype=torch.int32)
        speculation_length = (self.neuron_config.speculation_length
                              if self.tag == FUSED_SPECULATION_MODEL_TAG else 0)
        if self.neuron_config.enable_fused_speculation:
            vertical_dim, horizontal_dim = args[9], args[10]
        else:
            vertical_dim, horizontal_dim = args[13], args[14]
        if self.tag != CONTEXT_ENCODING_MODEL_TAG:
            horizontal_mask = buckets[:, 1] > torch.max(horizontal_dim) + speculation_length
            vertical_mask = buckets[:, 0] >= torch.max(vertical_dim)
            mask = horizontal_mask & vertical_mask
            final_buckets = buckets[mask]
            final_indices = torch.arange(len(buckets))[mask]
            if final_buckets.shape[0] == 0:
                raise ValueError(f"Input len {vertical_dim} exceeds largest bucket "
                                 f"({buckets[-1][1]}) for {self.tag}")
            bucket_idx = final_indices[torch.argmin(final_buckets[:, 1])]
            if strategy == "second_fit":
                bucket_idx = min(bucket_idx + 1, len(buckets) - 1)
            return buckets[bucket_idx]
        horizontal_dim = horizontal_dim[0][0]
        vertical_dim = vertical_dim[0][0]
        prefix_buckets, prefill_buckets = [], []
        for b in buckets:
            if b[0] not in prefill_buckets:
                prefill_buckets.append(b[0])
            if b[1] not in prefix_buckets:
                prefix_buckets.append(b[1])
        total_context = vertical_dim + horizontal_dim
        if 256 < total_context <= 512:
            for b in buckets:
                if b[0] == 512 and b[1] == 0:
                    return b
        prefill_index = 0
        for b in prefill_buckets:
            if vertical_dim > b:
                prefill_index += 1
            else:
                break
        if prefill_index == len(prefill_buckets):
            raise ValueError(f"Prefill len {vertical_dim} exceeds largest bucket "
                             f"({prefill_buckets[-1]}) for {self.tag}")
        empty_prefill_slots = max(0, prefill_buckets[prefill_index] - vertical_dim)
        horizontal_dim = max(0, horizontal_dim - empty_prefill_slots)
        prefix_index = 0
        for b in prefix_buckets:
            if horizontal_dim > b:
                prefix_index += 1
            else:
                break
        assert prefix_index != len(prefix_buckets), \
            f"Prefix len {horizontal_dim} exceeds largest bucket {prefix_buckets[-1]} for {self.tag}"
        return buckets[prefill_index * len(prefix_buckets) + prefix_index]

    def _pad_prefix_caching_inputs(self, *args, pad_type="first_fit"):
        c = self.neuron_config
        if self.tag == CONTEXT_ENCODING_MODEL_TAG and args[0].shape[0] > 1:
            return args
        prefill_bucket, prefix_bucket = (
            int(v) for v in self.get_target_2d_bucket_for_prefix_caching(*args,
                                                                        strategy=pad_type))
        fused = c.enable_fused_speculation
        first_slot = 7 if fused else 11
        if self.tag == CONTEXT_ENCODING_MODEL_TAG:
            slot_mapping, block_table = args[first_slot], args[first_slot + 1]
            prefill_len, prefix_len = args[first_slot + 2][0], args[first_slot + 3][0]
            extra_prefill_slots = max(0, prefill_bucket - prefill_len)
            adjusted_prefix_len = max(0, prefix_len - extra_prefill_slots)
            sliced_inputs = args[0][:, adjusted_prefix_len:]
            sliced_attn_mask = args[1][:, :adjusted_prefix_len]
            sliced_position_id = args[2][:, adjusted_prefix_len:]
            padded_inputs = F.pad(sliced_inputs, (0, prefill_bucket - sliced_inputs.shape[1]),
                                  "constant", self.config.pad_token_id)
            if prefix_bucket == 0:
                padded_attn_mask = torch.zeros(1, dtype=torch.int)
            else:
                padded_attn_mask = F.pad(sliced_attn_mask,
                                         (0, prefix_bucket - sliced_attn_mask.shape[1]),
                                         "constant", 0)
            padded_position_id = F.pad(sliced_position_id,
                                       (0, prefill_bucket - sliced_position_id.shape[1]),
                                       "constant", 1)
            padded_slot_mapping = F.pad(slot_mapping, (int(prefix_len - adjusted_prefix_len), 0),
                                        "constant", -1)
            padded_slot_mapping = F.pad(padded_slot_mapping,
                                        (0, prefill_bucket - padded_slot_mapping.shape[1]),
                                        "constant", -1)
            num_blocks = prefix_bucket // c.pa_block_size
            if num_blocks == 0:
                padded_block_table = torch.zeros(1, dtype=torch.int)
            else:  # F.pad with a negative width crops the table to num_blocks columns
                padded_block_table = F.pad(block_table, (0, num_blocks - block_table.shape[1]),
                                           "constant", 0)
            return (padded_inputs, padded_attn_mask, padded_position_id,
                    *args[3:first_slot], padded_slot_mapping, padded_block_table,
                    *args[first_slot + 2:])
        padded_attn_mask = F.pad(args[1], (0, prefix_bucket - args[1].shape[1]), "constant", 0)
        # 0.7/0.8 pad with -1 for either TKG attention kernel, 0.9 for the block one only.
        kernel = getattr(c, "attn_block_tkg_nki_kernel_enabled", False) or (
            RELEASE in ("0.7", "0.8") and getattr(c, "attn_tkg_nki_kernel_enabled", False))
        block_table = args[first_slot + 1]
        pad_right = (prefix_bucket // c.pa_block_size) - block_table.shape[1]
        new_args = list(args)
        new_args[1] = padded_attn_mask
        new_args[first_slot + 1] = F.pad(block_table, (0, pad_right), "constant",
                                         -1 if kernel else 0)
        return tuple(new_args)
