"""Run under an interpreter with NxD Inference (its CPU mode): the plugin's nxd EAGLE path
(NxDI's fused EAGLE speculation, `enable_eagle_speculation`) on real NxDI, with the
CPU mode's speculation guard lifted in this harness only. Used by test_nxdi_eagle.py
(which resolves the settings: this side has no vLLM); prints one JSON object.

    python nxdi_eagle_probe.py PLAN_JSON

PLAN: {"model": target dir, "settings": resolved settings (without on_cpu), "prompts":
[[ids], ...], "new_tokens": N, "guard": true|false}. Every prompt is prefilled, then the
rows decode together, every row with its whole draft budget, until each has N tokens.
Report: {"tokens": [[N ids], ...], "emitted": [[tokens a step per row], ...]}, or
{"failed": stage, "error": message} (with "guard": false nothing is lifted: what NxDI
and the plugin do as shipped).

What NxDI's CPU mode lacks for fused speculation, measured on 0.8 (cd3abf3) and 0.9
(ef2731e) alike, and the stand-ins this harness installs (none of them in the plugin):
1. the guard: to_cpu() raises "Speculation is not yet supported for CPU inference."
   for any speculation_length (application_base.py to_cpu), and the plugin refuses the
   same settings (core.nxdi_cpu_mode). Stand-in: to_cpu() sees speculation_length 0 on
   the application's own NeuronConfig for that check (the submodels, built from their
   copies, keep theirs), the plugin's copy of the guard skipped.
2. the draft's process group: a fused drafter lives in NxD's speculative draft group,
   which on a device NxD's ModelBuilder initialises (application_base.py
   init_custom_process_group_fn, its init_custom_process_group_fn argument); to_cpu()
   never does, so building the draft fails ("draft parallel group is not
   initialized"). Stand-in: NxDI's own init_custom_process_group_fn, called right after
   to_cpu()'s initialize_model_parallel.
3. the draft's argmax: speculation samples drafts with NxD's `argmax` (model_base.py
   _sample_on_device), which at TP 1 calls torch_neuronx's Argmax custom op, a Neuron
   kernel (neuronx_distributed/operators/argmax.py). Stand-in: torch.argmax.
4. the state: on a device the fused graphs alias the draft's and target's KV caches and
   EAGLE's hidden-state rolling buffer (model_wrapper.py aliases); on the CPU NxDI copies
   returned state back in `_copy_past_key_values`, whose fused branch reads attributes
   that do not exist (`self.fused_spec_model.draft_model` on a ModelWrapper,
   `.past_key_values` beside `kv_mgr.past_key_values`: AttributeError at the first
   context encoding), counts the states from output 2 where they start at 4, and never
   copies the hidden-state buffer. Stand-in: every returned KV cache and the buffer
   copied into the eager modules, as the device's aliasing keeps them.
5. the answer: the CPU branch of NxDI's output handling keeps the first output only
   (`logits_or_next_tokens, *_ = outputs`; 0.9 `_get_constructed_outputs`, 0.8 inline in
   `forward`), so `fused_outputs` lacks the next position
   ids the plugin counts accepted tokens from. Stand-in: the four fused outputs, what a
   device returns (the states are aliased there, not outputs).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.nxd import cpu_mode
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.speculation import NO_TOKEN

FUSED_OUTPUTS = 4  # accepted tokens, next input ids, next attention mask, next position ids


def lift_speculation_guard() -> None:
    """Install the stand-ins 1-5 of the module docstring."""
    from neuronx_distributed_inference.models import application_base, model_base

    refuse = cpu_mode.refuse_what_the_cpu_mode_cannot_run

    def refuse_but_speculation(settings: NeuronSettings) -> None:
        refuse(dataclasses.replace(settings, speculation_method=None))

    cpu_mode.refuse_what_the_cpu_mode_cannot_run = refuse_but_speculation  # type: ignore[assignment]

    to_cpu = application_base.NeuronApplicationBase.to_cpu
    init_model_parallel = application_base.initialize_model_parallel

    def to_cpu_lifted(self: Any) -> None:
        real = self.neuron_config
        lifted = copy.copy(real)
        lifted.speculation_length = 0

        def with_draft_group(*args: Any, **kwargs: Any) -> None:
            init_model_parallel(*args, **kwargs)
            application_base.init_custom_process_group_fn(self.config)

        self.neuron_config = lifted
        application_base.initialize_model_parallel = with_draft_group
        try:
            to_cpu(self)
        finally:
            self.neuron_config = real
            application_base.initialize_model_parallel = init_model_parallel

    application_base.NeuronApplicationBase.to_cpu = to_cpu_lifted

    class TorchArgmax:
        @staticmethod
        def apply(tensor: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
            return torch.argmax(tensor, dim=dim, keepdim=keepdim)

    importlib.import_module("neuronx_distributed.operators.argmax").Argmax = TorchArgmax

    def copy_fused_state(self: Any, outputs: list[torch.Tensor]) -> None:
        fused = self.fused_spec_model.model
        params = [
            *fused.draft_model.kv_mgr.past_key_values,
            *fused.target_model.kv_mgr.past_key_values,
        ]
        states = outputs[FUSED_OUTPUTS:]
        for param, new in zip(params, states, strict=False):
            param.data = new
        buffer = getattr(fused, "hidden_state_rolling_buffer", None)
        if buffer is not None:
            buffer.hidden_states.data = states[len(params)]
        encoder = self.context_encoding_model.model
        if encoder is not fused:  # continuous batching: one eager module per submodel
            mine = [
                *encoder.draft_model.kv_mgr.past_key_values,
                *encoder.target_model.kv_mgr.past_key_values,
            ]
            for param, source in zip(mine, params, strict=True):
                param.data = source.data
            if buffer is not None:
                encoder.hidden_state_rolling_buffer.hidden_states.data = buffer.hidden_states.data

    copy_past_key_values = model_base.NeuronBaseForCausalLM._copy_past_key_values
    construct_output = model_base.NeuronBaseForCausalLM._construct_output

    def copy_state(self: Any, outputs: Any) -> None:
        if not self.neuron_config.enable_fused_speculation:
            return copy_past_key_values(self, outputs)
        copy_fused_state(self, outputs)
        self._device_answer = list(outputs[:FUSED_OUTPUTS])  # for _construct_output
        return None

    def device_answer(self: Any, logits_or_next_tokens: Any) -> Any:
        # the CPU branch passes outputs[0] alone, right after _copy_past_key_values
        answer = self.__dict__.pop("_device_answer", None)
        return construct_output(self, logits_or_next_tokens if answer is None else answer)

    model_base.NeuronBaseForCausalLM._copy_past_key_values = copy_state
    model_base.NeuronBaseForCausalLM._construct_output = device_answer


def greedy(rows: int, width: int) -> SamplingInputs:
    return SamplingInputs(
        top_k=np.ones(rows, dtype=np.int32),
        top_p=np.ones(rows, dtype=np.float32),
        temperature=np.ones(rows, dtype=np.float32),
        uniform=np.zeros((rows, width), dtype=np.float32),
        needs_logits=np.zeros(rows, dtype=bool),
    )


def main(plan: dict[str, Any]) -> dict[str, Any]:
    if plan["guard"]:
        lift_speculation_guard()
    settings = NeuronSettings.from_dict(
        {**plan["settings"], "passthrough": {**plan["settings"]["passthrough"], "on_cpu": True}}
    )
    stage = "construct"
    try:
        backend = NxDBackend(settings, plan["model"])
        folder = Path(tempfile.mkdtemp())
        stage = "load"
        backend.compile(folder)
        backend.load(folder)
        width = settings.speculation_length
        histories = [list(p) for p in plan["prompts"]]
        stage = "context encoding"
        for seq, tokens in enumerate(histories):
            out = backend.run(
                context_encoding_inputs(settings, np.array(tokens), 0, seq, None), greedy(1, width)
            )
            tokens.append(int(out.tokens[0, 0]))
        stage = "token generation"
        starts = [len(p) for p in plan["prompts"]]
        emitted: list[list[int]] = []
        rows = np.arange(len(histories))
        while min(len(h) - s for h, s in zip(histories, starts, strict=True)) < plan["new_tokens"]:
            inputs = token_generation_inputs(
                settings,
                np.array([h[-1] for h in histories]),
                np.array([len(h) - 1 for h in histories]),
                rows,
                None,
                None,
                np.full(len(histories), settings.num_speculative_tokens),
            )
            out = backend.run(inputs, greedy(len(histories), width))
            step = []
            for row, tokens in enumerate(histories):
                new = out.tokens[row][out.tokens[row] != NO_TOKEN].tolist()
                tokens.extend(new)
                step.append(len(new))
            emitted.append(step)
    except Exception as error:  # the report says where and why
        return {"failed": stage, "error": f"{type(error).__name__}: {error}"}
    return {
        "tokens": [h[s : s + plan["new_tokens"]] for h, s in zip(histories, starts, strict=True)],
        "emitted": emitted,
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))))
