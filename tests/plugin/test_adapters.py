"""LoRA adapters below the engine: reading PEFT folders with vLLM's own checks (refusals
name the adapter, the value and the limit), the slot layout (scaling folded into B,
ranks zero-padded), the host cache (LRU, pins, never the step's adapters), slot reuse,
and the reference backend's slots in process and through the runner's shared memory,
whose logits per row equal transformers + PEFT's."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from neuron_plugin.backends.loader import open_backend
from neuron_plugin.core.adapters import (
    AdapterError,
    AdapterSlots,
    LayerWeights,
    build_adapter,
    row_slots,
)
from neuron_plugin.core.checkpoint import safetensors_shapes
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.lora import LoraGeometry
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.serving.adapter_files import AdapterChecks
from neuron_plugin.serving.adapters import AdapterStore

BUCKETS = {"context_encoding_buckets": [32, 64], "token_generation_buckets": [64]}


def lora_settings(**changes):
    limits = EngineLimits(max_model_len=64, max_num_seqs=3, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=64, dtype="float32", max_loras=2,
                          max_lora_rank=8, max_cpu_loras=2)
    settings = resolve_settings(dataclasses.replace(limits, **changes), BUCKETS,
                                backend="reference", architecture="LlamaForCausalLM")
    return settings


def geometry_of(model_dir, settings) -> LoraGeometry:
    return LoraGeometry.from_checkpoint(safetensors_shapes(model_dir), 2,
                                        settings.lora_target_modules)


def request(name, adapter_id, path, inplace=False):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, adapter_id, str(path), load_inplace=inplace)


def lora_config(rank=8):
    from vllm.config.lora import LoRAConfig

    return LoRAConfig(max_loras=2, max_lora_rank=rank)


def base_modules(model_dir) -> frozenset[str]:
    return frozenset(n.rsplit(".", 1)[0] for n in safetensors_shapes(model_dir))


def checks_of(model_dirs, settings=None) -> AdapterChecks:
    settings = settings or lora_settings()
    return AdapterChecks(settings, geometry_of(model_dirs["llama"], settings), lora_config(),
                         4096, base_modules(model_dirs["llama"]))


def read(model_dirs, path, name="x", adapter_id=1, settings=None):
    checks = checks_of(model_dirs, settings)
    return checks.verify(checks.read(name, str(path)), name, adapter_id, str(path), str(path))


# -- the slot layout and the slots ------------------------------------------------------
def test_slots_are_reused_least_recently_used_first_never_a_needed_one():
    slots = AdapterSlots(2)
    assert slots.assign([7, 9]) == ({7: 1, 9: 2}, [(1, 7), (2, 9)])
    assert slots.assign([9]) == ({9: 2}, [])
    # 7 is least recently used: 5 takes its slot; 9 keeps its own
    assert slots.assign([5, 9]) == ({5: 1, 9: 2}, [(1, 5)])
    assert slots.assign([7, 5]) == ({7: 2, 5: 1}, [(2, 7)])
    with pytest.raises(RuntimeError, match="3 LoRA adapters, more than --max-loras 2"):
        slots.assign([1, 2, 3])
    ids = np.array([0, 7, 5, 0, 7])
    assert row_slots(ids, {7: 2, 5: 1}).tolist() == [0, 2, 1, 0, 2]


def test_slot_layout_folds_scaling_and_pads_ranks():
    geometry = LoraGeometry(2, {"q_proj": (4, 6), "v_proj": (4, 2)})
    a = np.ones((3, 4), dtype=np.float32)
    b = np.ones((6, 3), dtype=np.float32)
    v_a, v_b = np.ones((2, 4), dtype=np.float32), np.ones((2, 2), dtype=np.float32)
    adapter = build_adapter("x", 1, "/p", [LayerWeights(1, "q_proj", a, b, 2.0),
                                           LayerWeights(0, "v_proj", v_a, v_b, 0.5)],
                            geometry, 8)
    assert adapter.rank == 3
    assert adapter.a["q_proj"].shape == (2, 3, 4) and adapter.b["v_proj"].shape == (2, 2, 3)
    assert adapter.b["q_proj"][1].max() == 2.0 and adapter.b["q_proj"][0].max() == 0.0
    assert adapter.b["v_proj"][0, :, :2].max() == 0.5 and adapter.b["v_proj"][0, :, 2].max() == 0
    for layers, message in (
        ([LayerWeights(0, "q_proj", np.ones((9, 4)), np.ones((6, 9)), 1.0)],
         "rank 9 is above --max-lora-rank 8"),
        ([LayerWeights(0, "o_proj", a, b, 1.0)], "trains o_proj, which has no compiled"),
        ([LayerWeights(2, "q_proj", a, b, 1.0)], "trains layer 2, the model has 2 layers"),
        ([LayerWeights(0, "q_proj", np.ones((3, 5)), b, 1.0)],
         r"lora_A \[3, 5\].*needs lora_A \[r, 4\] and lora_B \[6, r\] with one r"),
        # a transposed lora_A is named as such, never taken for a rank of 4
        ([LayerWeights(0, "q_proj", np.ones((4, 3)), b, 1.0)],
         r"this lora_A is transposed: \[4, 3\]\); save lora_A as \[r, in_features\]"),
    ):
        with pytest.raises(AdapterError, match=message) as info:
            build_adapter("x", 1, "/p", layers, geometry, 8)
        assert "'x' (/p)" in str(info.value)


# -- reading PEFT folders -----------------------------------------------------------------
def test_adapter_as_vllm_reads_it(model_dirs, lora_adapters):
    """rsLoRA with a per-module rank and alpha (lora-b): each module's scaling is in B."""
    adapter = read(model_dirs, lora_adapters["lora-b"], "b", 2)
    assert adapter.rank == 4 and sorted(adapter.a) == ["down_proj", "k_proj", "o_proj",
                                                       "q_proj", "v_proj"]
    from safetensors.torch import load_file

    raw = load_file(str(lora_adapters["lora-b"] / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.self_attn."
    v_b = raw[prefix + "v_proj.lora_B.weight"].numpy()  # rank 2 (rank_pattern)
    o_b = raw[prefix + "o_proj.lora_B.weight"].numpy()  # alpha 4 (alpha_pattern)
    np.testing.assert_allclose(adapter.b["v_proj"][1, :, :2], v_b * 8 / 2**0.5, rtol=1e-6)
    assert not adapter.b["v_proj"][1, :, 2:].any()
    np.testing.assert_allclose(adapter.b["o_proj"][1], o_b * 4 / 2.0, rtol=1e-6)


def test_bad_adapters_are_refused_naming_the_adapter(model_dirs, lora_adapters, tmp_path):
    from vllm.exceptions import LoRAAdapterNotFoundError

    from build_tiny_lora import build_lora

    llama = model_dirs["llama"]
    with pytest.raises(LoRAAdapterNotFoundError):
        read(model_dirs, tmp_path / "nowhere")
    pickled = build_lora(llama, tmp_path / "pickled", seed=5, safe_serialization=False, r=8,
                         lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"'x' \(.*pickled\).*adapter_model.bin.*safetensors"):
        read(model_dirs, pickled)
    rank16 = build_lora(llama, tmp_path / "rank16", seed=4, r=16, lora_alpha=16,
                        target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"'x'.*rank 16 is greater than max_lora_rank 8.*"
                                           r"--max-lora-rank 8"):
        read(model_dirs, rank16)
    narrow = lora_settings(lora_target_modules=("q_proj",))
    with pytest.raises(AdapterError, match=r"'x'.*k_proj.*--lora-target-modules"):
        read(model_dirs, lora_adapters["lora-b"], settings=narrow)
    dora = tmp_path / "dora"
    shutil.copytree(lora_adapters["lora-c"], dora)
    config = (dora / "adapter_config.json").read_text().replace('"use_dora": false',
                                                               '"use_dora": true')
    (dora / "adapter_config.json").write_text(config)
    with pytest.raises(AdapterError, match="'x'.*DoRA"):
        read(model_dirs, dora)
    saved = tmp_path / "saved"
    shutil.copytree(lora_adapters["lora-c"], saved)
    config = (saved / "adapter_config.json").read_text().replace('"modules_to_save": null',
                                                                '"modules_to_save": ["lm_head"]')
    (saved / "adapter_config.json").write_text(config)
    with pytest.raises(AdapterError, match="'x'.*modules_to_save"):
        read(model_dirs, saved)


def test_oversized_corrupt_and_half_adapters_are_refused(model_dirs, lora_adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    def variant(name, weights: bytes | None = None, drop: str | None = None):
        folder = tmp_path / name
        shutil.copytree(lora_adapters["lora-c"], folder)
        target = folder / "adapter_model.safetensors"
        if weights is not None:
            target.write_bytes(weights)
        if drop is not None:
            tensors = load_file(str(target))
            save_file({k: v for k, v in tensors.items() if drop not in k}, str(target))
        return folder

    # refused from its size, before anything parses it
    with pytest.raises(AdapterError, match=r"'x'.*is 3,145,728 bytes, more than a float32 "
                                           r"adapter of rank --max-lora-rank 8"):
        read(model_dirs, variant("huge", bytes(3 << 20)))
    with pytest.raises(AdapterError, match=r"'x'.*not a readable safetensors file"):
        read(model_dirs, variant("corrupt", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"))
    with pytest.raises(AdapterError, match=r"'x'.*no lora_B weight for "
                                           r"model\.layers\.1\.self_attn\.q_proj"):
        read(model_dirs, variant("half", drop="layers.1.self_attn.q_proj.lora_B"))


# -- the store and the backend's slots ----------------------------------------------------
@pytest.fixture(scope="module")
def cache_url(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("adapter-cache"))


def _store(model_dirs, backend, settings, copies_parent=None):
    if copies_parent is not None:
        os.makedirs(copies_parent, exist_ok=True)
    return AdapterStore(settings, geometry_of(model_dirs["llama"], settings), backend,
                        lora_config(), 4096, base_modules(model_dirs["llama"]),
                        copies_parent)


def test_store_holds_pins_evicts_and_fills_slots(model_dirs, lora_adapters, cache_url):
    settings = lora_settings()  # 2 slots, 2 adapters on the host
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    store = _store(model_dirs, backend, settings)
    a, b, c = (request(n, i, lora_adapters[f"lora-{n}"]) for i, n in enumerate("abc", 1))
    assert store.add(a) and store.add(b) and store.pin(1)
    assert store.prepare_step({1: a}) == ({1: 1}, {})
    assert store.add(c) and store.ids() == {1, 3}  # b: least recently used, not pinned
    assert store.add(b) and store.ids() == {1, 2}
    assert store.prepare_step({2: b}) == ({2: 2}, {})
    # c was evicted from the host: read again from its path, into a's slot (LRU)
    assert store.prepare_step({3: c}) == ({3: 1}, {}) and store.ids() == {1, 3}
    q_a = backend.lora.tensors[0]  # layer 0 q_proj A [slots, rank, in]
    want = store.read(c).a["q_proj"][0]
    torch.testing.assert_close(q_a[1, : want.shape[0]], torch.from_numpy(want))
    assert store.pin(3)
    with pytest.raises(AdapterError, match="'b'.*--max-cpu-loras 2.*all of them are pinned"):
        store.add(b)
    with pytest.raises(AdapterError, match="pin_lora.99"):
        store.pin(99)
    # removed while a request uses it: it keeps its slot (nothing is read again)
    assert store.remove(3) and store.ids() == {1}
    assert store.prepare_step({3: c}) == ({3: 1}, {}) and store.ids() == {1}
    # a slot taken by another adapter: read again from the request's path
    assert store.prepare_step({1: a, 2: b}) == ({1: 1, 2: 2}, {}) and store.ids() == {1}
    assert store.prepare_step({3: c}) == ({3: 2}, {}) and store.ids() == {1, 3}  # b: LRU


def test_reload_in_place_rewrites_the_slot_even_after_host_eviction(model_dirs, lora_adapters,
                                                                    cache_url):
    settings = lora_settings()  # 2 adapters on the host
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    store = _store(model_dirs, backend, settings)
    a, b, c = (request(n, i, lora_adapters[f"lora-{n}"]) for i, n in enumerate("abc", 1))
    assert store.prepare_step({1: a}) == ({1: 1}, {})
    assert store.add(b) and store.add(c)
    assert store.ids() == {2, 3}  # a left the host; its slot still holds it
    new = request("a", 1, lora_adapters["lora-c"], inplace=True)  # a's id, new weights
    assert store.add(new)
    assert store.prepare_step({1: new}) == ({1: 1}, {})
    want = store.read(new).a["q_proj"][0]
    torch.testing.assert_close(backend.lora.tensors[0][1, : want.shape[0]],
                               torch.from_numpy(want))


def test_slots_give_peft_logits_per_row_in_process_and_through_the_runner(
        model_dirs, lora_adapters, cache_url):
    from tests.e2e.support import PeftOracle

    oracle = PeftOracle(model_dirs["llama"], {"lora-a": lora_adapters["lora-a"],
                                              "lora-b": lora_adapters["lora-b"]})
    settings = lora_settings()
    local = open_backend(settings, model_dirs["llama"], cache_url)
    remote = open_backend(dataclasses.replace(settings, backend_python=sys.executable),
                          model_dirs["llama"], cache_url)
    try:
        prompts = [[5, 17, 99, 300], [11, 12, 13], [200, 201, 5, 9, 8]]
        names = ["lora-a", None, "lora-b"]
        for backend in (local, remote):
            store = _store(model_dirs, backend, settings)
            slots, _ = store.prepare_step({1: request("a", 1, lora_adapters["lora-a"]),
                                           2: request("b", 2, lora_adapters["lora-b"])})
            row_slot = [slots.get(1), 0, slots.get(2)]
            for seq, (prompt, slot, name) in enumerate(zip(prompts, row_slot, names,
                                                           strict=True)):
                inputs = context_encoding_inputs(settings, np.array(prompt), 0, seq, None,
                                                 adapter_slot=slot)
                want = oracle.model(input_ids=torch.tensor([prompt]),
                                    adapter_names=[name or oracle.BASE]).logits[0, -1]
                torch.testing.assert_close(backend.forward(inputs)[0], want, atol=2e-5,
                                           rtol=1e-5)
            nxt = [7, 8, 9]
            inputs = token_generation_inputs(settings, np.array(nxt),
                                             np.array([len(p) for p in prompts]),
                                             np.arange(3), None, adapter_slots=row_slot)
            got = backend.forward(inputs)
            for row, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
                want = oracle.model(input_ids=torch.tensor([[*prompt, nxt[row]]]),
                                    adapter_names=[name or oracle.BASE]).logits[0, -1]
                torch.testing.assert_close(got[row], want, atol=2e-5, rtol=1e-5)
    finally:
        remote.close()


def test_lora_settings_refusals():
    with pytest.raises(NeuronConfigError, match="--lora-dtype bfloat16 differs from --dtype"):
        lora_settings(lora_dtype="bfloat16")
    with pytest.raises(NeuronConfigError, match="--fully-sharded-loras"):
        lora_settings(fully_sharded_loras=True)
    assert lora_settings(lora_target_modules=("qkv_proj",)).lora_target_modules == (
        "q_proj", "k_proj", "v_proj")


# -- adapters read once and kept as checked (issue 32) ------------------------------------
def test_an_evicted_adapter_is_rebuilt_from_its_verified_copy_not_its_folder(
        model_dirs, lora_adapters, cache_url, tmp_path):
    settings = lora_settings()  # 2 slots, 2 adapters on the host
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    store = _store(model_dirs, backend, settings)
    ev_path = tmp_path / "ev"
    shutil.copytree(lora_adapters["lora-a"], ev_path)
    ev, b, c = (request("ev", 1, ev_path), request("b", 2, lora_adapters["lora-b"]),
                request("c", 3, lora_adapters["lora-c"]))
    assert store.add(ev)
    want = store.read(ev).a["q_proj"][0].copy()
    assert store.add(b) and store.add(c) and 1 not in store.ids()
    assert store.prepare_step({2: b, 3: c}) == ({2: 1, 3: 2}, {})  # ev in no slot either
    shutil.rmtree(ev_path)  # the folder gone: the verified copy serves
    assert store.prepare_step({1: ev})[0] == {1: 1}
    torch.testing.assert_close(backend.lora.tensors[0][1, : want.shape[0]], torch.from_numpy(want))
    # the verified copy itself changed: refused, the slot left empty, the others served
    kept = store._verified[1]
    (store.copies.folder(kept.digest) / "adapter_model.safetensors").write_bytes(b"changed")
    store.remove(1)
    assert store.prepare_step({2: b, 3: c})[1] == {}  # c takes ev's slot again
    slots, failed = store.prepare_step({1: ev, 2: b})
    assert set(slots) == {2} and "'ev'" in failed[1]
    assert "its verified copy" in failed[1] and "changed after it was verified" in failed[1]
    assert store.slots.slot_of(1) is None
    store.close()
    assert not store.copies.root.exists()


def test_an_adapter_that_cannot_be_written_fails_alone(model_dirs, lora_adapters, cache_url,
                                                         tmp_path):
    """Offline, never added: read in the step, refused there; the step's other adapter is
    written, and the failed one's slot is free for the next."""
    settings = lora_settings()
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    store = _store(model_dirs, backend, settings)
    os.mkfifo(tmp_path / "fifo")
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(lora_adapters["lora-c"] / "adapter_config.json", bad)
    (bad / "adapter_model.safetensors").symlink_to(tmp_path / "fifo")  # never a blocked read
    slots, failed = store.prepare_step({5: request("bad", 5, bad),
                                        2: request("b", 2, lora_adapters["lora-b"])})
    assert slots == {2: 2} and set(failed) == {5}
    assert "'bad'" in failed[5] and "is not a regular file" in failed[5]
    assert store.prepare_step({3: request("c", 3, lora_adapters["lora-c"])}) == ({3: 1}, {})


def test_target_modules_match_as_peft_matches_them():
    from neuron_plugin.serving.adapter_patterns import Budget, targets_match

    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"]

    def matches(targets):
        return targets_match(targets, modules, Budget())

    assert matches(["q_proj", "nonexistent"])  # PEFT: one match is enough
    assert matches(["self_attn.q_proj"])
    assert matches(r".*\.mlp\.down_proj")  # a string is a regex
    assert matches(r"^(?!.*vision).*\.(q_proj|v_proj)$")  # lookarounds, as PEFT's re has
    assert not matches(["query_key_value"])
    assert not matches(["proj"])  # a list names whole dotted parts
    assert not matches(r"down_proj")  # a regex matches whole names


# -- adapter configs are data (issue 39) ----------------------------------------------------
def _with_config(source, folder, **config):
    import json

    shutil.copytree(source, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


HOSTILE = {
    # the confirmed case: a catastrophically backtracking pattern (with Python's re,
    # hours per module name); matched with bounded work it is simply no module's
    "backtracking": ("target_modules", r"(\w|\.|\w\.?)*X",
                     ["none of which is a module of the base model"]),
    # one that backtracks whatever the engine: refused when the budget runs out
    "budget": ("target_modules", r"(\w|\.|\w\.?)*\d",
               ["target_modules cannot be used", "did not finish within 1 s"]),
    "invalid": ("target_modules", "(q_proj", ["target_modules cannot be used",
                                              "'(q_proj' is not a valid regular expression"]),
    "long": ("target_modules", "q" * 5000, ["target_modules cannot be used",
                                            "5,000 characters"]),
    "not-names": ("target_modules", ["q_proj", 5], ["target_modules cannot be used",
                                                    "neither a string nor a list of names"]),
    # vLLM matches rank_pattern keys against every module itself, unbounded
    "rank-pattern": ("rank_pattern", {r"(\w|\.|\w\.?)*\d": 4},
                     ["rank_pattern key cannot be used", "did not finish within 1 s"]),
    "alpha-pattern": ("alpha_pattern", {"q_proj)(": 4}, ["alpha_pattern key cannot be used",
                                                         "is not a valid regular expression"]),
}


@pytest.fixture(scope="module")
def hostile_outcomes(model_dirs, lora_adapters, tmp_path_factory):
    """Each HOSTILE adapter read in one child process, as the engine thread reads it, the
    outcome per case ("refused: <message>", or what else happened). A child, bounded by
    a timeout, because an unbounded match holds the GIL: the test then fails rather than
    hanging the suite."""
    import json
    import subprocess

    root = tmp_path_factory.mktemp("hostile")
    folders = {name: str(_with_config(lora_adapters["lora-c"], root / name, **{field: value}))
               for name, (field, value, _) in HOSTILE.items()}
    code = f"""
import json, sys
sys.path[:0] = {sys.path!r}
from pathlib import Path
from neuron_plugin.core.adapters import AdapterError
from tests.plugin.test_adapters import read
model_dirs = {{"llama": Path({str(model_dirs["llama"])!r})}}
for name, folder in {folders!r}.items():
    try:
        read(model_dirs, folder, name="hostile")
        outcome = "accepted"
    except AdapterError as exc:
        outcome = "refused: " + str(exc)
    except Exception as exc:
        outcome = f"{{type(exc).__name__}}: {{exc}}"
    print(json.dumps([name, outcome]), flush=True)
"""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, cwd=os.getcwd())
        lines = done.stdout.splitlines()
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        lines = (out.decode() if isinstance(out, bytes) else out).splitlines()
    return dict(json.loads(line) for line in lines if line.startswith("["))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_adapter_config_patterns_are_data_with_bounded_work(hostile_outcomes, case):
    """Each is a refusal naming the field (HTTP 400 from /v1/load_lora_adapter), never a
    stalled engine thread nor an uncaught re.error."""
    outcome = hostile_outcomes.get(case, "stalled: no outcome within the timeout")
    assert outcome.startswith("refused: "), outcome
    assert "'hostile'" in outcome
    for word in HOSTILE[case][2]:
        assert word in outcome, (word, outcome)


def test_rank_and_alpha_patterns_are_resolved_as_vllm_resolves_them(model_dirs,
                                                                    lora_adapters):
    """lora-b's rank_pattern/alpha_pattern, resolved here per module and handed to vLLM
    as the modules' own names: the same slots as vLLM's own matching gives (the scaling
    test_adapter_as_vllm_reads_it checks), and vLLM's helper holds no expression of the
    adapter's any more."""
    checks = checks_of(model_dirs)
    path = str(lora_adapters["lora-b"])
    files = checks.read("b", path)
    adapter = checks.verify(files, "b", 2, path, path)
    assert adapter.rank == 4
    import json

    from vllm.lora.peft_helper import PEFTHelper

    from neuron_plugin.serving.adapter_patterns import Budget, literal_patterns, resolve_pattern

    config = json.loads(files.config)
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": 4096})
    names = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("v_proj", "o_proj")]
    for name in names:
        resolved = {
            "rank_pattern": resolve_pattern("rank_pattern", helper.rank_pattern, [name], Budget()),
            "alpha_pattern": resolve_pattern("alpha_pattern", helper.alpha_pattern, [name],
                                             Budget()),
        }
        literal = dataclasses.replace(helper, **{k: literal_patterns(v)
                                                 for k, v in resolved.items()})
        assert literal.get_rank_and_scaling(name) == helper.get_rank_and_scaling(name), name


# -- the verified copies: after the checks, within a budget, swept (issue 39) --------------
def test_an_adapter_that_fails_its_checks_leaves_no_copy(model_dirs, lora_adapters, cache_url,
                                                         tmp_path):
    """Five refused loads (NaN weights) write nothing: copies are written only once every
    check has passed."""
    from safetensors.torch import load_file, save_file

    settings = lora_settings()
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    store = _store(model_dirs, backend, settings, tmp_path / "tmp")
    for i in range(5):
        bad = tmp_path / f"nan{i}"
        shutil.copytree(lora_adapters["lora-c"], bad)
        weights = bad / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        name = next(k for k in tensors if "lora_B" in k)
        tensors[name] = torch.full_like(tensors[name], float("nan"))
        first_a = next(k for k in tensors if "lora_A" in k)
        tensors[first_a] = tensors[first_a] + i  # five different adapters
        save_file(tensors, str(weights))
        with pytest.raises(AdapterError, match="NaN or Inf"):
            store.add(request(f"nan{i}", 10 + i, bad))
    assert sorted(os.listdir(store.copies.root)) == ["owner.lock"]
    assert store.add(request("c", 3, lora_adapters["lora-c"]))
    assert len(os.listdir(store.copies.root)) == 2
    store.close()


def test_copies_stay_within_their_budget_evicting_unused_ones(model_dirs, lora_adapters,
                                                              cache_url, tmp_path,
                                                              monkeypatch):
    """With room for three copies and two adapters on the host: a fourth adapter's copy
    evicts the least recently used copy no held, slotted or pinned adapter needs; that
    adapter is read (and checked) again from its folder when next needed; a copy that
    cannot fit beside the ones in use is refused naming the setting."""
    from neuron_plugin.serving.adapter_copies import MAX_BYTES_ENV

    def size(folder):
        return sum((folder / n).stat().st_size
                   for n in ("adapter_config.json", "adapter_model.safetensors"))

    d_path = _with_config(lora_adapters["lora-a"], tmp_path / "d", lora_dropout=0.25)
    room = sum(size(lora_adapters[f"lora-{n}"]) for n in "abc") + 100
    monkeypatch.setenv(MAX_BYTES_ENV, str(room))
    settings = lora_settings()  # 2 slots, 2 adapters on the host
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    store = _store(model_dirs, backend, settings, tmp_path / "tmp")
    a, b, c = (request(n, i, lora_adapters[f"lora-{n}"]) for i, n in enumerate("abc", 1))
    d = request("d", 4, d_path)
    assert store.add(a) and store.add(b) and store.add(c)  # a left the host, copy kept
    assert {1, 2, 3} <= set(store._verified)
    assert store.add(d)  # a's copy goes: the least recently used one not in use
    assert 1 not in store._verified and {2, 3, 4} <= set(store._verified)
    assert len(set(os.listdir(store.copies.root)) - {"owner.lock"}) == 3
    assert store.copies.used_bytes <= room
    # a is read again from its folder (and checked) when a step needs it, evicting
    # copies no adapter in use needs (c and d removed from the host)
    assert store.remove(3) and store.remove(4)
    assert store.prepare_step({1: a}) == ({1: 1}, {})
    assert 1 in store._verified and store.copies.used_bytes <= room
    monkeypatch.setenv(MAX_BYTES_ENV, "100")
    small = _store(model_dirs, backend, settings, tmp_path / "tmp")
    with pytest.raises(AdapterError, match=rf"'a'.*does not fit.*{MAX_BYTES_ENV}=100"):
        small.add(a)
    assert sorted(os.listdir(small.copies.root)) == ["owner.lock"]
    monkeypatch.setenv(MAX_BYTES_ENV, "lots")
    with pytest.raises(NeuronConfigError, match=f"{MAX_BYTES_ENV}='lots' must be a positive"):
        _store(model_dirs, backend, settings, tmp_path / "tmp")
    for kept_store in (store, small):
        kept_store.close()


def test_stale_copy_folders_of_dead_workers_are_swept_and_nothing_else(tmp_path):
    """A worker killed (SIGKILL) leaves its folder; the next worker's start removes it,
    and leaves a live worker's folder, a link named like one (never followed), a file,
    and an older version's folder without an owner lock."""
    import subprocess
    import textwrap

    from neuron_plugin.serving.adapter_copies import PREFIX, PrivateCopies

    parent = tmp_path / "tmp"
    parent.mkdir()
    code = textwrap.dedent(f"""
        import sys, time
        from neuron_plugin.serving.adapter_copies import PrivateCopies
        copies = PrivateCopies(1 << 20, {str(parent)!r})
        (copies.root / ("a" * 64)).mkdir()
        print(copies.root.name, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env)
    live = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        dead_name = killed.stdout.readline().strip()
        assert dead_name.startswith(PREFIX)
        live_name = live.stdout.readline().strip()
        killed.kill()
        killed.wait()
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "precious").write_text("keep")
        (parent / f"{PREFIX}link").symlink_to(outside)
        (parent / f"{PREFIX}file").write_text("x")
        (parent / f"{PREFIX}old").mkdir()  # an older version's: no owner lock
        copies = PrivateCopies(1 << 20, parent)
        left = sorted(os.listdir(parent))
        assert dead_name not in left
        assert live_name in left and copies.root.name in left
        assert {f"{PREFIX}link", f"{PREFIX}file", f"{PREFIX}old"} <= set(left)
        assert (outside / "precious").read_text() == "keep"
        copies.close()
        assert copies.root.name not in os.listdir(parent)
    finally:
        live.kill()
        live.wait()


def test_the_api_server_answers_a_refusal_as_the_clients_error():
    from neuron_plugin.serving.lora_api import refusal_text

    message = "Call to add_lora method failed: LoRA adapter 'x' (/p): rank 16 is above ..."
    assert refusal_text(message, "x") == "LoRA adapter 'x' (/p): rank 16 is above ..."
    assert refusal_text("Call to add_lora method failed: the runner died", "x") is None
    assert refusal_text(message, "y") is None
