"""Helpers for the end-to-end tests: the transformers oracle, corpus prompts, engines."""

from __future__ import annotations

import gc
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class GreedyOracle:
    """Greedy continuations from Hugging Face transformers (float32), the outside oracle."""

    def __init__(self, model_dir: Path):
        import torch

        self.torch = torch
        self.model = float32_model(model_dir)

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return self.trace(prompt, max_new_tokens)[0]

    def trace(self, prompt: list[int], max_new_tokens: int):
        """(greedy tokens, the logits each was chosen from [max_new_tokens, vocab])."""
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = self.model(ids, use_cache=True)
            tokens, logits = [], []
            for _ in range(max_new_tokens):
                logits.append(out.logits[0, -1])
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                out = self.model(torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                                 use_cache=True)
        return tokens, torch.stack(logits)


def float32_model(model_dir: Path):
    """transformers' model of `model_dir` with every weight in float32: an MXFP4
    checkpoint's experts (gpt-oss) come dequantized to bfloat16, which transformers then
    multiplies in bfloat16; .float() keeps their exact values (FP4 times a power of two)
    and computes them in float32 like the rest."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).float().eval()


def corpus_token_ids(model_dir: Path, count: int, offset: int = 0) -> list[int]:
    """`count` real token ids from the shipped corpus (wrapping), starting at `offset`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = (ROOT / "scripts" / "corpus" / "tiny_corpus.txt").read_text()
    ids = tokenizer(text)["input_ids"]
    return [ids[(offset + i) % len(ids)] for i in range(count)]


# vLLM's switch between an engine-core process and an engine core in the caller's.
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def make_llm(model_dir: Path, **kwargs):
    """vLLM's `LLM` with its engine core in this process (vLLM's InprocClient,
    VLLM_ENABLE_V1_MULTIPROCESSING=0): a spawned engine core imports vLLM and torch
    afresh, ~13 of the ~25 s an engine takes to start here, and the suite starts dozens.
    The engine processes users get are still tested: the deployment-build and
    backend-runner servers spawn theirs as `vllm serve` does (Server), and
    tests/e2e/test_offline_script.py forks one as an unguarded script does."""
    from vllm import LLM, envs

    defaults = dict(model=str(model_dir), dtype="float32", max_model_len=256,
                    max_num_seqs=4, seed=0, enable_prefix_caching=False,
                    enable_chunked_prefill=False,
                    gpu_memory_utilization=0.1)
    defaults.update(kwargs)
    before = os.environ.get(IN_PROCESS)
    os.environ[IN_PROCESS] = "0"
    try:
        return LLM(**defaults)
    finally:
        if before is None:
            del os.environ[IN_PROCESS]
        else:
            os.environ[IN_PROCESS] = before
        # the engine core caches vLLM's environment variables for the process once
        # started (vllm.envs.enable_envs_cache): later tests' settings must still count
        envs.disable_envs_cache()


def shutdown_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    # an engine core freezes the objects alive when it started (vLLM's freeze_gc_heap),
    # its own among them: unfrozen, the collector can free them with the engine
    gc.unfreeze()
    gc.collect()


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed child stays a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackProcess:
    """A server process on a free loopback port, its output in a log file."""

    name = "server"

    def __init__(self, cmd: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None):
        import os
        import subprocess

        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        # The in-process engine switch is this process's own (make_llm's, and vLLM's
        # external_launcher sets it in os.environ for good): a server starts its engine
        # core as users' servers do.
        env = {k: v for k, v in (os.environ if env is None else env).items() if k != IN_PROCESS}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 240) -> None:
        """Until /health answers; an AssertionError with the log's tail otherwise."""
        import time

        import requests

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, \
                f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, \
                f"{self.name} not healthy in {timeout} s:\n{self.log()[-4000:]}"
            time.sleep(0.5)

    def stop(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Server(LoopbackProcess):
    """A `vllm serve --device neuron` process on loopback, its log in a file."""

    name = "vllm serve"

    def __init__(self, model: Path, log_path: Path, args: list[str],
                 env: dict[str, str] | None = None, python: str | None = None,
                 engine_start: str | None = "fork"):
        """`python`: the interpreter of the vLLM environment to serve from (default:
        this one's). `engine_start`: how the API server starts its engine core, fork by
        default: the API server has run no torch computation by then, and a forked
        engine core skips importing vLLM and torch afresh (a tiny model's server was
        healthy after 16-18 s forked, 31-47 s spawned, here on 2026-11-28). None leaves
        it to the plugin, which spawns under `vllm serve` as users' servers do: the
        deployment-build and backend-runner tests serve that way."""
        import sys

        from neuron_plugin import MULTIPROC_ENV

        port = free_port()
        vllm = Path(python or sys.executable).with_name("vllm")
        env = {k: v for k, v in (os.environ if env is None else env).items()
               if k != MULTIPROC_ENV}
        if engine_start is not None:
            env[MULTIPROC_ENV] = engine_start
        super().__init__([str(vllm), "serve", str(model),
                          "--device", "neuron", "--host", "127.0.0.1", "--port", str(port),
                          "--dtype", "float32", *args], port, log_path, env)


class PlainVllmServer(LoopbackProcess):
    """`vllm serve` on vLLM's own CPU platform, with no plugin loaded (VLLM_PLUGINS names
    none): what a user compares the Neuron platform's answers with."""

    name = "plain vllm serve"

    def __init__(self, model: Path, log_path: Path, args: list[str]):
        import os
        import sys

        port = free_port()
        vllm = Path(sys.executable).with_name("vllm")
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NEURON")}
        env["VLLM_PLUGINS"] = ""
        super().__init__([str(vllm), "serve", str(model), "--host", "127.0.0.1",
                          "--port", str(port), "--dtype", "float32", *args], port, log_path,
                         env)


class PeftOracle:
    """Greedy continuations from transformers + PEFT (float32): the base model and each
    adapter (by name) as PEFT itself applies it, one prompt at a time."""

    BASE = "__base__"

    def __init__(self, model_dir: Path, adapters: dict[str, Path]):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.torch = torch
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        names = list(adapters)
        model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model = model.eval()

    def generate(self, prompt: list[int], max_new_tokens: int, adapter: str | None) -> list[int]:
        """Greedy tokens, EOS included (the served requests pass ignore_eos)."""
        torch = self.torch
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = self.model(input_ids=torch.tensor([tokens]),
                                    adapter_names=[adapter or self.BASE]).logits
                tokens.append(int(logits[0, -1].argmax()))
        return tokens[len(prompt):]


def dequantized_model(model_dir: Path, folder: Path):
    """transformers' float model with every weight NxDI's quantized checkpoint in
    `folder` holds int8 replaced by W_q * scale (what int8 weight-only serving computes);
    lm_head untied first, as NxDI quantizes it apart from the float embedding."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    tensors = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in tensors.items():
        if tensor.dtype == torch.int8:
            scale = tensors[name.removesuffix("weight") + "scale"]
            state[name if name.startswith("lm_head") else "model." + name] = tensor.float() * scale
    model.load_state_dict(state)
    return model
