"""EAGLE and EAGLE-3 heads as vLLM 0.32 defines them, read from a head's checkpoint folder
and checked against the target when the settings are resolved, so a head that cannot
serve the target is refused by name before anything compiles.

- EAGLE (vLLM `llama_eagle.py`): `fc` [hidden, 2 hidden] over [token embedding; target's
  final hidden state], then Llama decoder layers (the first without its input norm), no
  final norm; the target's lm_head (or the head's own) gives the logits.
- EAGLE-3 (`llama_eagle3.py`): `fc` [hidden, 3 target_hidden] over the target's hidden
  states entering three of its layers (`eagle_aux_hidden_state_layer_ids`, default
  (2, L // 2, L - 3), vLLM `get_eagle3_default_aux_hidden_state_layer_ids`); the first
  layer attends over [input_layernorm(embedding); hidden_norm(hidden)]; a final norm;
  its own lm_head over `draft_vocab_size` tokens, `d2t` mapping draft ids to target ids
  (target id = draft id + d2t[draft id]).

Pure: no vLLM or NxDI import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_plugin.core.checkpoint import read_hf_config, safetensors_shapes
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import EAGLE, EAGLE3

# EAGLE-3 options of vLLM's head this plugin does not compute; refused by name.
_UNSUPPORTED_EAGLE3 = ("norm_before_fc", "fc_norm", "parallel_drafting")


@dataclass(frozen=True)
class TargetShape:
    """What a head must fit in the target: its hidden size, vocabulary and layer count."""

    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class EagleHead:
    """A head's geometry (see the module docstring)."""

    method: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # EAGLE-3: target layers whose input is fused; () for EAGLE
    own_embedding: bool  # the head ships embed_tokens (else the target's is shared)
    own_lm_head: bool  # the head ships lm_head (EAGLE-3 always; else the target's)
    norm_before_residual: bool = False
    norm_output: bool = False

    @property
    def fc_inputs(self) -> int:
        return (
            2 * self.hidden_size
            if self.method == EAGLE
            else len(self.aux_layers) * self.target_hidden_size
        )


def tensor_name(name: str) -> str:
    """A head checkpoint's tensor name as the plugin names it: without a `model.`
    prefix, EAGLE-3's `midlayer.` as `layers.0.` (vLLM's Eagle3 weights mapper)."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _flag(what: str) -> str:
    return f"--speculative-config model={what}"


def aux_layer_ids(config: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head fuses, as vLLM picks them (gpu_model_runner
    `_get_eagle3_aux_layers_from_config`, else the model's default)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = config.get("eagle_config")
    if not ids and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)
    return (2, target_layers // 2, target_layers - 3)


def read_head(method: str, folder: str, target: TargetShape) -> EagleHead:
    """The head in `folder` for `method`, refused (naming the field, both values and the
    fix) when it does not fit `target`."""
    config = read_hf_config(folder)
    shapes = {tensor_name(n): shape for n, shape in safetensors_shapes(folder).items()}
    hidden = int(config["hidden_size"])
    vocab = int(config.get("vocab_size") or 0)
    layers = int(config.get("num_hidden_layers") or 0)
    flag = _flag(folder)
    fix = f"use an {method} head trained for this target"
    if layers < 1:
        raise NeuronConfigError(
            f"{flag}: num_hidden_layers={layers} in the head's config.json; an {method} "
            f"head has at least one decoder layer."
        )
    if vocab != target.vocab_size:
        raise NeuronConfigError(
            f"{flag}: the head's vocab_size is {vocab}, the target's {target.vocab_size}; "
            f"a head drafts in the target's vocabulary, {fix}."
        )
    own_embedding = "embed_tokens.weight" in shapes
    if not own_embedding and hidden != target.hidden_size:
        raise NeuronConfigError(
            f"{flag}: the head's hidden_size is {hidden}, the target's "
            f"{target.hidden_size}, and the head has no embed_tokens of its own (it shares "
            f"the target's); {fix}."
        )
    if method == EAGLE:
        head = EagleHead(
            EAGLE,
            hidden,
            layers,
            vocab,
            vocab,
            hidden,
            (),
            own_embedding,
            "lm_head.weight" in shapes,
        )
        if hidden != target.hidden_size:
            raise NeuronConfigError(
                f"{flag}: the head's hidden_size is {hidden}, the target's "
                f"{target.hidden_size}; an EAGLE head's fc reads the target's hidden "
                f"states, {fix}."
            )
    else:
        head = _eagle3(config, hidden, layers, vocab, own_embedding, target, flag, fix)
    _check_tensors(head, shapes, flag, fix)
    return head


def _eagle3(
    config: dict[str, Any],
    hidden: int,
    layers: int,
    vocab: int,
    own_embedding: bool,
    target: TargetShape,
    flag: str,
    fix: str,
) -> EagleHead:
    eagle_config = config.get("eagle_config") or {}
    for key in _UNSUPPORTED_EAGLE3:
        if config.get(key) or eagle_config.get(key):
            raise NeuronConfigError(
                f"{flag}: the head sets {key}, which the plugin's EAGLE-3 graphs do not "
                f"compute; use a head without it."
            )
    if eagle_config.get("use_aux_hidden_state") is False:
        raise NeuronConfigError(
            f"{flag}: the head sets eagle_config.use_aux_hidden_state false; the plugin "
            f"serves EAGLE-3 heads that fuse the target's hidden states."
        )
    target_hidden = int(config.get("target_hidden_size") or hidden)
    if target_hidden != target.hidden_size:
        raise NeuronConfigError(
            f"{flag}: the head's target_hidden_size is {target_hidden}, the target's "
            f"hidden_size {target.hidden_size}; {fix}."
        )
    aux = aux_layer_ids(config, target.num_layers)
    outside = [i for i in aux if not 0 <= i <= target.num_layers]
    if outside:
        raise NeuronConfigError(
            f"{flag}: eagle_aux_hidden_state_layer_ids {list(aux)} name layers outside the "
            f"target's 0..{target.num_layers} ({target.num_layers} layers; the default "
            f"(2, L // 2, L - 3) needs at least 4); set eagle_aux_hidden_state_layer_ids in "
            f"the head's config.json, or {fix}."
        )
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise NeuronConfigError(
            f"{flag}: draft_vocab_size={draft_vocab} is not within 1..{vocab} (the "
            f"vocabulary); {fix}."
        )
    return EagleHead(
        EAGLE3,
        hidden,
        layers,
        vocab,
        draft_vocab,
        target_hidden,
        tuple(sorted(set(aux))),
        own_embedding,
        True,
        bool(config.get("norm_before_residual", False)),
        bool(config.get("norm_output", False)),
    )


def _check_tensors(head: EagleHead, shapes: dict[str, list[int]], flag: str, fix: str) -> None:
    wanted = {"fc.weight": [head.hidden_size, head.fc_inputs]}
    if head.method == EAGLE3:
        wanted["lm_head.weight"] = [head.draft_vocab_size, head.hidden_size]
        if head.draft_vocab_size != head.vocab_size:
            wanted["d2t"] = [head.draft_vocab_size]
    for name, shape in wanted.items():
        found = shapes.get(name)
        if found != shape:
            raise NeuronConfigError(
                f"{flag}: the head's {name} is {found or 'missing'}, its config and the "
                f"target make it {shape}; {fix}."
            )
