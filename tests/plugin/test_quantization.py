"""Quantized checkpoints below the engine: the quantization keys' checks, the reference
quantizer writing exactly what NxDI's save_quantized_state_dict writes (the NxDI double
reproduces it; tests/e2e/test_nxdi_cpu_mode.py checks against the real code), the
reference backend computing exactly the dequantized model from that layout, the nxd
backend's quantized load through the double, refusals of checkpoints that would be
unpickled or do not match, the compile-cache key, and explain-config's HBM saved."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_plugin.backends.loader import cache_manifest, open_backend
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.core.inputs import context_encoding_inputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from tests.e2e.support import dequantized_model
from tests.plugin.fake_nxdi.nxdi_release import purge
from tests.plugin.test_nxd_backend import settings as nxd_settings
from tests.plugin.test_nxd_backend import use_release

LIMITS = EngineLimits(max_model_len=128, max_num_seqs=2, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=128, dtype="float32")
BUCKETS = {"context_encoding_buckets": [32, 64, 128], "token_generation_buckets": [128]}
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def quantized(path, arch="llama", backend="reference", **keys):
    override = {**BUCKETS, "quantized": True, "quantized_checkpoints_path": str(path),
                "quantization_type": "per_channel_symmetric", **keys}
    return resolve_settings(LIMITS, override, backend=backend, architecture=ARCH[arch])


def test_quantization_keys_are_checked():
    for override, words in (
        ({"quantized": True}, ["quantized_checkpoints_path", "neuron-plugin quantize"]),
        ({"quantized": True, "quantized_checkpoints_path": "/q",
          "quantization_type": "blockwise_symmetric"}, ["'blockwise_symmetric'",
                                                         "per_channel_symmetric"]),
        ({"quantized": True, "quantized_checkpoints_path": "/q", "quantization_dtype": "int4"},
         ["quantization_dtype='int4'", "int8"]),
        ({"quantized_checkpoints_path": "/q"}, ["without quantized: true"]),
        ({"quantized": True, "quantized_checkpoints_path": "/q",
          "modules_to_not_convert": "lm_head"}, ["modules_to_not_convert='lm_head'", "list"]),
        ({"quantized": True, "quantized_checkpoints_path": "/q",
          "quantization_type": "per_tensor_symmetric", "modules_to_not_convert": ["lm_head"]},
         ["no effect with quantization_type='per_tensor_symmetric'",
          "quantize_pytorch_model_per_tensor_symmetric"]),
    ):
        with pytest.raises(NeuronConfigError) as info:
            resolve_settings(LIMITS, override, backend="nxd", architecture="LlamaForCausalLM")
        for word in words:
            assert word in str(info.value), (override, str(info.value))
    with pytest.raises(NeuronConfigError, match="reference backend serves int8"):
        quantized("/q", quantization_dtype="f8e4m3")


def _written(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: lm_head tied to the embedding
@pytest.mark.parametrize("keys", [
    {"quantization_type": "per_channel_symmetric", "modules_to_not_convert": ["down_proj"]},
    {"quantization_type": "per_tensor_symmetric"},
], ids=["per-channel", "per-tensor"])
def test_reference_quantizer_writes_what_nxdi_writes(arch, keys, model_dirs, monkeypatch,
                                                     tmp_path):
    model = model_dirs[arch]
    ReferenceBackend(quantized(tmp_path / "reference", arch, **keys), model).quantize()
    use_release("0.9", monkeypatch, tmp_path)
    try:
        NxDBackend(quantized(tmp_path / "nxdi", arch, backend="nxd", **keys), model).quantize()
    finally:
        purge()
    ours, nxdi = _written(tmp_path / "reference"), _written(tmp_path / "nxdi")
    assert sorted(ours) == sorted(nxdi)
    for name, tensor in nxdi.items():
        assert ours[name].dtype == tensor.dtype or name.endswith(".weight"), name
        torch.testing.assert_close(ours[name].to(tensor.dtype), tensor, atol=0, rtol=0)
    assert ours["lm_head.weight"].dtype == torch.int8
    per_channel = keys["quantization_type"] == "per_channel_symmetric"
    # down_proj kept in the model dtype per channel; per tensor NxDI converts every module
    assert (ours["layers.0.mlp.down_proj.weight"].dtype == torch.int8) != per_channel
    scale = ours["layers.1.self_attn.k_proj.scale"]
    assert scale.dtype == torch.float32
    assert scale.shape == ((128, 1) if per_channel else (1,))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reference_backend_computes_the_dequantized_model(arch, model_dirs, tmp_path):
    model_dir = model_dirs[arch]
    s = quantized(tmp_path / "q", arch)
    ReferenceBackend(s, model_dir).quantize()
    backend = open_backend(s, model_dir, str(tmp_path / "cache"))
    oracle = dequantized_model(model_dir, tmp_path / "q")
    assert backend.weights[backend.module.names.index(
        "model.layers.0.self_attn.q_proj.weight")].dtype == torch.int8
    rng = np.random.default_rng(3)
    for length in (1, 17, 100):
        prompt = rng.integers(3, 900, size=length)
        got = backend.forward(context_encoding_inputs(s, prompt, 0, 0, None))[0]
        want = oracle(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_checkpoints_that_do_not_match_or_would_be_unpickled_are_refused(model_dirs,
                                                                         tiny_model, tmp_path):
    model = model_dirs["llama"]
    cache = str(tmp_path / "cache")
    per_tensor = quantized(tmp_path / "q", quantization_type="per_tensor_symmetric")
    ReferenceBackend(per_tensor, model).quantize()
    with pytest.raises(NeuronConfigError, match=r"layers.0.self_attn.q_proj.scale should be "
                                                r"float32 \[256, 1\].*it holds torch.float32 "
                                                r"\[1\].*neuron-plugin quantize"):
        open_backend(quantized(tmp_path / "q"), model, cache)
    (tmp_path / "q" / "pytorch_model.bin").write_bytes(b"never read")
    with pytest.raises(NeuronConfigError, match="pytorch_model.bin.*unpickle"):
        open_backend(per_tensor, model, cache)
    (tmp_path / "file.pt").write_bytes(b"never read")
    with pytest.raises(NeuronConfigError, match="is a file.*pickle"):
        open_backend(quantized(tmp_path / "file.pt"), model, cache)
    with pytest.raises(NeuronConfigError, match="holds no quantized checkpoint"):
        open_backend(quantized(tmp_path / "nowhere"), model, cache)
    with pytest.raises(NeuronConfigError, match="dense decoders only"):
        ReferenceBackend(dataclasses.replace(quantized("/q"), architecture="MixtralForCausalLM"),
                         tiny_model("mixtral"))


def test_nxdi_cpu_mode_writes_but_does_not_serve_a_quantized_checkpoint(model_dirs,
                                                                        monkeypatch, tmp_path):
    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = nxd_settings({"tp_degree": 1}, {"on_cpu": True, "quantized": True,
                                            "quantized_checkpoints_path": str(tmp_path / "q")})
        backend = NxDBackend(s, model_dirs["llama"])
        backend.quantize()
        (tmp_path / "graphs").mkdir()  # a compile-cache entry's folder
        backend.compile(tmp_path / "graphs")
        with pytest.raises(NeuronConfigError, match="never calls.*convert"):
            backend.load(tmp_path / "graphs")
    finally:
        purge()


def test_nxd_fp8_checkpoint_through_nxdis_path(model_dirs, monkeypatch, tmp_path):
    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = quantized(tmp_path / "fp8", backend="nxd", quantization_dtype="f8e4m3")
        NxDBackend(s, model_dirs["llama"]).quantize()
    finally:
        purge()
    tensors = _written(tmp_path / "fp8")
    weight = tensors["layers.0.mlp.up_proj.weight"]
    assert weight.dtype == torch.float8_e4m3fn
    assert float(weight.float().abs().max()) == 240.0  # NxDI's e4m3 bound, not 448


def test_cache_key_covers_the_layout_not_the_checkpoint_path(model_dirs):
    model = model_dirs["llama"]

    def key(path, **keys):
        s = quantized(path, **keys)
        return cache_manifest(s, ReferenceBackend(s, model))

    assert key("/a") == key("/b")
    assert key("/a") != key("/a", quantization_type="per_tensor_symmetric")
    assert key("/a") != key("/a", modules_to_not_convert=["lm_head"])


def test_explain_config_shows_the_memory_quantization_saves(model_dirs, monkeypatch,
                                                            capsys):
    from neuron_plugin.tools import cli

    monkeypatch.setenv("VLLM_NEURON_BACKEND", "reference")
    # explain-config would send vLLM's log lines to stderr for the rest of this process
    # (test_cli.py backend_env)
    monkeypatch.setenv("VLLM_LOGGING_STREAM",
                       os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.__stdout__"))
    extra = {"override_neuron_config": {**BUCKETS, "quantized": True,
                                        "quantized_checkpoints_path": "/q",
                                        "quantization_type": "per_channel_symmetric"}}
    args = ["explain-config", str(model_dirs["llama"]), "--max-model-len", "128",
            "--dtype", "bfloat16", "--additional-config", json.dumps(extra)]
    assert cli.main([*args, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    full, saved = (memory["unquantized_weights_per_core_bytes"],
                   memory["quantization_saves_per_core_bytes"])
    # 14 projections of 2 layers plus lm_head at 1 byte instead of 2, plus their scales
    assert full - saved == memory["weights_per_core_bytes"] and 0.3 * full < saved < 0.5 * full
    assert cli.main(args) == 0
    assert "quantized        int8 per_channel_symmetric from /q: weights" in (
        capsys.readouterr().out)


def test_a_folder_nxdi_would_pickle_into_is_never_written(model_dirs, monkeypatch, tmp_path):
    target = tmp_path / "target.pt"
    save_file({"x": torch.zeros(1)}, str(tmp_path / "placeholder.safetensors"))
    target.write_bytes(b"")
    use_release("0.9", monkeypatch, tmp_path)
    try:
        with pytest.raises(NeuronConfigError, match="is a file"):
            NxDBackend(quantized(target, backend="nxd"), model_dirs["llama"]).quantize()
    finally:
        purge()


def test_quantize_never_writes_over_the_model_or_other_files(model_dirs, tmp_path):
    """`neuron-plugin quantize` replaces what its folder holds: the model's folder, a
    folder above it, or one holding other files is refused before anything is written."""
    from neuron_plugin.core.quantization import check_output_folder

    model = model_dirs["llama"]
    for folder, words in ((model, "is the model's folder or contains it"),
                          (model.parent, "is the model's folder or contains it"),
                          (tmp_path, "holds notes.txt")):
        (tmp_path / "notes.txt").write_text("keep me")
        with pytest.raises(NeuronConfigError, match=words):
            check_output_folder(quantized(folder).quantization, str(model))
    previous = tmp_path / "previous"  # a previous checkpoint is replaced
    previous.mkdir()
    save_file({"x": torch.zeros(1)}, str(previous / "model.safetensors"))
    assert check_output_folder(quantized(previous).quantization, str(model)) == previous
    new = tmp_path / "new"
    assert check_output_folder(quantized(new).quantization, str(model)) == new


@pytest.mark.parametrize("keys", [{}, {"modules_to_not_convert": ["lm_head"]},
                                  {"quantization_type": "per_tensor_symmetric"}],
                         ids=["per-channel", "float-head", "per-tensor"])
def test_nxd_tied_head_is_served_as_the_checkpoint_holds_it(keys, model_dirs, monkeypatch,
                                                            tmp_path):
    """The tiny Qwen3 ties lm_head to the embedding. NxDI's loader would replace the
    checkpoint's quantized head by the float embedding (application_base.get_state_dict)
    and neuronx-distributed cast it to int8 (ModelBuilder.cast_weights), which the double
    reproduces (its graphs then answer garbage): the device gets the int8 head the
    checkpoint holds. Kept float (modules_to_not_convert), the head is the embedding,
    which NxDI's writer stores once and its loader copies."""
    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = quantized(tmp_path / "q", "qwen3", backend="nxd", **keys)
        backend = NxDBackend(s, model_dirs["qwen3"])
        backend.quantize()
        backend.compile(tmp_path / "graphs")
        backend.load(tmp_path / "graphs")
        head = backend.model.loaded_weights[0]["lm_head.weight"]
        written = _written(tmp_path / "q")
        float_head = bool(keys.get("modules_to_not_convert"))
        assert ("lm_head.weight" in written) != float_head
        assert torch.equal(head, written["embed_tokens.weight" if float_head
                                          else "lm_head.weight"])
        assert head.dtype == (torch.float32 if float_head else torch.int8)
        assert not backend.model.traced_model.nxd_model.garbled
        prompt = np.array([3, 4, 5])
        vocab = json.loads((model_dirs["qwen3"] / "config.json").read_text())["vocab_size"]
        logits = backend.forward(context_encoding_inputs(s, prompt, 0, 0, None))
        assert logits.argmax(-1).tolist() == [(int(prompt.sum()) + len(prompt) - 1) % vocab]
        if float_head:
            return
        # a checkpoint without the quantized head: refused, naming the tie
        save_file({k: v.contiguous() for k, v in written.items() if not k.startswith("lm_head")},
                  str(tmp_path / "q" / "model.safetensors"))
        with pytest.raises(NeuronConfigError, match="no lm_head.weight.*ties lm_head to "
                                                    "embed_tokens.*neuron-plugin quantize"):
            NxDBackend(s, model_dirs["qwen3"]).load(tmp_path / "graphs")
    finally:
        purge()


