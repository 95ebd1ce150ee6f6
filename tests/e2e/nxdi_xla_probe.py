"""Run under an interpreter with NxD Inference and torch-xla: every graph the plugin's NxD
backend would compile, replayed on torch-xla's CPU device (PJRT_DEVICE=CPU) as Neuron
traces it, checked with torch_xla.debug.metrics; prints one JSON object. Used by
test_nxdi_xla.py (which resolves the settings: this side has no vLLM).

    python nxdi_xla_probe.py PLAN_JSON

PLAN: {"model": dir, "cases": {name: SETTINGS}, "self_check": bool, "tolerance": float}.

Per case the backend is built as it serves (NxDI's CPU mode, `"on_cpu": true`: the
plugin's NeuronConfig, its patches, its submodels: the logits twins of graphs.py and the
prompt-logprob submodel of prompt_graphs.py). Then first every graph the settings run
(backends.base.graph_specs) is driven once through the backend's own `forward`/`run`
with inputs of core.inputs, and each NxDI submodel's call is recorded where NxDI hands it
to the module (`ModelWrapper._forward`: after its padding, as a compiled graph gets it),
with the KV cache before it. Then for every submodel (`backend.model.models`) and every
bucket NxDI would compile for it (`ModelWrapper.input_generator()`, block layout: the
whole (active, prefix) cross product), the bucket's module as NxDI's tracing builds it
(the wrapper's `DecoderModelInstance`: `load_module()`, the eager weights and KV cache
loaded, each Parameter and buffer rebuilt on the XLA device since `module.to()` fails
after an eager forward, then `.get(bucket_rank)`, which sets the bucket's sizes and
gives the KV aliasing map) is called twice:
- "trace": with the example inputs NxDI traces the bucket with (input_generator);
- "again": with the recorded call of that bucket ("served") or, for a bucket no
  configuration of at most max_model_len tokens reaches, the example with other token
  ids ("example").
Each call: XLA compiles counted during the forward (must be 0: a compile there is a host
sync) and at `torch_xla.sync()` (1 for the trace, or 0 where an identical graph compiled
earlier in the process, by its hash; 0 again, the same graph), device-to-host transfers
during both (must be 0), every output against the backend's eager CPU-mode module on
the same inputs and KV cache (the plugin's per-bucket hook, cpu_mode.py): floating ones
(logits, KV caches, prompt logprobs) within the tolerance relative to their scale above
1, integer ones (tokens, top-k ids, ranks) equal but for INTEGER_SLACK; the KV outputs
against the aliasing map (shape and dtype), and the sizes `get()` sets against those the
plugin's hook sets. The report gives per graph its submodel, bucket, both calls' counts,
largest difference and graph hash, and the problems found.

An image-to-text application (Qwen3-VL) adds its vision encoder's graphs, one per vision
bucket (its wrapper's `EncoderModelInstance`, no KV cache), driven through
`NxDBackend.encode_image` with an image of each bucket's size; its context encodings are
driven with image inputs (the positions, embeddings and DeepStack levels of a few image
tokens, M-RoPE positions), so the patched image merge is traced with served values.

"self_check": the first graph of the first case again, with a `.item()` injected before
its lm_head: the metrics must show the transfer and the extra compile, so the checks
cannot pass vacuously.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("NXD_CPU_MODE", "1")

import dataclasses
import gc
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.base import GraphSpec, graph_specs
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    context_encoding_inputs,
    context_encoding_need,
    token_generation_inputs,
)
from neuron_plugin.core.prompt_logprobs import prompt_targets
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.vision import LLAMA4_VISION, VISION_ENCODING, ImageInputs, VisionGeometry

TOLERANCE = 1e-5
# Integer outputs decided by comparing floats (a sampled token, the prompt logprobs'
# top-k ids and a target's rank) may differ where two values are closer than float noise:
# at most this share of an output's values (none of a decode's two tokens).
INTEGER_SLACK = 0.01
SIZES = ("n_positions", "n_active_tokens", "prefix_size")  # what DecoderModelInstance.get sets


# -- torch-xla ---------------------------------------------------------------------------
def xla() -> Any:
    import torch_xla

    return torch_xla


def _metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return 0 if data is None else int(data[0])


def _counts() -> tuple[int, int]:
    return _metric_count("CompileTime"), _metric_count("TransferFromDeviceTime")


def measured_call(module: torch.nn.Module, args: Sequence[torch.Tensor]) -> tuple[list, dict]:
    """`module(*args)` on the XLA device: compiles and device-to-host transfers during
    the forward (tracing) and at the sync (the graph's execution), outputs on the host."""
    torch_xla = xla()
    device = torch_xla.device()
    gc.collect()  # tensors a failed trace left in reference cycles would join the graph
    on_device = [a.to(device) for a in args]
    torch_xla.sync()  # the uploads (and anything pending): before the counts
    start = time.perf_counter()
    compiles0, transfers0 = _counts()
    with torch.no_grad():
        outputs = flat(module(*on_device))
    compiles1, transfers1 = _counts()
    tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
    found = torch_xla._XLAC._get_graph_hash(tensors)
    graph = found.hex() if isinstance(found, bytes) else str(found)
    torch_xla.sync()
    compiles2, transfers2 = _counts()
    seconds = time.perf_counter() - start
    host = [o.cpu() if isinstance(o, torch.Tensor) else o for o in outputs]
    return host, {
        "graph_hash": graph,
        "compiles_forward": compiles1 - compiles0,
        "compiles_sync": compiles2 - compiles1,
        "transfers_forward": transfers1 - transfers0,
        "transfers_sync": transfers2 - transfers1,
        "seconds": round(seconds, 3),
    }


def flat(outputs: Any) -> list:
    """A module's outputs as one list (Qwen3-VL's 0.8 vision graph answers a tensor and a
    list of DeepStack tensors)."""
    if not isinstance(outputs, (list, tuple)):
        return [outputs]
    return [leaf for output in outputs for leaf in flat(output)]


VISION_ENCODER = "vision_encoder_model"  # NxDI's model_wrapper.VISION_ENCODER_MODEL_TAG


def submodels(backend: NxDBackend) -> list[Any]:
    """Every wrapper whose graphs the backend compiles: the application's `models` and,
    for an image-to-text application, its vision encoder's."""
    return [*backend.model.models, *getattr(backend.model, "vision_models", [])]


def buckets_of(wrapper: Any) -> list:
    """A wrapper's buckets: a vision encoder's are its vision config's (its wrapper's
    config is the application's, whose neuron_config is the text one)."""
    config = wrapper.config.vision_config if wrapper.tag == VISION_ENCODER else wrapper.config
    return list(config.neuron_config.buckets)


def rebuild_on_device(module: torch.nn.Module, device: Any) -> None:
    """Each Parameter and buffer of `module` as a new one on `device` (a tied weight stays
    one tensor); `module.to(device)` fails once an eager forward has assigned the KV
    Parameters' data (they are no longer leaves, torch module.py `_apply`)."""
    moved: dict[int, Any] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                if id(param) not in moved:
                    moved[id(param)] = torch.nn.Parameter(
                        param.detach().to(device), requires_grad=False
                    )
                sub._parameters[name] = moved[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                if id(buffer) not in moved:
                    moved[id(buffer)] = buffer.detach().to(device)
                sub._buffers[name] = moved[id(buffer)]


def kv_params(module: torch.nn.Module) -> Any:
    """The KV cache Parameters, where DecoderModelInstance.get finds them (none in an
    encoder's module)."""
    manager = getattr(module, "kv_mgr", None)
    return manager.past_key_values if manager is not None else getattr(module, "past_key_values", [])


def set_kv(module: torch.nn.Module, values: Sequence[torch.Tensor], device: Any) -> None:
    params = kv_params(module)
    for i, value in enumerate(values):
        params[i] = torch.nn.Parameter(value.detach().clone().to(device), requires_grad=False)


# -- the eager side ----------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    """A module call: its positional tensors, the KV cache before it, where it came from."""

    args: tuple[torch.Tensor, ...]
    kv: list[torch.Tensor]
    source: str


def kv_snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in kv_params(module)]


def eager(wrapper: Any, call: Call) -> tuple[list, dict[str, int]]:
    """The backend's eager CPU-mode module on `call` (its per-bucket hook sets the sizes),
    its KV cache restored after; the outputs and the sizes the hook set."""
    module = wrapper.model
    params = kv_params(module)
    saved = [p.data for p in params]
    try:
        for p, value in zip(params, call.kv, strict=True):
            p.data = value.clone()
        with torch.inference_mode():
            outputs = flat(module(*[a.clone() for a in call.args]))
        sizes = {name: int(getattr(module, name)) for name in SIZES if hasattr(module, name)}
    finally:
        for p, value in zip(params, saved, strict=True):
            p.data = value
    return [o.clone() for o in outputs], sizes


def _shapes(tensors: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor))


