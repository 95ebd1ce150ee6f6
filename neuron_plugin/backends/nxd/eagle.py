"""EAGLE and EAGLE-3 heads as NxDI's fused EAGLE speculation takes them.

NxDI (0.8 cd3abf3 and 0.9 ef2731e alike) builds the head with the target's own
NeuronBaseModel class under `is_eagle_draft` (model_base.py NeuronFusedSpecModel.__init__,
`worker_cls(draft_config)`), a class that has the head's `fc` only for Llama
(models/llama/modeling_llama.py NeuronLlamaModel.init_model, `if
config.neuron_config.is_eagle_draft`), and loads its weights from the draft folder as a
whole model's state dict (application_base.py checkpoint_loader_fn, `get_state_dict`):
- the head's embed_tokens and lm_head come from that folder (no sharing with the target),
  while published EAGLE heads ship neither (EAGLE) or no embed_tokens (EAGLE-3); the
  plugin writes NxDI's layout (`write_nxdi_head`): the head's tensors, EAGLE-3's
  `midlayer.` as `layers.0.` (NxDI renames it only when it pads the hidden size,
  `_pad_eagle3_draft_hf_state_dict`), and the target's embed_tokens / lm_head where the
  head has none, as vLLM shares them;
- every decoder layer of the draft drops its input norm (NeuronLlamaDecoderLayer: no
  input_layernorm under is_eagle_draft unless enable_eagle_draft_input_norm), vLLM only
  the first (llama_eagle.py): an EAGLE head of more than one layer is refused;
- EAGLE-3: the target fuses the outputs of its decoder layers 1, L // 2 - 1 and L - 4
  (model_base.py NeuronBaseModel.get_model_output, `idx in (1, num_target_layers // 2 -
  1, num_target_layers - 4)`), whatever the head's `eagle_aux_hidden_state_layer_ids`:
  vLLM's (2, L // 2, L - 3), three distinct layers from L = 7 on; the head's lm_head is
  over the target's vocabulary (NxDI reads no `d2t`); no prefix caching
  (NeuronFusedSpecModel.__init__ asserts `not self.is_prefix_caching`), and the residual
  is the hidden state before the norm (vLLM's `norm_before_residual` false).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import safetensors_files, text_config
from neuron_plugin.core.eagle_heads import EagleHead, TargetShape, read_head, tensor_name
from neuron_plugin.core.neuron_settings import EAGLE3
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

# The target architecture whose NxDI model builds an EAGLE draft (module docstring).
EAGLE_TARGETS = ("LlamaForCausalLM",)
HEAD_FILE = "model.safetensors"


def nxdi_aux_layers(target_layers: int) -> tuple[int, ...]:
    """The target layers whose input NxDI 0.8/0.9 fuse for EAGLE-3, in vLLM's numbering
    (the input of layer i is the output of layer i - 1): outputs of 1, L // 2 - 1, L - 4."""
    return tuple(sorted({i + 1 for i in (1, target_layers // 2 - 1, target_layers - 4)}))


def check_eagle(settings: NeuronSettings, target: dict[str, Any]) -> EagleHead | None:
    """The head of EAGLE settings, refused (naming the reason and the fix) where NxDI's
    fused EAGLE speculation would compute something else than vLLM's head; None without
    EAGLE."""
    if not settings.is_eagle:
        return None
    method = settings.speculation_method
    flag = f"--speculative-config method {method!r}"
    fix = "serve the head on the reference backend (VLLM_NEURON_BACKEND=reference)"
    if settings.architecture not in EAGLE_TARGETS:
        raise NeuronConfigError(
            f"{flag} on the nxd backend with a {settings.architecture} target: NxDI builds "
            f"the head with the target's model class, and only its Llama model has the "
            f"head's fc (modeling_llama.py init_model under is_eagle_draft); {fix}."
        )
    text = text_config(target)
    shape = TargetShape(
        int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    )
    if settings.draft_model is None:
        raise ValueError(f"{flag} with settings.draft_model None: a plugin bug, please report it.")
    head = read_head(str(method), settings.draft_model, shape)
    if method != EAGLE3:
        if head.num_layers != 1:
            raise NeuronConfigError(
                f"{flag}: the head has {head.num_layers} decoder layers; NxDI drops the "
                f"input norm of every layer of an EAGLE draft (modeling_llama.py "
                f"NeuronLlamaDecoderLayer, is_eagle_draft) where vLLM drops only the "
                f"first's, so only one-layer heads compute the same; {fix}."
            )
        return head
    if head.draft_vocab_size != head.vocab_size:
        raise NeuronConfigError(
            f"{flag}: the head drafts over its own {head.draft_vocab_size}-token "
            f"vocabulary (draft_vocab_size, d2t); NxDI's EAGLE-3 reads no d2t/t2d mapping "
            f"(its head's lm_head is over the target's {head.vocab_size} tokens); use a "
            f"head with the target's vocabulary, or {fix}."
        )
    wanted = nxdi_aux_layers(shape.num_layers)
    if head.aux_layers != wanted or len(wanted) != 3:
        raise NeuronConfigError(
            f"{flag}: the head fuses the target's layers {list(head.aux_layers)} "
            f"(eagle_aux_hidden_state_layer_ids), NxDI always the inputs of layers "
            f"{list(wanted)} of this {shape.num_layers}-layer target (model_base.py "
            f"get_model_output; three distinct layers need 7 or more); use a head trained "
            f"on those layers, or {fix}."
        )
    if head.norm_before_residual:
        raise NeuronConfigError(
            f"{flag}: the head sets norm_before_residual; NxDI's EAGLE-3 layer adds the "
            f"hidden state before its norm (modeling_llama.py NeuronLlamaDecoderLayer); "
            f"{fix}."
        )
    if settings.is_block_layout:
        raise NeuronConfigError(
            f"{flag} with the block KV layout (prefix caching or chunked prefill) on the "
            f"nxd backend: NxDI asserts EAGLE-3 without prefix caching (model_base.py "
            f"NeuronFusedSpecModel.__init__); remove --enable-prefix-caching / "
            f"--enable-chunked-prefill, or use method eagle."
        )
    return head


def write_nxdi_head(head: EagleHead, head_dir: str, target_dir: str, out: Path) -> Path:
    """`out` holding the head as NxDI loads a draft (module docstring): config.json and
    one safetensors file of the head's tensors (renamed, d2t/t2d dropped) plus the
    target's embed_tokens and lm_head where the head has none."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for path in safetensors_files(head_dir):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                renamed = tensor_name(name)
                if renamed not in ("d2t", "t2d"):
                    tensors[renamed] = f.get_tensor(name)
    shared = {"embed_tokens.weight": not head.own_embedding, "lm_head.weight": not head.own_lm_head}
    wanted = {name for name, needed in shared.items() if needed}
    for path in safetensors_files(target_dir):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                short = name.removeprefix("model.")
                if short in wanted:
                    tensors[short] = f.get_tensor(name)
                    wanted.discard(short)
    if "lm_head.weight" in wanted and "embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]  # a tied target
        wanted.discard("lm_head.weight")
    if wanted:
        raise NeuronConfigError(
            f"--speculative-config model={head_dir}: the head has no {sorted(wanted)} and "
            f"the target's checkpoint {target_dir} holds none to share; NxDI loads them "
            f"from the head's folder; use a complete checkpoint."
        )
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(head_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / HEAD_FILE))
    return out
