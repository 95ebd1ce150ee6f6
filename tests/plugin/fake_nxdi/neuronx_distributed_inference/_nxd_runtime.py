"""The loaded model NxDI calls (`traced_model`, with `.nxd_model`): neuronx-distributed's
router and what the compiled graphs compute, on a KV cache that stores token ids.

Routing (neuronx-distributed trace/model_builder.py, trace/spmd.py): at trace time
`input_shape_map` maps the shapes of every bucket's example inputs
(ModelWrapper.input_generator) to its graph; `NxDModel.router` looks a call's inputs up
by their exact shapes, batch rows and sampling_params included, and fails with
"Input shape ... not found in input_shape_map" otherwise.

The graphs (NxDI models/model_base.py NeuronBaseModel.forward and
modules/kvcache/kv_cache_manager.py, 0.7-0.9 alike):
- contiguous context encoding writes the bucket's input ids into cache line seq_ids[r]
  from position 0 (update_cache_const_indices) and answers for the query at
  argmax(position_ids) (torch.max(position_ids, dim=1).indices), which attends the
  keys up to it whose attention mask is 1;
- contiguous token generation reads cache positions whose mask is 1 plus the active
  token, then writes the token at its position. Row r is cache line r, except in a
  batch-bucketing graph smaller than the KV cache (0.8+), where it is line seq_ids[r]
  (update_kv_by_layer_id / get_kv_by_layer_id);
- block layout: the prefix (context encoding) or cached context (token generation) is
  read through the block table the wrapper cropped to bucket // pa_block_size blocks, so
  positions past the last whole block are not read; new tokens are written to their
  slot_mapping slots (-1: nowhere).
A query's logits peak at (sum over the keys it attends of (token id + 1), minus 1) mod
vocab, with GARBAGE for a key never written, and fall off by one per token id above
the peak, so a wrong slot, line, block, prefix, pad or last-token choice shows.
On-device sampling runs the Sampler on these logits; the outputs are [tokens] or
[tokens, logits] (output_logits) or [logits], one tensor when there is one (the packer).
"""

import torch

from neuronx_distributed_inference.models.model_wrapper import CONTEXT_ENCODING_MODEL_TAG
from neuronx_distributed_inference.modules.generation.sampling import Sampler

GARBAGE = 389  # what an attended key contributes that no call ever wrote


def shape_key(tensors) -> str:
    """model_builder's input_shape_map key: the list of every input's shape."""
    return str([list(t.shape) for t in tensors])


class NxDModel:
    """`traced_model.nxd_model`: per-rank state (the KV cache), router and forward."""

    def __init__(self, neuron_config, vocab_size, num_layers, graphs):
        c = neuron_config
        self.config = c
        self.vocab_size = vocab_size
        self.block = c.is_block_kv_layout
        shape = ((c.pa_num_blocks, c.pa_block_size, 1, 1) if self.block
                 else (c.max_batch_size, 1, c.seq_len, 1))
        self.state = [{f"kv_mgr.past_key_values.{i}": torch.zeros(shape)
                       for i in range(2 * num_layers)} for _ in range(c.tp_degree)]
        # graphs: tag -> [(bucket, example input shapes)] in compile order
        self.buckets = {tag: [bucket for bucket, _ in items] for tag, items in graphs.items()}
        self.input_shape_map = {key: (tag, index) for tag, items in graphs.items()
                                for index, (_, key) in enumerate(items)}
        self.sampler = Sampler(c) if c.on_device_sampling_config is not None else None

    @property
    def memory(self):
        return self.state[0]["kv_mgr.past_key_values.0"]

    def router(self, inputs):
        key = shape_key(inputs)
        if key not in self.input_shape_map:
            raise ValueError(f"Input shape {key} not found in input_shape_map: "
                             f"{list(self.input_shape_map)}")
        return self.input_shape_map[key]

    def forward(self, inputs):
        tag, _ = self.router(inputs)
        contexts = (self._block(tag, inputs) if self.block
                    else self._contiguous(tag, inputs))
        for rank_state in self.state[1:]:
            rank_state["kv_mgr.past_key_values.0"].copy_(self.memory)
        logits = self._logits(contexts)
        if self.sampler is None:
            outputs = [logits]
        else:
            outputs = [self.sampler(logits[:, -1, :], inputs[4]).to(torch.int32)]
            if self.config.output_logits:
                outputs.append(logits)
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def _value(stored) -> int:
        return int(stored) if stored else GARBAGE

    def _logits(self, contexts):
        logits = torch.empty(len(contexts), 1, self.vocab_size)
        ids = torch.arange(self.vocab_size)
        for row, values in enumerate(contexts):
            peak = (sum(values) - 1) % self.vocab_size
            logits[row, 0] = -((ids - peak) % self.vocab_size).float()
        return logits

    def _contiguous(self, tag, inputs):
        input_ids, mask, positions, seq_ids = inputs[:4]
        memory = self.memory[:, 0, :, 0]
        rows = input_ids.shape[0]
        if tag == CONTEXT_ENCODING_MODEL_TAG:
            contexts = []
            for r in range(rows):
                line = int(seq_ids[r]) if self.config.is_continuous_batching else r
                memory[line, : input_ids.shape[1]] = input_ids[r].float() + 1
                query = int(torch.argmax(positions[r]))
                keys = [j for j in range(query + 1) if mask[r, j] == 1 or j == query]
                contexts.append([int(input_ids[r, j]) + 1 for j in keys])
            return contexts
        lines = (seq_ids if rows < self.config.kv_cache_batch_size
                 else torch.arange(rows)).tolist()
        contexts = [[self._value(memory[line, j]) for j in range(mask.shape[1])
                     if mask[r, j] == 1] + [int(input_ids[r, 0]) + 1]
                    for r, line in enumerate(lines)]
        for r, line in enumerate(lines):
            memory[line, int(positions[r, 0])] = float(input_ids[r, 0]) + 1
        return contexts

    def _block(self, tag, inputs):
        input_ids, mask, positions = inputs[:3]
        slot_mapping, block_table = inputs[11], inputs[12]
        flat = self.memory.view(-1)
        size = self.config.pa_block_size
        readable = block_table.shape[1] * size if block_table.dim() == 2 else 0
        width = min(mask.shape[1] if mask.dim() == 2 else 0, readable)
        contexts = []
        for r in range(input_ids.shape[0]):
            prior = [self._value(flat[int(block_table[r, j // size]) * size + j % size])
                     for j in range(width) if mask[r, j] == 1]
            last = int(torch.argmax(positions[r])) if tag == CONTEXT_ENCODING_MODEL_TAG else 0
            contexts.append(prior + [int(t) + 1 for t in input_ids[r, : last + 1]])
        for slots, tokens in zip(slot_mapping.tolist(), input_ids.tolist()):
            for slot, token in zip(slots, tokens):
                if slot >= flat.numel():
                    raise IndexError(f"NRT: KV slot {slot} out of bounds for "
                                     f"{self.config.pa_num_blocks} blocks of {size}")
                if slot >= 0:
                    flat[slot] = float(token) + 1
        return contexts


class TracedModel:
    """`NeuronApplicationBase.traced_model`: called by every ModelWrapper with its
    positional inputs; `nxd_model` holds the state (warm-up calls it directly)."""

    def __init__(self, nxd_model):
        self.nxd_model = nxd_model
        self.ran = []  # test instrumentation: (tag, bucket) of every model call, in order

    def __call__(self, *inputs):
        tag, index = self.nxd_model.router(list(inputs))
        self.ran.append((tag, self.nxd_model.buckets[tag][index]))
        return self.nxd_model.forward(list(inputs))
