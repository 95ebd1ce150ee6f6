"""Patch `cte-exact-bucket`: a context exactly as long as a context-encoding bucket is
pushed into the next bucket.

`ModelWrapper.get_target_bucket` (0.8+: `_get_seq_bucket`) takes the first bucket with
`input_len < bucket` and falls back to the largest bucket only when `input_len` equals
it, so with buckets [128, 256, 512] a 128-token prompt runs the 256 graph and pads 128
tokens for nothing (NxDI 0.7 to 0.9). For context encoding `input_len` is the number of
prompt tokens (the attention-mask width) and `pad_inputs` pads them to the bucket; a
zero-length pad is valid, which NxDI itself relies on when the prompt equals the
largest bucket. So the equal bucket is taken. Token generation is left alone: there
`input_len` is the width of the attention mask over cached positions, which the nxd
backend sets so that NxDI's rule (strict here, `<=` in the 0.8+ batch-bucketing path)
lands on the plugin's bucket. Prefix caching chooses its buckets elsewhere
(`get_target_2d_bucket_for_prefix_caching`), untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from neuron_plugin.patches.base import NxDIModules, Patch, replace_method, unpatched

NAME = "cte-exact-bucket"
PROBE_BUCKETS = [2, 4]


def exact_bucket(buckets: list, input_len: int) -> int | None:
    """The bucket equal to `input_len` in a 1-D grid, else None (leave it to NxDI)."""
    for bucket in buckets:
        if isinstance(bucket, int) and bucket == input_len:
            return bucket
    return None


def _stand_in_wrapper(model_wrapper_module) -> object:
    """An object with ModelWrapper's methods and the attributes bucket selection reads,
    without building a torch module."""
    cls = model_wrapper_module.ModelWrapper
    methods = {
        name: value
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("__")
    }
    probe_cls = type("ModelWrapperProbe", (), methods)
    stand_in: Any = object.__new__(probe_cls)
    stand_in.tag = model_wrapper_module.CONTEXT_ENCODING_MODEL_TAG
    stand_in.is_batch_bucketing = False
    stand_in.async_mode = False
    stand_in.neuron_config = SimpleNamespace(
        buckets=list(PROBE_BUCKETS), speculation_length=0, allow_input_truncation=False
    )
    return stand_in


def probe(modules: NxDIModules) -> str | None:
    import torch

    select = unpatched(modules.model_wrapper.ModelWrapper.get_target_bucket)
    tokens = torch.ones((1, PROBE_BUCKETS[0]), dtype=torch.int32)
    chosen = select(_stand_in_wrapper(modules.model_wrapper), tokens, tokens, tokens)
    if chosen == PROBE_BUCKETS[0]:
        return None
    return (
        f"get_target_bucket puts a {PROBE_BUCKETS[0]}-token context into bucket "
        f"{chosen} of {PROBE_BUCKETS} (strict <)"
    )


def apply(modules: NxDIModules) -> bool:
    tag = modules.model_wrapper.CONTEXT_ENCODING_MODEL_TAG

    def make(original: Callable) -> Callable:
        def get_target_bucket(self, *args, strategy="first_fit"):
            if self.tag == tag and strategy == "first_fit":
                bucket = exact_bucket(self.neuron_config.buckets, args[1].shape[1])
                if bucket is not None:
                    return bucket
            return original(self, *args, strategy=strategy)

        return get_target_bucket

    return replace_method(modules.model_wrapper.ModelWrapper, "get_target_bucket", NAME, make)


PATCH = Patch(
    name=NAME,
    defect="a context equal to a context-encoding bucket runs the next bucket",
    probe=probe,
    apply=apply,
)
