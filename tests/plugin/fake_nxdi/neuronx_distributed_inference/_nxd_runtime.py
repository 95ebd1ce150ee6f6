"""The loaded model NxDI calls (`traced_model`, with `.nxd_model`): neuronx-distributed's
ModelBuilder v1 runtime and what the compiled graphs compute, on a KV cache that stores
token ids.

The runtime (neuronx-distributed 0.16-0.18 trace/model_builder.py build_nxd_model,
trace/spmd.py NxDModel; unchanged from SDK 2.27 to 2.29):
- one weight set and one state (the KV cache) shared by every submodel and bucket; the
  state's tensors (`nxd_model.state`) live on the device, where a client may only view,
  copy contiguous slices to and from the host, never gather, scatter or copy between
  different device tensors (`_device.DeviceTensor`);
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
- block layout: a sliding-window prefill fails (Mistral, Llama with a window; windowed
  attention keeps window - 1 keys its BlockKVCacheManager cannot write); the state
  tensors have NxDI's prefix-caching shapes and dtype
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

LoRA (modules/lora_serving, lora_layer.py BaseMultiLora): the device weights hold each
adapter slot's weight ("lora.weight" [max_loras], one value per adapter, see
lora_serving/checkpoint.py) and weight_active [batch_size], one row per sequence. A
context encoding copies weight[adapter_ids[r]] into weight_active[seq_ids[r]]
(update_lora_tensor_for_continuous_batching; row r without continuous batching,
update_lora_tensor) and uses it; a token generation reads weight_active[seq_ids[r]]
(update_lora_adapter_ids returns seq_ids). The row's value is added to its peak.
On-device sampling runs the Sampler on these logits; the outputs are [tokens] or
[tokens, logits] or [logits], by the output_logits of the submodel's own config when it
was compiled (each ModelWrapper traces its deep copy of the config,
DecoderModelInstance; NeuronBaseModel.forward `if self.neuron_config.output_logits`),
one tensor when there is one (the packer).

Speculation (NxDI model_base.py, ef2731e; the same in 0.7-0.9 but for the padding
token, see _release):
- a graph with speculation_length input tokens (`_is_for_speculation`, lines 184-185;
  the speculation model, or the target inside a fused graph) attends the cached keys its
  mask allows plus the active tokens causally (the spec mask and the tril active mask,
  lines 246-251 and 813-821), writes the KV of all of them, rejected drafts included
  (by position, or by the host's slot mapping as given in a fused graph: lines 766-774
  recompute slots only without fused speculation) and, with on-device sampling and no
  do_sample, answers the argmax of every position (`_sample_on_device`, lines
  1163-1173; with do_sample one token sampled from the last position, 1174-1183);
- a fused graph (NeuronFusedSpecModel, enable_fused_speculation) holds a draft decoder
  with its own KV cache ("draft_model." state) beside the target's ("target_model.").
  Its context encoding encodes the prompt with both (`_context_encoding_forward`,
  lines 1750-1810) and answers `_cte_postprocessor`'s list (2756-2797). Its token
  generation (`_token_gen_forward`, 1812-1929) runs the draft speculation_length times,
  step i on the last candidate at position p + i (slot_mapping[:, i] in the block
  layout, where the draft recomputes the slot as any non-fused token generation does),
  sampling each draft with the draft's own sampler (the request's values under
  dynamic), and after each step sets the column of every row's p + i in the draft's
  mask (`index_fill_`: all rows, so a row may attend another row's column; on the
  device an HLO scatter, whose out-of-bounds columns are skipped); the last step only
  writes the KV of the last used draft. The target then verifies [last token, drafts
  1..k-1] at p..p+k-1 with the host's mask and slot mapping, and `_tkg_postprocessor`
  (2799-2855) answers [accepted tokens (padded), next input ids, next attention mask,
  next position ids]. With output_logits (the submodel's own, as above) the draft's and
  the target's logits follow ([rows, k, vocab] each in token generation); the KV caches
  are aliased state, not outputs (model_wrapper.py lines 1580-1610); the packer is
  traced from the fused context encoding's outputs. NxDI's context encoding with
  output_logits lists the draft's and target's logits twice before the caches
  (lines 1800-1809), so its aliasing indices (2 * 3 + i) fall one entry early there;
  the double returns the six leading outputs as the token-generation graph does.
EAGLE (enable_eagle_speculation, NeuronFusedSpecModel.forward lines 2878-2967): the same
contract, with the head as the draft decoder and its state handed over inside the graph
(the target's hidden states, the rolling buffer), so the double computes its drafts as
a fused draft's; a token generation clips positions to the bucket less
speculation_length (_eagle_clamped), the draft's mask takes each row's own column
(a per-row scatter, not index_fill_ over the batch), and a head NxDI would not build as
an EAGLE draft
drafts wrong (application_base._eagle_misfit).
The draft's logits peak where the target's do, except one token id higher when the
query attends a multiple of DRAFT_MISS_EVERY keys: with a draft cache that mirrors the
target's, the draft for position q (from the query at q - 1, attending q keys) is
rejected exactly when q % DRAFT_MISS_EVERY == 0, so tests see drafts accepted, rejected
and all accepted, and can predict which; a draft cache that does not mirror the
target's makes its drafts wrong.
"""

