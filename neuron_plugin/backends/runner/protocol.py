"""The runner protocol: framed JSON control messages and arrays in shared memory.

Control: each message is a 4-byte little-endian length and a UTF-8 JSON object of at
most MAX_MESSAGE_BYTES; requests carry "op", replies carry "ok" (and "error" when
false). JSON, so nothing received can run code. Messages travel on two pipes of their
own (`Channel`), passed to the runner as file descriptors: nothing else writes to them,
so whatever an interpreter wrapper, the Python start-up or a library prints goes to the
runner's stdout and stderr (the log), never into a message. A reader waits at most its
timeout for a whole message (`ChannelTimeout`), and a writer too. Arrays: the client
writes a call's arrays into the input arena and sends their layout ({name: [dtype,
shape, offset]}); the runner answers with the output arena's layout. Operations:
- "hello" (protocol version, backend), "load", "compile", "manifest" and "quantize"
  (writes the quantized checkpoint the settings name) carry settings and a model folder,
  no arrays; "load" answers which LoRA adapters the backend takes (`AdapterLoading`).
- "run", a serving call: every `ForwardInputs` array (`adapter_slots` [rows] int64, each
  row's LoRA slot, with LoRA on) and the call's `SamplingInputs` arrays ("sampling."
  names: top_k, top_p, temperature, needs_logits [rows] and uniform [rows, draws]
  float32, 17 bytes a row and 4 more per extra draw with speculation); it answers the
  rows' tokens [rows, width] int32 (width 1, or speculation_length with speculation,
  padded with -1) plus logits only for the rows whose sampling needs the host, and, for a
  context encoding whose inputs carry `prompt_targets` [1, active] int64, its scored
  positions' prompt logprobs ("prompt." names: token_ids and logprobs [positions, k + 1]
  int32 and float32, ranks [positions] int64: 8k + 16 bytes a position).
- "forward": the same inputs, every row's logits.
  A vision-language model's calls also carry vision_embeddings [rows, active, width]
  float32 (width: VisionGeometry.embedding_width, the hidden size times 1 + Qwen3-VL's
  DeepStack levels) and vision_mask [rows, active] bool (context encoding with images) and
  rope_positions [3, rows, active] int64 (M-RoPE), ForwardInputs arrays like the others;
  a hybrid model's block-layout calls state_slots [rows, 2, state layers] int64.
- "encode_image": one image's pixel_values [patches, patch_dim] float32 and grid_thw
  [3] int64; it answers its embeddings [embedding_tokens, width] float32.
- "set_adapter": a LoRA adapter's A and B arrays (float32, per target module) for a
  slot, between calls.
- "kv_geometry", "map_kv_arena", "read_kv_blocks", "write_kv_blocks": KV blocks
  (prefill/decode disaggregation, `backends.kv_blocks`): block ids [n] int64 in the
  input arena, the blocks themselves in the KV arena (below).
- "ping": an empty round trip; "shutdown".
Call replies carry "backend_s", the backend's own time, so the boundary's cost can be
told from the model's. Both arenas are memfd-backed mappings the client creates before
starting the runner (inherited file descriptors), sized once from the settings, so they
vanish with the last process holding them: nothing is left in /dev/shm after a crash.
KV blocks go through a third memfd mapping, the KV arena, sized once the backend's KV
geometry is known for a request's worth of blocks (`max_model_len / block_size` of
them): raw tensor bytes described by {"dtype", "shape"} in the message, a dtype of
`kv_blocks.TORCH_DTYPES` only. Requests are answered in order, one at a time, so a
client may send a "run" and read its reply later (`RunnerBackend.submit`/`collect`: the
forward overlaps the host's next step) as long as it sends nothing else, and writes
nothing into the arenas, until it has read that reply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import select
import struct
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.base import graph_specs
from neuron_plugin.backends.kv_blocks import TORCH_DTYPES
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    ForwardInputs,
    decode_width,
    padding_inputs,
)
from neuron_plugin.core.lora import LoraGeometry
from neuron_plugin.core.prompt_logprobs import PromptLogprobs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.vision import VISION_ENCODING, VisionGeometry

# 3: tokens and draws [rows, positions] (speculative decoding); 4: adapter_slots and
# "set_adapter" (LoRA); 5: KV blocks and the KV arena (prefill/decode disaggregation);
# 6: messages on pipes of their own, lengths capped; KVGeometry.computation; 7: the
# vision arrays of ForwardInputs and "encode_image" (vision-language models)
# 8: prompt_targets and the prompt logprobs of a run's answer; 9: state_slots (a hybrid
# model's state layers, core.recurrent_state)
PROTOCOL_VERSION = 9
# Control messages carry settings, layouts and manifests (arrays go through the arenas).
MAX_MESSAGE_BYTES = 16 << 20
# Array names of a call's SamplingInputs (ForwardInputs fields never start with it).
SAMPLING_PREFIX = "sampling."
# Array names of a run's prompt logprobs in its answer.
PROMPT_PREFIX = "prompt."
ALIGN = 64
_LENGTH = struct.Struct("<I")
# Allowed array dtypes (a layout naming anything else is refused).
DTYPES = frozenset({"int64", "int32", "float32", "bool"})
Layout = dict[str, list[Any]]


class ProtocolError(RuntimeError):
    """The other side sent something this protocol version does not allow."""


class ChannelTimeout(TimeoutError):
    """No whole message crossed the channel within the timeout."""


class Channel:
    """Messages out on `write_fd`, in from `read_fd` (two pipes of the channel's own),
    each wait bounded by a timeout in seconds (None: no bound)."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd = read_fd
        self.write_fd = write_fd
        os.set_blocking(write_fd, False)  # a write waits in poll, within its timeout
        self._pending = bytearray()

    def send(self, message: Mapping[str, Any], timeout: float | None = None) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(
                f"a {message.get('op', 'reply')!r} message of {len(data):,} bytes, more than "
                f"the protocol's {MAX_MESSAGE_BYTES:,}"
            )
        view = memoryview(_LENGTH.pack(len(data)) + data)
        deadline = _deadline(timeout)
        while view:
            self._wait(self.write_fd, select.POLLOUT, deadline)
            try:
                view = view[os.write(self.write_fd, view) :]
            except BlockingIOError:
                continue

    def receive(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message, or None at end of stream (the other side is gone)."""
        deadline = _deadline(timeout)
        head = self._read(_LENGTH.size, deadline)
        if head is None:
            return None
        (length,) = _LENGTH.unpack(head)
        if length > MAX_MESSAGE_BYTES:
            raise ProtocolError(
                f"a message announced as {length:,} bytes, more than the protocol's "
                f"{MAX_MESSAGE_BYTES:,}: the other side does not speak this protocol"
            )
        data = self._read(length, deadline)
        if data is None:
            return None
        try:
            message = json.loads(data)
        except ValueError as exc:
            raise ProtocolError(f"a message that is not JSON ({exc})") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"expected a JSON object, got {type(message).__name__}")
        return message

    def _read(self, count: int, deadline: float | None) -> bytes | None:
        while len(self._pending) < count:
            self._wait(self.read_fd, select.POLLIN, deadline)
            chunk = os.read(self.read_fd, max(count - len(self._pending), 1 << 16))
            if not chunk:
                return None
            self._pending += chunk
        data = bytes(self._pending[:count])
        del self._pending[:count]
        return data

    @staticmethod
    def _wait(fd: int, event: int, deadline: float | None) -> None:
        poller = select.poll()
        poller.register(fd, event)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ChannelTimeout()
            # POLLHUP/POLLERR too: the read or write that follows reports them
            if poller.poll(None if left is None else max(1, int(left * 1000) + 1)):
                return

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A shared mapping arrays are packed into, one call at a time."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size)

    @classmethod
    def create(cls, name: str, size: int) -> Arena:
        fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: the runner inherits it
        os.ftruncate(fd, size)
        return cls(fd, size)

    def put(self, arrays: Mapping[str, np.ndarray]) -> Layout:
        """Copy arrays in back to back; their layout for the other side."""
        layout: Layout = {}
        offset = 0
        for name, array in arrays.items():
            end = offset + array.nbytes
            if end > self.size:
                raise ProtocolError(
                    f"a call's arrays need more than the {self.size} bytes sized from the "
                    f"settings (at {name}, shape {array.shape}); report this with your "
                    f"configuration"
                )
            view = np.ndarray(array.shape, array.dtype, buffer=self.map, offset=offset)
            view[...] = array
            layout[name] = [array.dtype.name, list(array.shape), offset]
            offset = _aligned(end)
        return layout

    def get(self, layout: Mapping[str, list[Any]]) -> dict[str, np.ndarray]:
        """Views (no copy) of the arrays a layout describes, bounds-checked."""
        arrays = {}
        for name, (dtype, shape, offset) in layout.items():
            if dtype not in DTYPES:
                raise ProtocolError(
                    f"array {name!r} has dtype {dtype!r}, not one of {sorted(DTYPES)}"
                )
            view = np.ndarray(tuple(shape), np.dtype(dtype), buffer=self.map, offset=offset)
            arrays[name] = view
        return arrays

    def close(self) -> None:
        # A caller may still hold a view; the mapping then goes when that view does.
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)


class KVArena:
    """The KV arena: a memfd both processes map once its size is known (`map`); the
    client, which created it, sizes it."""

    def __init__(self, fd: int):
        self.fd = fd
        self.size = 0
        self.map: mmap.mmap | None = None

    @classmethod
    def create(cls, name: str) -> KVArena:
        return cls(os.memfd_create(name, 0))  # no MFD_CLOEXEC: the runner inherits it

    def resize(self, size: int) -> None:
        """The client: grow the file to `size` bytes and map it."""
        os.ftruncate(self.fd, size)
        self.attach(size)

    def attach(self, size: int) -> None:
        """Map the first `size` bytes (the runner maps what the client sized)."""
        if os.fstat(self.fd).st_size < size:
            raise ProtocolError(f"the KV arena holds {os.fstat(self.fd).st_size} bytes, not {size}")
        self._unmap()
        self.map = mmap.mmap(self.fd, size)
        self.size = size

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.map is None or nbytes > self.size:
            raise ProtocolError(
                f"{nbytes} bytes of KV blocks do not fit the KV arena ({self.size} bytes, "
                f"a request's worth of blocks)"
            )
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes)

    def put(self, tensor: torch.Tensor) -> dict[str, Any]:
        """Copy a tensor's bytes in; its description for the other side."""
        name = next((n for n, d in TORCH_DTYPES.items() if d == tensor.dtype), None)
        if name is None:
            raise ProtocolError(f"KV blocks in {tensor.dtype} cannot cross the runner boundary")
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        self._buffer(raw.numel()).copy_(raw)
        return {"dtype": name, "shape": list(tensor.shape)}

    def get(self, description: Mapping[str, Any]) -> torch.Tensor:
        """A view (no copy) of the tensor a description names, checked."""
        dtype, shape = description.get("dtype"), description.get("shape")
        if dtype not in TORCH_DTYPES:
            raise ProtocolError(f"KV blocks in dtype {dtype!r}, not one of {sorted(TORCH_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"KV blocks of shape {shape!r}: not a list of sizes")
        torch_dtype = TORCH_DTYPES[dtype]
        count = int(np.prod(shape)) if shape else 1
        nbytes = count * torch.empty(0, dtype=torch_dtype).element_size()
        return self._buffer(nbytes).view(torch_dtype).reshape(shape)

    def _unmap(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view may still hold it
                self.map.close()
            self.map = None

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


def encode_inputs(inputs: ForwardInputs) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(JSON-able fields, arrays) of a call: every ndarray field goes to the arena."""
    fields, arrays = {}, {}
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if isinstance(value, np.ndarray):
            arrays[f.name] = value
        elif value is not None:
            fields[f.name] = list(value) if isinstance(value, tuple) else value
    return fields, arrays


def encode_sampling(sampling: SamplingInputs) -> dict[str, np.ndarray]:
    return {SAMPLING_PREFIX + name: array for name, array in sampling.arrays().items()}


def decode_sampling(arrays: Mapping[str, np.ndarray]) -> SamplingInputs:
    names = SamplingInputs.ARRAYS
    missing = [n for n in names if SAMPLING_PREFIX + n not in arrays]
    if missing:
        raise ProtocolError(f"a run call lacks the sampling arrays {missing}")
    return SamplingInputs(*(arrays[SAMPLING_PREFIX + n] for n in names))


def encode_prompt_logprobs(scored: PromptLogprobs) -> dict[str, np.ndarray]:
    return {PROMPT_PREFIX + name: array for name, array in scored.arrays().items()}


def decode_prompt_logprobs(arrays: Mapping[str, np.ndarray]) -> PromptLogprobs | None:
    """A run answer's prompt logprobs (copied out of the arena), None where it has none."""
    names = PromptLogprobs.ARRAYS
    present = [n for n in names if PROMPT_PREFIX + n in arrays]
    if not present:
        return None
    if len(present) != len(names):
        raise ProtocolError(f"a run answer carries the prompt arrays {present} of {names}")
    return PromptLogprobs(*(arrays[PROMPT_PREFIX + n].copy() for n in names))


def decode_inputs(fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> ForwardInputs:
    arrays = {k: v for k, v in arrays.items() if not k.startswith(SAMPLING_PREFIX)}
    known = {f.name for f in dataclasses.fields(ForwardInputs)}
    unknown = sorted((set(fields) | set(arrays)) - known)
    if unknown:
        raise ProtocolError(f"unknown ForwardInputs fields {unknown}")
    # A field the sender left out is one it held as None (see encode_inputs).
    values: dict[str, Any] = dict.fromkeys(known) | dict(fields) | arrays
    values["bucket"] = tuple(values["bucket"])
    return ForwardInputs(**values)


def input_arena_bytes(
    settings: NeuronSettings,
    geometry: LoraGeometry | None = None,
    vision: VisionGeometry | None = None,
) -> int:
    """Room for the largest call the settings allow: every graph's padded arrays, plus a
    whole context of token ids (block-layout context encoding sends them); with LoRA
    (`geometry`) at least one adapter at max_lora_rank (`set_adapter`); a
    vision-language model's (`vision`) vision arrays and its largest image."""
    largest = 0
    for graph in graph_specs(settings):
        if graph.phase == VISION_ENCODING:
            assert vision is not None, "vision buckets without the model's vision geometry"
            image = _aligned(4 * graph.shape[0] * vision.patch_dim) + _aligned(8 * 3)
            largest = max(largest, image)
            continue
        inputs = padding_inputs(settings, graph.phase, graph.shape)
        if vision is not None:
            inputs = with_vision_arrays(inputs, vision.embedding_width)
        if settings.state_layers and settings.is_block_layout:  # each row's state slots
            rows = inputs.input_ids.shape[0]
            slots = np.zeros((rows, 2, settings.state_layers), dtype=np.int64)
            inputs = dataclasses.replace(inputs, state_slots=slots)
        _, arrays = encode_inputs(inputs)
        if graph.prompt_logprobs:  # [1, active] int64, as input_ids
            arrays["prompt_targets"] = inputs.input_ids
        draws = decode_width(settings)
        arrays.update(encode_sampling(SamplingInputs.greedy(inputs.input_ids.shape[0], draws)))
        largest = max(largest, sum(_aligned(a.nbytes) for a in arrays.values()))
    largest += _aligned(8 * settings.max_model_len)
    if geometry is not None and settings.max_loras:
        # one aligned array per module and A/B
        padding = 2 * len(geometry.shapes) * ALIGN
        largest = max(largest, geometry.slot_bytes(settings.max_lora_rank) + padding)
    return largest + ALIGN


def with_vision_arrays(inputs: ForwardInputs, width: int) -> ForwardInputs:
    """`inputs` with every vision array a call of its phase may carry, zero: the most a
    vision-language model's call sends."""
    rows, active = inputs.input_ids.shape
    inputs = dataclasses.replace(inputs, rope_positions=np.zeros((3, rows, active), dtype=np.int64))
    if inputs.phase != CONTEXT_ENCODING:
        return inputs
    return dataclasses.replace(
        inputs,
        vision_embeddings=np.zeros((rows, active, width), dtype=np.float32),
        vision_mask=np.zeros((rows, active), dtype=bool),
    )


def output_arena_bytes(
    settings: NeuronSettings, vocab_size: int, vision: VisionGeometry | None = None
) -> int:
    """Int32 tokens (a row's emitted tokens with speculation) and float32 logits for the
    most rows one call returns; for a vision-language model (`vision`) at least the
    largest image's float32 embeddings; and the prompt logprobs of the largest context
    encoding where the settings compile prompt-logprob graphs."""
    rows = max(max(settings.token_generation_batches), settings.ctx_batch_size)
    step = _aligned(4 * rows * decode_width(settings)) + _aligned(4 * rows * vocab_size)
    if vision is not None and settings.vision_buckets:
        tokens = max(settings.vision_buckets) // vision.spatial_merge_size**2
        step = max(step, _aligned(4 * tokens * vision.embedding_width))
    if settings.prompt_logprobs is not None:
        positions = max(settings.context_encoding_buckets)
        columns = settings.prompt_logprobs + 1
        step += 2 * _aligned(4 * positions * columns) + _aligned(8 * positions) + ALIGN
    return step + ALIGN
