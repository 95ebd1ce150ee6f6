"""The backend runner as a real process: the same logits as in-process for both KV
layouts, errors that cross the boundary with their cause, and faults (a missing package,
a runner killed mid-call, the parent gone) that end in a clear error or exit."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from neuron_plugin.backends.loader import open_backend
from neuron_plugin.backends.runner.client import RunnerBackend, RunnerError
from neuron_plugin.backends.runner.protocol import ProtocolError
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from tests.e2e.support import alive

BUCKETS = {"context_encoding_buckets": [32, 64, 128], "token_generation_buckets": [64, 128]}


def settings_for(block: bool, **changes):
    limits = EngineLimits(max_model_len=128, max_num_seqs=2, block_size=32 if block else None,
                          enable_prefix_caching=block, enable_chunked_prefill=False,
                          max_num_batched_tokens=128, dtype="float32")
    settings = resolve_settings(limits, BUCKETS, backend="reference",
                                architecture="LlamaForCausalLM")
    return dataclasses.replace(settings, **changes)


@pytest.fixture(scope="module")
def cache_url(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("runner-cache"))


def _calls(settings):
    """A prefill of 40 tokens into slot 0 / blocks 1-2, then one decode step."""
    ids = np.arange(3, 43, dtype=np.int64)
    blocks = [1, 2] if settings.is_block_layout else None
    seq = 0 if settings.is_block_layout else 0
    yield context_encoding_inputs(settings, ids, 0, seq, blocks)
    yield token_generation_inputs(settings, np.array([7]), np.array([40]), np.array([seq]),
                                  [blocks] if blocks else None)


@pytest.mark.parametrize("block", [False, True], ids=["contiguous", "block"])
def test_runner_logits_equal_in_process(model_dirs, cache_url, block, monkeypatch):
    """Bit for bit: the runner runs torch with this process's thread count (the sums of
    a matmul split across threads round differently), whatever the tests before set, and
    both processes hold their weights 64-byte aligned (the next test: MKL rounds 8- and
    16-byte aligned operands differently, which made this test flaky)."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    local = open_backend(settings_for(block), model_dirs["llama"], cache_url)
    remote = open_backend(settings_for(block, backend_python=sys.executable),
                          model_dirs["llama"], cache_url)
    try:
        assert isinstance(remote, RunnerBackend)
        assert remote.handshake["versions"]["executable"] == sys.executable
        for inputs in _calls(settings_for(block)):
            expected = local.forward(inputs).clone()
            got = remote.forward(inputs)
            assert got.shape == expected.shape == (1, remote_vocab(model_dirs))
            assert np.array_equal(got.numpy(), expected.numpy())
    finally:
        remote.close()
    assert remote.runner.process.returncode == 0


def _relaid(model_dir: Path, folder: Path, residue: int) -> Path:
    """The checkpoint rewritten with header metadata padding its tensors' data to a file
    offset of `residue` mod 64 (safetensors pads the header to 8 bytes): the alignment
    its tensors get when read through a memory map."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for pad in range(64):
        save_file(tensors, str(folder / "model.safetensors"), metadata={"pad": "x" * pad})
        with open(folder / "model.safetensors", "rb") as f:
            header = int.from_bytes(f.read(8), "little")
        if (8 + header) % 64 == residue:
            return folder
    raise AssertionError(f"no padding puts the data at {residue} mod 64")


@pytest.mark.parametrize("block", [False, True], ids=["contiguous", "block"])
def test_logits_do_not_depend_on_where_the_checkpoint_file_puts_its_tensors(
        model_dirs, tmp_path, block):
    """The root of the bit-for-bit test's flakes: MKL's float32 GEMM rounds the last bits
    differently when its operands are 8- rather than 16-byte aligned (its reproducibility
    conditions ask for aligned buffers), and weights read through safetensors' memory map
    sit at their file offset, wherever the header leaves it. The reference backend holds
    its weights in torch's own (64-byte aligned) memory, so two processes, or two
    layouts of one checkpoint, compute the same bits."""
    eight = _relaid(model_dirs["llama"], tmp_path / "eight", 40)
    sixteen = _relaid(model_dirs["llama"], tmp_path / "sixteen", 48)
    logits = []
    for folder in (eight, sixteen):
        backend = open_backend(settings_for(block), folder, str(tmp_path / "cache"))
        assert {w.data_ptr() % 64 for w in backend.weights} == {0}
        logits.append([backend.forward(inputs).clone() for inputs in _calls(settings_for(block))])
    for first, second in zip(*logits, strict=True):
        assert np.array_equal(first.numpy(), second.numpy())


def test_runner_takes_servings_thread_count_once_loaded(model_dirs, cache_url, monkeypatch):
    """The runner computes the reference model: it sets its torch threads by the serving
    rule (core.threads) after loading, here the count VLLM_NEURON_TORCH_THREADS asks for
    (an OMP_NUM_THREADS, which these tests set, would be kept instead)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("VLLM_NEURON_TORCH_THREADS", "3")
    remote = open_backend(settings_for(False, backend_python=sys.executable),
                          model_dirs["llama"], cache_url)
    try:
        assert isinstance(remote, RunnerBackend)
        assert remote.torch_threads == 3
    finally:
        remote.close()


