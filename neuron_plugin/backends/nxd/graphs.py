"""Which of NxDI's compiled graphs a call runs: token generation with and without logits.

With on-device sampling most decode steps need tokens only, yet `output_logits` makes
NxDI gather the [batch, vocab] logits across TP ranks and return them from every graph
(models/model_base.py NeuronBaseModel.forward, `_gather_along_dim`). The flag is read
per submodel when it is traced (each ModelWrapper traces its own deep copy of the
config, model_wrapper.DecoderModelInstance), so the application gets:
- `context_encoding_model` with logits: one row per call (ctx_batch_size 1), a vocabulary
  row per prefill, and a context-encoding variant would double the largest graphs;
- `token_generation_model` without logits: a step whose rows are all sampled on the
  device moves tokens only off the device;
- `token_generation_logits_model` (LOGITS_TAG), added here: the same decode with logits,
  run by a step that has a host-sampled row, at the lengths of
  `token_generation_logits_buckets` (by default the largest alone: a host row at any
  context length runs the twin there, core.inputs.token_generation_bucket) and the full
  batch (`NeuronSettings.token_generation_logits_shapes`). It shares the weights and
  the KV cache state with every other submodel: NxD's ModelBuilder compiles every
  submodel against one weight set and one state (neuronx-distributed
  trace/model_builder.py build_nxd_model, build_state_initializer).
- With n-gram speculation NxDI's `speculation_model` (model_base.py enable_speculation,
  ef2731e lines 3155-3179) replaces the token-generation submodel and returns
  [batch, speculation_length, vocab] logits a call: it is split the same way, its logits
  variant `speculation_logits_model` (SPECULATION_LOGITS_TAG). NxDI adds the lookahead
  to a call's need only for the tag `speculation_model` (model_wrapper.py
  get_target_bucket), so the variant's calls carry it in the mask's width
  (nxd/arguments.py).

Two things in NxD and NxDI would pick the wrong graph, so the plugin decides both:
- NxD's router finds a graph by the shapes of its inputs alone (trace/spmd.py
  NxDModel.router over `input_shape_map`, where a later submodel with the same shapes
  overwrites an earlier one), and one output packer, traced from the first submodel's
  first graph, packs every result (build_packer). The two token-generation submodels
  have identical inputs and different outputs, so each wrapper calls its own graphs by
  tag and bucket index, as NxDModel.forward does after routing (`TaggedGraphs`).
- NxDI's forward runs whatever `token_generation_model` is for a decode, and parses its
  outputs (and, on the CPU, copies the KV cache) by the application's `output_logits`
  (model_base.py `_get_model_outputs`, `_get_constructed_outputs`,
  `_copy_past_key_values`): `selected` sets both for one call.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from neuron_plugin.backends.nxd.prompt_graphs import prompt_variant
from neuron_plugin.core.inputs import CONTEXT_ENCODING
from neuron_plugin.core.settings import NeuronSettings

LOGITS_TAG = "token_generation_logits_model"
SPECULATION_LOGITS_TAG = "speculation_logits_model"
# the application's attribute each logits variant stands in for
_PLAIN = {LOGITS_TAG: "token_generation_model", SPECULATION_LOGITS_TAG: "speculation_model"}


def add_logits_graphs(model: Any, settings: NeuronSettings) -> None:
    """Before compile, load or to_cpu: the token-generation (or n-gram speculation)
    submodel without logits and a logits variant beside it (see the module docstring);
    nothing without them."""
    shapes = settings.token_generation_logits_shapes()
    if not shapes:
        return
    lengths = {length for _, length in shapes}
    tag = SPECULATION_LOGITS_TAG if settings.speculation_length else LOGITS_TAG
    plain = getattr(model, _PLAIN[tag])
    config = copy.deepcopy(plain.config)
    neuron_config = config.neuron_config
    neuron_config.output_logits = True
    if getattr(neuron_config, "token_generation_batches", None) is not None:
        # NxDI batch-buckets the token_generation_model tag only: the variant is 1-D,
        # compiled for the full batch (tkg_batch_size), its buckets what
        # autobucketing.generate_buckets_for_tkg gives an explicit list without batches.
        neuron_config.token_generation_batches = None
        buckets = list(neuron_config.token_generation_buckets)
    else:
        buckets = list(neuron_config.buckets)  # lengths, or [1, length] (block layout)
    neuron_config.buckets = [b for b in buckets if _length(b) in lengths]
    variant = type(plain)(
        config=config,
        model_cls=plain.model_cls,
        tag=tag,
        compiler_args=plain.compiler_args,
        model_init_kwargs=plain.model_init_kwargs,
    )
    plain.neuron_config.output_logits = False
    model.models.append(variant)
    # A submodule of the application, as NxDI's own submodels are, so that what NxDI
    # does to all of them (eval() in to_cpu, the dtype cast in load) reaches it too.
    setattr(model, tag, variant)


def _length(bucket: int | Sequence[int]) -> int:
    return int(bucket[-1]) if isinstance(bucket, Sequence) else int(bucket)


def logits_variant(model: Any) -> Any | None:
    """The application's token-generation (or speculation) logits submodel, if any."""
    return next((w for w in model.models if w.tag in _PLAIN), None)