def test_nxd_fused_draft_with_quantized_weights_is_refused(model_dirs, monkeypatch, tmp_path):
    """NxDI converts a fused draft's layers like the model's and loads the draft's float
    weights into them without scales (the double reproduces it: a garbage draft, every
    draft rejected, no speed-up): refused before anything compiles, naming the layers,
    unless draft_model_modules_to_not_convert keeps all of them float in NxDI's own module
    paths (checkpoint paths like self_attn.q_proj keep nothing there)."""
    from tests.plugin.test_nxd_speculation import settings as spec_settings

    override = {"quantized": True, "quantized_checkpoints_path": str(tmp_path / "q"),
                "quantization_type": "per_channel_symmetric"}
    s = spec_settings("draft_model", model_dirs["qwen3"], override=override)
    use_release("0.9", monkeypatch, tmp_path)
    try:
        with pytest.raises(NeuronConfigError, match=r"quantized: true.*fused draft.*own float "
                                                     r"folder.*model\.layers\.0\.mlp\.down_proj"
                                                     r".*draft_model_modules_to_not_convert.*ngram"):
            NxDBackend(s, model_dirs["llama"])
        checkpoint_names = {**override, "draft_model_modules_to_not_convert": [
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp", "lm_head"]}
        named = spec_settings("draft_model", model_dirs["qwen3"], override=checkpoint_names)
        # self_attn.o_proj is a substring of NxDI's layers.0.self_attn.o_proj.o_proj; the
        # q/k/v entries match nothing of layers.0.self_attn.qkv_proj.q_proj
        with pytest.raises(NeuronConfigError, match=r"would propose garbage.*: "
                                                     r"model\.layers\.0\.self_attn\.k_proj, "
                                                     r"model\.layers\.0\.self_attn\.q_proj, "
                                                     r"model\.layers\.0\.self_attn\.v_proj, "
                                                     r"model\.layers\.1\.self_attn\.k_proj "
                                                     r"and 5 more would be converted"):
            NxDBackend(named, model_dirs["llama"])
        # what NxDI would do, past the refusal: the draft's layers are garbage
        monkeypatch.setattr("neuron_plugin.backends.nxd.backend.refuse_quantized_draft",
                            lambda settings: None)
        backend = NxDBackend(s, model_dirs["llama"])
        backend.quantize()
        backend.compile(tmp_path / "graphs")
        backend.load(tmp_path / "graphs")
        assert backend.model.traced_model.nxd_model.garbled == {"draft_model."}
        # the checkpoint's names, past the refusal: NxDI's paths differ, still garbage
        backend = NxDBackend(named, model_dirs["llama"])
        backend.compile(tmp_path / "named")
        backend.load(tmp_path / "named")
        assert backend.model.traced_model.nxd_model.garbled == {"draft_model."}
    finally:
        purge()


@pytest.mark.parametrize("fused", [False, True], ids=["qkv", "fused-qkv"])
def test_nxd_float_draft_of_a_quantized_model_is_served(model_dirs, monkeypatch, tmp_path,
                                                        fused):
    """draft_model_modules_to_not_convert keeping every linear layer of the draft float:
    NxDI converts none of them (model_wrapper.py load_module, ef2731e lines 1512-1522,
    with the draft's own modules_to_not_convert) and loads its float weights as they are;
    the target's quantized layers get the quantized checkpoint. Speculation pays off:
    greedy tokens equal plain decoding's, with drafts accepted (a garbage draft would
    have each step emit one token). With fused_qkv NxDI's state-dict conversion looks the
    exact entry layers.{l}.self_attn up in the list before concatenating the draft's q/k/v
    scales, which a float draft lacks (KeyError at load, convert_state_dict_to_fused_qkv):
    the plugin adds those entries, which keep nothing more in float."""
    from tests.plugin.test_nxd_speculation import (
        DRAFTS,
        PROMPTS,
        assert_greedy_equal,
        plain_continuations,
        speculative_histories,
    )
    from tests.plugin.test_nxd_speculation import settings as spec_settings

    override = {"quantized": True, "quantized_checkpoints_path": str(tmp_path / "q"),
                "quantization_type": "per_channel_symmetric",
                "draft_model_modules_to_not_convert": ["layers", "lm_head"],
                **({"fused_qkv": True} if fused else {})}
    s = spec_settings("draft_model", model_dirs["qwen3"], override=override)
    use_release("0.9", monkeypatch, tmp_path)
    try:
        backend = NxDBackend(s, model_dirs["llama"])
        backend.quantize()
        backend.compile(tmp_path / "graphs")
        backend.load(tmp_path / "graphs")
        nxd_model = backend.model.traced_model.nxd_model
        assert nxd_model.garbled == set()
        weights = backend.model.loaded_weights[0]
        qkv = "self_attn.Wqkv" if fused else "self_attn.q_proj"
        assert weights[f"target_model.layers.0.{qkv}.weight"].dtype == torch.int8
        assert weights[f"target_model.layers.0.{qkv}.scale"].dtype == torch.float32
        assert weights[f"draft_model.layers.0.{qkv}.weight"].dtype == torch.float32
        draft_config = backend.model.fused_spec_config.draft_config.neuron_config
        layers = json.loads((model_dirs["qwen3"] / "config.json").read_text())[
            "num_hidden_layers"]
        exact = [f"layers.{n}.self_attn" for n in range(layers)] if fused else []
        assert draft_config.modules_to_not_convert == ["layers", "lm_head", *exact]
        plain = plain_continuations(model_dirs["llama"], tmp_path / "plain", 60)
        history = speculative_histories(backend, s, plain, 10, lambda step, seq: DRAFTS,
                                        lambda step: [0, 1, 2, 3])
        assert_greedy_equal(history, plain)
        assert max(len(h) - len(PROMPTS[q]) - 1 for q, h in history.items()) > 2 * 10
    finally:
        purge()


def test_nxd_fused_qkv_target_keeping_its_attention_float(model_dirs, monkeypatch, tmp_path):
    """A quantized model with fused_qkv whose modules_to_not_convert keeps the attention
    float by a broader entry ("self_attn"): NxDI's writer stores no q/k/v scales and its
    fused-QKV conversion, which looks the exact entry layers.{l}.self_attn up, would
    concatenate them (KeyError at load): served, the exact entries added. A list keeping
    q/k/v but not o_proj cannot be completed that way: refused before anything compiles,
    naming the setting and the fix."""
    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = quantized(tmp_path / "q", backend="nxd", fused_qkv=True,
                      modules_to_not_convert=["self_attn"])
        backend = NxDBackend(s, model_dirs["llama"])
        backend.quantize()
        backend.compile(tmp_path / "graphs")
        backend.load(tmp_path / "graphs")
        weights = backend.model.loaded_weights[0]
        assert weights["layers.0.self_attn.Wqkv.weight"].dtype == torch.float32
        assert weights["layers.0.mlp.up_proj.weight"].dtype == torch.int8
        assert backend.model.neuron_config.modules_to_not_convert == [
            "self_attn", "layers.0.self_attn", "layers.1.self_attn"]
        assert not backend.model.traced_model.nxd_model.garbled
        prompt = np.array([3, 4, 5])
        vocab = json.loads((model_dirs["llama"] / "config.json").read_text())["vocab_size"]
        logits = backend.forward(context_encoding_inputs(s, prompt, 0, 0, None))
        assert logits.argmax(-1).tolist() == [(int(prompt.sum()) + len(prompt) - 1) % vocab]
        partial = quantized(tmp_path / "q2", backend="nxd", fused_qkv=True,
                            modules_to_not_convert=["qkv_proj"])
        with pytest.raises(NeuronConfigError, match=r"modules_to_not_convert=\['qkv_proj'\] "
                                                     r"keeps layers\.0\.self_attn's q/k/v.*"
                                                     r"o_proj.*fused_qkv false"):
            NxDBackend(partial, model_dirs["llama"]).compile(tmp_path / "partial")
    finally:
        purge()
