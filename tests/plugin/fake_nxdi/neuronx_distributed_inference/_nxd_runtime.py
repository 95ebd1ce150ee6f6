"""The loaded model NxDI calls (`traced_model`, with `.nxd_model`): neuronx-distributed's
ModelBuilder v1 runtime and what the compiled graphs compute, on a KV cache that stores
token ids.

The runtime (neuronx-distributed 0.16-0.18 trace/model_builder.py build_nxd_model,
trace/spmd.py NxDModel; unchanged from SDK 2.27 to 2.29):
- one weight set and one state (the KV cache) shared by every submodel and bucket;
- `input_shape_map` maps the shapes of every bucket's example inputs
  (ModelWrapper.input_generator) to (tag, bucket index), built submodel by submodel in
  the order they were added, so a later submodel whose inputs have the same shapes
  silently takes them over from an earlier one; `router` looks a call's inputs up by
  their exact shapes, batch rows and sampling_params included, and fails with "Input
  shape ... not found in input_shape_map" otherwise;
- `forward(inputs)`: the router, the bucket's flattener (`flattener_map`,
  f"{tag}_{index}"), the tag's bucket model (`models.<tag>.forward(flattened inputs,
  bucket index tensor)`, SPMDBucketModelScript, which returns the graph's non-aliased
  outputs as a list), then ONE output packer traced from the first submodel's first
  bucket (build_packer): it returns that graph's outputs, a tensor for one, a list for
  more, and fails on a result with fewer. NxDI reaches `nxd_model.models.<tag>` itself
  (application_base._get_spmd_model_objects).

The graphs (NxDI models/model_base.py NeuronBaseModel.forward and
modules/kvcache/kv_cache_manager.py, 0.7-0.9 alike):
- contiguous context encoding writes the bucket's input ids into cache line seq_ids[r]
  from position 0 (update_cache_const_indices) and answers for the query at
  argmax(position_ids) (torch.max(position_ids, dim=1).indices; per window with
  windowed context encoding, see _context_query), which attends the keys up to it whose
  attention mask is 1;
- contiguous token generation reads cache positions whose mask is 1 plus the active
  token, then writes the token at its position. With a sliding window W (Mistral,
  gpt-oss, Gemma3) a cache line is a rolling buffer: key j lives at j % (W - 1), a decode
  reads the W - 1 newest keys and writes at position % (W - 1), wherever the position. Row r is cache line r, except in a
  batch-bucketing graph smaller than the KV cache (0.8+), where it is line seq_ids[r]
  (update_kv_by_layer_id / get_kv_by_layer_id);
- block layout: the state tensors have NxDI's prefix-caching shapes and dtype
  (`block_kv_shape`); a graph writes a token into every layer's K and V (each its own
  value, `slot_value`) and reads layer 0's K. The prefix (context encoding) or cached
  context (token generation) is
  read through the block table the wrapper cropped to bucket // pa_block_size blocks, so
  positions past the last whole block are not read; new tokens are written to their
  slot_mapping slots (-1: nowhere; token generation recomputes the others from the
  positions and the cropped block table, see _tokengen_slots). Token generation attends the cached positions whose
  mask is 1 (attention_base compute_for_token_gen masks its prior scores); a context
  encoding over a cached prefix runs NeuronAttentionBase.perform_prefix_prefill, which
  attends every position of the prefix bucket (see modules/attention/attention_base).
A query's logits peak at (sum over the keys it attends of (token id + 1), minus 1) mod
vocab, with GARBAGE for a key never written, and fall off by one per token id above
the peak, so a wrong slot, line, block, prefix, pad or last-token choice shows.
On-device sampling runs the Sampler on these logits; the outputs are [tokens] or
[tokens, logits] or [logits], by the output_logits of the submodel's own config when it
was compiled (each ModelWrapper traces its deep copy of the config,
DecoderModelInstance; NeuronBaseModel.forward `if self.neuron_config.output_logits`).
"""

import math

import torch

from neuronx_distributed_inference.models.model_wrapper import CONTEXT_ENCODING_MODEL_TAG
from neuronx_distributed_inference.modules.attention.attention_base import NeuronAttentionBase
from neuronx_distributed_inference.modules.generation.sampling import Sampler