def _shapes(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors)


class TaggedGraphs:
    """A wrapper's `_forward` on the device: its own graph for the call's input shapes,
    by tag and bucket index, with neither NxD's router nor its shared packer; a single
    output comes back as a tensor, several as a list, as the packer returns them."""

    def __init__(self, nxd_model: Any, tag: str, examples: Sequence[Sequence[torch.Tensor]]):
        self.nxd_model = nxd_model
        self.tag = tag
        self.index = {_shapes(example): i for i, example in enumerate(examples)}

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        shapes = _shapes(args)
        if shapes not in self.index:
            raise ValueError(
                f"NxDI submodel {self.tag} has no graph for input shapes {list(shapes)} "
                f"(compiled: {[list(s) for s in self.index]}); this is a plugin bug, "
                f"please report it with your override_neuron_config."
            )
        index = self.index[shapes]
        # NxDModel.forward after its router: the bucket's flattener, then the tag's
        # SPMDBucketModelScript (neuronx-distributed trace/spmd.py).
        flat = getattr(self.nxd_model.flattener_map, f"{self.tag}_{index}")(list(args))
        bucket = torch.tensor(index, dtype=torch.int32)
        outputs = list(getattr(self.nxd_model.models, self.tag).forward(flat, bucket))
        return outputs[0] if len(outputs) == 1 else outputs


def route_by_tag(model: Any) -> None:
    """After `load()` on the device: every submodel calls its own graphs (TaggedGraphs),
    where a logits variant shares shapes with the token-generation submodel or the
    prompt-logprob submodel with the context encoding (`prompt_graphs`); without either
    (no host-row logits split, or speculation) NxD's router tells the graphs apart."""
    if logits_variant(model) is None and prompt_variant(model) is None:
        return
    nxd_model = model.traced_model.nxd_model
    for wrapper in model.models:
        wrapper._forward = TaggedGraphs(nxd_model, wrapper.tag, wrapper.input_generator())


@contextmanager
def selected(model: Any, phase: str, logits: bool, prompt: bool = False) -> Iterator[Any]:
    """For one call of NxDI's forward: the submodel it runs for `phase` (a decode with
    `logits` runs the logits variant where there is one, a context encoding with
    `prompt` the prompt-logprob submodel) and the application's output_logits of that
    submodel, both restored after. Yields the submodel (None without a variant: NxDI's
    own choice, e.g. its fused speculation model)."""
    if phase == CONTEXT_ENCODING and prompt:
        chosen = prompt_variant(model)
        if chosen is None:
            raise ValueError(
                "a prompt-logprob call without the prompt-logprob submodel (settings."
                "prompt_logprobs unset); this is a plugin bug, please report it."
            )
        with _standing_in(model, "context_encoding_model", chosen):
            yield chosen
        return
    variant = logits_variant(model)
    if variant is None:
        yield None
        return
    name = _PLAIN[variant.tag]
    if phase == CONTEXT_ENCODING:
        chosen = model.context_encoding_model
    else:
        chosen = variant if logits else getattr(model, name)
    with _standing_in(model, name if chosen is variant else "", chosen):
        yield chosen


@contextmanager
def _standing_in(model: Any, name: str, chosen: Any) -> Iterator[None]:
    """`chosen` as the application's submodel `name` (none: as it is) and its
    output_logits as the application's, both restored after."""
    plain = getattr(model, name) if name else None
    configs = _application_configs(model)
    saved = [config.output_logits for config in configs]
    if name:
        setattr(model, name, chosen)
    for config in configs:
        config.output_logits = chosen.neuron_config.output_logits
    try:
        yield
    finally:
        if name:
            setattr(model, name, plain)
        for config, value in zip(configs, saved, strict=True):
            config.output_logits = value


def _application_configs(model: Any) -> list[Any]:
    """The NeuronConfigs whose output_logits NxDI's forward reads: the application's,
    and an image-to-text application's text config's, a copy of it that
    NeuronBaseForImageToText._get_constructed_outputs reads instead."""
    configs = [model.neuron_config]
    text = getattr(getattr(model, "text_config", None), "neuron_config", None)
    if text is not None and text is not model.neuron_config:
        configs.append(text)
    return configs
