"""The one place the plugin adapts between vLLM 0.32 and 0.33 (`serving.vllm_compat`):
both layouts, whichever vLLM is installed. Which one a real engine sends is checked end
to end on each release (structured outputs with n-gram speculation in
tests/e2e/test_deployment_build.py)."""

from __future__ import annotations

import pytest

from neuron_plugin.serving.vllm_compat import first_bitmask_rows

IDS = ["a", "b", "c"]
DRAFTS = {"a": [7, 8], "c": [9]}  # b has no drafts this step


def test_vllm_032_rows_follow_each_requests_scheduled_drafts():
    # rows: a a a | b | c c
    rows = first_bitmask_rows(IDS, DRAFTS, num_rows=6, fixed_blocks=False)
    assert rows.tolist() == [0, 3, 4]


def test_vllm_033_gives_every_request_a_block_of_the_speculative_length():
    # num_speculative_tokens 3: rows a a a a | b b b b | c c c c, whatever was scheduled
    rows = first_bitmask_rows(IDS, DRAFTS, num_rows=12, fixed_blocks=True)
    assert rows.tolist() == [0, 4, 8]


@pytest.mark.parametrize("fixed", [False, True])
def test_one_row_per_request_is_the_identity(fixed):
    assert first_bitmask_rows(IDS, {}, num_rows=3, fixed_blocks=fixed).tolist() == [0, 1, 2]
