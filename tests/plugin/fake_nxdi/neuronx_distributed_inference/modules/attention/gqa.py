"""modules/attention/gqa.py: how NxDI shards attention heads over the TP ranks, the same
in 0.7-0.9 (line numbers of ef2731e / cd3abf3, 0.9 / 0.8):
- determine_sharding_strategy (62-75 / 89-102): REPLICATE_TO_TP_DEGREE unless the TP
  degree is no multiple of the KV heads, then CONVERT_TO_MHA;
- get_shardable_head_counts (78-100 / 105-127): attention heads padded to a multiple of
  TP (neuronx-distributed parallel_layers/pad.py get_number_of_extra_heads); multi-head
  attention keeps a KV head per padded attention head; GQA/MQA with fewer KV heads than
  TP, or a count TP does not divide, gets TP (replicate) or the padded attention heads
  (convert);
- GroupQueryAttention_QKV.preshard_hook (679-952 / 894-1167; the head counts at 783-864
  / 998-1079), whatever the model's kind:
  where the KV count changed, replicate_kv (228-243 / 255-270: repeat_interleave) repeats
  each KV head TP / KV (replicate) or attention / KV (convert) times; then replicate pads
  Q with zero heads interleaved after each KV head's group (_maybe_pad_interleaved,
  154-193 / 181-220), convert pads Q and K/V at the tail (_maybe_pad_tail, 203-214 /
  230-241).
Only the head layout is reproduced (which model head each padded slot copies), not the
tensors: the double's graphs compute from token ids.
"""

REPLICATE_TO_TP_DEGREE = "replicate-to-tp-degree"
CONVERT_TO_MHA = "convert-to-mha"


def determine_sharding_strategy(tp_degree, source_key_value_heads):
    if tp_degree % source_key_value_heads != 0:
        return CONVERT_TO_MHA
    return REPLICATE_TO_TP_DEGREE


def get_shardable_head_counts(tp_degree, num_attention_heads, num_key_value_heads, strategy):
    padded_heads = num_attention_heads + (-num_attention_heads % tp_degree)
    padded_kv = num_key_value_heads
    if num_attention_heads == num_key_value_heads:
        padded_kv = padded_heads
    elif num_key_value_heads < tp_degree or num_key_value_heads % tp_degree:
        padded_kv = tp_degree if strategy == REPLICATE_TO_TP_DEGREE else padded_heads
    return padded_heads, padded_kv


def preshard_head_slots(tp_degree, heads, kv_heads):
    """(query slots, KV slots) after the preshard hook: per padded head, in rank order,
    the model's head it holds (None: a zero padding head)."""
    strategy = determine_sharding_strategy(tp_degree, kv_heads)
    padded_heads, padded_kv = get_shardable_head_counts(tp_degree, heads, kv_heads, strategy)
    kv_slots = list(range(kv_heads))
    if padded_kv != kv_heads:
        repeats = tp_degree // kv_heads if strategy == REPLICATE_TO_TP_DEGREE else heads // kv_heads
        kv_slots = [h for h in kv_slots for _ in range(repeats)]
    if strategy == REPLICATE_TO_TP_DEGREE:
        group = heads // kv_heads
        pad = (padded_heads - heads) // kv_heads
        q_slots = [q for g in range(kv_heads)
                   for q in [*range(g * group, (g + 1) * group), *[None] * pad]]
    else:
        q_slots = list(range(heads)) + [None] * (padded_heads - heads)
        kv_slots += [None] * (padded_kv - len(kv_slots))
    return q_slots, kv_slots


def read_kv_slots(tp_degree, heads, kv_heads):
    """The KV slots a real query head attends: on each rank, local query i reads local KV
    head i // (queries per KV head) (attention_base.py 421 and 576-577 / 503 and 658-659:
    repeat_kv over num_key_value_groups); a padding query's reads reach no output
    (GroupQueryAttention_O.preshard_hook pads o_proj's inputs the same way, 1077-1129 /
    1306-1358)."""
    q_slots, kv_slots = preshard_head_slots(tp_degree, heads, kv_heads)
    q_per, kv_per = len(q_slots) // tp_degree, len(kv_slots) // tp_degree
    return sorted({(j // q_per) * kv_per + (j % q_per) // (q_per // kv_per)
                   for j, q in enumerate(q_slots) if q is not None})