def record_calls(backend: NxDBackend, drive: Callable[[], None]) -> dict[tuple[int, int], Call]:
    """(submodel index, bucket rank) -> the first call NxDI handed that submodel's module
    while `drive` ran, with the KV cache before it."""
    found: dict[tuple[int, int], Call] = {}
    wrappers = submodels(backend)
    saved = []
    for index, wrapper in enumerate(wrappers):
        ranks = {_shapes(e): r for r, e in enumerate(wrapper.input_generator())}
        original = wrapper._forward

        def spy(
            *args: Any,
            _index: int = index,
            _ranks: dict = ranks,
            _orig: Any = original,
            _wrapper: Any = wrapper,
        ) -> Any:
            rank = _ranks.get(_shapes(args))
            if rank is not None and (_index, rank) not in found:
                tensors = tuple(a.detach().clone() for a in args if isinstance(a, torch.Tensor))
                found[(_index, rank)] = Call(tensors, kv_snapshot(_wrapper.model), "served")
            return _orig(*args)

        saved.append((wrapper, original))
        wrapper._forward = spy
    try:
        drive()
    finally:
        for wrapper, original in saved:
            wrapper._forward = original
    return found


def greedy(rows: int, host: Sequence[bool] = ()) -> SamplingInputs:
    needs = np.zeros(rows, dtype=bool)
    needs[: len(host)] = host
    return dataclasses.replace(SamplingInputs.greedy(rows), needs_logits=needs)