def remote_vocab(model_dirs) -> int:
    from neuron_plugin.core.checkpoint import vocab_size

    return vocab_size(model_dirs["llama"])


def test_configuration_error_crosses_the_boundary(model_dirs, cache_url):
    """A NeuronConfigError raised in the runner reaches the worker as one, message intact."""
    settings = settings_for(False, backend_python=sys.executable, architecture="GPT2LMHeadModel",
                            dtype="int8")
    backend = RunnerBackend(settings, model_dirs["llama"])
    try:
        with pytest.raises((NeuronConfigError, RunnerError), match="dtype='int8'"):
            backend.load(cache_url)
        backend.ping()  # the runner keeps serving after a failed operation
    finally:
        backend.close()


def test_missing_package_stops_start_up_naming_interpreter_and_package(model_dirs, tmp_path,
                                                                        monkeypatch):
    """An interpreter without the plugin (a bare venv) cannot host the backend. (Run
    from elsewhere than the source tree, which `python -m` would put on its path, and
    without a PYTHONPATH, which the runner would inherit.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = str(bare / "bin" / "python")
    with pytest.raises(RunnerError) as info:
        RunnerBackend(settings_for(False, backend_python=python), model_dirs["llama"])
    message = str(info.value)
    assert python in message
    assert "No module named 'neuron_plugin'" in message
    assert "pip install 'vllm-neuron-plugin[backend]'" in message


def test_runner_killed_mid_call_is_an_error_naming_the_signal(model_dirs, cache_url):
    backend = open_backend(settings_for(False, backend_python=sys.executable),
                           model_dirs["llama"], cache_url)
    os.kill(backend.runner.process.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RunnerError, match="was killed by SIGKILL during forward"):
        backend.forward(next(_calls(settings_for(False))))
    assert time.monotonic() - started < 5
    backend.close()


def test_runner_dies_with_its_parent(model_dirs, cache_url, tmp_path):
    """SIGKILL of the process that started the runner leaves no runner behind."""
    pid_file = tmp_path / "runner.pid"
    code = f"""
import sys, time, dataclasses
sys.path.insert(0, {str(os.getcwd())!r})
from tests.plugin.test_runner import settings_for
from neuron_plugin.backends.loader import open_backend
backend = open_backend(settings_for(False, backend_python=sys.executable),
                       {str(model_dirs["llama"])!r}, {cache_url!r})
