"""A drop-in for vllm-neuron users: every vllm-neuron environment variable and
`override_neuron_config` key works with the same meaning here or is refused with its
replacement named (docs/migration.md). Through vLLM's own EngineArgs ->
VllmConfig path and, for the compile cache, the real `neuron-plugin precompile`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from compile_cache.cache import CompileCache  # noqa: E402
from compile_cache.settings import CACHE_URL_ENV, LOCAL_DIR_ENV, local_read_cache_dir  # noqa: E402
from compile_cache.signing import Trust  # noqa: E402
from compile_cache.stores import LocalStore, open_store  # noqa: E402
from neuron_plugin.core import vllm_neuron_env  # noqa: E402
from neuron_plugin.tools import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = "NEURON_COMPILED_ARTIFACTS"


@pytest.fixture
def environ():
    """os.environ restored after the test: resolving a configuration may set compile-cache
    variables (that is the feature under test)."""
    saved = dict(os.environ)
    for name in vllm_neuron_env.NAMES:
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def engine_config(model_dirs, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    defaults = dict(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                    max_num_seqs=4, enable_prefix_caching=False, enable_chunked_prefill=False)
    return EngineArgs(**{**defaults, **kwargs}).create_engine_config()


def settings_of(config):
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    return settings_from_vllm_config(config)


def refusal(model_dirs, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        engine_config(model_dirs, **kwargs)
    return cli.error_message(info.value)


# -- the hyphenated spelling of AWS's guide -------------------------------------------
def test_hyphenated_override_spelling_works_with_a_warning(model_dirs, environ, plugin_log):
    from vllm.platforms import current_platform

    config = engine_config(model_dirs, additional_config={
        "override-neuron-config": {"context_encoding_buckets": [64, 128]}})
    first = settings_of(config)
    current_platform.check_and_update_config(config)  # vLLM may run it again
    assert first.context_encoding_buckets == (64, 128)
    assert settings_of(config) == first
    warnings = [line for line in plugin_log
                if "'override-neuron-config' read as 'override_neuron_config'" in line]
    assert len(warnings) == 1  # read once: apply() stores the canonical spelling
    assert "override-neuron-config" not in config.additional_config
    assert config.additional_config["override_neuron_config"] == {
        "context_encoding_buckets": [64, 128]}


# -- NEURON_COMPILED_ARTIFACTS ----------------------------------------------------------
def test_compiled_artifacts_is_the_compile_cache_local_store(model_dirs, environ, tmp_path):
    folder = tmp_path / "compiled"
    environ[ARTIFACTS] = str(folder)
    engine_config(model_dirs)
    assert environ[CACHE_URL_ENV] == str(folder)
    store = open_store()
    assert isinstance(store, LocalStore) and store.root == folder
    engine_config(model_dirs)  # the same store named twice is no conflict
    environ[CACHE_URL_ENV] = f"file://{folder}"
    engine_config(model_dirs)


def test_compiled_artifacts_is_the_read_cache_of_an_s3_store(model_dirs, environ, tmp_path):
    environ[CACHE_URL_ENV] = "s3://bucket/neuron-cache"
    environ[ARTIFACTS] = str(tmp_path / "compiled")
    engine_config(model_dirs)
    assert environ[CACHE_URL_ENV] == "s3://bucket/neuron-cache"
    assert local_read_cache_dir() == tmp_path / "compiled"


def _precompile(model_dirs, env: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "neuron_plugin.tools.cli", "precompile",
         str(model_dirs["llama"]), "--max-model-len", "128", "--max-num-seqs", "2",
         "--dtype", "float32"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_compiled_artifacts_serve_a_second_start_and_stay_verified(model_dirs, tmp_path):
    """precompile (which resolves exactly as `vllm serve` does) compiles into
    NEURON_COMPILED_ARTIFACTS; a second process finds the entry there. The entry is
    keyed, signed and verified like any compile-cache entry: a changed file is refused."""
    folder = tmp_path / "compiled"
    env = {k: v for k, v in os.environ.items() if k not in vllm_neuron_env.NAMES}
    env.update(VLLM_NEURON_BACKEND="reference", XDG_CONFIG_HOME=str(tmp_path / "config"),
               **{ARTIFACTS: str(folder)})
    first = _precompile(model_dirs, env)
    key = re.search(r"compiled and published: key (\w+)", first).group(1)
    assert (folder / "entries" / key / "entry.json").is_file()
    assert f"already in the cache: key {key}" in _precompile(model_dirs, env)
    cache = CompileCache(LocalStore(folder), trust=Trust.from_env(env))
    assert cache.verify([key])[0].ok
    graph = next(p for p in (folder / "entries" / key / "files").rglob("*") if p.is_file())
    graph.write_bytes(graph.read_bytes() + b"stale")
    result = cache.verify([key])[0]
    assert not result.ok and result.problem


# -- the other variables ----------------------------------------------------------------
def test_framework_variable_accepts_nxd_inference(model_dirs, environ):
    environ["VLLM_NEURON_FRAMEWORK"] = "neuronx-distributed-inference"
    assert settings_of(engine_config(model_dirs)).backend == "reference"
    environ["VLLM_NEURON_FRAMEWORK"] = "transformers-neuronx"
    assert "VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference" in refusal(model_dirs)


def test_native_scheduler_variable_means_chunked_prefill(model_dirs, environ):
    environ["DISABLE_NEURON_CUSTOM_SCHEDULER"] = "1"
    settings = settings_of(engine_config(model_dirs, enable_chunked_prefill=True,
                                         max_num_batched_tokens=128))
    assert settings.is_chunked_prefill and settings.kv_layout == "block"
    environ["DISABLE_NEURON_CUSTOM_SCHEDULER"] = "0"
    assert not settings_of(engine_config(model_dirs)).is_chunked_prefill


@pytest.mark.parametrize("name,key", sorted(vllm_neuron_env.BUCKET_ENVS.items()))
def test_bucket_variables_name_a_replacement_that_works(model_dirs, environ, name, key):
    environ[name] = "128, 256"
    message = refusal(model_dirs)
    additional = json.loads(re.search(r"--additional-config '(.+?)'", message).group(1))
    del environ[name]
    settings = settings_of(engine_config(model_dirs, max_model_len=256,
                                         additional_config=additional))
    assert getattr(settings, key) == (128, 256)


def test_visible_cores_variable_keeps_its_meaning():
    from neuron_plugin.core.instances import check_tp_fits, visible_cores
    from neuron_plugin.platform import NeuronPlatform

    assert NeuronPlatform.device_control_env_var == "NEURON_RT_VISIBLE_CORES"
    count, source = visible_cores({"NEURON_RT_VISIBLE_CORES": "0-1"}, [], None)
    assert count == 2
    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES=0-3"):
        check_tp_fits(4, count, source)


def test_on_device_sampling_variable_is_read_by_on_device_sampling():
    from neuron_plugin.core.sampling import DISABLED_ENV

    assert DISABLED_ENV == "NEURON_ON_DEVICE_SAMPLING_DISABLED"


def test_migration_page_lists_every_vllm_neuron_variable():
    from neuron_plugin.core.sampling import DISABLED_ENV

    section = (ROOT / "docs" / "migration.md").read_text()
    own = {CACHE_URL_ENV, LOCAL_DIR_ENV}
    names = (set(vllm_neuron_env.NAMES) - own) | {DISABLED_ENV, "NEURON_RT_VISIBLE_CORES"}
    assert not [n for n in sorted(names) if f"`{n}" not in section]
    assert "override-neuron-config" in section and "--override-neuron-config" in section


# -- override_neuron_config keys vllm-neuron sets or documents --------------------------
PREFIX = dict(enable_prefix_caching=True, block_size=32)
# key, value, EngineArgs keywords, the NeuronSettings fields that show its meaning
WORKS = [
    ("tp_degree", 1, {}, {"tp_degree": 1}),
    ("batch_size", 4, {}, {"max_num_seqs": 4}),
    ("ctx_batch_size", 1, {}, {"ctx_batch_size": 1}),
    ("max_context_length", 256, {}, {"max_context_length": 256,
                                     "context_encoding_buckets": (128, 256)}),
    ("seq_len", 512, {}, {"max_model_len": 512}),
    ("enable_bucketing", False, {}, {"enable_bucketing": False,
                                     "context_encoding_buckets": (512,)}),
    ("is_continuous_batching", True, {}, {"kv_layout": "contiguous"}),
    ("torch_dtype", "float32", {}, {"dtype": "float32"}),
    ("padding_side", "right", {}, {"kv_layout": "contiguous"}),
    ("quantized", False, {}, {"passthrough": {"quantized": False}}),
    ("quantized", True, {}, {"passthrough": {"quantized": True,
                                             "quantized_checkpoints_path": "/q",
                                             "quantization_type": "per_channel_symmetric"}}),
    ("is_prefix_caching", True, PREFIX, {"is_prefix_caching": True}),
    ("is_block_kv_layout", True, PREFIX, {"kv_layout": "block"}),
    ("pa_block_size", 32, PREFIX, {"block_size": 32}),
    ("pa_num_blocks", 100, PREFIX, {"num_blocks": 100}),
    ("context_encoding_buckets", [128, 512], {}, {"context_encoding_buckets": (128, 512)}),
    ("token_generation_buckets", [256, 512], {}, {"token_generation_buckets": (256, 512)}),
    ("skip_warmup", True, {}, {"skip_warmup": True}),
    ("fused_qkv", True, {}, {"passthrough": {"fused_qkv": True}}),
]


# keys that come together with the key under test
COMPANIONS = {("quantized", True): {"quantized_checkpoints_path": "/q",
                                    "quantization_type": "per_channel_symmetric"}}


@pytest.mark.parametrize("key,value,kwargs,expected", WORKS,
                         ids=[f"{w[0]}={w[1]}" for w in WORKS])
def test_vllm_neuron_keys_keep_their_meaning(model_dirs, environ, key, value, kwargs,
                                             expected):
    override = {key: value, **(COMPANIONS.get((key, value), {}) if value is True else {})}
    settings = settings_of(engine_config(model_dirs, **kwargs, additional_config={
        "override_neuron_config": override}))
    assert {k: getattr(settings, k) for k in expected} == expected


def test_enable_lora_refused_by_vllm_neuron_is_served(model_dirs, environ):
    """vllm-neuron 0.x raises NotImplementedError for --enable-lora; here it compiles
    adapter slots (docs/configuration/lora.md)."""
    settings = settings_of(engine_config(model_dirs, enable_lora=True, max_loras=2,
                                         max_lora_rank=16))
    assert (settings.max_loras, settings.lora_slots, settings.max_lora_rank) == (2, 3, 16)
    assert settings.lora_target_modules == ("q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj")


# key, value, EngineArgs keywords, what the refusal names as the replacement
REFUSED = [
    ("tp_degree", 2, {}, "--tensor-parallel-size"),
    ("batch_size", 8, {}, "max_num_seqs=4"),
    ("chunked_prefill_config", {"max_num_seqs": 4}, {}, "--enable-chunked-prefill"),
    # LoRA comes from vLLM's --enable-lora flags; the key alone would turn on NxDI's
    ("lora_config", {"max_loras": 2}, {}, "--enable-lora"),
    ("text_neuron_config", {"tp_degree": 2}, {}, "text-only"),
    ("vision_neuron_config", {"tp_degree": 2}, {}, "text-only"),
    ("enable_fused_speculation", True, {}, "--speculative-config"),
    # vllm-neuron adds vLLM's null block itself; here pa_num_blocks includes it.
    ("pa_num_blocks", 64, PREFIX, "pa_num_blocks >= 65"),
]


@pytest.mark.parametrize("key,value,kwargs,replacement", REFUSED, ids=[r[0] for r in REFUSED])
def test_vllm_neuron_keys_refused_with_replacement(model_dirs, environ, key, value, kwargs,
                                                   replacement):
    message = refusal(model_dirs, **kwargs,
                      additional_config={"override_neuron_config": {key: value}})
    assert f"override_neuron_config.{key}" in message or f"{key}=" in message
    assert replacement in message, message
