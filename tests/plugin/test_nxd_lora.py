"""Multi-LoRA on the nxd backend against the NxDI double (modules/lora_serving of NxDI
0.7-0.9, tests/plugin/fake_nxdi): vLLM's LoRA flags as NxDI's LoraServingConfig with
nothing widened, each row's adapter through `adapter_ids` (a row's adapter fixed at its
prefill, as NxDI's weight_active is), run-time loading through NxDI 0.9's own path with
the plugin's slot evictions leaving NxDI's CPU cache, the adapters given at start where
NxDI cannot load at run time (0.7, 0.8; said at start-up), and what is refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import numpy as np
import pytest

from neuron_plugin.backends.loader import cache_manifest
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.adapters import AdapterError, AdapterWeights
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import NeuronConfigError
from tests.plugin.test_nxd_backend import expected, loaded, sampling, settings, use_release
from tests.plugin.fake_nxdi.nxdi_release import purge

LORA = dict(max_loras=2, max_lora_rank=8, max_cpu_loras=3)


@pytest.fixture
def tiny(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(params=["0.7", "0.8", "0.9"])
def nxdi(request, monkeypatch, tmp_path):
    use_release(request.param, monkeypatch, tmp_path)
    yield request.param
    purge()


def lora_settings(lora_config: dict | None = None, **limits):
    override = {"on_device_sampling_config": {"global_topk": 8}}
    if lora_config is not None:
        override["lora_config"] = lora_config
    return settings({**LORA, **limits}, override)


def adapter(name: str, path, adapter_id: int) -> AdapterWeights:
    """What the nxd backend reads of an adapter the worker checked: its name and folder."""
    return AdapterWeights(name, adapter_id, str(path), 8)


def value(path) -> int:
    """The double's weight for an adapter (lora_serving/checkpoint.signature)."""
    from neuronx_distributed_inference.modules.lora_serving.checkpoint import signature

    return int(signature(str(path)))


def prefill(backend, s, prompt, seq, slot) -> int:
    inputs = context_encoding_inputs(s, np.array(prompt), 0, seq, None, adapter_slot=slot)
    return int(backend.run(inputs, sampling(1, needs_logits=False)).tokens[0, 0])


def test_lora_config_is_vllms_flags_with_nothing_widened(nxdi, tiny, lora_adapters, tmp_path):
    start = {"a": str(lora_adapters["lora-a"])}
    s = lora_settings({"lora_ckpt_paths": start} if nxdi != "0.9" else None)
    backend = loaded(s, tiny, tmp_path / "graphs")
    config = backend.model.neuron_config.lora_config
    assert config.max_lora_rank == 8
    assert config.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"]
    assert config.batch_size == 4
    if nxdi == "0.9":  # NxDI's own zero base slot, adapters streamed at run time
        assert config.enable_base_model_only and config.dynamic_multi_lora
        assert config.max_loras == 3 and config.max_cpu_loras == 3
    else:  # one zero slot beyond the adapters, the start-up adapters only
        assert not config.dynamic_multi_lora
        assert config.max_loras == 3
        assert backend.adapter_loading.at_start == {"a": str(lora_adapters["lora-a"].resolve())}


def test_rows_get_their_adapters_and_keep_them_from_prefill(monkeypatch, tiny, lora_adapters,
                                                            tmp_path):
    """NxDI 0.9 on a device: adapters loaded at run time, a batch mixing two adapters and
    the base model, then a slot reused under a running request."""
    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = lora_settings()
        backend = loaded(s, tiny, tmp_path / "graphs")
        paths = {n: lora_adapters[f"lora-{n}"] for n in "abc"}
        backend.set_adapter(1, adapter("a", paths["a"], 1))
        backend.set_adapter(2, adapter("b", paths["b"], 2))
        manager = backend.model.lora_model_manager
        assert set(manager.cpu_adapter_cache.map) == {0, 1, 2}  # base, a, b
        prompts = {0: [3, 4, 5], 1: [7, 8], 2: [9, 10, 11, 12]}
        slots = {0: 1, 1: 0, 2: 2}  # seq 0: a, seq 1: the base model, seq 2: b
        shift = {0: value(paths["a"]), 1: 0, 2: value(paths["b"])}
        assert len({shift[0], shift[2], 0}) == 3
        for seq, prompt in prompts.items():
            token = prefill(backend, s, prompt, seq, slots[seq])
            assert token == (expected(prompt) + shift[seq]) % 977
        # the plugin's slot 1 now takes "c": NxDI forgets "a" on the CPU, the running
        # request of seq 0 keeps a's weights (weight_active), seq 3 prefills with c
        backend.set_adapter(1, adapter("c", paths["c"], 3))
        assert manager.lora_adapter_id_mapping["a@1"] not in manager.cpu_adapter_cache.map
        c_token = prefill(backend, s, [20, 21], 3, 1)
        assert c_token == (expected([20, 21]) + value(paths["c"])) % 977
        inputs = token_generation_inputs(s, np.array([1, 2, 3, 4]), np.array([3, 2, 4, 2]),
                                         np.array([0, 1, 2, 3]), None,
                                         adapter_slots=[1, 0, 2, 1])
        out = backend.run(inputs, sampling(4, needs_logits=False))
        contexts = [[*prompts[0], 1], [*prompts[1], 2], [*prompts[2], 3], [20, 21, 4]]
        shifts = [shift[0], 0, shift[2], value(paths["c"])]
        assert out.tokens[:, 0].tolist() == [(expected(c) + v) % 977
                                             for c, v in zip(contexts, shifts, strict=True)]
    finally:
        purge()