GARBAGE = 389  # what an attended key contributes that no call ever wrote
# attention_base NeuronAttentionBase.forward (ef2731e :1745-1751): with prefix caching a
# context encoding narrower than 128 tokens takes the token-generation attention (prior
# scores masked); from 128 on it takes perform_prefix_prefill.
PREFIX_PREFILL_MIN_WIDTH = 128


# What a block-layout graph writes for a token into KV tensor i (K0, V0, K1, ...): the
# token's value plus i * KV_INDEX_STRIDE, so a block moved into the wrong layer or K/V
# shows in the one the graphs read (index 0).
KV_INDEX_STRIDE = 4096


def slot_value(token, index):
    return float(token) + 1 + KV_INDEX_STRIDE * index


def kv_heads_per_rank(neuron_config, text) -> int:
    """modules/kvcache/kv_cache_manager.py _get_num_kv_heads_per_rank (ef2731e lines
    166-186) with attention/gqa.py determine_sharding_strategy and
    get_shardable_head_counts (lines 62-100): KV heads replicated up to the TP degree
    where they divide it (GQA.REPLICATE_TO_TP_DEGREE), else converted to multi-head
    attention, split evenly over the ranks."""
    tp = neuron_config.tp_degree
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    padded_heads = heads + (-heads % tp)
    if heads == kv:
        kv = padded_heads
    elif kv < tp or kv % tp:
        kv = tp if tp % kv == 0 else padded_heads
    return kv // tp


