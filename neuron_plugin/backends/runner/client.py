"""The worker's side of the runner: starts the runner process in the backend's
interpreter and serves the Backend contract through it (see the package docstring).

Faults end in an error naming the interpreter, the runner's last log lines and the fix:
a runner that cannot start (missing package, wrong protocol) stops the engine's start-up;
a runner that dies while serving fails the call in progress, and with it the engine
step, so vLLM fails the in-flight requests and shuts down rather than hanging. Every
wait has a bound (`RunnerTimeouts`): a runner that does not shake hands, or answer a
call, in time is killed and the wait ends in a `RunnerTimeout` naming the operation and
the setting, never a silent hang.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compile_cache.cache import CacheResult
from neuron_plugin import BACKEND_PYTHON_ENV, plugin_logger
from neuron_plugin.backends.base import AdapterLoading, StepOutput
from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.backends.runner.protocol import (
    PROTOCOL_VERSION,
    Arena,
    Channel,
    ChannelTimeout,
    KVArena,
    decode_prompt_logprobs,
    encode_inputs,
    encode_sampling,
    input_arena_bytes,
    output_arena_bytes,
)
from neuron_plugin.core.adapters import AdapterError, AdapterWeights
from neuron_plugin.core.checkpoint import (
    read_hf_config,
    safetensors_shapes,
    text_config,
    vocab_size,
)
from neuron_plugin.core.inputs import ForwardInputs
from neuron_plugin.core.lora import LoraGeometry
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.vision import ImageInputs, VisionGeometry, vision_bucket

logger = plugin_logger(__name__)

TAIL_LINES = 25
EXIT_WAIT_S = 10.0
START_TIMEOUT_ENV = "VLLM_NEURON_RUNNER_START_TIMEOUT_S"
CALL_TIMEOUT_ENV = "VLLM_NEURON_RUNNER_CALL_TIMEOUT_S"
BUILD_TIMEOUT_ENV = "VLLM_NEURON_RUNNER_BUILD_TIMEOUT_S"
# Operations that compile or load graphs (a compile takes minutes to hours).
BUILD_OPS = frozenset({"load", "compile", "quantize", "manifest"})


class RunnerError(RuntimeError):
    """The backend runner failed or died; the message says why and what to do."""


class RunnerTimeout(RunnerError):
    """The backend runner did not answer within its timeout (and was stopped)."""


@dataclass(frozen=True)
class RunnerTimeouts:
    """How long the worker waits for the runner, in seconds: the handshake (the runner
    starts its interpreter and imports the backend: NxDI takes about a minute), a call
    that compiles or loads graphs, and every other call (an engine step's)."""

    start_s: float = 300.0
    build_s: float = 12 * 3600.0
    call_s: float = 600.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RunnerTimeouts:
        values = {}
        for field, env in (
            ("start_s", START_TIMEOUT_ENV),
            ("build_s", BUILD_TIMEOUT_ENV),
            ("call_s", CALL_TIMEOUT_ENV),
        ):
            given = environ.get(env, "").strip()
            if not given:
                continue
            try:
                value = float(given)
            except ValueError:
                value = -1.0
            if not 0 < value < float("inf"):
                raise NeuronConfigError(
                    f"{env}={given!r} must be a positive number of seconds (default "
                    f"{getattr(cls, field):g}); fix or unset it."
                )
            values[field] = value
        return cls(**values)

    def for_op(self, op: str) -> tuple[float, str]:
        """(seconds, the setting that sets them) for a reply to `op`."""
        if op == "hello":
            return self.start_s, START_TIMEOUT_ENV
        if op in BUILD_OPS:
            return self.build_s, BUILD_TIMEOUT_ENV
        return self.call_s, CALL_TIMEOUT_ENV


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class RunnerProcess:
    """A started runner: its process, its arenas, and request/reply over its channel."""

    def __init__(
        self,
        python: str,
        backend: str,
        input_bytes: int,
        output_bytes: int,
        timeouts: RunnerTimeouts | None = None,
    ):
        self.python = python
        self.timeouts = timeouts or RunnerTimeouts.from_env()
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.inputs = Arena.create("neuron-runner-inputs", input_bytes)
        self.outputs = Arena.create("neuron-runner-outputs", output_bytes)
        self.kv = KVArena.create("neuron-runner-kv")  # sized on first use
        # The channel's pipes: the runner reads requests from one, answers on the other.
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        fds = (self.inputs.fd, self.outputs.fd, self.kv.fd, request_r, reply_w)
        try:
            self.process = subprocess.Popen(
                [
                    python,
                    "-m",
                    "neuron_plugin.backends.runner",
                    "--input-fd",
                    str(fds[0]),
                    "--input-bytes",
                    str(input_bytes),
                    "--output-fd",
                    str(fds[1]),
                    "--output-bytes",
                    str(output_bytes),
                    "--kv-fd",
                    str(fds[2]),
                    "--request-fd",
                    str(request_r),
                    "--reply-fd",
                    str(reply_w),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,  # the log: whatever it prints
                stderr=subprocess.STDOUT,
                pass_fds=fds,
            )
        except OSError as exc:
            for fd in (request_r, request_w, reply_r, reply_w):
                os.close(fd)
            self._close_arenas()
            raise RunnerError(
                f"cannot start the backend runner with VLLM_NEURON_BACKEND_PYTHON="
                f"{python!r}: {exc}; point it at the Python of the environment that "
                f"has the backend installed."
            ) from exc
        os.close(request_r)  # the runner's ends: its exit is then our end of stream
        os.close(reply_w)
        self.channel = Channel(reply_r, request_w)
        log = self.process.stdout
        assert log is not None  # Popen made the pipe (typed optional)
        self._log = log
        self._relay = threading.Thread(
            target=self._relay_log, daemon=True, name="neuron-runner-log"
        )
        self._relay.start()
        try:
            self.handshake = self.request("hello", protocol=PROTOCOL_VERSION, backend=backend)
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        """The handshake in one line: who runs the backend, with which versions."""
        v = self.handshake["versions"]
        return (
            f"backend runner pid {self.handshake['pid']}: {self.handshake['backend']} "
            f"backend in {v['executable']} (Python {v['python']}, torch {v['torch']}, "
            f"transformers {v['transformers']}, NxDI "
            f"{v['neuronx-distributed-inference']}, neuronx-cc {v['neuronx-cc']}), "
            f"protocol {PROTOCOL_VERSION}"
        )

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.receive(op)

    def send(self, op: str, **fields: Any) -> None:
        """The request half of `request`: the runner starts on it while this process
        goes on; `receive` waits for its reply."""
        try:
            self.channel.send({"op": op, **fields}, self.timeouts.call_s)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(op) from None
        except ChannelTimeout:
            raise self._timed_out(op, self.timeouts.call_s, CALL_TIMEOUT_ENV) from None

    def receive(self, op: str) -> dict[str, Any]:
        """The reply to the request `send` sent for `op`, within the op's timeout."""
        seconds, setting = self.timeouts.for_op(op)
        try:
            reply = self.channel.receive(seconds)
        except (BrokenPipeError, ConnectionResetError):
            reply = None
        except ChannelTimeout:
            raise self._timed_out(op, seconds, setting) from None
        if reply is None:
            raise self._died(op)
        if not reply.get("ok"):
            error = reply.get("error", "unknown error")
            kind = reply.get("type")
            if kind in ("NeuronConfigError", "AdapterError"):  # its message says the fix
                cls = AdapterError if kind == "AdapterError" else NeuronConfigError
                raise cls(error.removeprefix(f"{kind}: "))
            raise RunnerError(
                f"the backend runner ({self.python}) failed {op}: {error}"
                + (self._fix_for_start() if op == "hello" else "")
            )
        return reply

    def close(self) -> None:
        """Stop the runner (it would also die with this process)."""
        if self.process.poll() is None:
            try:
                self.channel.send({"op": "shutdown"}, EXIT_WAIT_S)
                self.process.wait(EXIT_WAIT_S)
            except (OSError, ChannelTimeout, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.channel.close()
        self._close_arenas()

    def _relay_log(self) -> None:
        """The runner's output into vLLM's log, keeping the last lines for errors."""
        for raw in iter(self._log.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            logger.info("backend runner: %s", line)

    def _died(self, op: str) -> RunnerError:
        try:
            code = self.process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        self._relay.join(2.0)
        tail = "\n".join(self._tail) or "(it printed nothing)"
        if op == "hello":
            fix = self._fix_for_start()
        else:
            fix = (
                "; the engine cannot continue without its backend, so the requests in "
                "flight fail and the server stops: restart it once the cause above is "
                "fixed"
            )
        return RunnerError(
            f"the backend runner (pid {self.process.pid}, {self.python}) "
            f"{describe_exit(code)} during {op}. Its last lines:\n{tail}\n{fix}"
        )

    def _timed_out(self, op: str, seconds: float, setting: str) -> RunnerTimeout:
        """Stop a runner that did not answer in time (its channel is out of step now)."""
        self.process.kill()
        self.process.wait()
        self._relay.join(2.0)
        tail = "\n".join(self._tail) or "(it printed nothing)"
        if op == "hello":
            fix = (
                f"; it did not shake hands: check that {self.python} is the backend "
                f"environment's Python and starts, or raise {setting} if importing the "
                f"backend takes longer on this host"
            )
        else:
            fix = (
                f"; the backend is stuck or far slower than expected: the engine cannot "
                f"continue, so the requests in flight fail and the server stops; raise "
                f"{setting} if this call legitimately takes longer"
            )
        return RunnerTimeout(
            f"the backend runner (pid {self.process.pid}, {self.python}) did not answer "
            f"{op} within {setting}={seconds:g} s and was stopped. Its last lines:\n{tail}\n"
            f"{fix}"
        )

    def _fix_for_start(self) -> str:
        return (
            f"; install the backend side in that environment ({self.python} -m pip "
            f"install 'vllm-neuron-plugin[backend]', plus the Neuron SDK packages for "
            f"the nxd backend), or point VLLM_NEURON_BACKEND_PYTHON at the right "
            f"interpreter; `neuron-plugin doctor` checks both."
        )

    def _close_arenas(self) -> None:
        self.inputs.close()
        self.outputs.close()
        self.kv.close()


def probe(python: str, backend: str, timeouts: RunnerTimeouts | None = None) -> dict[str, Any]:
    """Start a runner, shake hands (it imports the backend), stop it: the handshake."""
    runner = RunnerProcess(python, backend, mmap.PAGESIZE, mmap.PAGESIZE, timeouts)
    try:
        return runner.handshake
    finally:
        runner.close()


def _cache_result(fields: dict[str, Any]) -> CacheResult:
    return CacheResult(
        path=Path(fields["path"]),
        key=fields["key"],
        hit=fields["hit"],
        in_store=fields["in_store"],
        reason=fields["reason"],
    )


class RunnerBackend:
    """The Backend contract, served by `python -m neuron_plugin.backends.runner` under
    `settings.backend_python`."""

    def __init__(self, settings: NeuronSettings, model_dir: str | Path):
        if not settings.backend_python:
            raise NeuronConfigError(
                f"the backend runner needs the interpreter of the backend's environment; "
                f"set {BACKEND_PYTHON_ENV} to it, or leave it unset to run the "
                f"{settings.backend} backend in this process."
            )
        self.name = settings.backend
        self.settings = settings
        self.model_dir = os.path.abspath(model_dir)  # the runner may run elsewhere
        geometry = None
        if settings.max_loras:
            geometry = LoraGeometry.from_checkpoint(
                safetensors_shapes(model_dir),
                int(text_config(read_hf_config(model_dir))["num_hidden_layers"]),
                settings.lora_target_modules,
            )
        vision = VisionGeometry.from_hf_config(read_hf_config(model_dir))
        self.runner = RunnerProcess(
            settings.backend_python,
            settings.backend,
            input_arena_bytes(settings, geometry, vision),
            output_arena_bytes(settings, vocab_size(model_dir), vision),
        )
        self.handshake = self.runner.handshake
        # The backend's own time in the last forward/run (the rest was the boundary's).
        self.last_backend_s = 0.0
        self._in_flight = False  # a submitted "run" whose reply is not read yet
        self.adapter_loading = AdapterLoading()  # the loaded backend's, once loaded
        self.torch_threads: int | None = None  # the runner's for serving (core.threads)
        self._kv_geometry: KVGeometry | None = None
        logger.info(self.runner.describe())

    @property
    def module(self) -> torch.nn.Module:
        raise RunnerError(
            "the model lives in the backend runner process "
            f"({self.runner.python}); it cannot be handed to vLLM as a module."
        )

    def load(self, cache_url: str | None = None) -> CacheResult:
        """Compile-or-fetch through the compile cache, load and warm up, in the runner."""
        reply = self.runner.request(
            "load",
            settings=self.settings.to_dict(),
            model_dir=self.model_dir,
            cache_url=cache_url,
        )
        self.adapter_loading = AdapterLoading.from_dict(reply["adapter_loading"])
        self.torch_threads = reply.get("torch_threads")
        return _cache_result(reply["cache"])

    def compile(self, cache_url: str | None = None) -> CacheResult:
        """Compile-or-fetch without loading (precompile), in the runner."""
        return _cache_result(
            self.runner.request(
                "compile",
                settings=self.settings.to_dict(),
                model_dir=self.model_dir,
                cache_url=cache_url,
            )["cache"]
        )

    def quantize(self) -> dict[str, Any]:
        """Write the quantized checkpoint (`neuron-plugin quantize`), in the runner."""
        return self.runner.request(
            "quantize", settings=self.settings.to_dict(), model_dir=self.model_dir
        )["written"]

    def manifest(self) -> dict[str, Any]:
        return self.runner.request(
            "manifest", settings=self.settings.to_dict(), model_dir=self.model_dir
        )["manifest"]

    def _call(
        self, op: str, inputs: ForwardInputs, extra: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Inputs into the input arena, the reply's arrays as views of the output arena
        (valid until the next call)."""
        self._send(op, inputs, extra)
        return self._receive(op)

    def _send(self, op: str, inputs: ForwardInputs, extra: dict[str, np.ndarray]) -> None:
        if self._in_flight:  # its inputs are still in the input arena, being read
            raise RunnerError(f"{op} while a submitted call is in flight: collect it first")
        fields, arrays = encode_inputs(inputs)
        arrays.update(extra)
        self.runner.send(op, fields=fields, arrays=self.runner.inputs.put(arrays))

    def _receive(self, op: str) -> dict[str, np.ndarray]:
        reply = self.runner.receive(op)
        self.last_backend_s = reply["backend_s"]
        return self.runner.outputs.get(reply["arrays"])

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """Logits [num_real, vocab]: a view of the output arena, valid until the next
        call (the model runner copies them into its batch)."""
        return torch.from_numpy(self._call("forward", inputs, {})["logits"])

    def run(self, inputs: ForwardInputs, sampling: SamplingInputs) -> StepOutput:
        """Tokens (copied: 4 bytes a row) and the logits of the rows the host samples (a
        view of the output arena, valid until the next call)."""
        out = self._call("run", inputs, encode_sampling(sampling))
        return self._step_output(out)

    def submit(self, inputs: ForwardInputs, sampling: SamplingInputs) -> None:
        """Send a serving call and return at once: the runner computes it while this
        process prepares the next step (nothing else may be called until `collect`)."""
        self._send("run", inputs, encode_sampling(sampling))
        self._in_flight = True

    def collect(self) -> StepOutput:
        """The submitted call's answer, as `run` gives it."""
        if not self._in_flight:
            raise RunnerError("collect() without a submitted call")
        self._in_flight = False
        return self._step_output(self._receive("run"))

    def _step_output(self, out: dict[str, np.ndarray]) -> StepOutput:
        return StepOutput(
            tokens=out["tokens"].copy(),
            logits=torch.from_numpy(out["logits"]),
            backend_s=self.last_backend_s,
            prompt_logprobs=decode_prompt_logprobs(out),
        )

    def _idle(self, op: str) -> None:
        if self._in_flight:  # the runner is computing; its arenas are in use
            raise RunnerError(f"{op} while a submitted call is in flight: collect it first")

    def encode_image(self, image: ImageInputs) -> np.ndarray:
        """The image's arrays through the input arena (sized for the largest vision
        bucket: a larger image is refused here, as the backend would); its embeddings
        copied out."""
        self._idle("encode_image")
        if not image.is_padding:
            vision_bucket(self.settings.vision_buckets, image.patches)
        arrays = {"pixel_values": image.pixel_values, "grid_thw": image.grid_thw}
        reply = self.runner.request("encode_image", arrays=self.runner.inputs.put(arrays))
        self.last_backend_s = reply["backend_s"]
        return self.runner.outputs.get(reply["arrays"])["embeddings"].copy()

    def set_adapter(self, slot: int, adapter: AdapterWeights) -> None:
        """The adapter's arrays through the input arena into the runner's slot `slot`."""
        self._idle("set_adapter")
        layout = self.runner.inputs.put(adapter.arrays())
        self.runner.request("set_adapter", slot=slot, adapter=adapter.describe(), arrays=layout)

    # -- KV blocks through the KV arena (protocol docstring) ------------------------------
    def kv_geometry(self) -> KVGeometry:
        """The backend's KV geometry; the first call sizes the KV arena for a request's
        worth of blocks and has the runner map it."""
        if self._kv_geometry is None:
            self._idle("kv_geometry")
            geometry = KVGeometry.from_dict(self.runner.request("kv_geometry")["geometry"])
            size = geometry.block_bytes * self.settings.max_blocks_per_seq
            self.runner.kv.resize(size)
            self.runner.request("map_kv_arena", bytes=size)
            self._kv_geometry = geometry
        return self._kv_geometry

    def read_kv_blocks(self, block_ids: np.ndarray) -> torch.Tensor:
        """A view of the KV arena, valid until the next KV call."""
        self.kv_geometry()
        self._idle("read_kv_blocks")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        reply = self.runner.request(
            "read_kv_blocks", arrays=self.runner.inputs.put({"block_ids": ids})
        )
        return self.runner.kv.get(reply["kv"])

    def write_kv_blocks(self, block_ids: np.ndarray, kv: torch.Tensor) -> None:
        self.kv_geometry()
        self._idle("write_kv_blocks")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self.runner.request(
            "write_kv_blocks",
            arrays=self.runner.inputs.put({"block_ids": ids}),
            kv=self.runner.kv.put(kv),
        )

    def ping(self) -> None:
        """An empty round trip (the protocol's fixed cost, for benchmarks)."""
        if self._in_flight:
            raise RunnerError("ping while a submitted call is in flight: collect it first")
        self.runner.request("ping")

    def close(self) -> None:
        self.runner.close()