@pytest.mark.parametrize("release", ["0.7", "0.8"])
def test_adapters_given_at_start_where_nxdi_cannot_load_at_run_time(
        release, monkeypatch, tiny, lora_adapters, tmp_path, caplog):
    use_release(release, monkeypatch, tmp_path)
    try:
        a = str(lora_adapters["lora-a"])
        s = lora_settings({"lora_ckpt_paths": {"a": a}})
        with caplog.at_level(logging.WARNING):
            backend = loaded(s, tiny, tmp_path / "graphs")
        assert "cannot be loaded at run time" in caplog.text and f"a={a}" in caplog.text
        refusal = backend.adapter_loading.refusal("b", str(lora_adapters["lora-b"]))
        assert refusal is not None
        assert "'b'" in refusal and "lora_ckpt_paths" in refusal
        assert "cannot load adapters at run time" in refusal
        with pytest.raises(NeuronConfigError, match="'b'"):
            backend.set_adapter(1, adapter("b", lora_adapters["lora-b"], 2))
        backend.set_adapter(2, adapter("a", a, 1))
        assert prefill(backend, s, [3, 4], 0, 2) == (expected([3, 4]) + value(a)) % 977
        assert prefill(backend, s, [3, 4], 1, 0) == expected([3, 4])  # the zero slot
    finally:
        purge()


