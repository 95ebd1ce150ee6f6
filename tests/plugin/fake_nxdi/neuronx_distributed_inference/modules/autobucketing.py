"""modules/autobucketing.py: the bucket lists NxDI compiles (generate_buckets_for_cte /
generate_buckets_for_tkg / generate_buckets_for_fused_spec /
generate_buckets_for_speculation), minus chunked prefill, which the plugin never
configures. Prefix caching compiles the whole (active x [0] + prefix) cross product;
batch bucketing (0.8+) the whole (batch x length) one, largest batch first. Speculation
has no 2-D forms: the fused model's prefix-caching buckets are [1, length] as token
generation's, the speculation model's are lengths only (ef2731e lines 282-341)."""

from math import log2

from neuronx_distributed_inference._release import HAS_BATCH_BUCKETING


def generate_buckets(min_length: int, max_length: int):
    """autobucketing.generate_buckets: powers of two, then max_length."""
    if min_length == max_length:
        return [max_length]
    min_bound = int(log2(min_length))
    max_bound = round(log2(max_length))
    return [2**i for i in range(min_bound, max_bound)] + [max_length]


def generate_2d_buckets_for_prefix_caching(min_vertical_len, max_vertical_len,
                                           min_horizontal_len, max_horizontal_len,
                                           is_context_encode=False):
    """autobucketing.generate_2d_buckets_for_prefix_caching."""
    vertical = generate_buckets(min_vertical_len, max_vertical_len)
    horizontal = generate_buckets(min_horizontal_len, max_horizontal_len)
    return generate_2d_buckets_for_prefix_caching_from_config(vertical, horizontal,
                                                              is_context_encode)


def generate_2d_buckets_for_prefix_caching_from_config(vertical_ranges, horizontal_ranges,
                                                       is_context_encode=False):
    """autobucketing.generate_2d_buckets_for_prefix_caching_from_config: prefix 0 is
    added for context encoding."""
    if is_context_encode:
        horizontal_ranges = [0] + list(horizontal_ranges)
    return [[v, h] for v in vertical_ranges for h in horizontal_ranges]


def generate_2d_buckets_for_batch_bucketing(neuron_config, buckets):
    """autobucketing.generate_2d_buckets_for_batch_bucketing (0.8+): tkg_batch_size is
    always a batch bucket; batches largest first."""
    batch_buckets = list(neuron_config.token_generation_batches)
    if neuron_config.tkg_batch_size not in batch_buckets:
        batch_buckets.append(neuron_config.tkg_batch_size)
    batch_buckets = sorted(batch_buckets, reverse=True)
    return [[b, s] for b in batch_buckets for s in buckets]


def _unsupported(neuron_config):
    if neuron_config.chunked_prefill_config is not None:
        raise NotImplementedError("the NxDI double does not reproduce NxDI's chunked-prefill "
                                  "kernel buckets; the plugin never configures it")


def generate_buckets_for_cte(inference_config):
    """autobucketing.generate_buckets_for_cte."""
    c = inference_config.neuron_config
    _unsupported(c)
    if not c.enable_bucketing:
        if c.is_prefix_caching:
            return generate_2d_buckets_for_prefix_caching(
                c.max_context_length, c.max_context_length, c.max_context_length,
                c.max_context_length, True)
        return generate_buckets(c.max_context_length, c.max_context_length)
    if c.context_encoding_buckets is not None:
        if c.is_prefix_caching:
            return generate_2d_buckets_for_prefix_caching_from_config(
                c.context_encoding_buckets, c.prefix_buckets, True)
        return c.context_encoding_buckets
    if c.is_prefix_caching:
        return generate_2d_buckets_for_prefix_caching(512, c.max_context_length, 512,
                                                      c.max_context_length, True)
    return generate_buckets(128, c.max_context_length)


def generate_buckets_for_tkg(inference_config):
    """autobucketing.generate_buckets_for_tkg: prefix caching as [1, length]; 0.8+ with
    token_generation_batches as [batch, length]."""
    c = inference_config.neuron_config
    _unsupported(c)
    if not c.enable_bucketing:
        buckets = (generate_2d_buckets_for_prefix_caching(1, 1, c.max_length, c.max_length)
                   if c.is_prefix_caching else generate_buckets(c.max_length, c.max_length))
    elif c.token_generation_buckets is not None:
        buckets = c.token_generation_buckets
        if c.is_prefix_caching:
            buckets = [[1, n] for n in buckets]
    elif c.is_prefix_caching:
        buckets = generate_2d_buckets_for_prefix_caching(1, 1, 256, c.max_length)
    else:
        buckets = generate_buckets(128, c.max_length)
    if HAS_BATCH_BUCKETING and c.token_generation_batches is not None:
        if c.is_prefix_caching:
            raise NotImplementedError(
                "Batch bucketing is not yet supported with prefix caching enabled.")
        return generate_2d_buckets_for_batch_bucketing(c, buckets)
    return buckets


def generate_buckets_for_fused_spec(inference_config):
    """autobucketing.generate_buckets_for_fused_spec (ef2731e lines 282-322): token
    generation's buckets without batch bucketing."""
    c = inference_config.neuron_config
    if not c.enable_bucketing:
        if c.is_prefix_caching:
            return generate_2d_buckets_for_prefix_caching(1, 1, c.max_length, c.max_length)
        return generate_buckets(c.max_length, c.max_length)
    if c.token_generation_buckets is not None:
        if c.is_prefix_caching:
            return [[1, n] for n in c.token_generation_buckets]
        return c.token_generation_buckets
    if c.is_prefix_caching:
        return generate_2d_buckets_for_prefix_caching(1, 1, 256, c.max_length)
    return generate_buckets(128, c.max_length)


def generate_buckets_for_speculation(inference_config):
    """autobucketing.generate_buckets_for_speculation (ef2731e lines 325-341): lengths
    only, whatever the KV layout."""
    c = inference_config.neuron_config
    if not c.enable_bucketing:
        return generate_buckets(c.max_length, c.max_length)
    if c.token_generation_buckets is not None:
        return c.token_generation_buckets
    return generate_buckets(128, c.max_length)
