"""Test double of NxD Inference (neuronx-distributed-inference) at the plugin's seam.

It reproduces the signatures and call paths the plugin and its patches touch, copied in
shape from the NxDI source (NeuronConfig/InferenceConfig, NeuronBaseForCausalLM.forward,
ModelWrapper.get_target_bucket, HuggingFaceGenerationAdapter.prepare_inputs_for_generation,
MODEL_TYPES, prepare_sampling_params). The "device" is a KV cache that stores token ids:
a row's logits peak at (sum of its context's token ids) mod vocab, so a wrong slot, block
table, seq_id order or prefix makes a visible difference. `_release.RELEASE`
(FAKE_NXDI_RELEASE) selects which release's defects it reproduces.
"""
