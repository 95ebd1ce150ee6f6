"""Run under an interpreter with NxD Inference: the plugin's NxDI patches on that real
release. Prints one JSON object: each patch's outcome as the backend applies them
(import_nxdi), and the effect of the patches whose fixed code runs on the CPU outside a
model (the forward-time ones run through the backend in the other -m nxdi tests):
- cte-exact-bucket: NxDI's ModelWrapper.get_target_bucket on a context as long as its
  first bucket (bucket_fit's stand-in wrapper, buckets [2, 4]);
- sampler-top-p: the probabilities NxDI's on-device Sampler._multinomial_sample draws
  from, per top_p, for one row of logits (the test compares them with vLLM's own
  apply_top_k_top_p, which this environment has not);
- vision-scatter-scratch-row: Qwen3-VL's text module's scatter_by_index_put on a
  three-token target, rows for positions 0 and 2 and a padding entry at 3 (the scratch
  row);
- i2t-capture-hook: whether NeuronBaseForImageToText.forward's tensor_capture_hook
  resolves (a parameter, or the module global the patch defines);
- qwen2-vl-mrope: whether NeuronQwen2VLRotaryEmbedding, given three different position
  rows, rotates section i as NxDI's own 2-D path rotates row i, and the shapes of the
  rotary_position_ids Qwen2VLTextModelWrapper.input_generator traces (context buckets 4
  and 8 at batch 1, token generation at batch 2) on a stand-in wrapper of those sizes.

    python nxdi_patches_probe.py LOGITS_JSON TOP_PS_JSON
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

from neuron_plugin.backends.nxd.nxdi import import_nxdi
from neuron_plugin.patches import bucket_fit, sampler_top_p


def main(logits: list[float], top_ps: list[float]) -> dict:
    nxdi = import_nxdi()
    from neuronx_distributed_inference.models import model_wrapper
    from neuronx_distributed_inference.modules.generation import sampling

    tokens = torch.ones((1, bucket_fit.PROBE_BUCKETS[0]), dtype=torch.int32)
    wrapper = bucket_fit._stand_in_wrapper(model_wrapper)
    chosen = model_wrapper.ModelWrapper.get_target_bucket(wrapper, tokens, tokens, tokens)
    row = torch.tensor(logits)
    nuclei = []
    for top_p in top_ps:
        sampler = sampler_top_p._stand_in(sampling.Sampler)
        object.__setattr__(sampler, "global_topk", len(logits))
        params = torch.tensor([[float(len(logits)), top_p, 1.0]])
        indices, probs = sampler._multinomial_sample(row[None, :], params, True, 1, None)
        nucleus = torch.zeros_like(row)
        nucleus[indices[0]] = probs[0]
        nuclei.append(nucleus.tolist())
    from neuronx_distributed_inference.models import image_to_text_model_base
    from neuronx_distributed_inference.models.qwen3_vl import modeling_qwen3_vl_text

    scattered = modeling_qwen3_vl_text.scatter_by_index_put(
        torch.zeros(1, 3, 2), torch.tensor([[1.0, 1.0], [2.0, 2.0], [5.0, 5.0]]),
        torch.tensor([[[0], [2], [3]]]))
    forward = image_to_text_model_base.NeuronBaseForImageToText.forward
    hook = "tensor_capture_hook"
    return {"version": nxdi.version, "status": dict(nxdi.patch_status),
            "cte_bucket": int(chosen), "nuclei": nuclei, "scattered": scattered.tolist(),
            "capture_hook_resolves": hook in forward.__code__.co_varnames
            or hasattr(image_to_text_model_base, hook),
            **qwen2_vl_mrope(model_wrapper)}


def qwen2_vl_mrope(model_wrapper) -> dict:
    from neuronx_distributed_inference.models.qwen2_vl import modeling_qwen2_vl_text as text

    config = SimpleNamespace(hidden_size=8, num_attention_heads=1, rope_theta=10000.0)
    embedding = text.NeuronQwen2VLRotaryEmbedding(config)
    x = torch.zeros(1)
    rows = torch.tensor([[[0, 1, 2, 3]], [[0, 5, 5, 9]], [[0, 7, 3, 1]]])
    cos, sin = embedding(x, rows)
    each = []
    for i in range(3):
        row_cos, row_sin = embedding(x, rows[i])  # NxDI's own 2-D path: [3, 1, 4, 8]
        each.append(bool(torch.equal(cos[i], row_cos[0]) and torch.equal(sin[i], row_sin[0])))
    shapes = []
    for tag, buckets, batch, active in (
        (model_wrapper.CONTEXT_ENCODING_MODEL_TAG, [4, 8], 1, None),
        (model_wrapper.TOKEN_GENERATION_MODEL_TAG, [8], 2, 1),
    ):
        neuron_config = SimpleNamespace(
            buckets=buckets, batch_size=batch, bucket_n_active_tokens=active is None,
            n_active_tokens=active, seq_len=8, torch_dtype=torch.float32)
        wrapper = SimpleNamespace(
            neuron_config=neuron_config, tag=tag,
            config=SimpleNamespace(neuron_config=neuron_config, hidden_size=4),
            get_dummy_vision_inputs=text.Qwen2VLTextModelWrapper.get_dummy_vision_inputs)
        examples = text.Qwen2VLTextModelWrapper.input_generator(wrapper)
        shapes += [list(example[21].shape) for example in examples]
    return {"mrope_sections_equal_one_row_each": each, "traced_rotary_shapes": shapes}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))
