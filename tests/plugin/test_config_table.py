"""Strict configuration: invalid configurations go through vLLM's own EngineArgs ->
VllmConfig path (and `neuron-plugin explain-config`'s `vllm serve` flags) and are refused
before start-up, each error naming the setting, the value and the fix. No engine starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from neuron_plugin.core.vllm_neuron_env import NAMES as VLLM_NEURON_ENV  # noqa: E402
from neuron_plugin.tools import cli  # noqa: E402


@dataclass(frozen=True)
class Row:
    id: str
    kwargs: dict                       # EngineArgs keywords on top of BASE
    says: tuple[str, ...]              # fragments the message must contain
    env: dict = field(default_factory=dict)
    never: tuple[str, ...] = ()        # fragments it must not contain


def onc(**keys) -> dict:
    return {"additional_config": {"override_neuron_config": keys}}


PREFIX = {"enable_prefix_caching": True}
NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                "prompt_lookup_max": 3}}
NXD = {"VLLM_NEURON_BACKEND": "nxd"}
NEURON_KV = {"kv_connector": "NeuronKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "neuron_plugin.kv_transfer.connector"}

ROWS = [
    # -- vLLM flags the platform cannot honour ---------------------------------------
    Row("kv-cache-dtype-fp8", {"kv_cache_dtype": "fp8"},
        ("--kv-cache-dtype fp8", "kv_cache_dtype='fp8'", "remove --kv-cache-dtype")),
    Row("kv-cache-dtype-fp8-e5m2", {"kv_cache_dtype": "fp8_e5m2"},
        ("--kv-cache-dtype fp8_e5m2", "remove --kv-cache-dtype")),
    Row("pipeline-parallel", {"pipeline_parallel_size": 2},
        ("--pipeline-parallel-size 2", "forever", "use --tensor-parallel-size")),
    Row("decode-context-parallel", {"decode_context_parallel_size": 2,
                                    "tensor_parallel_size": 4},
        ("--decode-context-parallel-size 2", "remove --decode-context-parallel-size"),
        env=NXD),
    Row("executor-external-launcher", {"distributed_executor_backend": "external_launcher"},
        ("--distributed-executor-backend external_launcher",
         "remove --distributed-executor-backend")),
    Row("cpu-offload", {"cpu_offload_gb": 1},
        ("--cpu-offload-gb 1", "NeuronCore memory", "--tensor-parallel-size")),
    Row("prefetch-offload", {"offload_group_size": 2, "offload_num_in_group": 1},
        ("--offload-group-size 2", "remove --offload-group-size")),
    Row("kv-offloading", {"kv_offloading_size": 1.0},
        ("--kv-offloading-size 1.0", "remove --kv-offloading-size")),
    Row("kv-cache-memory-bytes", {"kv_cache_memory_bytes": 1_000_000},
        ("--kv-cache-memory-bytes 1000000", "--max-num-seqs",
         "--num-gpu-blocks-override")),
    # Disaggregated prefill is served with the plugin's connector in the block layout.
    Row("kv-connector-of-vllm", {**PREFIX, "kv_transfer_config": {
        "kv_connector": "NixlConnector", "kv_role": "kv_both"}},
        ('--kv-transfer-config {"kv_connector": "NixlConnector", '
         '"kv_connector_module_path": null} is not supported on Neuron',
         "the KV cache lives in the compiled NxD graphs", '"kv_connector": "NeuronKVConnector"',
         '"kv_connector_module_path": "neuron_plugin.kv_transfer.connector"')),
    Row("kv-transfer-contiguous-layout", {"kv_transfer_config": {**NEURON_KV}},
        ("--kv-transfer-config needs the block KV layout", "contiguous",
         "block_size = max_model_len", "pass --enable-prefix-caching")),
    Row("kv-transfer-unknown-option", {**PREFIX, "kv_transfer_config": {
        **NEURON_KV, "kv_connector_extra_config": {"path": "/dev/shm/kv", "dir": "x"}}},
        ("kv_connector_extra_config has unknown keys ['dir']", "remove the others")),
    Row("kv-transfer-relative-path", {**PREFIX, "kv_transfer_config": {
        **NEURON_KV, "kv_connector_extra_config": {"path": "kv"}}},
        ("kv_connector_extra_config.path='kv' must be an absolute folder path",)),
    Row("encoder-cache-transfer", {"ec_transfer_config": {"ec_connector": "x",
                                                          "ec_role": "ec_both"}},
        ("--ec-transfer-config", "remove --ec-transfer-config")),
    Row("vllm-quantization", {"quantization": "fp8", "dtype": "bfloat16"},
        ("--quantization fp8", "quantized_checkpoints_path")),
    Row("prompt-embeds", {"enable_prompt_embeds": True},
        ("--enable-prompt-embeds", "token ids")),
    Row("pooling-runner", {"runner": "pooling"},
        ("--runner pooling", "text generation only", "remove --runner")),
    Row("convert-to-embedding", {"convert": "embed"},
        ("--convert embed", "remove --convert")),
    Row("hf-overrides", {"hf_overrides": {"rope_theta": 5000}},
        ('--hf-overrides {"rope_theta": 5000}', "config.json")),
    Row("dummy-weights", {"load_format": "dummy"},
        ("--load-format dummy", "safetensors", "remove --load-format")),
    Row("attention-backend", {"attention_backend": "FLASH_ATTN"},
        ("--attention-backend FLASH_ATTN", "remove --attention-backend")),
    Row("custom-worker", {"worker_cls": "my.Worker"},
        ("--worker-cls my.Worker", "remove --worker-cls")),
    Row("fully-sharded-loras", {"enable_lora": True, "fully_sharded_loras": True},
        ("--fully-sharded-loras", "remove --fully-sharded-loras")),
    # Multi-LoRA is served; these combinations of it cannot work.
    Row("lora-with-speculation", {"enable_lora": True, **NGRAM},
        ("--enable-lora with --speculative-config method 'ngram'", "remove one")),
    Row("lora-target-not-a-projection", {"enable_lora": True, "lora_target_modules": ["lm_head"]},
        ("--lora-target-modules 'lm_head'", "q_proj", "qkv_proj")),
    Row("lora-config-on-reference", {"enable_lora": True,
                                     **onc(lora_config={"dynamic_multi_lora": True})},
        ("override_neuron_config.lora_config", "only the nxd backend", "remove lora_config")),
    Row("lora-config-contradicts-flag", {"enable_lora": True, "max_loras": 2,
                                         **onc(lora_config={"max_loras": 4})},
        ("lora_config.max_loras=4", "--max-loras 2", "pass --max-loras 4"), env=NXD),
    Row("lora-config-derived-key", {"enable_lora": True,
                                    **onc(lora_config={"batch_size": 4})},
        ("lora_config.batch_size", "--max-num-seqs"), env=NXD),
    Row("lora-start-adapters-above-slots", {"enable_lora": True, "max_loras": 1,
                                            **onc(lora_config={"lora_ckpt_paths": {
                                                "a": "/x", "b": "/y"}})},
        ("lists 2 adapters", "--max-loras 1", "pass --max-loras 2"), env=NXD),
    # Speculative decoding is served; these combinations of it cannot work.
    Row("speculation-with-host-sampling", {**NGRAM, **onc(on_device_sampling_config=None)},
        ("--speculative-config method 'ngram' with on-device sampling off",
         "remove on_device_sampling_config: null")),
    Row("ngram-speculation-in-the-block-layout-on-nxd", {**NGRAM, **PREFIX},
        ("--speculative-config method 'ngram' with the block KV layout",
         "no prefix-caching graphs", "use a draft model"), env=NXD),
    Row("speculation-tkg-buckets-short-of-the-lookahead",
        {**NGRAM, **onc(token_generation_buckets=[256, 512])},
        ("token_generation_buckets", "speculation_length=3 reaches max_model_len + 2 = 514")),
    # -- override_neuron_config keys and values --------------------------------------
    Row("misspelt-key", onc(context_encoding_bucket=[128]),
        ("override_neuron_config.context_encoding_bucket=[128]",
         "did you mean context_encoding_buckets?")),
    Row("unknown-key-nxd", onc(no_such_key_xyz=1),
        ("override_neuron_config.no_such_key_xyz=1", "not a key of NxDI", "remove it"),
        env=NXD),
    Row("unknown-key-reference", onc(no_such_key_xyz=1),
        ("override_neuron_config.no_such_key_xyz=1", "remove it")),
    Row("hyphenated-key", onc(**{"skip-warmup": True}),
        ("override_neuron_config.skip-warmup=True", "did you mean skip_warmup?")),
    Row("misspelt-bucket-set", onc(bucket_sets="tuned.yaml"),
        ("bucket_sets='tuned.yaml'", "did you mean bucket_set?")),
    Row("vllm-setting-as-key", onc(enable_prefix_caching=True),
        ("override_neuron_config.enable_prefix_caching=True", "vLLM setting",
         "--enable-prefix-caching")),
    Row("empty-chunked-prefill-config", onc(chunked_prefill_config={}),
        ("override_neuron_config.chunked_prefill_config={}", "--enable-chunked-prefill",
         "remove chunked_prefill_config")),
    Row("lora-config-object", onc(lora_config={}),
        ("override_neuron_config.lora_config={}", "LoRA is off", "--enable-lora",
         "remove lora_config")),
    Row("speculation-length", onc(speculation_length=4),
        ("override_neuron_config.speculation_length=4", "remove the key")),
    Row("skip-warmup-not-bool", onc(skip_warmup="maybe"),
        ("override_neuron_config.skip_warmup='maybe'", "must be true or false",
         "fix the value or remove the key")),
    Row("tp-degree-string", onc(tp_degree="2"),
        ("override_neuron_config.tp_degree='2'", "positive integer")),
    Row("pa-num-blocks-fraction", {**PREFIX, **onc(pa_num_blocks=300.5)},
        ("override_neuron_config.pa_num_blocks=300.5", "positive integer")),
    Row("torch-dtype-name", onc(torch_dtype="fp32"),
        ("override_neuron_config.torch_dtype='fp32'", "'bfloat16'")),
    Row("padding-side", onc(padding_side="middle"),
        ("override_neuron_config.padding_side='middle'", "'left' or 'right'")),
    Row("empty-bucket-list", onc(context_encoding_buckets=[]),
        ("override_neuron_config.context_encoding_buckets=[]", "non-empty list",
         "e.g. [128, 512, 2048]")),
    Row("bucket-zero", onc(token_generation_buckets=[0, 512]),
        ("override_neuron_config.token_generation_buckets=[0, 512]", "positive integers")),
    Row("context-bucket-above-max-model-len", onc(context_encoding_buckets=[128, 1024]),
        ("context_encoding_buckets=[128, 1024]", "max_model_len=512", "--max-model-len"),
        never=("max_context_length",)),
    Row("sampling-field-misspelt", onc(on_device_sampling_config={"topk": 4}),
        ("override_neuron_config.on_device_sampling_config.topk", "did you mean top_k?")),
    Row("sampling-top-p-range", onc(on_device_sampling_config={"top_p": 1.5}),
        ("override_neuron_config.on_device_sampling_config.top_p=1.5", "(0, 1]")),
    Row("sampling-config-not-object", onc(on_device_sampling_config=True),
        ("override_neuron_config.on_device_sampling_config=True", "global_topk")),
    Row("multimodal-key", onc(text_neuron_config={}),
        ("override_neuron_config.text_neuron_config={}", "remove text_neuron_config")),
    Row("override-not-object", {"additional_config": {"override_neuron_config": [1]}},
        ("additional_config.override_neuron_config must be a JSON object",
         "--additional-config")),
    Row("both-spellings", {"additional_config": {
        "override_neuron_config": {}, "override-neuron-config": {"skip_warmup": True}}},
        ("'override_neuron_config'", "'override-neuron-config'", "keep one")),
    # -- vllm-neuron environment variables -------------------------------------------
    Row("framework-transformers-neuronx", {},
        ("VLLM_NEURON_FRAMEWORK='transformers-neuronx'", "NxD Inference only",
         "VLLM_NEURON_FRAMEWORK=neuronx-distributed-inference"),
        env={"VLLM_NEURON_FRAMEWORK": "transformers-neuronx"}),
    Row("context-length-buckets-env", {},
        ("NEURON_CONTEXT_LENGTH_BUCKETS='128, 512'",
         '"context_encoding_buckets": [128, 512]', "unset NEURON_CONTEXT_LENGTH_BUCKETS"),
        env={"NEURON_CONTEXT_LENGTH_BUCKETS": "128, 512"}),
    Row("token-gen-buckets-env", {},
        ("NEURON_TOKEN_GEN_BUCKETS='512'", '"token_generation_buckets": [512]'),
        env={"NEURON_TOKEN_GEN_BUCKETS": "512"}),
    Row("native-scheduler-without-chunked-prefill", {},
        ("DISABLE_NEURON_CUSTOM_SCHEDULER=1", "pass --enable-chunked-prefill"),
        env={"DISABLE_NEURON_CUSTOM_SCHEDULER": "1"}),
    Row("native-scheduler-not-a-number", {},
        ("DISABLE_NEURON_CUSTOM_SCHEDULER='yes'", "must be 0 or 1"),
        env={"DISABLE_NEURON_CUSTOM_SCHEDULER": "yes"}),
    Row("quant-dtype-env", {},
        ("NEURON_QUANT_DTYPE='s8'", "quantized_checkpoints_path", "unset NEURON_QUANT_DTYPE"),
        env={"NEURON_QUANT_DTYPE": "s8"}),
    Row("data-parallel-beyond-visible-cores", {"data_parallel_size": 5},
        ("--tensor-parallel-size 1 x --data-parallel-size 5 needs 5 NeuronCores",
         "4 are visible (NEURON_RT_VISIBLE_CORES=4-7)",
         "lower --data-parallel-size to at most 4"),
        env={"NEURON_RT_VISIBLE_CORES": "4-7"}),
    Row("compiled-artifacts-url", {},
        ("NEURON_COMPILED_ARTIFACTS='s3://bucket/compiled'", "VLLM_NEURON_CACHE_URL"),
        env={"NEURON_COMPILED_ARTIFACTS": "s3://bucket/compiled"}),
    Row("compiled-artifacts-vs-cache-url", {},
        ("NEURON_COMPILED_ARTIFACTS='/srv/compiled'", "VLLM_NEURON_CACHE_URL='/srv/cache'",
         "set one of them"),
        env={"NEURON_COMPILED_ARTIFACTS": "/srv/compiled",
             "VLLM_NEURON_CACHE_URL": "/srv/cache"}),
    Row("compiled-artifacts-vs-read-cache", {},
        ("NEURON_COMPILED_ARTIFACTS='/srv/compiled'",
         "VLLM_NEURON_CACHE_LOCAL_DIR='/srv/local'"),
        env={"NEURON_COMPILED_ARTIFACTS": "/srv/compiled",
             "VLLM_NEURON_CACHE_URL": "s3://bucket/cache",
             "VLLM_NEURON_CACHE_LOCAL_DIR": "/srv/local"}),
]


@pytest.fixture
def clean_env(monkeypatch):
    """Only the variables a row sets; the rest of the environment is restored after."""
    for name in VLLM_NEURON_ENV:
        monkeypatch.delenv(name, raising=False)
    # vLLM's own value (its default), recorded so that what vLLM writes there for a row
    # (external_launcher turns in-process engines on in os.environ) is undone after it
    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    monkeypatch.setenv(name, os.environ.get(name, "1"))
    return monkeypatch


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_refused_before_start_up(model_dirs, clean_env, row):
    from vllm.engine.arg_utils import EngineArgs

    for name, value in row.env.items():
        clean_env.setenv(name, value)
    kwargs = dict(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                  max_num_seqs=4, enable_prefix_caching=False, enable_chunked_prefill=False)
    with pytest.raises(ValueError) as info:
        EngineArgs(**{**kwargs, **row.kwargs}).create_engine_config()
    message = cli.error_message(info.value)
    assert not [f for f in row.says if f not in message], message
    assert not [f for f in row.never if f in message], message


def test_vllm_neuron_compiled_artifacts_are_never_loaded(model_dirs, clean_env, tmp_path):
    """A folder vllm-neuron compiled into (NxDI's neuron_config.json and model.pt) is not
    a compile-cache store: loading it would skip every key and signature check."""
    from vllm.engine.arg_utils import EngineArgs

    (tmp_path / "neuron_config.json").write_text("{}")
    clean_env.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path))
    with pytest.raises(ValueError) as info:
        EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                   enable_prefix_caching=False,
                   enable_chunked_prefill=False).create_engine_config()
    message = cli.error_message(info.value)
    assert f"NEURON_COMPILED_ARTIFACTS={str(tmp_path)!r}" in message
    assert "neuron_config.json" in message and "never loaded" in message
    assert "point NEURON_COMPILED_ARTIFACTS at an empty directory" in message


def test_every_problem_is_reported_at_once(model_dirs, clean_env):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError) as info:
        EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                   enable_prefix_caching=False, enable_chunked_prefill=False,
                   kv_cache_dtype="fp8", pipeline_parallel_size=2,
                   **onc(skip_warmup="maybe", context_encoding_bucket=[128])
                   ).create_engine_config()
    message = cli.error_message(info.value)
    for fragment in ("--kv-cache-dtype fp8", "--pipeline-parallel-size 2",
                     "skip_warmup='maybe'", "did you mean context_encoding_buckets?"):
        assert fragment in message


# `vllm serve` flags through explain-config: vLLM's own parser with the platform's hook.
CLI_ROWS = [
    ("max-num-seqs-zero", ["--max-num-seqs", "0"],
     ("argument --max-num-seqs", "'0' must be a whole number >= 1", "--max-num-seqs 4")),
    ("additional-config-bad-json", ["--additional-config", '{"override_neuron_config": {bad}}'],
     ("argument --additional-config", "is not valid JSON", "at character",
      "--additional-config '{\"override_neuron_config\"")),
    ("additional-config-unbalanced", ["--additional-config", "{bad"],
     ("argument --additional-config", "'{bad' is not valid JSON")),
    ("additional-config-list", ["--additional-config", "[1]"],
     ("argument --additional-config", "is a JSON list, not an object")),
    ("old-override-flag", ["--override-neuron-config", '{"skip_warmup": true}'],
     ("argument --override-neuron-config",
      "--additional-config '{\"override_neuron_config\": {\"skip_warmup\": true}}'")),
    ("pipeline-parallel-flag", ["--pipeline-parallel-size", "2"],
     ("--pipeline-parallel-size 2", "use --tensor-parallel-size")),
    ("kv-cache-dtype-flag", ["--kv-cache-dtype", "fp8"],
     ("--kv-cache-dtype fp8", "remove --kv-cache-dtype")),
    ("unknown-key-backend-nxd", ["--backend", "nxd", "--additional-config",
                                 '{"override_neuron_config": {"context_encoding_bucket": [128]}}'],
     ("context_encoding_bucket=[128]", "did you mean context_encoding_buckets?")),
]


@pytest.fixture
def backend_env(clean_env):
    """explain-config sets VLLM_NEURON_BACKEND and VLLM_LOGGING_STREAM for its process."""
    clean_env.setenv("VLLM_NEURON_BACKEND", os.environ.get("VLLM_NEURON_BACKEND", "reference"))
    clean_env.setenv("VLLM_LOGGING_STREAM",
                     os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.__stdout__"))


@pytest.mark.parametrize("flags,says", [row[1:] for row in CLI_ROWS],
                         ids=[row[0] for row in CLI_ROWS])
def test_serve_flags_refused_with_flag_and_fix(model_dirs, backend_env, capsys, flags, says):
    try:
        code = cli.main(["explain-config", str(model_dirs["llama"]), "--max-model-len", "256",
                         *flags])
    except SystemExit as exc:  # argparse's own error exit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert not [f for f in says if f not in err], err
    assert "validation error" not in err and "<function" not in err


def test_every_refused_flag_is_read_from_vllms_config(model_dirs, clean_env):
    """Each flag's path exists in vLLM 0.32's VllmConfig and its default is served, so
    a typo in a path can neither hide a refusal nor refuse every configuration."""
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.core.vllm_flags import VLLM_FLAGS, flag_problems
    from neuron_plugin.serving.vllm_settings import vllm_flag_values

    config = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                        enable_prefix_caching=False,
                        enable_chunked_prefill=False).create_engine_config()
    values = vllm_flag_values(config)
    assert sorted(values) == sorted(flag.flag for flag in VLLM_FLAGS)
    assert flag_problems(values) == []


def test_the_plugin_connector_is_served_in_the_block_layout(model_dirs, clean_env):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=512,
                        max_num_seqs=4, enable_prefix_caching=True,
                        enable_chunked_prefill=False,
                        kv_transfer_config=NEURON_KV).create_engine_config()
    assert config.kv_transfer_config.kv_connector == "NeuronKVConnector"
    assert config.cache_config.block_size == 32


def test_a_draft_model_is_refused_with_kv_transfer():
    from neuron_plugin.core.kv_transfer import kv_transfer_problems
    from neuron_plugin.core.neuron_settings import KVTransferLimits

    limits = KVTransferLimits(NEURON_KV["kv_connector"], NEURON_KV["kv_connector_module_path"],
                              "kv_both")
    assert kv_transfer_problems(limits, "block", "prefix caching on", None) == []
    (problem,) = kv_transfer_problems(limits, "block", "prefix caching on", "/models/draft")
    assert "--speculative-config model=/models/draft" in problem
    assert "the draft's own KV cache is not transferred" in problem and "ngram" in problem
