"""Which NxDI release the double reproduces, from FAKE_NXDI_RELEASE (read at import).

Every release is a published commit of aws-neuron/neuronx-distributed-inference:
- "0.7": fcb5a86, Neuron SDK 2.27.0.
- "0.8": cd3abf3, SDK 2.28.0: batch bucketing (token_generation_batches) with the 2-D
  token-generation bucket choice; prefix caching passes adapter_ids to its graphs.
- "0.9": c63afe0, SDK 2.29 ("Release 2.29"); the paths the plugin touches are 0.8's.
- "0.9-ef2731e": ef2731e, the release-2.29-v2 sync (still version 0.9.0): the HF adapter
  reads tensor_capture_hook from its kwargs and forward() accepts it.
Fused speculation pads its accepted tokens with 0 in 0.7 and -1 from 0.8 on
(NeuronFusedSpecModel.acceptance_padding_token: v0.7 model_base.py line 1699, v0.8
line 1692, ef2731e line 1650).
In 0.7, 0.8 and 0.9 `HuggingFaceGenerationAdapter.prepare_inputs_for_generation` reads
`tensor_capture_hook` as an undefined global (NameError) and `forward()` has no such
parameter. No release passes prefix-caching context lengths from the adapter, and every
release sends a context equal to a bucket to the next bucket.
"""

import os

RELEASES = ("0.7", "0.8", "0.9", "0.9-ef2731e")
RELEASE = os.environ.get("FAKE_NXDI_RELEASE", "0.7")
if RELEASE not in RELEASES:
    raise ValueError(f"FAKE_NXDI_RELEASE={RELEASE!r}; use one of {RELEASES}")

VERSION = "0.9.0" if RELEASE.startswith("0.9") else f"{RELEASE}.0"
# NeuronConfig.token_generation_batches, autobucketing.generate_2d_buckets_for_batch_
# bucketing and ModelWrapper._get_batch_and_seq_bucket exist from 0.8.
HAS_BATCH_BUCKETING = RELEASE != "0.7"
# hf_adapter.prepare_inputs_for_generation / NeuronBaseForCausalLM.forward of ef2731e.
HOOK_FIXED = RELEASE == "0.9-ef2731e"
# NeuronBaseForCausalLM._get_captured_tensors_offset, which _copy_past_key_values (the
# CPU mode's KV copy) calls in every release: defined on text models from 0.9 (ef2731e
# model_base.py 3816-3819), in 0.7 and 0.8 only on NeuronBaseForImageToText.
DEFINES_CAPTURED_OFFSET = RELEASE.startswith("0.9")
# NeuronQwen3ForCausalLM.convert_hf_to_neuron_state_dict fuses q/k/v into Wqkv with
# fused_qkv from 0.9 (c63afe0 and ef2731e modeling_qwen3.py lines 263-265; not in 0.8).
QWEN3_FUSES_QKV = RELEASE.startswith("0.9")
# NeuronFusedSpecModel.acceptance_padding_token (see the module docstring).
ACCEPTANCE_PADDING_TOKEN = 0 if RELEASE == "0.7" else -1
