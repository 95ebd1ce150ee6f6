"""The NeuronCore arithmetic of data parallelism: which cores each engine of a host gets,
and the refusal, with the arithmetic and the fix, when TP x DP exceeds what is visible."""

from __future__ import annotations

import pytest

from neuron_plugin import neuron_devices
from neuron_plugin.core.instances import (
    INSTANCE_TYPES,
    VISIBLE_CORES_ENV,
    assign_rank_cores,
    core_slices,
    format_core_list,
    rank_cores,
    visible_core_ids,
)
from neuron_plugin.core.settings import NeuronConfigError


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


def test_assigning_a_rank_narrows_the_variable_the_runtime_reads():
    environ = {VISIBLE_CORES_ENV: "4-7"}
    assert assign_rank_cores(2, 1, environ) == "6-7"
    assert environ == {VISIBLE_CORES_ENV: "6-7"}
    environ = {VISIBLE_CORES_ENV: "2,3,5,7"}
    assert assign_rank_cores(1, 2, environ) == "5"
    with pytest.raises(NeuronConfigError, match="data-parallel rank 4"):
        assign_rank_cores(1, 4, {VISIBLE_CORES_ENV: "2,3,5,7"})


@pytest.mark.skipif(bool(neuron_devices()), reason="this host has Neuron devices")
def test_nothing_is_assigned_where_no_core_is_visible():
    environ: dict[str, str] = {}
    assert assign_rank_cores(1, 0, environ) is None
    assert environ == {}