def block_kv_shape(neuron_config, text):
    """modules/kvcache/block_kv_cache_manager.py _init_kv_shape_for_prefix_caching
    (ef2731e lines 48-77): (pa_num_blocks + 1 reserved block, pa_block_size, heads per
    rank, head_dim), the block dimension tiled when a sequence spans fewer than 128 blocks
    and the block token-generation kernel is off."""
    c = neuron_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads = kv_heads_per_rank(c, text)
    per_seq = (c.max_length + c.pa_block_size - 1) // c.pa_block_size
    if per_seq < 128 and not c.attn_block_tkg_nki_kernel_enabled:
        tiling = 2 ** math.ceil(math.log2(128 / per_seq))
        return (c.pa_num_blocks + 1, tiling, c.pa_block_size // tiling, heads, head_dim)
    return (c.pa_num_blocks + 1, c.pa_block_size, heads, head_dim)


def shape_key(tensors) -> str:
    """model_builder's input_shape_map key: the list of every input's shape."""
    return str([list(t.shape) for t in tensors])


class _Named:
    """A torch.nn.ModuleDict of a scripted NxDModel as Python code reaches it: entries
    are attributes (getattr(nxd_model.models, tag))."""

    def __init__(self, entries):
        self.__dict__.update(entries)

    def items(self):
        return self.__dict__.items()


class BucketModel:
    """`nxd_model.models.<tag>` (SPMDBucketModelScript): forward(flattened inputs, bucket
    index tensor) runs that bucket's graph, whose inputs must have the shapes it was
    compiled for (the runtime refuses others), and returns its outputs as a list."""

    def __init__(self, nxd_model, tag, keys):
        self.nxd_model = nxd_model
        self.tag = tag
        self.keys = keys

    def forward(self, inputs, bucket_idx_tensor):
        index = int(bucket_idx_tensor)
        if shape_key(inputs) != self.keys[index]:
            raise RuntimeError(f"NRT: {self.tag} bucket {index} was compiled for input shapes "
                               f"{self.keys[index]}, got {shape_key(inputs)}")
        return self.nxd_model.run_graph(self.tag, index, inputs)


class Flattener:
    """`nxd_model.flattener_map[f"{tag}_{index}"]`: the bucket's inputs as the list its
    graph takes (traced from that bucket's example inputs)."""

    def __call__(self, inputs):
        return list(inputs)


class Packer:
    """The one packer build_packer traces from the first submodel's first bucket's
    non-aliased outputs: it returns those outputs (a tensor for one, a list for more)
    and indexes past the end of a shorter result."""

    def __init__(self, count):
        self.count = count

    def __call__(self, outputs):
        if len(outputs) < self.count:
            raise IndexError(f"list index out of range: the packer was traced for "
                             f"{self.count} outputs, the graph returned {len(outputs)}")
        return outputs[0] if self.count == 1 else list(outputs[: self.count])


class NxDModel:
    """`traced_model.nxd_model`: per-rank state (the KV cache), the per-tag bucket models
    and flatteners, the router, the packer and forward (see the module docstring)."""

    def __init__(self, neuron_config, text, graphs):
        c = neuron_config
        self.config = c
        self.vocab_size = text.vocab_size
        self.window = getattr(text, "sliding_window", None)
        self.block = c.is_block_kv_layout
        if self.block:
            # kv_cache_manager.py lines 138-142: the cache dtype
            shape, dtype = block_kv_shape(c, text), (getattr(c, "attention_dtype", None)
                                                     or c.torch_dtype)
        else:
            shape, dtype = (c.max_batch_size, 1, c.seq_len, 1), torch.float32
        self.state = [{f"kv_mgr.past_key_values.{i}": torch.zeros(shape, dtype=dtype)
                       for i in range(2 * text.num_hidden_layers)}
                      for _ in range(c.tp_degree)]
        # graphs: tag -> {"output_logits": bool, "graphs": [(bucket, example input shapes)]}
        # in the order the submodels were added
        self.buckets = {tag: [bucket for bucket, _ in g["graphs"]] for tag, g in graphs.items()}
        self.output_logits = {tag: g["output_logits"] for tag, g in graphs.items()}
        self.input_shape_map = {key: (tag, index) for tag, g in graphs.items()
                                for index, (_, key) in enumerate(g["graphs"])}
        self.models = _Named({tag: BucketModel(self, tag, [key for _, key in g["graphs"]])
                              for tag, g in graphs.items()})
        self.flattener_map = _Named({f"{tag}_{index}": Flattener() for tag, g in graphs.items()
                                     for index in range(len(g["graphs"]))})
        self.sampler = Sampler(c) if c.on_device_sampling_config is not None else None
        first = next(iter(graphs))
        self.packer = Packer(1 + int(self.sampler is not None and self.output_logits[first]))
        self.attention = NeuronAttentionBase()
        # test instrumentation: (tag, bucket), the inputs and the bytes of each output
        # ("tokens" / "logits") of every graph that ran, in order
        self.ran = []
        self.inputs = []
        self.returned = []

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
        tag, index = self.router(inputs)
        flattened = getattr(self.flattener_map, f"{tag}_{index}")(inputs)
        result = getattr(self.models, tag).forward(flattened, torch.tensor(index))
        return self.packer(result)

    def run_graph(self, tag, index, inputs):
        """What bucket `index` of submodel `tag` computes, as its list of outputs."""
        self.ran.append((tag, self.buckets[tag][index]))
        self.inputs.append(tuple(inputs))
        if self.block:
            contexts = self._block(tag, inputs)
        else:
            contexts = self._contiguous(tag, inputs)
            for rank_state in self.state[1:]:
                rank_state["kv_mgr.past_key_values.0"].copy_(self.memory)
        logits = self._logits(contexts)
        if self.sampler is None:
            outputs = {"logits": logits}
        else:
            outputs = {"tokens": self.sampler(logits[:, -1, :], inputs[4]).to(torch.int32)}
            if self.output_logits[tag]:
                outputs["logits"] = logits
        self.returned.append({name: t.numel() * t.element_size() for name, t in outputs.items()})
        return list(outputs.values())

    @staticmethod
    def _value(stored) -> int:
        return int(stored) if stored else GARBAGE

    def _logits(self, contexts):
        """[rows, 1, vocab padded to a multiple of tp_degree]: the lm_head's padded
        columns hold the float minimum (model_base.py mask_padded_logits), and with
        output_logits the shards are gathered whole (_gather_along_dim), pads included."""
        tp = self.config.tp_degree
        width = -(-self.vocab_size // tp) * tp
        logits = torch.full((len(contexts), 1, width), torch.finfo(torch.float32).min)
        ids = torch.arange(self.vocab_size)
        for row, values in enumerate(contexts):
            peak = (sum(values) - 1) % self.vocab_size
            logits[row, 0, : self.vocab_size] = -((ids - peak) % self.vocab_size).float()
        return logits

    def _context_query(self, positions):
        """The query whose hidden state a context encoding answers with: the first
        maximum of position_ids (torch.max(..).indices); with windowed context encoding
        the first maximum of the last window whose positions are not all 1, NxDI's pad
        position (model_base.py NeuronBaseModel.forward, `is_valid_window`)."""
        size = self.config.windowed_context_encoding_size
        if not size:
            return int(torch.argmax(positions))
        query = 0
        for start in range(0, positions.shape[0], size):
            window = positions[start:start + size]
            if bool(torch.any(window != 1)):
                query = start + int(torch.argmax(window))
        return query

    def _contiguous(self, tag, inputs):
        input_ids, mask, positions, seq_ids = inputs[:4]
        memory = self.memory[:, 0, :, 0]
        rows = input_ids.shape[0]
        if tag == CONTEXT_ENCODING_MODEL_TAG:
            contexts = []
            for r in range(rows):
                line = int(seq_ids[r]) if self.config.is_continuous_batching else r
                query = self._context_query(positions[r])
                if self.window:
                    contexts.append(self._window_context(memory[line], input_ids[r],
                                                         int(mask[r].sum()), query))
                    continue
                memory[line, : input_ids.shape[1]] = input_ids[r].float() + 1
                keys = [j for j in range(query + 1) if mask[r, j] == 1 or j == query]
                contexts.append([int(input_ids[r, j]) + 1 for j in keys])
            return contexts
        lines = (seq_ids if rows < self.config.kv_cache_batch_size
                 else torch.arange(rows)).tolist()
        if self.window:
            contexts = [self._window_decode(memory[line], int(input_ids[r, 0]),
                                            int(positions[r, 0]))
                        for r, line in enumerate(lines)]
            return contexts
        contexts = [[self._value(memory[line, j]) for j in range(mask.shape[1])
                     if mask[r, j] == 1] + [int(input_ids[r, 0]) + 1]
                    for r, line in enumerate(lines)]
        for r, line in enumerate(lines):
            memory[line, int(positions[r, 0])] = float(input_ids[r, 0]) + 1
        return contexts

    def _window_context(self, line, ids, length, query):
        """A sliding-window context encoding (model_base._create_windowed_attn_mask_cte:
        key j visible to query i iff i - window < j <= i) that leaves the last window - 1
        keys in the rolling cache line, key j at j % (window - 1)."""
        size = self.window - 1
        for j in range(max(0, length - size), length):
            line[j % size] = float(ids[j]) + 1
        return [int(ids[j]) + 1 for j in range(max(0, query - self.window + 1), query + 1)]

    def _window_decode(self, line, token, position):
        """A sliding-window decode: reads cache slots idx < min(position, window - 1)
        (model_base._create_windowed_attn_mask_tkg), then writes its token at
        position % (window - 1) (kv_cache_manager._get_index_to_update_new_position)."""
        size = self.window - 1
        context = [self._value(line[idx]) for idx in range(min(position, size))]
        line[position % size] = float(token) + 1
        return context + [token + 1]

    def _prefix_prefill_sum(self, stored, visible, active):
        """The sum of the values the last active query attends, through the model's
        perform_prefix_prefill (so a patch of it takes effect): every key scores 0 and
        carries the value [v, 0]; one more prior key, always visible, carries [0, 1], so
        the output [sum / (n + 1), 1 / (n + 1)] gives back the sum over the n keys
        attended, counted as often as they are attended (NxDI's float32 scores keep the
        ratio exact to well under one)."""
        dtype = torch.float64
        prior = torch.tensor([[v, 0.0] for v in stored] + [[0.0, 1.0]], dtype=dtype)
        mask = torch.tensor([visible + [True]], dtype=torch.int64)
        values = torch.tensor([[v, 0.0] for v in active], dtype=dtype)
        q = len(active)
        out, _ = self.attention.perform_prefix_prefill(
            torch.zeros(1, 1, q, 2, dtype=dtype), torch.zeros(1, 1, q, 2, dtype=dtype),
            values[None, None], q, 1, mask,
            (torch.zeros_like(prior)[None, None], prior[None, None]),
            torch.ones(q, q, dtype=torch.bool).tril()[None, None])
        total, null_share = (float(x) for x in out[0, 0, -1])
        return round(total / null_share)

    def _tokengen_slots(self, positions, slot_mapping, block_table):
        """Token generation recomputes its write slots inside the graph from the
        positions and the cropped block table, keeping only the -1 of pad rows
        (block_kv_cache_manager.generate_tokengen_slot_mapping, called from
        NeuronBaseModel.forward in 0.7-0.9)."""
        size = self.config.pa_block_size
        rows = torch.arange(positions.shape[0])
        blocks = block_table[rows, (positions // size).squeeze(1)]
        slots = (size * blocks + (positions % size).squeeze(1)).unsqueeze(1)
        return torch.where(slot_mapping >= 0, slots, torch.full_like(slots, -1))

    def _block(self, tag, inputs):
        input_ids, mask, positions = inputs[:3]
        slot_mapping, block_table = inputs[11], inputs[12]
        flat = self._slot_rows(self.memory)[:, 0]  # layer 0's K, one value a slot
        size = self.config.pa_block_size
        readable = block_table.shape[1] * size if block_table.dim() == 2 else 0
        width = min(mask.shape[1] if mask.dim() == 2 else 0, readable)
        contexts = []
        for r in range(input_ids.shape[0]):
            blocks = block_table[r].tolist() if readable else []
            stored = [self._value(flat[blocks[j // size] * size + j % size])
                      if blocks[j // size] >= 0 else GARBAGE for j in range(readable)]
            prior = [stored[j] for j in range(width) if mask[r, j] == 1]
            if tag != CONTEXT_ENCODING_MODEL_TAG:
                contexts.append(prior + [int(input_ids[r, 0]) + 1])
                continue
            last = int(torch.argmax(positions[r]))
            active = [int(t) + 1 for t in input_ids[r, : last + 1]]
            if readable and input_ids.shape[1] >= PREFIX_PREFILL_MIN_WIDTH:
                visible = [j < width and int(mask[r, j]) == 1 for j in range(readable)]
                contexts.append([self._prefix_prefill_sum(stored, visible, active)])
            else:
                contexts.append(prior + active)
        if tag != CONTEXT_ENCODING_MODEL_TAG:
            slot_mapping = self._tokengen_slots(positions, slot_mapping, block_table)
        for slots, tokens in zip(slot_mapping.tolist(), input_ids.tolist()):
            for slot, token in zip(slots, tokens):
                if slot >= flat.numel():
                    raise IndexError(f"NRT: KV slot {slot} out of bounds for "
                                     f"{self.config.pa_num_blocks + 1} blocks of {size}")
                if slot >= 0:
                    self._write_slot(slot, token)
        return contexts

    @staticmethod
    def _slot_rows(tensor):
        """A block-layout state tensor as (slots, heads * head_dim): the flat slot index
        block_kv_cache_manager._update_cache_with_reshape scatters at (lines 246-303)."""
        return tensor.view(-1, tensor.shape[-2] * tensor.shape[-1])

    def _write_slot(self, slot, token):
        """Every layer's K and V of every rank take the token at `slot`."""
        for rank_state in self.state:
            for i in range(len(rank_state)):
                rows = self._slot_rows(rank_state[f"kv_mgr.past_key_values.{i}"])
                rows[slot] = slot_value(token, i)


class TracedModel:
    """`NeuronApplicationBase.traced_model` (NxDModelExecutor): called by every
    ModelWrapper with its positional inputs, it runs `nxd_model.forward`, router and
    packer included; `nxd_model` holds the state (warm-up calls it directly)."""

    def __init__(self, nxd_model):
        self.nxd_model = nxd_model

    # test instrumentation: the graphs that ran, their inputs and their output bytes
    @property
    def ran(self):
        return self.nxd_model.ran

    @property
    def inputs(self):
        return self.nxd_model.inputs

    @property
    def returned(self):
        return self.nxd_model.returned

    def __call__(self, *inputs):
        return self.nxd_model.forward(list(inputs))
