"""The NeuronCore arithmetic of data parallelism: which cores each engine of a host gets,
and the refusal, with the arithmetic and the fix, when TP x DP exceeds what is visible."""

from __future__ import annotations

import dataclasses

import pytest

from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    VISIBLE_CORES_ENV,
    core_slices,
    format_core_list,
    rank_cores,
    visible_core_ids,
)
from neuron_plugin.backends.loader import _RUNTIME_ONLY
from neuron_plugin.core.settings import (
    EngineLimits,
    NeuronConfigError,
    NeuronSettings,
    resolve_settings,
)


def test_core_list_is_written_as_a_range_or_a_comma_list():
    assert format_core_list([4, 5]) == "4-5"
    assert format_core_list([3, 0, 1, 2]) == "0-3"
    assert format_core_list([7]) == "7"
    assert format_core_list([2, 5]) == "2,5"


def test_visible_core_ids_come_from_the_variable_or_the_devices():
    assert visible_core_ids({VISIBLE_CORES_ENV: "0,2,4-5"}, [], None) == (
        [0, 2, 4, 5], f"{VISIBLE_CORES_ENV}=0,2,4-5")
    inf2 = INSTANCE_TYPES["inf2.48xlarge"]
    ids, source = visible_core_ids({}, [f"/dev/neuron{i}" for i in range(12)], inf2)
    assert ids == list(range(24)) and source == "12 device(s) of inf2.48xlarge"
    assert visible_core_ids({}, [], None)[0] is None


def test_an_inf2_48xlarge_holds_twelve_disjoint_tp2_engines():
    slices = core_slices(2, 12, list(range(24)), "24 cores")
    assert slices == [[2 * r, 2 * r + 1] for r in range(12)]


def test_slices_follow_the_cores_the_user_made_visible():
    visible = [5, 6, 9, 10, 11]
    assert core_slices(2, 2, visible, "x") == [[5, 6], [9, 10]]
    assert core_slices(1, 3, visible, "x") == [[5], [6], [9]]
    assert rank_cores(2, 1, visible, "x") == [9, 10]


def test_too_many_engines_are_refused_with_the_arithmetic_and_the_fix():
    with pytest.raises(NeuronConfigError) as info:
        core_slices(2, 3, [0, 1, 2, 3], f"{VISIBLE_CORES_ENV}=0-3")
    message = str(info.value)
    assert ("--tensor-parallel-size 2 x --data-parallel-size 3 needs 6 NeuronCores "
            "(3 engine(s) of 2) but 4 are visible (NEURON_RT_VISIBLE_CORES=0-3)") in message
    assert "lower --data-parallel-size to at most 2" in message
    with pytest.raises(NeuronConfigError, match="lower --tensor-parallel-size to at most 2"):
        core_slices(4, 1, [0, 1], "x")


def test_a_rank_beyond_the_visible_cores_is_refused_naming_its_cores():
    with pytest.raises(NeuronConfigError) as info:
        rank_cores(2, 2, [0, 1, 2, 3], f"{VISIBLE_CORES_ENV}=0-3")
    assert ("data-parallel rank 2 needs NeuronCores 4 to 5 of the visible ones "
            "(--tensor-parallel-size 2 per engine) but only 4 are visible") in str(info.value)
    assert "lower --data-parallel-size to at most 2" in str(info.value)


def test_the_settings_give_each_engine_its_cores_once_for_all_ranks():
    """Decided with the rest of the settings, so an impossible TP x DP stops the server
    before any engine starts; not part of the compile-cache key (ranks share a compile)."""
    four = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                        enable_prefix_caching=False, enable_chunked_prefill=False,
                        max_num_batched_tokens=256, dtype="float32", tp_degree=2,
                        dp_degree=2)
    settings = resolve_settings(four, {}, backend="nxd", architecture="LlamaForCausalLM",
                                visible_cores=[4, 5, 6, 7],
                                cores_source=f"{VISIBLE_CORES_ENV}=4-7")
    assert settings.rank_cores == ((4, 5), (6, 7)) and settings.dp_degree == 2
    assert NeuronSettings.from_dict(settings.to_dict()) == settings
    assert {"rank_cores", "dp_degree"} <= _RUNTIME_ONLY
    with pytest.raises(NeuronConfigError, match="lower --data-parallel-size to at most 2"):
        resolve_settings(dataclasses.replace(four, dp_degree=3), {}, backend="nxd",
                         architecture="LlamaForCausalLM", visible_cores=[4, 5, 6, 7],
                         cores_source=f"{VISIBLE_CORES_ENV}=4-7")
    nowhere = resolve_settings(dataclasses.replace(four, tp_degree=1), {},
                               backend="reference", architecture="LlamaForCausalLM")
    assert nowhere.rank_cores == ()


@pytest.mark.parametrize("value,cores", [("4-7", [4, 5, 6, 7]), ("4-5,9", [4, 5, 9]),
                                         ("5,6,9", [5, 6, 9])])
def test_vllm_reads_the_visible_cores_as_the_runtime_does(monkeypatch, value, cores):
    """vLLM's data-parallel launcher maps each rank's devices through the platform
    (vllm/v1/engine/utils.py); a range would otherwise fail to parse there."""
    from vllm.v1.engine.utils import get_physical_gpu_ids_for_local_dp_rank

    from neuron_plugin.platform import NeuronPlatform

    monkeypatch.setenv(VISIBLE_CORES_ENV, value)
    assert [NeuronPlatform.device_id_to_physical_device_id(i)
            for i in range(len(cores))] == cores
    with pytest.raises(IndexError):
        NeuronPlatform.device_id_to_physical_device_id(len(cores))
    monkeypatch.setattr("vllm.v1.engine.utils.current_platform", NeuronPlatform)
    assert get_physical_gpu_ids_for_local_dp_rank(VISIBLE_CORES_ENV, 1, 1) == cores[1:2]
