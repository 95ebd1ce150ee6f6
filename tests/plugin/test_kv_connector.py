"""NeuronKVConnector's scheduler side with vLLM's own request, block and scheduler-output
types: a prefill request's save is planned in the step that completes its prompt (whole
or chunked, blocks as vLLM hands them out) and its params name the payload; a decode
request's whole prompt past a block-aligned local hit is an asynchronous load planned
once (a failed one is recomputed, not retried), and params that cannot name a payload
become a failed load with the reason; the worker side reports every load in
finished_recving, failures also in failed_recving."""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from bench_host_overhead import scheduler_output  # noqa: E402

from neuron_plugin.kv_transfer.connector import LoadJob, SchedulerSide, WorkerSide  # noqa: E402
from neuron_plugin.kv_transfer.params import decode_params  # noqa: E402

BLOCK = 32


def _vllm_config(model_dir, role: str = "kv_both", extra: dict | None = None):
    """vLLM's own config for a disaggregated server (EngineArgs, the platform's checks)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=4,
        enable_prefix_caching=True, enable_chunked_prefill=False, block_size=BLOCK,
        kv_transfer_config={
            "kv_connector": "NeuronKVConnector", "kv_role": role,
            "kv_connector_module_path": "neuron_plugin.kv_transfer.connector",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra or {}},
    ).create_engine_config()


@pytest.fixture(scope="module")
def configs(model_dirs):
    return {role: _vllm_config(model_dirs["llama"], role)
            for role in ("kv_both", "kv_producer", "kv_consumer")}


def _request(rid: str, prompt: list[int], params: dict | None) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}
                              if params is not None else None)
    return Request(rid, prompt, sampling, None)


def _blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _new(request: Request, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(request.request_id, request.prompt_token_ids, [],
                          request.sampling_params, None, (blocks,), computed, None)


def _cached(rid: str, new_blocks: list[int], computed: int) -> CachedRequestData:
    return CachedRequestData([rid], set(), [], {}, [(new_blocks,)], [computed], [0])


PROMPT = list(range(100, 170))  # 70 tokens: three blocks


def test_a_whole_prompt_is_saved_in_its_prefill_step(configs):
    side = SchedulerSide(configs["kv_both"])
    request = _request("p1", PROMPT, {"do_remote_decode": True, "remote_engine_id": None})
    side.on_new_request(request)
    assert side.matched_tokens(request, 0) == (0, False)  # a prefill request loads nothing
    (save,) = side.build_meta(scheduler_output([_new(request, [4, 9, 2])], scheduled={"p1": 70})).saves
    assert (save.req_id, save.block_ids, save.token_ids) == ("p1", [4, 9, 2], PROMPT)
    params = side.finished(request)
    assert params == decode_params(save.key, 70)
    assert side.finished(request) is None  # once


def test_a_chunked_prompt_is_saved_when_its_last_chunk_is_scheduled(configs):
    side = SchedulerSide(configs["kv_both"])
    request = _request("p2", PROMPT, {"do_remote_decode": True})
    side.on_new_request(request)
    assert side.build_meta(scheduler_output([_new(request, [4])], scheduled={"p2": 32})).saves == []
    assert side.build_meta(scheduler_output(cached=_cached("p2", [7], 32), scheduled={"p2": 32})).saves == []
    (save,) = side.build_meta(scheduler_output(cached=_cached("p2", [8], 64), scheduled={"p2": 6})).saves
    assert save.block_ids == [4, 7, 8]
    assert side.build_meta(scheduler_output(cached=_cached("p2", [], 70), scheduled={"p2": 1})).saves == []


def test_a_request_aborted_before_its_prompt_is_done_returns_no_params(configs):
    side = SchedulerSide(configs["kv_both"])
    request = _request("p3", PROMPT, {"do_remote_decode": True})
    side.on_new_request(request)
    side.build_meta(scheduler_output([_new(request, [4])], scheduled={"p3": 32}))
    assert side.finished(request) is None


def test_a_decode_request_loads_its_prompt_past_the_local_hit_once(configs):
    side = SchedulerSide(configs["kv_both"])
    request = _request("d1", PROMPT, decode_params("ab" * 16, 70))
    assert side.matched_tokens(request, 64) == (6, True)  # two blocks cached here
    side.after_alloc(request, _blocks(3, 5, 11), 6)
    side.after_alloc(request, _blocks(3, 5, 11), 0)  # vLLM's second call after the load
    (load,) = side.build_meta(scheduler_output()).loads
    assert load == LoadJob("d1", "ab" * 16, None, [3, 5, 11], 2, PROMPT)
    # after a failed load with kv_load_failure_policy recompute, vLLM asks again
    assert side.matched_tokens(request, 0) == (0, False)
    side.finished(request)
    assert side.matched_tokens(request, 0) == (70, True)  # a new request of that id


def test_payloads_no_load_will_take_are_deleted_at_once(model_dirs, tmp_path):
    """Rather than left in the payload folder (memory, in /dev/shm) until ttl_s."""
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(_vllm_config(model_dirs["llama"], extra={"path": str(tmp_path)}))

    def payload_file(key: str):
        path = tmp_path / f"{key}.safetensors"
        path.write_bytes(b"kv")  # what the prefill server's worker wrote
        return path

    # a prefill request aborted after its save (the client went away)
    prefill = _request("p5", PROMPT, {"do_remote_decode": True})
    side.on_new_request(prefill)
    (save,) = side.build_meta(scheduler_output([_new(prefill, [4, 9, 2])],
                                               scheduled={"p5": 70})).saves
    saved = payload_file(save.key)
    prefill.status = RequestStatus.FINISHED_ABORTED
    assert side.finished(prefill) is None and not saved.exists()
    # a decode request that ended while it waited, before its blocks were allocated
    waiting = _request("d6", PROMPT, decode_params("ab" * 16, 70))
    left = payload_file("ab" * 16)
    assert side.matched_tokens(waiting, 0) == (70, True)
    side.finished(waiting)
    assert not left.exists()
    # vLLM dropped the external hit (it computes the prompt itself): no load comes
    dropped = _request("d7", PROMPT, decode_params("cd" * 16, 70))
    unused = payload_file("cd" * 16)
    assert side.matched_tokens(dropped, 0) == (70, True)
    side.after_alloc(dropped, _blocks(3, 5, 11), 0)
    assert side.build_meta(scheduler_output()).loads == [] and not unused.exists()
    # a planned load: the worker reads and then deletes the payload, the scheduler never
    loading = _request("d8", PROMPT, decode_params("ef" * 16, 70))
    kept = payload_file("ef" * 16)
    assert side.matched_tokens(loading, 0) == (70, True)
    side.after_alloc(loading, _blocks(3, 5, 11), 70)
    side.finished(loading)
    assert kept.exists()


@pytest.mark.parametrize("params, reason, kept", [
    ({"do_remote_prefill": True, "remote_block_ids": [1, 2]}, "no neuron_kv object", None),
    (decode_params("../../etc/passwd", 70), "is not 32 lowercase hex digits", None),
    # the rest is wrong, the key is not: kept, so the worker deletes the payload
    (decode_params("ab" * 16, 69), "num_tokens=69 is not this request's prompt length 70",
     "ab" * 16),
])
def test_params_that_cannot_name_a_payload_become_a_failed_load(configs, params, reason, kept):
    side = SchedulerSide(configs["kv_both"])
    request = _request("d2", PROMPT, params)
    assert side.matched_tokens(request, 0) == (70, True)
    side.after_alloc(request, _blocks(3, 5, 11), 70)
    (load,) = side.build_meta(scheduler_output()).loads
    assert reason in load.error and load.key == kept


def test_roles_limit_what_a_server_does(configs):
    producer = SchedulerSide(configs["kv_producer"])
    consumer = SchedulerSide(configs["kv_consumer"])
    decode = _request("d3", PROMPT, decode_params("ab" * 16, 70))
    assert producer.matched_tokens(decode, 0) == (0, False)
    prefill = _request("p4", PROMPT, {"do_remote_decode": True})
    consumer.on_new_request(prefill)
    assert consumer.build_meta(scheduler_output([_new(prefill, [4, 9, 2])], scheduled={"p4": 70})).saves == []


def test_the_worker_side_reports_every_load_and_its_failures(model_dirs, tmp_path,
                                                              monkeypatch):
    """Load jobs whose payload is missing, not a regular file (a directory, a FIFO: never
    a blocked read) or whose params were unusable: logged, in finished_recving and in
    failed_recving (vLLM then applies kv_load_failure_policy), reported once; the
    backend's cache is left as it was, and what cannot be deleted is left in place."""
    import numpy as np

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.core.kv_transfer import KEY_ENV, transfer_options
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    monkeypatch.setenv(KEY_ENV, "k" * 32)
    extra = {"path": str(tmp_path / "kv")}
    config = _vllm_config(model_dirs["llama"], extra=extra)
    settings = settings_from_vllm_config(config)
    backend = open_backend(settings, model_dirs["llama"], str(tmp_path / "cache"))
    worker = WorkerSide(config, transfer_options(extra))
    worker.bind(backend, settings)
    (tmp_path / "kv" / f"{'ef' * 16}.safetensors").mkdir()
    os.mkfifo(tmp_path / "kv" / f"{'01' * 16}.safetensors")
    before = backend.read_kv_blocks(np.array([3, 5, 11])).clone()
    worker.load([LoadJob("d4", "cd" * 16, None, [3, 5, 11], 0, PROMPT),
                 LoadJob("d5", None, "bad params", [6], 0, PROMPT[:5]),
                 LoadJob("d6", "ef" * 16, None, [3, 5, 11], 0, PROMPT),
                 LoadJob("d7", "01" * 16, None, [3, 5, 11], 0, PROMPT)])
    results = worker.results()
    assert results.finished_recving == {"d4", "d5", "d6", "d7"}
    assert results.failed_recving == {"d4", "d5", "d6", "d7"}
    assert worker.results().finished_recving == set()
    assert backend.read_kv_blocks(np.array([3, 5, 11])).equal(before)
    assert (tmp_path / "kv" / f"{'ef' * 16}.safetensors").is_dir()  # not ours to remove
    # the payload folder removed under a running server (a tmpfs cleaner): the sweep
    # logs it, and the server goes on
    shutil.rmtree(tmp_path / "kv")
    worker.sweep()
    worker.close()


def test_jobs_carry_the_requests_adapter_and_cache_salt(configs):
    """What a payload is bound to (issue 39): the prefill's save and the decode's load
    name the request's LoRARequest and cache salt, as vLLM's prefix cache keys them."""
    from vllm.lora.request import LoRARequest

    side = SchedulerSide(configs["kv_both"])
    lora = LoRARequest("sql", 3, "/adapters/sql")
    prefill = Request("p9", PROMPT, SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), None, lora_request=lora,
        cache_salt="tenant-a")
    side.on_new_request(prefill)
    (save,) = side.build_meta(scheduler_output([_new(prefill, [4, 9, 2])],
                                               scheduled={"p9": 70})).saves
    assert (save.lora, save.cache_salt) == (lora, "tenant-a")
    decode = Request("d9", PROMPT, SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": decode_params("ab" * 16, 70)}), None, cache_salt="tenant-b")
    assert side.matched_tokens(decode, 0) == (70, True)
    side.after_alloc(decode, _blocks(3, 5, 11), 70)
    (load,) = side.build_meta(scheduler_output()).loads
    assert (load.lora, load.cache_salt) == (None, "tenant-b")
