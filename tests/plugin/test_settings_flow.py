"""Settings flow one way: vLLM's untouched config -> resolve_settings -> apply. Every
value the platform changes in vLLM's config is one of `engine_updates`, decided by the
pure resolution; nothing registers metrics outside a serving frontend."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from neuron_plugin.core.settings import engine_updates

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

SECTIONS = ("cache_config", "scheduler_config", "parallel_config", "model_config")


def engine_config(model_dirs, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    defaults = dict(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                    max_num_seqs=4, enable_prefix_caching=False, enable_chunked_prefill=False)
    defaults.update(kwargs)
    return EngineArgs(**defaults)


def _fields(section) -> dict:
    return {k: copy.deepcopy(v) for k, v in vars(section).items() if not k.startswith("_")}


# (id, EngineArgs keywords): configurations whose changes the table checks.
CASES = [
    ("contiguous", {}),
    ("prefix-caching", dict(enable_prefix_caching=True)),
    ("prefix-caching-user-block", dict(enable_prefix_caching=True, block_size=64)),
    ("chunked-prefill", dict(enable_chunked_prefill=True, max_num_batched_tokens=128)),
    ("block-layout-asked", dict(block_size=32, additional_config={
        "override_neuron_config": {"is_block_kv_layout": True}})),
    ("blocks-given", dict(enable_prefix_caching=True, num_gpu_blocks_override=100)),
    ("vllm-default-max-num-seqs", dict(max_num_seqs=None)),
    ("vllm-neuron-batch-size", dict(max_num_seqs=None, additional_config={
        "override_neuron_config": {"batch_size": 8}})),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_every_change_the_platform_makes_is_an_engine_update(model_dirs, kwargs):
    """Build the config without the platform hook, snapshot it, run the hook, and
    compare: each changed field must be exactly an update resolve_settings decided."""
    from vllm.platforms import current_platform

    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    hook = type(current_platform).check_and_update_config
    type(current_platform).check_and_update_config = classmethod(lambda cls, c: None)
    try:
        config = engine_config(model_dirs, **kwargs).create_engine_config()
    finally:
        type(current_platform).check_and_update_config = hook
    before = {name: _fields(getattr(config, name)) for name in SECTIONS}
    current_platform.check_and_update_config(config)
    settings = settings_from_vllm_config(config)
    decided = {(u.section, u.name): u.value for u in engine_updates(settings)}
    changed = {(name, key): value
               for name in SECTIONS
               for key, value in _fields(getattr(config, name)).items()
               if before[name].get(key) != value}
    assert changed, "the platform changed nothing"
    for (section, key), value in changed.items():
        assert (section, key) in decided, f"{section}.{key} changed outside resolve_settings"
        assert decided[(section, key)] == value
    # And every decided value is in vLLM's config afterwards.
    for (section, key), value in decided.items():
        assert getattr(getattr(config, section), key) == value


def test_users_block_size_survives_an_explicit_block_layout(model_dirs):
    """The reproduced bug: --block-size 32 with is_block_kv_layout was rewritten to
    max_model_len (contiguous) before the layout was decided, then used for blocks."""
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model_dirs, block_size=32, additional_config={
        "override_neuron_config": {"is_block_kv_layout": True}}).create_engine_config()
    settings = settings_from_vllm_config(config)
    assert settings.kv_layout == "block"
    assert settings.block_size == config.cache_config.block_size == 32
    assert settings.num_blocks == 4 * (512 // 32) + 1


def test_resolution_is_idempotent(model_dirs):
    """vLLM may run the hook again on the same config; the result must not drift."""
    from vllm.platforms import current_platform

    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model_dirs, enable_prefix_caching=True).create_engine_config()
    first = settings_from_vllm_config(config)
    current_platform.check_and_update_config(config)
    assert settings_from_vllm_config(config) == first
    assert config.cache_config.block_size == 32


def test_unknown_additional_config_key_is_refused(model_dirs):
    with pytest.raises(ValueError, match="unknown key.*'override_neuron_cfg'"):
        engine_config(model_dirs, additional_config={
            "override_neuron_cfg": {"enable_bucketing": True}}).create_engine_config()


def test_backend_python_must_be_an_interpreter(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_BACKEND_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(ValueError, match="VLLM_NEURON_BACKEND_PYTHON=.*no-python.*is not "
                                         "an executable file"):
        engine_config(model_dirs).create_engine_config()
    monkeypatch.setenv("VLLM_NEURON_BACKEND_PYTHON", sys.executable)
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model_dirs).create_engine_config()
    assert settings_from_vllm_config(config).backend_python == sys.executable


@pytest.mark.parametrize("verb", ["explain-config", "precompile"])
def test_tools_start_no_metrics_collector(model_dirs, tmp_path, verb):
    """The collector belongs to the process serving /metrics: a tool run registers no
    Prometheus collector and creates no telemetry directory."""
    code = f"""
import sys, tempfile, glob
from prometheus_client import REGISTRY
from neuron_plugin.tools import cli
before = set(glob.glob(tempfile.gettempdir() + "/vllm-neuron-telemetry-*"))
status = cli.main([{verb!r}, {str(model_dirs["llama"])!r}, "--max-model-len", "128",
                   "--max-num-seqs", "2", "--dtype", "float32"]
                  + (["--cache", {str(tmp_path / "cache")!r}] if {verb!r} == "precompile" else []))
names = [type(c).__name__ for c in REGISTRY._collector_to_names]
after = set(glob.glob(tempfile.gettempdir() + "/vllm-neuron-telemetry-*"))
print("STATUS", status, "NEURON", any("Neuron" in n for n in names), "NEWDIRS", len(after - before))
"""
    # a temporary folder of its own: engines elsewhere on the host make telemetry
    # directories in the shared one meanwhile
    private = tmp_path / "tmp"
    private.mkdir()
    env = dict(os.environ, VLLM_NEURON_BACKEND="reference", TMPDIR=str(private))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert "STATUS 0 NEURON False NEWDIRS 0" in result.stdout, result.stdout + result.stderr[-3000:]