import math

import torch

from neuronx_distributed_inference._device import on_device
from neuronx_distributed_inference._release import ACCEPTANCE_PADDING_TOKEN
from neuronx_distributed_inference.models.model_wrapper import CONTEXT_ENCODING_MODEL_TAG
from neuronx_distributed_inference.modules.attention.attention_base import NeuronAttentionBase
from neuronx_distributed_inference.modules.attention.gqa import preshard_head_slots, read_kv_slots
from neuronx_distributed_inference.modules.generation.sampling import Sampler

GARBAGE = 389  # what an attended key contributes that no call ever wrote
# attention_base NeuronAttentionBase.forward (ef2731e :1745-1751): with prefix caching a
# context encoding narrower than 128 tokens takes the token-generation attention (prior
# scores masked); from 128 on it takes perform_prefix_prefill.
PREFIX_PREFILL_MIN_WIDTH = 128
DRAFT_MISS_EVERY = 4  # see the module docstring
# model_base.py _create_windowed_attn_mask_spec_decode (ef2731e line 329).
WINDOW_SPEC_ASSERT = ("Currently we only support speculative decoding with sliding window "
                      "attention when the cascaded tkg attention kernel is enabled")


# What a block-layout graph writes for a token into KV tensor i (K0, V0, K1, ...): the
# token's value plus i * KV_INDEX_STRIDE, so a block moved into the wrong layer or K/V
# shows in the one the graphs read (index 0).
KV_INDEX_STRIDE = 4096


def slot_value(token, index):
    return float(token) + 1 + KV_INDEX_STRIDE * index


def _heads(neuron_config, text):
    heads = text.num_attention_heads
    return neuron_config.tp_degree, heads, getattr(text, "num_key_value_heads", None) or heads


def kv_slot_heads(neuron_config, text) -> list:
    """Per KV head slot over all ranks (rank r holds the slots [r * per_rank, (r + 1) *
    per_rank)), the model's KV head it is a copy of, None for a padding head: NxDI's
    sharding strategy and preshard hook (modules/attention/gqa.py
    preshard_head_slots)."""
    return preshard_head_slots(*_heads(neuron_config, text))[1]


def kv_heads_per_rank(neuron_config, text) -> int:
    """modules/kvcache/kv_cache_manager.py _get_num_kv_heads_per_rank (ef2731e lines
    166-186): the padded KV heads (kv_slot_heads) split evenly over the ranks."""
    return len(kv_slot_heads(neuron_config, text)) // neuron_config.tp_degree


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


def target_peak(values: list[int], vocab: int) -> int:
    return (sum(values) - 1) % vocab



def garbled_peak(values: list[int], vocab: int) -> int:
    """A decoder a quantized layer of which got a float weight cast to its quantized
    dtype, or no scale (quantization.cast_to_parameters): never the right answer."""
    return (sum(values) + 6) % vocab


def draft_peak(values: list[int], vocab: int) -> int:
    """The double's draft: the target's answer, one id higher when the query attends a
    multiple of DRAFT_MISS_EVERY keys."""
    return (sum(values) - 1 + (len(values) % DRAFT_MISS_EVERY == 0)) % vocab


