"""The nxd backend's EAGLE path (NxDI's fused EAGLE speculation) on real NxD Inference, in
its CPU mode with the speculation guard lifted in the harness only (nxdi_eagle_probe.py
names the five stand-ins and why each is needed, on 0.8 and 0.9 alike): the plugin's
settings -> NeuronConfig, its published-head conversion (nxd.eagle), its fused inputs and
its reading of the answers give transformers' greedy tokens at batch 2, with the head's
drafts accepted (which needs the converted head's embeddings and lm_head and NxDI's
hidden-state hand-over). Without the stand-ins the plugin refuses the CPU mode's
speculation by name, as NxDI's to_cpu() does.

The target is a Llama twin of the corpus-trained speculation target (the same weights,
without its 16-token sliding window, which NxDI's speculation refuses:
nxd/neuron_config.check_speculation_models), the head scripts/build_eagle_heads.py's
EAGLE head, written as published heads are (no embed_tokens nor lm_head).

EAGLE-3: NxDI fuses fixed target layers and reads no d2t (nxd/eagle.py), which the trained
head does not fit, so a random EAGLE-3 head of the target's vocabulary on a random 8-layer
Llama gives the tokens (its drafts are rejected; the graphs run, and greedy tokens equal
transformers' only with the plugin's sequence_parallel_enabled: without it NxDI's
EAGLE-3 prefill fails on both releases).

Needs NEURON_TEST_NXDI_PYTHONS (tests/e2e/conftest.py); skips otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.e2e.support import GreedyOracle, corpus_token_ids

pytestmark = [pytest.mark.nxdi]

PROBE = Path(__file__).with_name("nxdi_eagle_probe.py")
ROOT = Path(__file__).resolve().parents[2]
DRAFTS = 3
NEW_TOKENS = 16
MAX_MODEL_LEN = 128
# one graph each: the CPU mode sets a bucket's sizes on the fused module alone
# (cpu_mode.load), which hands them to its target and draft in context encoding only
OVERRIDE = {
    "context_encoding_buckets": [MAX_MODEL_LEN],
    "token_generation_buckets": [MAX_MODEL_LEN + DRAFTS],
}


@pytest.fixture(scope="module")
def llama_target(eagle_heads, tmp_path_factory) -> Path:
    """The speculation target as a Llama (module docstring)."""
    folder = tmp_path_factory.mktemp("eagle-target") / "llama"
    shutil.copytree(eagle_heads[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    config.pop("sliding_window")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _probe(
    nxdi_python: str,
    target: Path,
    head: Path,
    prompts: list[list[int]],
    guard: bool,
    out: Path,
    method: str = "eagle",
    override: dict | None = None,
) -> dict:
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    config = json.loads((target / "config.json").read_text())
    limits = EngineLimits(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        block_size=None,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=MAX_MODEL_LEN,
        dtype="float32",
        tp_degree=1,
        speculative_method=method,
        num_speculative_tokens=DRAFTS,
        draft_model=str(head),
        target_shape=(config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]),
    )
    settings = resolve_settings(
        limits, {**OVERRIDE, **(override or {})}, backend="nxd", architecture="LlamaForCausalLM"
    )
    plan = out / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "model": str(target),
                "settings": settings.to_dict(),
                "prompts": prompts,
                "new_tokens": NEW_TOKENS,
                "guard": guard,
            }
        )
    )
    env = {
        **os.environ,
        "NXD_CPU_MODE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [nxdi_python, str(PROBE), str(plan)], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_eagle_on_real_nxdi_equals_transformers(nxdi_python, llama_target, eagle_heads, tmp_path):
    prompts = [
        corpus_token_ids(llama_target, 9, offset=40),
        corpus_token_ids(llama_target, 20, offset=300),
    ]
    report = _probe(nxdi_python, llama_target, eagle_heads[1], prompts, True, tmp_path)
    assert "failed" not in report, report
    oracle = GreedyOracle(llama_target)
    assert report["tokens"] == [oracle.generate(p, NEW_TOKENS) for p in prompts]
    # the trained head's drafts are accepted: more than one token a step on average
    emitted = [n for step in report["emitted"] for n in step]
    assert max(emitted) == DRAFTS + 1
    assert sum(emitted) > 2 * len(emitted)


def test_cpu_mode_as_shipped_refuses_speculation(nxdi_python, llama_target, eagle_heads, tmp_path):
    report = _probe(
        nxdi_python,
        llama_target,
        eagle_heads[1],
        [corpus_token_ids(llama_target, 9)],
        False,
        tmp_path,
    )
    assert report["failed"] == "construct"
    assert "Speculation is not yet supported for CPU inference." in report["error"]


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A random 8-layer float32 Llama and a random EAGLE-3 head over its vocabulary, in the
    published layout (`midlayer.`, no embed_tokens)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("eagle3")
    hidden, vocab = 64, 1024
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.save_pretrained(folder / "target")

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * 0.2

    tensors = {
        "fc.weight": weight(hidden, 3 * hidden),
        "lm_head.weight": weight(vocab, hidden),
        "norm.weight": torch.ones(hidden),
    }
    for name, shape in {
        "self_attn.q_proj": (64, 2 * hidden),
        "self_attn.k_proj": (32, 2 * hidden),
        "self_attn.v_proj": (32, 2 * hidden),
        "self_attn.o_proj": (hidden, 64),
        "mlp.gate_proj": (128, hidden),
        "mlp.up_proj": (128, hidden),
        "mlp.down_proj": (hidden, 128),
    }.items():
        tensors[f"midlayer.{name}.weight"] = weight(*shape)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = torch.ones(hidden)
    head = folder / "head"
    head.mkdir()
    save_file(tensors, str(head / "model.safetensors"))
    (head / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_hidden_layers": 1,
                "vocab_size": vocab,
                "draft_vocab_size": vocab,
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 512,
                "tie_word_embeddings": False,
            }
        )
    )
    return folder / "target", head


def test_eagle3_on_real_nxdi_equals_transformers(nxdi_python, eagle3_pair, tmp_path):
    import torch

    target, head = eagle3_pair
    torch.manual_seed(1)
    prompts = [torch.randint(1, 1024, (n,)).tolist() for n in (9, 20)]
    report = _probe(nxdi_python, target, head, prompts, True, tmp_path, "eagle3")
    assert "failed" not in report, report
    oracle = GreedyOracle(target)
    assert report["tokens"] == [oracle.generate(p, NEW_TOKENS) for p in prompts]
    # without sequence parallelism NxDI's EAGLE-3 prefill fails (nxd/neuron_config.py),
    # so an override turning it off is refused by name before NxDI builds anything
    refused = _probe(
        nxdi_python,
        target,
        head,
        prompts,
        True,
        tmp_path,
        "eagle3",
        {"sequence_parallel_enabled": False},
    )
    assert refused["failed"] == "load"
    assert "sequence_parallel_enabled=False but the nxd backend needs True" in refused["error"]
