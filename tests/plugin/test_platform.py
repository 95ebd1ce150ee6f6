"""NeuronPlatform's changes to vLLM's config and its request checks, through vLLM's own
EngineArgs -> VllmConfig path (no engine is started)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")


def engine_config(model_dirs, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    defaults = dict(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                    max_num_seqs=4, enable_prefix_caching=False, enable_chunked_prefill=False)
    defaults.update(kwargs)
    return EngineArgs(**defaults).create_engine_config()


def settings_of(config):
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    return settings_from_vllm_config(config)


def test_contiguous_layout_shapes_the_scheduler(model_dirs, plugin_log):
    config = engine_config(model_dirs)
    assert config.parallel_config.worker_cls == "neuron_plugin.serving.worker.NeuronWorker"
    assert config.cache_config.block_size == 512
    assert config.scheduler_config.max_num_batched_tokens >= 512  # whole prompts per step
    assert config.cache_config.num_gpu_blocks_override == 5  # 4 slots + null block
    assert config.scheduler_config.async_scheduling is True  # on-device sampling is on
    settings = settings_of(config)
    assert settings.kv_layout == "contiguous"
    logged = "\n".join(plugin_log)
    assert "num_gpu_blocks_override None -> 5" in logged
    assert "block_size" in logged and "contiguous KV layout: one block per sequence" in logged


def test_async_scheduling_is_off_where_every_step_needs_its_logits(model_dirs, plugin_log):
    override = {"override_neuron_config": {"on_device_sampling_config": None}}
    assert engine_config(model_dirs, additional_config=override).scheduler_config\
        .async_scheduling is False
    assert "async_scheduling True -> False (on-device sampling is off" in "\n".join(plugin_log)
    assert engine_config(model_dirs, async_scheduling=False).scheduler_config\
        .async_scheduling is False  # --no-async-scheduling is kept


def test_prefix_caching_switches_to_block_layout(model_dirs):
    config = engine_config(model_dirs, enable_prefix_caching=True)
    settings = settings_of(config)
    assert settings.kv_layout == "block"
    assert config.cache_config.block_size == 32
    # 4 sequences x ceil(512 / 32) blocks + the null block
    assert config.cache_config.num_gpu_blocks_override == settings.num_blocks == 65


def test_users_block_size_is_kept_for_block_layout(model_dirs):
    config = engine_config(model_dirs, enable_prefix_caching=True, block_size=64)
    assert config.cache_config.block_size == 64
    assert settings_of(config).num_blocks == 4 * 8 + 1


def test_contradiction_fails_before_anything_compiles(model_dirs):
    # vLLM wraps the platform's NeuronConfigError in pydantic's ValidationError (both
    # ValueErrors); the message reaches the user intact.
    with pytest.raises(ValueError, match="pa_block_size=16 differs from vLLM's "
                                                "block_size=32; pass --block-size 16"):
        engine_config(model_dirs, enable_prefix_caching=True,
                      additional_config={"override_neuron_config": {"pa_block_size": 16}})


def test_validate_request_names_limit_and_fix(model_dirs):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform

    # validate_request reads the live config through a weak reference, as a server
    # holds its config: the test holds it too, or a collection in between loses it.
    config = engine_config(model_dirs, additional_config={"override_neuron_config": {
        "context_encoding_buckets": [64, 128]}})
    current_platform.validate_request({"type": "token", "prompt_token_ids": [1] * 128},
                                      SamplingParams())
    with pytest.raises(VLLMValidationError) as info:
        current_platform.validate_request({"type": "token", "prompt_token_ids": [1] * 129},
                                          SamplingParams())
    message = str(info.value)
    assert "prompt has 129 tokens but the largest context-encoding bucket holds 128" in message
    assert "add a bucket >= 129" in message
    with pytest.raises(VLLMValidationError) as info:
        current_platform.validate_request({"type": "token", "prompt_token_ids": [1]},
                                          SamplingParams(prompt_logprobs=1))
    message = str(info.value)
    # /v1/completions turns echo=true with logprobs into prompt_logprobs: the message
    # names both causes and both fixes.
    assert "need the prompt-logprob graphs, which this server did not compile" in message
    assert "--additional-config '{\"prompt_logprobs\": true}'" in message
    assert "echo=true with logprobs" in message
    assert "remove prompt_logprobs or drop echo" in message


def test_echo_with_logprobs_is_refused_as_echo(model_dirs):
    """The request vLLM's OpenAI server builds for /v1/completions with echo and
    logprobs carries prompt_logprobs the user never wrote; the refusal names echo."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform

    config = engine_config(model_dirs)  # held: see above
    params = CompletionRequest(model="m", prompt="hi", echo=True, logprobs=2,
                               max_tokens=4).to_sampling_params(max_tokens=4)
    assert params.prompt_logprobs == 2
    with pytest.raises(VLLMValidationError, match="drop echo"):
        current_platform.validate_request({"type": "token", "prompt_token_ids": [1]},
                                          params)