class NxDModel:
    """`traced_model.nxd_model`: per-rank state (the KV caches), the per-tag bucket
    models and flatteners, the router, the packer and forward (see the module
    docstring)."""

    def __init__(self, neuron_config, text, graphs, draft=None):
        """`text`: the model's text config; `draft`: (draft NeuronConfig, draft text
        config) of a fused speculation model."""
        c = neuron_config
        self.config = c
        self.vocab_size = text.vocab_size
        self.window = getattr(text, "sliding_window", None)
        self.block = c.is_block_kv_layout
        self.fused = bool(c.enable_fused_speculation)
        # state key prefix -> (NeuronConfig, text config) of the decoder owning that cache
        decoders = {"": (c, text)}
        if self.fused:
            decoders = {"draft_model.": draft, "target_model.": (c, text)}
        self.decoders = decoders
        self.head_masks = {}  # prefix -> per rank, 1 on its real KV heads (_head_masks)
        self.layers = {prefix: t.num_hidden_layers for prefix, (_, t) in decoders.items()}
        # what the graphs compute on, and the same memory as NxD's device tensors
        # (`state`, which clients read and write; see _device)
        self.graph_state = [{f"{prefix}kv_mgr.past_key_values.{i}": self._kv_tensor(config, t)
                             for prefix, (config, t) in decoders.items()
                             for i in range(2 * t.num_hidden_layers)}
                            for _ in range(c.tp_degree)]
        self.state = [{key: on_device(tensor) for key, tensor in rank_state.items()}
                      for rank_state in self.graph_state]
        self.target_prefix = "target_model." if self.fused else ""
        self.draft_prefix = "draft_model."
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
        # The draft decoder's own sampler (NeuronBaseModel.__init__ of worker_cls(draft
        # config), model_base.py init_inference_optimization, lines 161-166), built from the draft's NeuronConfig.
        self.draft_config = draft[0] if self.fused else None
        self.draft_sampler = Sampler(draft[0]) if self.fused else None
        self.packer = Packer(self._output_count(next(iter(graphs))))
        # prefixes of the decoders with a garbled quantized layer (set at load)
        self.garbled = set()
        # tag -> the module NxD traced for it where its class overrides forward (set at
        # load, see models/model_base.py NeuronBaseModel)
        self.traced_modules = {}
        self.attention = NeuronAttentionBase()
        # the device weights NxDI reaches (application_base.load_weights initialises them
        # per rank); the double holds only the LoRA weights there
        self.weights = [{} for _ in range(c.tp_degree)]
        # test instrumentation: (tag, bucket), the inputs and the bytes of each output
        # (by name: "tokens" / "logits", or a fused graph's, see _fused) of every graph
        # that ran, in order
        self.ran = []
        self.inputs = []
        self.returned = []

    def _kv_tensor(self, config, text):
        """One KV state tensor: contiguous (max_batch_size, 1, seq_len, 1) float32 holding
        a value a position; block layout NxDI's prefix-caching shape and cache dtype
        (kv_cache_manager.py lines 138-142)."""
        if self.block:
            dtype = getattr(config, "attention_dtype", None) or config.torch_dtype
            return torch.zeros(block_kv_shape(config, text), dtype=dtype)
        c = self.config
        return torch.zeros((c.max_batch_size, 1, c.seq_len, 1))

    @property
    def memory(self):
        return self.graph_state[0][f"{self.target_prefix}kv_mgr.past_key_values.0"]

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
        outputs = self._fused(tag, inputs) if self.fused else self._plain(tag, inputs)
        if not self.block:  # block-layout writes reach every rank already (_write_slot)
            for prefix in self.layers:
                key = f"{prefix}kv_mgr.past_key_values.0"
                for rank_state in self.graph_state[1:]:
                    rank_state[key].copy_(self.graph_state[0][key])
        self.returned.append({name: t.numel() * t.element_size() for name, t in outputs.items()})
        return list(outputs.values())

    def _output_count(self, tag):
        """How many non-aliased outputs submodel `tag`'s graphs return (see _plain and
        _fused)."""
        logits = int(self.output_logits[tag])
        if self.fused:
            return 4 + 2 * logits
        return 1 + int(self.sampler is not None and bool(logits))

    # -- what a NeuronBaseModel graph computes -------------------------------------------
    def _is_context_encoding(self, input_ids, config):
        """NeuronBaseModel._is_context_encoding (ef2731e lines 181-182)."""
        width = input_ids.shape[-1]
        return width > 1 and width != config.speculation_length

    def _sample_on_device(self, sampler, config, logits, sampling_params):
        """NeuronBaseModel._sample_on_device (ef2731e lines 1151-1185)."""
        for_speculation = logits.shape[1] == config.speculation_length
        if for_speculation and not config.on_device_sampling_config.do_sample:
            return torch.argmax(logits, dim=2).to(torch.int32)
        return sampler(logits[:, -1, :], sampling_params).to(torch.int32)

    def _decoder(self, inputs, prefix, config, peak, recompute_slots=True, lora_values=None,
                 every_query=False):
        """One decoder graph over `inputs` (ids, mask, positions, seq_ids, then the
        block layout's slot mapping and block table), on the KV cache whose state keys
        start with `prefix`: logits [rows, queries, vocab], each row's peak moved by its
        LoRA value (`lora_values`, none without LoRA). A context encoding answers its
        one query a row, or with `every_query` the logits of every position (what the
        lm_head makes of get_model_output's hidden states, which NeuronBaseModel.forward
        has before it keeps the last position's, ef2731e lines 935-976)."""
        ids, mask, positions, seq_ids = inputs[:4]
        cte = self._is_context_encoding(ids, config)
        if self.block:
            contexts = self._block(ids, mask, positions, inputs[4], inputs[5], prefix, cte,
                                   recompute_slots, every_query)
        else:
            memory = self.graph_state[0][f"{prefix}kv_mgr.past_key_values.0"]
            contexts = self._contiguous(ids, mask, positions, seq_ids, memory, cte,
                                        every_query)
        return self._logits(contexts, peak, lora_values)

    def _plain(self, tag, inputs):
        """A graph of submodel `tag` without a draft: a context encoding, a token
        generation, or NxDI's speculation model; {tokens} or {tokens, logits} (the
        submodel's output_logits) with on-device sampling, else {logits}."""
        c = self.config
        layout = (*inputs[:4], inputs[11], inputs[12]) if self.block else inputs[:4]
        if self.window and inputs[0].shape[-1] == c.speculation_length:
            raise NotImplementedError("the NxDI double does not reproduce NxDI's "
                                      "speculation model over sliding-window attention")
        module = self.traced_modules.get(tag)
        every = module is not None and self._is_context_encoding(inputs[0], c)
        logits = self._decoder(layout, self.target_prefix, c,
                               self._peak(self.target_prefix, target_peak),
                               lora_values=self._lora_values(tag, inputs), every_query=every)
        hidden = logits
        if every:  # the position NxDI answers for, as _context_query finds it
            rows = torch.arange(logits.shape[0])
            query = torch.tensor([self._context_query(p) for p in inputs[2]])
            logits = logits[rows, query].unsqueeze(1)
        if self.sampler is None:
            outputs = {"logits": logits}
        else:
            outputs = {"tokens": self._sample_on_device(self.sampler, c, logits, inputs[4])}
            if self.output_logits[tag]:
                outputs["logits"] = logits
        return outputs if module is None else self._traced(module, inputs, outputs, hidden)

    @staticmethod
    def _traced(module, inputs, outputs, hidden):
        """The graph of a submodel whose NeuronBaseModel class overrides forward: that
        forward traced on the call's inputs, NxDI's parts computed as above (see
        models/model_base.py NeuronBaseModel); what it appends to NxDI's outputs is named
        `appended_<i>`."""
        module.graph_hidden, module.graph_outputs = hidden, list(outputs.values())
        result = module.forward(*inputs)
        appended = {f"appended_{i}": t for i, t in enumerate(result[len(outputs):])}
        return {**outputs, **appended}

    def _peak(self, prefix, peak):
        return garbled_peak if prefix in self.garbled else peak

    @staticmethod
    def _value(stored) -> int:
        return int(stored) if stored else GARBAGE

    def _lora_values(self, tag, inputs):
        """Each row's LoRA value (see the module docstring), 0 without LoRA."""
        rows = inputs[0].shape[0]
        if "lora.weight" not in self.weights[0]:
            return [0] * rows
        seq_ids = inputs[3]
        adapter_ids = inputs[6] if inputs[6].numel() else torch.zeros(rows, dtype=torch.int32)
        continuous = self.config.is_continuous_batching
        lines = [int(seq_ids[r]) if continuous else r for r in range(rows)]
        values = []
        for r, line in enumerate(lines):
            for rank_weights in self.weights:
                active = rank_weights["lora.weight_active"]
                if tag == CONTEXT_ENCODING_MODEL_TAG:
                    active[line] = rank_weights["lora.weight"][int(adapter_ids[r])]
            values.append(int(self.weights[0]["lora.weight_active"][line]))
        return values

    def _logits(self, contexts, peak, lora_values=None):
        """[rows, queries, vocab padded to a multiple of tp_degree]: the lm_head's padded
        columns hold the float minimum (model_base.py mask_padded_logits), and with
        output_logits the shards are gathered whole (_gather_along_dim), pads included.
        `contexts[r][q]` are the values query q of row r attends."""
        tp = self.config.tp_degree
        width = -(-self.vocab_size // tp) * tp
        queries = len(contexts[0])
        logits = torch.full((len(contexts), queries, width), torch.finfo(torch.float32).min)
        ids = torch.arange(self.vocab_size)
        for row, per_query in enumerate(contexts):
            lora = lora_values[row] if lora_values else 0
            for query, values in enumerate(per_query):
                top = (peak(values, self.vocab_size) + lora) % self.vocab_size
                logits[row, query, : self.vocab_size] = -((ids - top) % self.vocab_size).float()
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

    def _contiguous(self, input_ids, mask, positions, seq_ids, memory, cte, every_query=False):
        memory = memory[:, 0, :, 0]
        rows = input_ids.shape[0]
        if cte:
            contexts = []
            for r in range(rows):
                line = int(seq_ids[r]) if self.config.is_continuous_batching else r
                queries = (range(input_ids.shape[1]) if every_query
                           else [self._context_query(positions[r])])
                if self.window:
                    contexts.append([self._window_context(memory[line], input_ids[r],
                                                          int(mask[r].sum()), query)
                                     for query in queries])
                    continue
                memory[line, : input_ids.shape[1]] = input_ids[r].float() + 1
                contexts.append([[int(input_ids[r, j]) + 1 for j in range(query + 1)
                                  if mask[r, j] == 1 or j == query] for query in queries])
            return contexts
        lines = (seq_ids if rows < self.config.kv_cache_batch_size
                 else torch.arange(rows)).tolist()
        if self.window:
            return [[self._window_decode(memory[line], int(input_ids[r, 0]),
                                         int(positions[r, 0]))]
                    for r, line in enumerate(lines)]
        contexts = []
        for r, line in enumerate(lines):
            prior = [self._value(memory[line, j]) for j in range(mask.shape[1])
                     if mask[r, j] == 1]
            active = [int(t) + 1 for t in input_ids[r]]
            contexts.append([prior + active[: q + 1] for q in range(len(active))])
        for r, line in enumerate(lines):
            for q in range(input_ids.shape[1]):
                memory[line, int(positions[r, q])] = float(input_ids[r, q]) + 1
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

    def _prefix_prefill_sums(self, stored, visible, active):
        """For each active query, the sum of the values it attends, through the model's
        perform_prefix_prefill (so a patch of it takes effect): every key scores 0 and
        carries the value [v, 0]; one more prior key, always visible, carries [0, 1], so
        query i's output [sum / (n + 1), 1 / (n + 1)] gives back the sum over the n keys
        it attends (the prior ones, and the active ones up to i under the causal active
        mask), counted as often as they are attended (NxDI's float32 scores keep the
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
        return [round(float(total) / float(null_share)) for total, null_share in out[0, 0]]

    def _tokengen_slots(self, positions, slot_mapping, block_table):
        """Token generation recomputes its write slots inside the graph from the
        positions and the cropped block table, keeping only the -1 of pad rows
        (block_kv_cache_manager.generate_tokengen_slot_mapping, called from
        NeuronBaseModel.forward in 0.7-0.9 unless fused speculation is on)."""
        size = self.config.pa_block_size
        rows = torch.arange(positions.shape[0])
        blocks = block_table[rows, (positions // size).squeeze(1)]
        slots = (size * blocks + (positions % size).squeeze(1)).unsqueeze(1)
        return torch.where(slot_mapping >= 0, slots, torch.full_like(slots, -1))

    def _block(self, input_ids, mask, positions, slot_mapping, block_table, prefix, cte,
               recompute_slots, every_query=False):
        if self.window and cte:
            # attention_base.py windowed_attention_forward keeps the last window - 1 keys
            # of a prefill (get_last_kv_window), which BlockKVCacheManager.update_cache
            # cannot reshape to the bucket-long slot mapping (measured with NxDI 0.9)
            raise RuntimeError(
                f"shape '[{input_ids.shape[1]}, ...]' is invalid for the {self.window - 1} "
                f"keys a sliding-window prefill keeps (block_kv_cache_manager.py update_cache)")
        # layer 0's K of the decoder whose state keys start with `prefix`, a value a slot
        flat = self._agreed_slots(prefix)
        size = self.config.pa_block_size
        readable = block_table.shape[1] * size if block_table.dim() == 2 else 0
        width = min(mask.shape[1] if mask.dim() == 2 else 0, readable)
        contexts = []
        for r in range(input_ids.shape[0]):
            blocks = block_table[r].tolist() if readable else []
            stored = [self._value(flat[blocks[j // size] * size + j % size])
                      if blocks[j // size] >= 0 else GARBAGE for j in range(readable)]
            prior = [stored[j] for j in range(width) if mask[r, j] == 1]
            if not cte:
                active = [int(t) + 1 for t in input_ids[r]]
                contexts.append([prior + active[: q + 1] for q in range(len(active))])
                continue
            queries = (range(input_ids.shape[1]) if every_query
                       else [int(torch.argmax(positions[r]))])
            visible = [j < width and int(mask[r, j]) == 1 for j in range(readable)]
            active = [int(t) + 1 for t in input_ids[r, : max(queries) + 1]]
            if readable and input_ids.shape[1] >= PREFIX_PREFILL_MIN_WIDTH:
                sums = self._prefix_prefill_sums(stored, visible, active)
                contexts.append([[sums[query]] for query in queries])
            else:
                contexts.append([prior + active[: query + 1] for query in queries])
        if not cte and recompute_slots:
            slot_mapping = self._tokengen_slots(positions, slot_mapping, block_table)
        for slots, tokens in zip(slot_mapping.tolist(), input_ids.tolist()):
            for slot, token in zip(slots, tokens):
                if slot >= flat.numel():
                    raise IndexError(f"NRT: KV slot {slot} out of bounds for "
                                     f"{self.config.pa_num_blocks + 1} blocks of {size}")
                if slot >= 0:
                    self._write_slot(slot, token, prefix)
        return contexts

    # -- what a NeuronFusedSpecModel graph computes ---------------------------------------
    def _fused(self, tag, inputs):
        """NeuronFusedSpecModel.forward (ef2731e lines 2857-3021): context
        encoding iff more than one input token and not speculation_length of them.
        Outputs by name: accepted (padded), next_input_ids, next_attention_mask,
        next_position_ids, then draft_logits and target_logits with submodel `tag`'s
        output_logits."""
        c = self.config
        if self.window:
            if not (getattr(c, "attn_block_tkg_nki_kernel_enabled", False) and getattr(
                    c, "attn_block_tkg_nki_kernel_cascaded_attention", False)):
                raise AssertionError(WINDOW_SPEC_ASSERT)
            raise NotImplementedError("the NxDI double does not reproduce the cascaded "
                                      "token-generation attention kernel")
        ids = inputs[0]
        if ids.shape[-1] > 1 and ids.shape[-1] != c.speculation_length:
            outputs = self._fused_context_encoding(inputs)
        elif c.enable_eagle_speculation:
            outputs = self._fused_token_generation(self._eagle_clamped(inputs))
        else:
            outputs = self._fused_token_generation(inputs)
        names = ["accepted", "next_input_ids", "next_attention_mask", "next_position_ids"]
        if self.output_logits[tag]:
            names += ["draft_logits", "target_logits"]
        return dict(zip(names, outputs[: len(names)], strict=True))

    def _eagle_clamped(self, inputs):
        """EAGLE token generation clips each row's position to the bucket's width less
        speculation_length (NeuronFusedSpecModel.forward, ef2731e lines 2915-2918,
        `torch.clamp(position_ids, min=0, max=bucket_size - generation_length)`)."""
        positions = torch.clamp(inputs[2], min=0,
                                max=inputs[1].shape[-1] - self.config.speculation_length)
        return (*inputs[:2], positions, *inputs[3:])

    def _fused_context_encoding(self, inputs):
        """`_context_encoding_forward` (target, then draft, on the same inputs) and
        `_cte_postprocessor` (ef2731e lines 1750-1810, 2756-2797)."""
        c = self.config
        if c.is_eagle3 and not getattr(c, "sequence_parallel_enabled", False):
            # NeuronBaseModel.forward gathers the last position with expand(batch, 1,
            # self.hidden_size) from the EAGLE-3 target's 4 fused hidden sizes unless
            # sequence parallelism sliced it already (`sliced_hidden`, ef2731e lines
            # 963-976, 1449-1463), then slices [3H:4H] of that for the lm_head: empty
            raise RuntimeError("einsum(): subscript m has size 64 for operand 1 which does "
                               "not broadcast with previously seen size 0")
        ids, mask, positions, seq_ids, sampling_params = inputs[:5]
        layout = (ids, mask, positions, seq_ids, *(inputs[7:9] if self.block else ()))
        target_logits = self._decoder(layout, self.target_prefix, c,
                                      self._peak(self.target_prefix, target_peak))
        draft_logits = self._decoder(layout, self.draft_prefix, self.draft_config,
                                     self._peak(self.draft_prefix, draft_peak))
        target_token = self.sampler(target_logits[:, -1, :], sampling_params).to(torch.int32)
        self.draft_sampler(draft_logits[:, -1, :], sampling_params)  # dropped by NxDI
        rows = ids.shape[0]
        if self.block:
            current = (inputs[9] + inputs[10]).to(torch.int32)
        else:
            current = torch.sum(mask, dim=1).to(torch.int32)
        padded = torch.cat([target_token.reshape(rows, 1),
                            torch.full((rows, c.speculation_length - 1),
                                       ACCEPTANCE_PADDING_TOKEN, dtype=torch.int32)],
                           dim=1).to(torch.int32)
        next_positions = current.reshape(rows, 1).to(torch.int32)
        length = c.seq_len
        next_mask = (next_positions.expand(rows, length) - 1
                     >= torch.arange(length).view(1, -1)).to(positions.dtype)
        return [padded, padded[:, :1], next_mask, next_positions, draft_logits,
                target_logits]

    def _fused_token_generation(self, inputs):
        """`_token_gen_forward` and `_tkg_postprocessor` (ef2731e lines 1812-1929,
        2799-2855), see the module docstring."""
        c = self.config
        k = c.speculation_length
        ids, mask, positions, seq_ids, sampling_params = inputs[:5]
        rows = ids.shape[0]
        draft_positions = positions.expand(rows, k)
        candidates = ids
        draft_mask = mask.clone()
        draft_logits = []
        for i in range(k):
            position = draft_positions[:, i:i + 1] + i
            layout = (candidates[:, -1:], draft_mask, position, seq_ids)
            if self.block:
                layout += (inputs[7][:, i:i + 1], inputs[8])
            logits = self._decoder(layout, self.draft_prefix, self.draft_config,
                                   self._peak(self.draft_prefix, draft_peak))
            draft_logits.append(logits)
            token = self._sample_on_device(self.draft_sampler, self.draft_config, logits,
                                           sampling_params)
            columns = position.to(torch.int64).reshape(-1)
            inside = columns < draft_mask.shape[1]
            if c.enable_eagle_speculation:
                # each row's own column (`_eagle_token_gen_forward`, ef2731e lines
                # 2601-2606: torch.scatter(draft_attention_mask, 1, draft_position_id, 1))
                draft_mask[torch.arange(rows)[inside], columns[inside]] = 1
            else:
                # index_fill_ on the device: an HLO scatter, out-of-bounds columns skipped
                draft_mask[:, columns[inside]] = 1
            candidates = torch.cat((candidates, token.view(rows, -1)), dim=-1)
        target_positions = positions + torch.arange(k).view(1, -1)
        layout = (candidates[:, :-1], mask, target_positions, seq_ids)
        if self.block:
            layout += (inputs[7], inputs[8])
        target_logits = self._decoder(layout, self.target_prefix, c,
                                      self._peak(self.target_prefix, target_peak),
                                      recompute_slots=False)
        target_tokens = self._sample_on_device(self.sampler, c, target_logits,
                                               sampling_params)
        outputs = self._tkg_postprocessor(candidates[:, 1:], target_tokens, mask, positions)
        return outputs + [torch.cat(draft_logits, dim=1), target_logits]

    def _tkg_postprocessor(self, candidate_tokens, target_tokens, attention_mask,
                           position_ids):
        """`_tkg_postprocessor` (ef2731e lines 2799-2855): the leading drafts equal to the
        target's tokens, then the target's next one, padded; where the next call starts."""
        k = self.config.speculation_length
        pad = ACCEPTANCE_PADDING_TOKEN
        differs = candidate_tokens[:, :-1] != target_tokens[:, :-1]
        matches = (differs.cumsum(dim=-1) < 1).sum(dim=-1, keepdim=True)
        matches = matches.reshape(self.config.batch_size, 1) + 1
        keep = torch.arange(target_tokens.shape[1]).expand(target_tokens.shape) < matches
        accepted = torch.where(keep, target_tokens, torch.full_like(target_tokens, pad))
        accepted = accepted.to(torch.int32)
        next_positions = (position_ids + matches).to(torch.int32)
        rows, length = attention_mask.shape
        next_mask = (next_positions.expand(rows, length) - 1
                     >= torch.arange(length).view(1, -1)).to(position_ids.dtype)
        first_pad = torch.sum((accepted != pad).to(torch.int), dim=1)
        index = (first_pad + (k - 1)) % k
        next_ids = accepted[torch.arange(rows), index].reshape(rows, 1)
        return [accepted, next_ids, next_mask, next_positions]

    @staticmethod
    def _slot_rows(tensor):
        """A block-layout state tensor as (slots, heads * head_dim): the flat slot index
        block_kv_cache_manager._update_cache_with_reshape scatters at (lines 246-303)."""
        return tensor.view(-1, tensor.shape[-2] * tensor.shape[-1])

    def _head_masks(self, prefix):
        """Per rank, [heads * head_dim] of 1 on its real KV heads, 0 on padding heads
        (kv_slot_heads), for the decoder whose state keys start with `prefix`."""
        if prefix not in self.head_masks:
            config, text = self.decoders[prefix]
            slots = kv_slot_heads(config, text)
            per = len(slots) // config.tp_degree
            width = self.graph_state[0][f"{prefix}kv_mgr.past_key_values.0"].shape[-1]
            self.head_masks[prefix] = [
                torch.tensor([float(h is not None) for h in slots[r * per:(r + 1) * per]]
                             ).repeat_interleave(width) for r in range(config.tp_degree)]
        return self.head_masks[prefix]

    def _agreed_slots(self, prefix):
        """Layer 0's K per slot as the graphs read it: each rank computes attention for
        its own query heads from its own copy of their KV heads, so a slot whose copies
        read by a real query head (every rank's, every replica; gqa.read_kv_slots)
        disagree answers as never written (0, read as GARBAGE): a KV write that misses
        such a replica shows. A replica only a padding query reads reaches no output."""
        key = f"{prefix}kv_mgr.past_key_values.0"
        config, text = self.decoders[prefix]
        read = set(read_kv_slots(*_heads(config, text)))
        copies = []
        for rank, rank_state in enumerate(self.graph_state):
            rows = self._slot_rows(rank_state[key])
            per = rank_state[key].shape[-2]
            head_dim = rank_state[key].shape[-1]
            copies += [rows[:, h * head_dim] for h in range(per) if rank * per + h in read]
        stacked = torch.stack(copies)
        agreed = (stacked == stacked[0]).all(dim=0)
        return torch.where(agreed, stacked[0], torch.zeros_like(stacked[0]))

    def _write_slot(self, slot, token, prefix):
        """Every layer's K and V of every rank (of the decoder whose state keys start
        with `prefix`) take the token at `slot`; padding heads stay zero (their k_proj
        and v_proj rows are zero, gqa.py maybe_pad_tail)."""
        masks = self._head_masks(prefix)
        for rank_state, mask in zip(self.graph_state, masks):
            for i in range(2 * self.layers[prefix]):
                rows = self._slot_rows(rank_state[f"{prefix}kv_mgr.past_key_values.{i}"])
                rows[slot] = slot_value(token, i) * mask


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