def test_what_nxdi_cannot_serve_is_refused(nxdi, tiny, lora_adapters, tmp_path):
    if nxdi != "0.9":
        with pytest.raises(NeuronConfigError, match="cannot load adapters at run time"):
            NxDBackend(lora_settings({"dynamic_multi_lora": True}), tiny)
    with pytest.raises(NeuronConfigError, match="contiguous KV layout"):
        NxDBackend(lora_settings(enable_prefix_caching=True, block_size=32), tiny)
    with pytest.raises(NeuronConfigError, match="CPU mode.*--enable-lora.*_copy_past_key_values"):
        NxDBackend(settings({**LORA, "tp_degree": 1}, {"on_cpu": True}), tiny)
    pickled = tmp_path / "pickled"
    shutil.copytree(lora_adapters["lora-a"], pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(NeuronConfigError, match="'p'.*adapter_model.bin"):
        NxDBackend(lora_settings({"lora_ckpt_paths": {"p": str(pickled)}}), tiny)
    with pytest.raises(NeuronConfigError, match=r"'b'.*rank 4, above --max-lora-rank 1"):
        NxDBackend(dataclasses.replace(
            lora_settings({"lora_ckpt_paths": {"b": str(lora_adapters["lora-b"])}}),
            max_lora_rank=1), tiny)
    # lora-b: per-module ranks and alphas, which NxDI's loader would ignore
    with pytest.raises(NeuronConfigError, match="'b'.*sets rank_pattern/alpha_pattern"):
        NxDBackend(lora_settings({"lora_ckpt_paths": {"b": str(lora_adapters["lora-b"])}}),
                   tiny)
    broken = tmp_path / "broken"
    shutil.copytree(lora_adapters["lora-a"], broken)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(NeuronConfigError, match="'x'.*unreadable adapter_config.json"):
        NxDBackend(lora_settings({"lora_ckpt_paths": {"x": str(broken)}}), tiny)
    # a PEFT pattern: NxDI's set(target_modules) would take it letter by letter
    pattern = tmp_path / "pattern"
    shutil.copytree(lora_adapters["lora-a"], pattern)
    config = json.loads((pattern / "adapter_config.json").read_text())
    config["target_modules"] = r".*\.(q_proj|v_proj)"
    (pattern / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(NeuronConfigError, match=r"'r'.*target_modules as a pattern.*listed"):
        NxDBackend(lora_settings({"lora_ckpt_paths": {"r": str(pattern)}}), tiny)


def test_cache_key_covers_slot_shapes_not_adapters(nxdi, tiny, lora_adapters):
    def key(lora_config, **limits):
        s = lora_settings(lora_config, **limits)
        return cache_manifest(s, NxDBackend(s, tiny))

    one = {"lora_ckpt_paths": {"a": str(lora_adapters["lora-a"])}}
    other = {"lora_ckpt_paths": {"c": str(lora_adapters["lora-c"])}}
    assert key(one) == key(other)
    assert key(one) != key(one, max_lora_rank=16)
    assert key(one) != key(one, max_loras=3)


def test_a_reused_name_serves_its_new_weights(monkeypatch, tiny, lora_adapters, tmp_path):
    """vLLM gives a name loaded again (after /v1/unload_lora_adapter) from another folder
    a new lora_int_id; NxDI keys its caches by name and would keep the old weights on
    the CPU and the device (lora_model.py add_new_cpu_adapter, insert_device_adapter).
    The old adapter and the new one, in two slots at once, each serve their own."""
    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = lora_settings()
        backend = loaded(s, tiny, tmp_path / "graphs")
        first, second = lora_adapters["lora-a"], lora_adapters["lora-c"]
        assert value(first) != value(second)
        backend.set_adapter(1, adapter("shared", first, 1))
        assert prefill(backend, s, [3, 4], 0, 1) == (expected([3, 4]) + value(first)) % 977
        backend.set_adapter(2, adapter("shared", second, 2))  # unloaded, loaded anew
        assert prefill(backend, s, [3, 4], 1, 2) == (expected([3, 4]) + value(second)) % 977
        assert prefill(backend, s, [3, 4], 2, 1) == (expected([3, 4]) + value(first)) % 977
        backend.set_adapter(1, adapter("other", lora_adapters["lora-b"], 3))  # evicts id 1
        assert prefill(backend, s, [3, 4], 3, 2) == (expected([3, 4]) + value(second)) % 977
    finally:
        purge()


def test_an_adapter_nxdi_cannot_load_empties_its_slot_only(monkeypatch, tiny, lora_adapters,
                                                          tmp_path):
    """An adapter whose folder is gone: AdapterError naming it and NxDI's reason; its
    slot is empty (the base model) and NxDI holds no part of it; the next adapter into
    that slot loads (NxDI's remove_adapter is never called for one it does not hold, a
    KeyError there), and the other slot serves on."""
    from neuron_plugin.core.adapters import AdapterError

    use_release("0.9", monkeypatch, tmp_path)
    try:
        s = lora_settings()
        backend = loaded(s, tiny, tmp_path / "graphs")
        a, b = lora_adapters["lora-a"], lora_adapters["lora-b"]
        gone = tmp_path / "gone"
        shutil.copytree(lora_adapters["lora-c"], gone)
        backend.set_adapter(1, adapter("a", a, 1))
        backend.set_adapter(2, adapter("c", gone, 3))
        shutil.rmtree(gone)
        backend.set_adapter(2, adapter("b", b, 2))  # c leaves NxDI
        with pytest.raises(AdapterError, match=r"'c' \(id 3\).*FileNotFoundError"):
            backend.set_adapter(2, adapter("c", gone, 3))  # NxDI re-reads its files
        manager = backend.model.lora_model_manager
        assert set(manager.cpu_adapter_cache.map) == {0, manager.lora_adapter_id_mapping["a@1"]}
        assert prefill(backend, s, [3, 4], 0, 2) == expected([3, 4])  # the base model
        assert prefill(backend, s, [3, 4], 1, 1) == (expected([3, 4]) + value(a)) % 977
        with pytest.raises(AdapterError, match="'c'"):
            backend.set_adapter(2, adapter("c", gone, 3))
        backend.set_adapter(2, adapter("b", b, 2))
        assert prefill(backend, s, [3, 4], 2, 2) == (expected([3, 4]) + value(b)) % 977
        assert prefill(backend, s, [3, 4], 3, 1) == (expected([3, 4]) + value(a)) % 977
    finally:
        purge()


# -- save_sharded_checkpoint: adapters in the artifacts ------------------------------------
PRESHARDED = {"save_sharded_checkpoint": True}


def test_presharded_artifacts_with_run_time_adapters_are_refused_by_name():
    """NxDI cannot load adapters at run time into pre-sharded artifacts: refused when the
    settings are resolved, naming both settings and the way out."""
    override = {"on_device_sampling_config": {"global_topk": 8}, **PRESHARDED}
    for lora_config in (None, {"dynamic_multi_lora": True}):
        given = {**override, **({"lora_config": lora_config} if lora_config else {})}
        with pytest.raises(NeuronConfigError, match=r"save_sharded_checkpoint=true with "
                                                     r"--enable-lora.*dynamic_multi_lora=false"):
            settings(LORA, given)
    static = settings(LORA, {**override, "lora_config": {"dynamic_multi_lora": False}})
    assert static.passthrough["save_sharded_checkpoint"] is True
    assert settings({}, override).passthrough["save_sharded_checkpoint"] is True  # no LoRA


def test_what_nxdi_does_with_presharded_run_time_adapters(monkeypatch, tiny, lora_adapters,
                                                          tmp_path):
    """Why the refusal, past it (the double as NxDI 0.9): no start adapter stops the
    compile; with one, an adapter loaded at run time fails (the pre-sharded load leaves
    NxDI's add_adapter no model)."""
    use_release("0.9", monkeypatch, tmp_path)
    try:
        for start, folder in (({}, "none"), ({"a": str(lora_adapters["lora-a"])}, "one")):
            s = lora_settings({"lora_ckpt_paths": start})
            s = dataclasses.replace(s, passthrough={**s.passthrough, **PRESHARDED})
            backend = NxDBackend(s, tiny)
            if not start:
                with pytest.raises(AssertionError):
                    backend.compile(tmp_path / folder)
                continue
            backend.compile(tmp_path / folder)
            backend.load(tmp_path / folder)
            with pytest.raises(AdapterError, match="'c'.*could not load it.*NoneType"):
                backend.set_adapter(1, adapter("c", lora_adapters["lora-c"], 3))
    finally:
        purge()


def test_start_adapters_sharded_into_the_artifacts_key_them(nxdi, tiny, lora_adapters,
                                                            tmp_path):
    """With save_sharded_checkpoint NxDI shards the start adapters' weights into the
    compiled artifacts (the double reproduces it: the device gets the adapter as it was
    at compile): the cache key covers their content, so a changed adapter in the same
    folder compiles anew and serves its new weights, never the baked old ones."""
    from compile_cache.cache import CompileCache
    from compile_cache.stores import open_store
    from neuron_plugin.backends.loader import compile_into_cache

    folder = tmp_path / "adapter"
    shutil.copytree(lora_adapters["lora-a"], folder)
    lora_config = {"lora_ckpt_paths": {"a": str(folder)}, "dynamic_multi_lora": False}
    s = settings(LORA, {"on_device_sampling_config": {"global_topk": 8}, **PRESHARDED,
                        "lora_config": lora_config})
    cache = CompileCache(open_store(str(tmp_path / "cache")))

    def serve() -> tuple[bool, int]:
        backend = NxDBackend(s, tiny)
        result = compile_into_cache(backend, cache)
        backend.load(result.path)
        backend.set_adapter(1, adapter("a", folder, 1))
        return result.hit, prefill(backend, s, [3, 4], 0, 1)

    first = value(folder)
    assert serve() == (False, (expected([3, 4]) + first) % 977)
    assert serve()[0]  # the same adapter: a hit
    for name in ("adapter_model.safetensors", "adapter_config.json"):  # lora-c's content
        shutil.copy(lora_adapters["lora-c"] / name, folder / name)
    assert value(folder) != first
    assert serve() == (False, (expected([3, 4]) + value(folder)) % 977)
    unsharded = settings(LORA, {"on_device_sampling_config": {"global_topk": 8},
                                "lora_config": lora_config})
    before = cache_manifest(unsharded, NxDBackend(unsharded, tiny))
    shutil.copy(lora_adapters["lora-a"] / "adapter_model.safetensors",
                folder / "adapter_model.safetensors")
    assert cache_manifest(unsharded, NxDBackend(unsharded, tiny)) == before  # not embedded