def drive_every_graph(backend: NxDBackend, errors: list[str], seed: int = 0) -> Callable[[], None]:
    """A call of each graph the settings run (graph_specs), through the backend's own
    serving calls with inputs of core.inputs (token ids at random); a call that fails
    adds the graph's name and the error to `errors` (its graph is then replayed with the
    example's values only)."""
    settings = backend.settings
    rng = np.random.default_rng(seed)
    vocab = backend.vocab_size
    per_seq = settings.max_blocks_per_seq
    block = settings.is_block_layout

    def blocks(slot: int) -> list[int] | None:
        return [1 + per_seq * slot + j for j in range(per_seq)] if block else None

    geometry = VisionGeometry.from_hf_config(backend.hf_config)

    def with_image(inputs: Any) -> Any:
        """An image-to-text context encoding with a few image tokens (after the first
        one): their embeddings and DeepStack levels at random, M-RoPE positions with the
        image's rows and columns; unchanged for a text model."""
        if geometry is None:
            return inputs
        active = inputs.input_ids.shape[1]
        tokens = min(4, int(inputs.full_context_lens[0]) - 1)
        mask = np.zeros((1, active), dtype=bool)
        mask[0, 1 : 1 + tokens] = True
        embeddings = np.zeros((1, active, geometry.embedding_width), dtype=np.float32)
        embeddings[mask] = rng.standard_normal((tokens, geometry.embedding_width))
        rope = np.broadcast_to(inputs.position_ids, (3, *inputs.position_ids.shape)).copy()
        rope[1:, 0, 1 : 1 + tokens] = 1 + np.arange(tokens) % 2
        return dataclasses.replace(
            inputs, vision_embeddings=embeddings, vision_mask=mask, rope_positions=rope
        )

    vision = backend.hf_config.get("vision_config") or {}
    tower = vision.get("model_type")
    # Pixtral's rotary table covers image_size / patch_size patches a side; Llama 4's
    # images are tiles of that many a side
    side = vision["image_size"] // vision["patch_size"] if tower in ("pixtral", LLAMA4_VISION) else 0

    def encode(spec: GraphSpec) -> None:
        """An image that fills vision bucket spec.shape: patches in 2 rows, or as many
        rows of the widest side as it takes where the tower has one, or whole tiles."""
        if geometry is None:
            raise ValueError(f"a vision graph {spec.shape} for a model without vision_config")
        patches = spec.shape[0]
        pixels = rng.standard_normal((patches, geometry.patch_dim)).astype(np.float32)
        if tower == LLAMA4_VISION:
            grid = (patches // (side * side), side, side)
        else:
            columns = min(patches // 2, side) if side else patches // 2
            grid = (1, patches // columns, columns)
        backend.encode_image(ImageInputs(pixels, np.array(grid)))

    def prefill(spec: GraphSpec) -> None:
        new, cached = context_encoding_need(settings, spec.shape)
        ids = rng.integers(1, vocab, new + cached)
        inputs = with_image(context_encoding_inputs(settings, ids, cached, 0, blocks(0)))
        if spec.prompt_logprobs:
            width = inputs.input_ids.shape[1]
            targets = prompt_targets(ids, cached, new, width)
            inputs = dataclasses.replace(inputs, prompt_targets=targets)
            backend.run(inputs, SamplingInputs.host_rows(1))
        elif settings.on_device_sampling:
            backend.run(inputs, greedy(1))
        else:
            backend.forward(inputs)

    def decode(spec: GraphSpec) -> None:
        rows, length = spec.shape
        lengths = sorted({n for _, n in settings.token_generation_shapes()})
        below = max([n for n in lengths if n < length], default=0)
        top = min(length, settings.max_model_len) - 2  # need = position + 1 < length
        positions = np.array([max(top - row, below) for row in range(rows)])
        tokens = rng.integers(1, vocab, rows)
        tables = [blocks(slot) for slot in range(rows)] if block else None
        logits = spec.logits or not settings.on_device_sampling
        inputs = token_generation_inputs(
            settings, tokens, positions, np.arange(rows), tables, logits=logits
        )
        if settings.on_device_sampling:
            backend.run(inputs, greedy(rows, [spec.logits]))
        else:
            backend.forward(inputs)

    def run() -> None:
        calls = {CONTEXT_ENCODING: prefill, VISION_ENCODING: encode}
        for spec in graph_specs(settings):
            try:
                calls.get(spec.phase, decode)(spec)
            except Exception as exc:  # a served call that fails is a finding
                errors.append(f"{spec.name}: {type(exc).__name__}: {exc}")

    return run


# -- comparing ---------------------------------------------------------------------------
def compare(got: list, want: list) -> tuple[float, int, list[str]]:
    """The largest difference of the floating outputs (relative to the output's scale
    where it exceeds 1: logits, KV values), how many integer values differ (tokens, the
    prompt logprobs' top-k ids and ranks), and what else differs (count, shape, dtype, a
    NaN on one side only, integers beyond INTEGER_SLACK)."""
    if len(got) != len(want):
        return float("inf"), 0, [f"{len(got)} outputs, eager {len(want)}"]
    problems = []
    largest, mismatches = 0.0, 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            problems.append(f"output {i}: {g.dtype}{list(g.shape)}, eager {w.dtype}{list(w.shape)}")
            continue
        if g.is_floating_point():
            nan = torch.isnan(g) != torch.isnan(w)
            if bool(nan.any()):
                problems.append(f"output {i}: NaN at {int(nan.sum())} places on one side only")
            both = ~(torch.isnan(g) | torch.isnan(w))
            if bool(both.any()):
                scale = max(1.0, float(w[both].abs().max()))
                largest = max(largest, float((g[both] - w[both]).abs().max()) / scale)
            continue
        differ = int((g != w).sum())
        mismatches += differ
        if differ > int(g.numel() * INTEGER_SLACK):
            problems.append(f"output {i}: {differ} of {g.numel()} values differ")
    return largest, mismatches, problems


def alias_problems(outputs: list, aliases: dict) -> list[str]:
    """The KV outputs NxDI aliases to the cache Parameters (DecoderModelInstance.get):
    each must have its Parameter's shape and dtype, or the traced graph cannot update
    the cache in place."""
    found = []
    for param, index in aliases.items():
        if index >= len(outputs):
            found.append(f"alias to output {index} of {len(outputs)}")
        elif (
            tuple(outputs[index].shape) != tuple(param.shape) or outputs[index].dtype != param.dtype
        ):
            found.append(
                f"output {index}: {outputs[index].dtype}{list(outputs[index].shape)} aliases a "
                f"{param.dtype}{list(param.shape)} cache"
            )
    return found


# graph hash -> the first graph that compiled it in this process (XLA's compilation cache
# serves a later identical graph without compiling: one graph all the same)
COMPILED: dict[str, str] = {}


def call_problems(
    step: str, counts: dict, diff: float, tolerance: float, compiles_expected: int
) -> list[str]:
    found = []
    if counts["compiles_forward"]:
        found.append(
            f"{step}: {counts['compiles_forward']} XLA compiles during the forward "
            f"(a host sync inside the graph)"
        )
    cached = counts.get("same_graph_as") is not None and counts["compiles_sync"] == 0
    if counts["compiles_sync"] != compiles_expected and not cached:
        found.append(
            f"{step}: {counts['compiles_sync']} XLA compiles at the sync, "
            f"{compiles_expected} expected"
        )
    if counts["transfers_forward"] or counts["transfers_sync"]:
        found.append(
            f"{step}: {counts['transfers_forward'] + counts['transfers_sync']} "
            f"device-to-host transfers inside the graph"
        )
    if not diff <= tolerance:
        found.append(f"{step}: outputs differ from eager by {diff:.3g} (> {tolerance:g})")
    return found


# -- one graph ---------------------------------------------------------------------------
class ReplayError(Exception):
    """A call that cannot be replayed on the XLA device: what failed, its traceback."""

    def __init__(self, message: str, trace: str):
        super().__init__(message)
        self.trace = trace


@dataclasses.dataclass
class DeviceModule:
    """A submodel's module as NxDI's tracing builds it (DecoderModelInstance), on XLA."""

    instance: Any
    device: Any


def device_module(wrapper: Any) -> DeviceModule:
    device = xla().device()
    instance = wrapper.get_model_instance()
    instance.load_module()
    module = instance.module
    module.load_state_dict(wrapper.model.state_dict(), strict=True)
    rebuild_on_device(module, device)
    keep_cached_state(wrapper.model, module, device)
    return DeviceModule(instance, device)


def keep_cached_state(eager_module: torch.nn.Module, module: torch.nn.Module, device: Any) -> None:
    """What a forward computes once and keeps, as the eager module holds it: a buffer
    registered as None (RotaryEmbedding.inv_freq, modules/attention/utils.py ef2731e and
    cd3abf3 lines 320, 333) or an attribute left None (gpt-oss's YaRN `concentration`,
    modeling_gpt_oss.py ef2731e lines 579-580, 625). Without it the module's first call
    computes them inside its graph and every later call takes them as inputs: two graphs
    for one bucket (Neuron traces each bucket once)."""
    for ours, theirs in zip(module.modules(), eager_module.modules(), strict=True):
        for name, buffer in theirs._buffers.items():
            if buffer is not None and name in ours._buffers and ours._buffers[name] is None:
                ours._buffers[name] = buffer.detach().clone().to(device)
        for name, value in vars(theirs).items():
            if name.startswith("_") or value is None or ours.__dict__.get(name, 0) is not None:
                continue
            tensor = torch.is_tensor(value)
            ours.__dict__[name] = value.detach().clone().to(device) if tensor else value


def replay_call(dev: DeviceModule, rank: int, call: Call) -> tuple[list, dict, list[str], dict]:
    """One measured call of bucket `rank`: outputs, counts, aliasing problems, sizes."""
    set_kv(dev.instance.module, call.kv, dev.device)
    module, aliases = dev.instance.get(rank)
    sizes = {name: int(getattr(module, name)) for name in SIZES if hasattr(module, name)}
    outputs, counts = measured_call(module, call.args)
    return outputs, counts, alias_problems(outputs, aliases), sizes


def check_call(
    step: str,
    wrapper: Any,
    dev: DeviceModule,
    rank: int,
    call: Call,
    tolerance: float,
    compiles_expected: int,
) -> dict[str, Any]:
    try:
        got, counts, aliasing, sizes = replay_call(dev, rank, call)
    except Exception as exc:
        trace = traceback.format_exc()[-2000:]
        try:
            eager(wrapper, call)
            also = "the eager forward runs"
        except Exception as eager_exc:
            also = f"the eager forward too: {type(eager_exc).__name__}"
        raise ReplayError(f"{step} on XLA: {type(exc).__name__}: {exc} ({also})", trace) from exc
    want, eager_sizes = eager(wrapper, call)
    label = f"{wrapper.tag} {buckets_of(wrapper)[rank]}"
    first = COMPILED.setdefault(counts["graph_hash"], label)
    if step == "trace" and first != label:
        counts["same_graph_as"] = first  # e.g. windowed decode buckets: one cache size
    diff, mismatches, problems = compare(got, want)
    problems = [f"{step}: {p}" for p in problems + aliasing]
    problems += call_problems(step, counts, diff, tolerance, compiles_expected)
    differing = {k: (v, eager_sizes.get(k)) for k, v in sizes.items() if eager_sizes.get(k) != v}
    if differing:
        problems.append(f"{step}: NxDI's get() sets {differing} (value, the plugin's CPU hook's)")
    return {
        **counts,
        "max_diff": diff,
        "integers_differing": mismatches,
        "values": call.source,
        "problems": problems,
    }


def other_values(example: Sequence[torch.Tensor], seed: int, vocab: int) -> tuple:
    """The example with other token ids (same shapes and dtypes); a vision graph's,
    other pixel values."""
    generator = torch.Generator().manual_seed(seed)
    first = example[0]
    if first.is_floating_point():
        values = torch.randn(tuple(first.shape), generator=generator)
    else:
        values = torch.randint(1, vocab, tuple(first.shape), generator=generator)
    return (values.to(first.dtype), *example[1:])


INPUT_IDS, ATTENTION_MASK, POSITION_IDS, SAMPLING_PARAMS = 0, 1, 2, 4  # text graph inputs
VISION_EMBEDDINGS = 22  # an image-to-text text graph's (image_to_text_model_wrapper.py)


def defined_example(example: Sequence[torch.Tensor]) -> tuple:
    """A trace example whose attention mask is all zeros (NxDI's Qwen3-VL text wrapper,
    modeling_qwen3_vl_text.py input_generator: every position masked, position ids,
    sampling_params and the image positions zeros too, so the image merge zeroes
    position 0, where the answer is read) with the values of a real call of the same
    shapes and dtypes: ones in the mask, the sampling params (greedy) and the token ids,
    positions counting up. Its logits are otherwise all equal (all zero on a checkpoint
    whose token 0 is a padding token with a zero embedding, as the tiny Qwen3-VL's), so
    the sampled token is undefined and XLA and eager may pick different ones. Any other
    example as it is (a text model's block-layout example has a zero mask of one value
    where its prefix is empty: it stays NxDI's)."""
    found = list(example)
    if len(found) <= VISION_EMBEDDINGS or bool(found[ATTENTION_MASK].any()):
        return tuple(found)
    for index in (INPUT_IDS, ATTENTION_MASK, SAMPLING_PARAMS):
        found[index] = torch.ones_like(found[index])
    positions = found[POSITION_IDS]
    width = positions.shape[-1]
    if width > 1:
        found[POSITION_IDS] = torch.arange(width, dtype=positions.dtype).expand_as(positions)
    return tuple(found)


def replay_submodel(
    backend: NxDBackend, index: int, recorded: dict, tolerance: float, only: int | None = None
) -> list[dict[str, Any]]:
    wrapper = submodels(backend)[index]
    examples = wrapper.input_generator()
    buckets = buckets_of(wrapper)
    dev = device_module(wrapper)
    graphs = []
    for rank, example in enumerate(examples):
        if only is not None and rank != only:
            continue
        entry: dict[str, Any] = {"graph": str(wrapper.tag), "bucket": buckets[rank], "rank": rank}
        try:
            kv = kv_snapshot(wrapper.model)
            trace = Call(defined_example(example), kv, "example")
            again = recorded.get((index, rank)) or Call(
                other_values(example, rank + 1, backend.vocab_size), kv, "example"
            )
            entry["trace"] = check_call("trace", wrapper, dev, rank, trace, tolerance, 1)
            entry["again"] = check_call("again", wrapper, dev, rank, again, tolerance, 0)
            entry["problems"] = entry["trace"].pop("problems") + entry["again"].pop("problems")
            if entry["again"]["graph_hash"] != entry["trace"]["graph_hash"]:
                entry["problems"].append("again: another XLA graph than the trace's")
        except ReplayError as exc:  # a graph that cannot be traced is a finding
            entry["problems"] = [str(exc)]
            entry["traceback"] = exc.trace
            dev = device_module(wrapper)  # what the failed forward left set stays there
        except Exception as exc:  # so is one whose eager forward fails
            entry["problems"] = [f"eager: {type(exc).__name__}: {exc}"]
            entry["traceback"] = traceback.format_exc()[-3000:]
        graphs.append(entry)
    return graphs


# -- a case ------------------------------------------------------------------------------
def build(settings: NeuronSettings, model: str) -> NxDBackend:
    backend = NxDBackend(settings, model)
    folder = Path(tempfile.mkdtemp(prefix="nxdi-xla-"))
    backend.compile(folder)
    backend.load(folder)
    return backend


def run_case(settings: NeuronSettings, model: str, tolerance: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        backend = build(settings, model)
    except NeuronConfigError as exc:
        return {"refused": str(exc)}
    drive_errors: list[str] = []
    recorded = record_calls(backend, drive_every_graph(backend, drive_errors))
    graphs = []
    for index in range(len(submodels(backend))):
        graphs += replay_submodel(backend, index, recorded, tolerance)
    return {
        "graphs": graphs,
        "submodels": [str(w.tag) for w in submodels(backend)],
        "buckets": sum(len(buckets_of(w)) for w in submodels(backend)),
        "served_calls": len(recorded),
        "drive_errors": drive_errors,
        "patches": list(backend.nxdi.patches_for(settings.architecture)),
        "seconds": round(time.perf_counter() - start, 1),
        "backend": backend,
    }


def self_check(backend: NxDBackend, tolerance: float) -> dict[str, Any]:
    """The first bucket of the first submodel, a `.item()` run before its lm_head: a host
    sync the metrics must report (a transfer, a compile during the forward)."""
    wrapper = backend.model.models[0]
    example = tuple(wrapper.input_generator()[0])
    call = Call(example, kv_snapshot(wrapper.model), "example")
    dev = device_module(wrapper)
    head = dev.instance.module.lm_head

    def host_sync(_module: Any, args: tuple) -> None:
        float(args[0].sum().item())

    hook = head.register_forward_pre_hook(host_sync)
    try:
        return {
            "trace": check_call("trace", wrapper, dev, 0, call, tolerance, 1),
            "again": check_call("again", wrapper, dev, 0, call, tolerance, 0),
        }
    finally:
        hook.remove()


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    names = ("neuronx-distributed-inference", "neuronx-distributed", "torch", "torch-xla")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def main(plan: dict[str, Any]) -> dict[str, Any]:
    tolerance = float(plan.get("tolerance", TOLERANCE))
    report: dict[str, Any] = {"versions": versions(), "cases": {}}
    first = None
    for name, settings in plan["cases"].items():
        case = run_case(NeuronSettings.from_dict(settings), plan["model"], tolerance)
        backend = case.pop("backend", None)
        first = first or backend
        report["cases"][name] = case
    if plan.get("self_check") and first is not None:
        report["self_check"] = self_check(first, tolerance)
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))))