def test_set_device_is_a_no_op_for_vllms_async_output_thread():
    """vLLM's multiprocess executor calls set_device from its async-output thread with
    async scheduling (data parallelism, --distributed-executor-backend mp); the base
    Platform raises NotImplementedError there, which killed the thread and hung the
    engine (tests/e2e/test_data_parallel.py runs that path end to end)."""
    import torch

    from neuron_plugin.platform import NeuronPlatform

    assert NeuronPlatform.set_device(torch.device("cpu")) is None


def test_speculation_is_configured_and_logged(model_dirs, plugin_log):
    config = engine_config(model_dirs, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert config.scheduler_config.async_scheduling is False
    settings = settings_of(config)
    assert (settings.speculation_method, settings.speculation_length) == ("ngram", 4)
    assert "speculative decoding: ngram, up to 3 drafts a step" in "\n".join(plugin_log)


def test_host_sampled_requests_are_refused_with_a_fused_draft_on_nxd(model_dirs,
                                                                     monkeypatch):
    """NxDI's fused speculation is compiled without logits (core.speculation.
    host_sampling_refusal): a request the device cannot sample gets HTTP 400; one it
    can is served. The reference backend serves both."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from neuron_plugin.platform import NeuronPlatform

    draft = {"model": str(model_dirs["llama"]), "num_speculative_tokens": 2}
    prompt = {"prompt_token_ids": [1, 2, 3]}
    monkeypatch.setenv("VLLM_NEURON_BACKEND", "nxd")
    keep = engine_config(model_dirs, speculative_config=draft)  # noqa: F841 (resolved)
    NeuronPlatform.validate_request(prompt, SamplingParams(temperature=0.7, top_p=0.9))
    with pytest.raises(VLLMValidationError,
                       match=r"logprobs needs the host sampler, but with a draft model"):
        NeuronPlatform.validate_request(prompt, SamplingParams(logprobs=2))
    monkeypatch.setenv("VLLM_NEURON_BACKEND", "reference")
    keep = engine_config(model_dirs, speculative_config=draft)  # noqa: F841
    NeuronPlatform.validate_request(prompt, SamplingParams(logprobs=2))



# Run in the host's vLLM environment: vLLM inspects Qwen3-VL's model class, which imports
# transformers' Qwen2-VL image processor, which needs torchvision.
IMAGES_ONLY_SCRIPT = """
import json
import sys

from vllm.engine.arg_utils import EngineArgs

from neuron_plugin.serving.vllm_settings import settings_from_vllm_config


def config(**kwargs):
    return EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=512,
                      max_num_seqs=4, **kwargs).create_engine_config()


mm = config().model_config.multimodal_config
out = {"video": mm.get_limit_per_prompt("video"), "image": mm.get_limit_per_prompt("image"),
       "buckets": list(settings_from_vllm_config(config()).vision_buckets)}
try:
    config(limit_mm_per_prompt={"video": 1})
except ValueError as exc:
    out["refusal"] = str(exc)
print(json.dumps(out))
"""


def test_a_vision_model_takes_images_only(tiny_model, host_python):
    """The vision graphs encode images: vLLM's video limit becomes 0 (vLLM then answers
    a video with a 400 before reading it), and asking for videos is refused at start-up.
    The vision buckets come from Qwen3-VL's processor (its `size` keys, 16-pixel
    patches): 16 to 256 patches."""
    done = subprocess.run(
        [host_python, "-c", IMAGES_ONLY_SCRIPT, str(tiny_model("qwen3_vl"))],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["video"], out["image"] > 0) == (0, True)
    assert out["buckets"] == [16, 32, 64, 128, 256]
    assert "--limit-mm-per-prompt video=1: the neuron platform runs this model's vision " \
           "encoder on images only" in out.get("refusal", "")


TEXT_ONLY_SCRIPT = """
import sys

from vllm.engine.arg_utils import EngineArgs

from neuron_plugin.serving.vllm_settings import settings_from_vllm_config


def config(**kwargs):
    return EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=512,
                      max_num_seqs=4, **kwargs).create_engine_config()


print("text-only buckets", list(settings_from_vllm_config(
    config(language_model_only=True)).vision_buckets))
try:
    config()
except ValueError as exc:
    print("refusal", exc)
"""


def test_a_vision_tower_the_plugin_does_not_run_is_refused_unless_served_text_only(
        tiny_model, host_python, tmp_path):
    """Qwen3-VL-MoE's vision tower is not in the plugin: vLLM would hand its graphs
    placeholder tokens they cannot encode, so it is refused at start-up, naming
    --language-model-only, under which vLLM takes no images and it plans no vision
    buckets. The checkpoint is the tiny Qwen3-VL's config relabelled as transformers
    names the MoE model (vLLM reads only the config here)."""
    for source in tiny_model("qwen3_vl").glob("*.json"):
        shutil.copy(source, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["Qwen3VLMoeForConditionalGeneration"],
                  model_type="qwen3_vl_moe")
    config["text_config"]["model_type"] = "qwen3_vl_moe_text"
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [host_python, "-c", TEXT_ONLY_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "text-only buckets []" in done.stdout
    assert ("Qwen3VLMoeForConditionalGeneration is a multimodal model whose vision encoder "
            "this plugin does not run") in done.stdout
    assert "pass --language-model-only to serve its text model" in done.stdout
