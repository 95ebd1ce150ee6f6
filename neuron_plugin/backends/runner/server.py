"""The runner process: hosts one backend in this interpreter and serves the backend
contract to the vLLM worker that started it (see the package docstring).

It exits with its parent: the kernel kills it when the parent dies (PR_SET_PDEATHSIG),
and it exits at end of input (the parent closed the pipe). Messages come and go on two
pipes the client passes as file descriptors (`protocol.Channel`), kept from the
processes the backend starts (a compiler): stdout and stderr are only the log, which
the client relays into vLLM's log, so nothing an interpreter wrapper, the Python
start-up or a library prints can corrupt a message.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from neuron_plugin.backends.runner.protocol import (
    PROTOCOL_VERSION,
    Arena,
    Channel,
    KVArena,
    ProtocolError,
    decode_inputs,
    decode_sampling,
    encode_prompt_logprobs,
)
from neuron_plugin.core.lifecycle import die_with_parent
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.core.threads import (
    RUNNER,
    apply_serving_threads,
    available_cores,
    model_on_host,
    serving_threads,
)

logger = logging.getLogger("neuron_plugin.runner")

# Distributions whose versions the handshake reports (those of the Neuron SDK decide
# which graphs neuronx-cc builds; the backends put them in the compile-cache key).
REPORTED = (
    "torch",
    "transformers",
    "numpy",
    "neuronx-distributed-inference",
    "neuronx-distributed",
    "neuronx-cc",
    "torch-neuronx",
)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {
        "python": platform.python_version(),
        "executable": sys.executable,
    }
    for name in REPORTED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def check_backend_importable(name: str) -> None:
    """Import what the backend needs now, so a missing package stops start-up with its
    name rather than failing later inside a load."""
    import neuron_plugin.backends.loader

    if name == "nxd":
        from neuron_plugin.backends.nxd.nxdi import import_nxdi

        import_nxdi()
    else:
        import neuron_plugin.backends.reference.backend  # noqa: F401


class Runner:
    """One backend behind the protocol's operations."""

    def __init__(self, inputs: Arena, outputs: Arena, kv: KVArena):
        self.inputs = inputs
        self.outputs = outputs
        self.kv = kv
        self.backend: Any = None

    def hello(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("protocol") != PROTOCOL_VERSION:
            raise ValueError(
                f"the vLLM side speaks runner protocol {message.get('protocol')}, this "
                f"runner ({sys.executable}) speaks {PROTOCOL_VERSION}: install the same "
                f"vllm-neuron-plugin version in both environments"
            )
        check_backend_importable(message["backend"])
        return {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "backend": message["backend"],
            "versions": versions(),
        }

    def _settings(self, message: dict[str, Any]) -> NeuronSettings:
        return NeuronSettings.from_dict(message["settings"])

    def load(self, message: dict[str, Any]) -> dict[str, Any]:
        from neuron_plugin.backends.loader import load_backend

        settings = self._settings(message)
        self.backend, result = load_backend(
            settings, message["model_dir"], message.get("cache_url")
        )
        # serving's thread count once loaded (loading keeps torch's own): core.threads
        choice = serving_threads(
            RUNNER,
            cores=available_cores(),
            engines=settings.dp_degree,
            model_on_host=model_on_host(settings.backend, settings.passthrough),
            runner=True,
        )
        return {
            "cache": _cache_result(result),
            "adapter_loading": self.backend.adapter_loading.to_dict(),
            "torch_threads": apply_serving_threads(RUNNER, choice, logger),
        }

    def compile(self, message: dict[str, Any]) -> dict[str, Any]:
        from compile_cache.cache import CompileCache
        from compile_cache.stores import open_store
        from neuron_plugin.backends.loader import compile_into_cache, make_backend

        backend = make_backend(self._settings(message), message["model_dir"])
        result = compile_into_cache(backend, CompileCache(open_store(message.get("cache_url"))))
        return {"cache": _cache_result(result)}

    def quantize(self, message: dict[str, Any]) -> dict[str, Any]:
        from neuron_plugin.backends.loader import make_backend

        backend = make_backend(self._settings(message), message["model_dir"])
        return {"written": backend.quantize()}

    def manifest(self, message: dict[str, Any]) -> dict[str, Any]:
        from neuron_plugin.backends.loader import cache_manifest, make_backend

        settings = self._settings(message)
        return {"manifest": cache_manifest(settings, make_backend(settings, message["model_dir"]))}

    # Each call's reply carries `backend_s`, the backend's own time, so the boundary's
    # cost (the rest of the round trip) can be told apart from the model's.
    def forward(self, message: dict[str, Any]) -> dict[str, Any]:
        inputs = decode_inputs(message["fields"], self.inputs.get(message["arrays"]))
        started = time.perf_counter()
        logits = self.backend.forward(inputs)
        backend_s = time.perf_counter() - started
        return {"arrays": self.outputs.put({"logits": logits.numpy()}), "backend_s": backend_s}

    def run(self, message: dict[str, Any]) -> dict[str, Any]:
        """A serving call: tokens for every row, logits only where the host samples."""
        arrays = self.inputs.get(message["arrays"])
        inputs, sampling = decode_inputs(message["fields"], arrays), decode_sampling(arrays)
        started = time.perf_counter()
        out = self.backend.run(inputs, sampling)
        backend_s = time.perf_counter() - started
        arrays = {"tokens": out.tokens, "logits": out.logits.numpy()}
        if out.prompt_logprobs is not None:
            arrays |= encode_prompt_logprobs(out.prompt_logprobs)
        return {"arrays": self.outputs.put(arrays), "backend_s": backend_s}

    def encode_image(self, message: dict[str, Any]) -> dict[str, Any]:
        """One image's embeddings (its arrays are views of the input arena)."""
        from neuron_plugin.core.vision import ImageInputs

        arrays = self.inputs.get(message["arrays"])
        image = ImageInputs(arrays["pixel_values"], arrays["grid_thw"])
        started = time.perf_counter()
        embeddings = self.backend.encode_image(image)
        backend_s = time.perf_counter() - started
        return {"arrays": self.outputs.put({"embeddings": embeddings}), "backend_s": backend_s}

    def set_adapter(self, message: dict[str, Any]) -> dict[str, Any]:
        """A LoRA adapter's arrays (views of the input arena, copied by the backend)
        into a slot."""
        from neuron_plugin.core.adapters import AdapterWeights

        adapter = AdapterWeights.from_arrays(message["adapter"], self.inputs.get(message["arrays"]))
        self.backend.set_adapter(int(message["slot"]), adapter)
        return {}

    # KV blocks (backends.kv_blocks): block ids in the input arena, blocks in the KV arena.
    def kv_geometry(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"geometry": self.backend.kv_geometry().to_dict()}

    def map_kv_arena(self, message: dict[str, Any]) -> dict[str, Any]:
        self.kv.attach(int(message["bytes"]))
        return {}

    def read_kv_blocks(self, message: dict[str, Any]) -> dict[str, Any]:
        ids = self.inputs.get(message["arrays"])["block_ids"].copy()
        return {"kv": self.kv.put(self.backend.read_kv_blocks(ids))}

    def write_kv_blocks(self, message: dict[str, Any]) -> dict[str, Any]:
        ids = self.inputs.get(message["arrays"])["block_ids"].copy()
        self.backend.write_kv_blocks(ids, self.kv.get(message["kv"]))
        return {}

    def ping(self, message: dict[str, Any]) -> dict[str, Any]:
        return {}


def _cache_result(result: Any) -> dict[str, Any]:
    return {
        "key": result.key,
        "hit": result.hit,
        "path": str(result.path),
        "reason": result.reason,
        "in_store": result.in_store,
    }


def serve(runner: Runner, channel: Channel) -> int:
    """Answer requests until shutdown or end of input. An operation's error is a reply,
    not an exit: the worker decides what it means."""
    while True:
        try:
            message = channel.receive()
        except ProtocolError as exc:  # the channel is out of step: nothing can follow
            logger.error("runner protocol: %s", exc)
            return 1
        if message is None:
            return 0
        op = message.get("op")
        if op == "shutdown":
            channel.send({"ok": True})
            return 0
        handler = getattr(runner, op, None) if op in OPS else None
        try:
            if handler is None:
                raise ValueError(f"unknown runner operation {op!r}")
            reply = {"ok": True, **handler(message)}
        except Exception as exc:  # every failure goes back to the worker with its cause
            logger.error("%s failed:\n%s", op, traceback.format_exc())
            reply = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "type": type(exc).__name__,
            }
        try:
            channel.send(reply)
        except ProtocolError as exc:  # a reply too large: its error goes instead
            channel.send({"ok": False, "error": f"ProtocolError: {exc}", "type": "ProtocolError"})


OPS = frozenset(
    {
        "hello",
        "load",
        "compile",
        "manifest",
        "quantize",
        "forward",
        "run",
        "encode_image",
        "set_adapter",
        "ping",
        "kv_geometry",
        "map_kv_arena",
        "read_kv_blocks",
        "write_kv_blocks",
    }
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m neuron_plugin.backends.runner", description=__doc__
    )
    parser.add_argument("--input-fd", type=int, required=True)
    parser.add_argument("--input-bytes", type=int, required=True)
    parser.add_argument("--output-fd", type=int, required=True)
    parser.add_argument("--output-bytes", type=int, required=True)
    parser.add_argument("--kv-fd", type=int, required=True)
    parser.add_argument("--request-fd", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGKILL, args.parent_pid)
    for fd in (args.request_fd, args.reply_fd):
        os.set_inheritable(fd, False)  # a process the backend starts never holds them
    channel = Channel(args.request_fd, args.reply_fd)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    runner = Runner(
        Arena(args.input_fd, args.input_bytes),
        Arena(args.output_fd, args.output_bytes),
        KVArena(args.kv_fd),
    )
    return serve(runner, channel)
