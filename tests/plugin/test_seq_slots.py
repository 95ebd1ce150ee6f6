"""Sequence slots (core.seq_slots): the lowest free cache line, so that a decode batch's
largest seq_id, which picks its batch bucket, stays low."""

from __future__ import annotations

import pytest

from neuron_plugin.core.seq_slots import SeqSlots


def test_lowest_free_slot_first_and_stable_per_request():
    slots = SeqSlots(4)
    assert [slots.assign(r) for r in "abc"] == [0, 1, 2]
    assert slots.assign("b") == 1  # a request keeps its slot
    slots.release("a")
    slots.release("c")
    assert slots.assign("d") == 0  # not the most recently freed (2), the lowest
    assert "b" in slots and slots["b"] == 1 and "a" not in slots
    slots.release("nobody")  # nothing held: nothing to do


def test_a_lone_request_after_a_busy_period_takes_slot_zero():
    slots = SeqSlots(32)
    for i in range(32):
        slots.assign(f"r{i}")
    for i in range(32):  # they finish in any order; the last to go held slot 17
        slots.release(f"r{(i + 18) % 32}")
    assert slots.assign("alone") == 0


def test_more_requests_than_slots_is_a_plugin_bug_named_as_such():
    slots = SeqSlots(1)
    slots.assign("a")
    with pytest.raises(RuntimeError, match="no free sequence slot for request b"):
        slots.assign("b")
