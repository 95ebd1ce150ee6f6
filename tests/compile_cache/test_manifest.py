"""Manifests, keys, diffs and weight fingerprints."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compile_cache import weights
from compile_cache.errors import ManifestError
from compile_cache.manifest import (VOLATILE_MODEL_KEYS, cache_key, canonical_json,
                                    diff_manifests, weights_fingerprint)

from .cache_helpers import TINY_LLAMA, manifest_for


def test_volatile_model_keys_are_dropped_and_dtype_recorded_once():
    manifest = manifest_for()
    assert manifest["model"] == {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                 "model_type": "llama", "num_attention_heads": 4,
                                 "num_hidden_layers": 2, "num_key_value_heads": 2,
                                 "vocab_size": 512}
    assert manifest["dtype"] == "bfloat16"
    assert not VOLATILE_MODEL_KEYS & set(manifest["model"])


def test_volatile_fields_do_not_change_the_key_but_graph_fields_do():
    base = manifest_for()
    moved = manifest_for(model_config={**TINY_LLAMA, "_name_or_path": "/elsewhere",
                                       "transformers_version": "5.0", "eos_token_id": 7,
                                       "use_cache": False})
    assert cache_key(moved) == cache_key(base)
    assert cache_key(manifest_for(model_config={**TINY_LLAMA, "num_hidden_layers": 3})) \
        != cache_key(base)
    assert cache_key(manifest_for(model_config={**TINY_LLAMA, "torch_dtype": "float32"})) \
        != cache_key(base)


def test_nested_sub_configs_lose_volatile_keys_too():
    manifest = manifest_for(model_config={
        **TINY_LLAMA, "text_config": {"hidden_size": 8, "_name_or_path": "x", "pad_token_id": 0}})
    assert manifest["model"]["text_config"] == {"hidden_size": 8}


def test_explicit_dtype_wins_and_torch_prefix_is_dropped():
    assert manifest_for(dtype="torch.float16")["dtype"] == "float16"


def test_key_is_32_hex_digits_of_sha256_over_canonical_json():
    manifest = manifest_for()

    assert cache_key(manifest) == hashlib.sha256(canonical_json(manifest)).hexdigest()[:32]
    assert b" " not in canonical_json(manifest)


def test_tuples_and_lists_give_the_same_key():
    as_tuples = manifest_for(buckets={"context_encoding_buckets": (128, 256)},
                             compiler_flags=("-O1",))
    as_lists = manifest_for(buckets={"context_encoding_buckets": [128, 256]},
                            compiler_flags=["-O1"])
    assert cache_key(as_tuples) == cache_key(as_lists)


def test_compiler_flag_order_matters():
    assert cache_key(manifest_for(compiler_flags=["-O1", "-O2"])) != \
        cache_key(manifest_for(compiler_flags=["-O2", "-O1"]))


@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.one_of(st.integers(), st.booleans(), st.text(max_size=8),
                                 st.lists(st.integers(), max_size=4)),
                       max_size=8))
def test_key_does_not_depend_on_dict_order(neuron_config):
    reordered = dict(reversed(list(neuron_config.items())))
    assert cache_key(manifest_for(neuron_config=neuron_config)) == \
        cache_key(manifest_for(neuron_config=reordered))


def test_bool_and_int_are_different_values():
    assert cache_key(manifest_for(neuron_config={"x": True})) != \
        cache_key(manifest_for(neuron_config={"x": 1}))


@pytest.mark.parametrize("bad, field", [
    ({"x": {1, 2}}, "manifest.neuron.x"),
    ({"x": float("nan")}, "manifest.neuron.x"),
    ({1: "a"}, "manifest.neuron"),
    ({"x": [object()]}, "manifest.neuron.x[0]"),
])
def test_values_without_a_canonical_json_form_are_refused_naming_the_field(bad, field):
    with pytest.raises(ManifestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        manifest_for(neuron_config=bad)


def test_the_plugins_own_version_is_refused():
    with pytest.raises(ManifestError, match="plugin's own version"):
        manifest_for(versions={"vllm-neuron-plugin": "0.1.0", "neuronx-cc": "2.21"})


def test_compiler_flags_as_one_string_is_refused():
    with pytest.raises(ManifestError, match="list of flags"):
        manifest_for(compiler_flags="-O1 --auto-cast=none")


def test_diff_names_dotted_fields():
    a = manifest_for()
    b = manifest_for(buckets={"context_encoding_buckets": [128, 512],
                              "token_generation_buckets": [128, 256, 512, 1024, 2048]},
                     neuron_config={"tp_degree": 2, "batch_size": 8, "seq_len": 2048,
                                    "is_block_kv_layout": False, "new_switch": 1})
    assert diff_manifests(a, b) == ["buckets.context_encoding_buckets", "neuron.batch_size",
                                    "neuron.new_switch"]
    assert diff_manifests(a, a) == []


# -- weights fingerprint -------------------------------------------------------------
def _safetensors(path: Path, payload: bytes) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)],
                               "data_offsets": [0, len(payload)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def test_fingerprint_changes_with_any_weight_byte_of_a_small_checkpoint(tmp_path):
    _safetensors(tmp_path / "model.safetensors", bytes(range(256)) * 40)
    (tmp_path / "config.json").write_text("{}")
    before = weights_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"changed": 1}')
    assert weights_fingerprint(tmp_path) == before  # not a weight file
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[5000] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) != before


def test_large_files_are_sampled_and_full_mode_reads_everything(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "FULL_HASH_LIMIT", 4096)
    monkeypatch.setattr(weights, "SAMPLE_BYTES", 64)
    monkeypatch.setattr(weights, "SAMPLES", 4)
    path = tmp_path / "model.safetensors"
    payload = bytearray(b"\x01" * 100_000)
    _safetensors(path, bytes(payload))
    sampled, full = weights_fingerprint(tmp_path), weights_fingerprint(tmp_path, full=True)
    assert sampled != full
    payload[50_000] ^= 0xFF  # between samples: only the full hash sees it
    _safetensors(path, bytes(payload))
    assert weights_fingerprint(tmp_path) == sampled
    assert weights_fingerprint(tmp_path, full=True) != full
    payload[-1] ^= 0xFF  # inside the last sample
    _safetensors(path, bytes(payload))
    assert weights_fingerprint(tmp_path) != sampled


def test_renaming_a_shard_changes_the_fingerprint(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"weights")
    before = weights_fingerprint(tmp_path)
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "model-00001.bin")
    assert weights_fingerprint(tmp_path) != before


def test_folder_without_weights_is_an_error_that_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="weights_fingerprint=None"):
        weights_fingerprint(tmp_path)


def test_fingerprint_goes_into_the_key():
    assert cache_key(manifest_for(weights_fingerprint="a" * 64)) != \
        cache_key(manifest_for(weights_fingerprint="b" * 64))
