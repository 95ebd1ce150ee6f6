"""ModelWrapper: bucket selection as in NxDI (0.7 inline loop; 0.9 split into
_get_seq_bucket / _get_batch_and_seq_bucket), padding to the chosen bucket, and the
call into the compiled model (here: the token-memory device of application_base)."""

import torch

from neuronx_distributed_inference._release import CTE_TAKES_EQUAL_BUCKET, RELEASE

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
SPECULATION_MODEL_TAG = "speculation_model"
MEDUSA_MODEL_TAG = "medusa_speculation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"


class ModelWrapper(torch.nn.Module):
    def __init__(self, config, model_cls=None, tag="", **kwargs):
        super().__init__()
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_cls = model_cls
        self.tag = tag
        self.model = None
        self.async_mode = False
        self.is_batch_bucketing = getattr(config.neuron_config, "token_generation_batches",
                                          None) is not None
        self.selected_buckets = []

    def is_neuron(self):
        return True

    def input_generator(self):
        return [[bucket] for bucket in self.neuron_config.buckets]

    if RELEASE in ("2.27", "2.28"):
        def get_target_bucket(self, *args, strategy="first_fit"):
            input_len = args[1].shape[1]
            buckets = self.neuron_config.buckets
            speculation_length = (
                self.neuron_config.speculation_length
                if self.tag == FUSED_SPECULATION_MODEL_TAG or self.tag == SPECULATION_MODEL_TAG
                else 0
            )
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
                f"Input len {input_len} exceeds largest bucket ({largest_bucket}) for {self.tag}"
            )
    else:
        def get_target_bucket(self, *args, strategy="first_fit"):
            input_len = args[1].shape[1]  # attention_mask
            buckets = self.neuron_config.buckets
            speculation_length = (
                self.neuron_config.speculation_length
                if self.tag in (FUSED_SPECULATION_MODEL_TAG, SPECULATION_MODEL_TAG)
                else 0
            )
            if self.is_batch_bucketing and self.tag == TOKEN_GENERATION_MODEL_TAG:
                input_batch_size = args[3].shape[0]  # seq_ids
                return self._get_batch_and_seq_bucket(
                    buckets, input_batch_size, input_len, speculation_length, strategy)
            return self._get_seq_bucket(buckets, input_len, speculation_length, strategy)

        def _get_batch_and_seq_bucket(self, buckets, input_batch_size, input_len,
                                      speculation_length, strategy):
            required_len = input_len + speculation_length
            fitting = [b for b in buckets if input_batch_size <= b[0] and required_len <= b[1]]
            if fitting:
                return min(fitting)
            raise ValueError(
                f"Input batch_size={input_batch_size}, seq_len={input_len} exceeds largest "
                f"bucket for {self.tag}. Available buckets are {buckets}.")

        def _get_seq_bucket(self, buckets, input_len, speculation_length, strategy):
            required_len = input_len + speculation_length
            largest = buckets[-1]
            equal_fits = CTE_TAKES_EQUAL_BUCKET and self.tag == CONTEXT_ENCODING_MODEL_TAG
            for i, bucket in enumerate(buckets):
                if strategy == "first_fit" and (required_len < bucket
                                                or (equal_fits and required_len == bucket)):
                    return bucket
                if strategy == "second_fit" and input_len < bucket:
                    return buckets[min(i + 1, len(buckets) - 1)]
            if required_len == largest or self.neuron_config.allow_input_truncation:
                return largest
            raise ValueError(
                f"Input len {input_len} exceeds largest bucket ({largest}) for {self.tag}")

    def get_target_2d_bucket_for_prefix_caching(self, *args, strategy="first_fit"):
        buckets = self.neuron_config.buckets
        active, prefix = args[13], args[14]
        if self.tag != CONTEXT_ENCODING_MODEL_TAG:
            fitting = [b for b in buckets if b[1] > int(prefix.max())]
            if not fitting:
                raise ValueError(f"Input len {prefix} exceeds largest bucket ({buckets[-1][1]}) for {self.tag}")
            return min(fitting, key=lambda b: b[1])
        need_active, need_prefix = int(active[0][0]), int(prefix[0][0])
        fitting = [b for b in buckets if b[0] >= need_active and b[1] >= need_prefix]
        if not fitting:
            raise ValueError(f"Input len {need_active} exceeds largest bucket for {self.tag}")
        return min(fitting, key=lambda b: (b[0] * max(b[1], 1), b))

    def forward(self, *args, pad_type="first_fit"):
        if self.model is None:
            raise RuntimeError(
                "Forward called before load. Run load() or load_state_dict() making calling forward")
        if self.neuron_config.is_prefix_caching:
            bucket = self.get_target_2d_bucket_for_prefix_caching(*args, strategy=pad_type)
        else:
            bucket = self.get_target_bucket(*args, strategy=pad_type)
        self.selected_buckets.append(bucket)
        return self.model.run(self.tag, bucket, args)