open({str(pid_file)!r}, "w").write(str(backend.runner.process.pid))
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert parent.poll() is None, "the parent died before starting its runner"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    runner_pid = int(pid_file.read_text())
    assert alive(runner_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(runner_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(runner_pid), "the runner outlived its parent"




# -- the channel (issue 39): nothing printed breaks it, nothing waits forever -------------
def _script(path, body: str) -> str:
    path.write_text(body)
    path.chmod(0o755)
    return str(path)


def test_an_interpreter_wrapper_that_prints_still_shakes_hands(model_dirs, cache_url,
                                                               tmp_path):
    """A wrapper printing to stdout before it execs Python (a conda or module shim), and
    a library printing at import: the handshake and calls go on, and the lines reach
    the log. (Before messages had pipes of their own, the wrapper's line was read as a
    message length and the handshake waited forever.)"""
    wrapper = _script(tmp_path / "python", f"#!/bin/sh\necho 'activating the SDK env'\n"
                                           f"exec {sys.executable} \"$@\"\n")
    from neuron_plugin.backends.runner.client import probe

    # the handshake alone first, on a thread, so that a hang fails this test instead of
    # hanging the suite (a runner dies with the thread that started it: PDEATHSIG)
    shaken = []
    thread = threading.Thread(target=lambda: shaken.append(probe(wrapper, "reference")),
                              daemon=True)
    thread.start()
    thread.join(240)
    assert shaken, "the handshake with a printing interpreter wrapper never completed"
    assert shaken[0]["versions"]["executable"] == sys.executable
    backend = open_backend(settings_for(False, backend_python=wrapper), model_dirs["llama"],
                           cache_url)
    try:
        assert backend.handshake["versions"]["executable"] == sys.executable
        logits = backend.forward(next(_calls(settings_for(False))))
        assert logits.shape == (1, remote_vocab(model_dirs))
        assert "activating the SDK env" in "\n".join(backend.runner._tail)
    finally:
        backend.close()


def test_a_runner_that_never_answers_is_a_named_timeout(model_dirs, tmp_path):
    """An interpreter that starts and then never answers (stuck, or not Python at all)
    fails the engine's start with RunnerTimeout naming the setting, within it."""
    from neuron_plugin.backends.runner.client import (
        START_TIMEOUT_ENV,
        RunnerTimeout,
        RunnerTimeouts,
        probe,
    )

    silent = _script(tmp_path / "python", "#!/bin/sh\necho 'started'\nexec sleep 600\n")
    with pytest.raises(RunnerTimeout, match=rf"(?s)did not answer hello within "
                                            rf"{START_TIMEOUT_ENV}=2 s and was stopped.*"
                                            rf"started"):
        probe(silent, "reference", RunnerTimeouts(start_s=2))
    with pytest.raises(NeuronConfigError, match=f"{START_TIMEOUT_ENV}='soon' must be a "
                                                f"positive number of seconds"):
        RunnerTimeouts.from_env({START_TIMEOUT_ENV: "soon"})
    assert RunnerTimeouts.from_env({START_TIMEOUT_ENV: "30"}).start_s == 30


def test_a_stuck_call_is_a_named_timeout_and_stops_the_runner(model_dirs, cache_url):
    """A call the runner does not answer in time (its backend stuck: here the runner is
    stopped with SIGSTOP) ends in RunnerTimeout naming the call and the setting."""
    from neuron_plugin.backends.runner.client import CALL_TIMEOUT_ENV, RunnerTimeout

    backend = open_backend(settings_for(False, backend_python=sys.executable),
                           model_dirs["llama"], cache_url)
    backend.runner.timeouts = dataclasses.replace(backend.runner.timeouts, call_s=1)
    os.kill(backend.runner.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RunnerTimeout, match=rf"did not answer forward within "
                                                rf"{CALL_TIMEOUT_ENV}=1 s"):
            backend.forward(next(_calls(settings_for(False))))
        assert backend.runner.process.poll() is not None  # stopped, not left stuck
    finally:
        backend.close()


def test_messages_are_capped_and_lengths_not_trusted():
    """A message length past MAX_MESSAGE_BYTES is refused at once (never a read of 4 GiB);
    so is a message too large to send."""
    from neuron_plugin.backends.runner.protocol import MAX_MESSAGE_BYTES, Channel

    read_fd, write_fd = os.pipe()
    os.write(write_fd, (0xFFFFFFF0).to_bytes(4, "little"))
    channel = Channel(read_fd, write_fd)
    try:
        with pytest.raises(ProtocolError, match="announced as 4,294,967,280 bytes, more than"):
            channel.receive(timeout=5)
        with pytest.raises(ProtocolError, match="more than the protocol's"):
            channel.send({"op": "x", "data": "a" * MAX_MESSAGE_BYTES}, timeout=5)
        channel.send({"op": "ping"}, timeout=5)
        assert channel.receive(timeout=5) == {"op": "ping"}
    finally:
        channel.close()


@pytest.mark.parametrize("where", ["in-process", "sdk-runner"])
def test_kv_blocks_move_between_backends_through_the_kv_arena(model_dirs, cache_url, where,
                                                             sdk_python):
    """A prompt's blocks read from one backend and written into other blocks of another
    (in this process, a runner under the torch-2.9 environment) decode there
    exactly as where they were computed; the runner's KV arena is sized from the geometry
    for a request's worth of blocks."""
    import torch

    settings = settings_for(True)
    python = {"in-process": None, "sdk-runner": sdk_python}[where]
    source = open_backend(settings, model_dirs["llama"], cache_url)
    target = open_backend(dataclasses.replace(settings, backend_python=python),
                          model_dirs["llama"], cache_url)
    try:
        prompt = np.arange(3, 43, dtype=np.int64)
        source.forward(context_encoding_inputs(settings, prompt, 0, 0, [1, 2]))
        kv = source.read_kv_blocks(np.array([1, 2]))
        geometry = target.kv_geometry()
        assert geometry == source.kv_geometry()
        assert kv.shape == geometry.shape(2) == (2, 2, 2, 32, 2, 64)
        target.write_kv_blocks(np.array([4, 3]), kv)
        assert torch.equal(target.read_kv_blocks(np.array([4, 3])), kv)
        if python is not None:
            assert target.runner.kv.size == geometry.block_bytes * settings.max_blocks_per_seq
        step = [np.array([7]), np.array([40]), np.array([0])]
        here = source.forward(token_generation_inputs(settings, *step, [[1, 2]])).clone()
        there = target.forward(token_generation_inputs(settings, *step, [[4, 3]]))
        assert torch.equal(here, there)
    finally:
        if python is not None:
            target.close()


def test_kv_block_errors_cross_the_boundary(model_dirs, cache_url):
    import torch

    settings = settings_for(True, backend_python=sys.executable)
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    try:
        with pytest.raises(RunnerError, match="repeat a block"):
            backend.read_kv_blocks(np.array([2, 2]))
        with pytest.raises(RunnerError, match="do not fit this backend's cache"):
            backend.write_kv_blocks(np.array([1]), torch.zeros(2, 2, 2, 32, 2, 64))
        more = torch.zeros(backend.kv_geometry().shape(settings.max_blocks_per_seq + 1))
        with pytest.raises(ProtocolError, match="do not fit the KV arena"):
            backend.write_kv_blocks(np.arange(1, settings.max_blocks_per_seq + 2), more)
    finally:
        backend.close()
    contiguous = open_backend(settings_for(False, backend_python=sys.executable),
                              model_dirs["llama"], cache_url)
    try:
        with pytest.raises(NeuronConfigError, match="block KV layout only"):
            contiguous.kv_geometry()
    finally:
        contiguous.close()


def test_doctor_checks_the_runner_interpreter(tmp_path):
    """doctor starts the runner and shakes hands: ok with a working interpreter, a fail
    naming the fix with one that lacks the backend."""
    from neuron_plugin.tools.doctor import check_runner

    check, versions = check_runner(sys.executable, "reference")
    assert check.status == "ok" and versions["executable"] == sys.executable
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    check, versions = check_runner(str(bare / "bin" / "python"), "reference")
    assert check.status == "fail" and versions == {}
    assert "pip install 'vllm-neuron-plugin[backend]'" in check.fix
