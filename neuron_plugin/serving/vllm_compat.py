"""Where the contracts of vLLM 0.32 and 0.33 differ for this plugin, and how it adapts.

- The grammar bitmask's rows (`GrammarOutput.grammar_bitmask`). vLLM 0.32 sends one row
  per scheduled position of each structured-output request, 1 + its scheduled drafts
  (`StructuredOutputManager.grammar_bitmask`, `v1/structured_output/__init__.py`); 0.33
  gives every request a block of `num_speculative_tokens + 1` rows, whatever was
  scheduled (`mask_stride` there; `apply_grammar_bitmask` in
  `v1/structured_output/utils.py` recovers it as rows // requests).
  `first_bitmask_rows` finds each request's first row in either layout.
- 0.33 made `AsyncModelRunnerOutput.get_kv_connector_output` abstract (a failed step's
  KV-connector output is salvaged through it); `serving.steps.AsyncStepOutput` implements
  it, and 0.32 never calls it.

Everything else the plugin uses is the same in both releases (compared file by file:
the worker, model-runner output, sampler, scheduler output, KV-connector and platform
interfaces).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import vllm
from packaging.version import Version

VLLM_RELEASE = Version(vllm.__version__).release[:2]
FIXED_BITMASK_BLOCKS = VLLM_RELEASE >= (0, 33)


def first_bitmask_rows(
    request_ids: Sequence[str],
    scheduled_drafts: Mapping[str, Sequence[int]],
    num_rows: int,
    fixed_blocks: bool = FIXED_BITMASK_BLOCKS,
) -> np.ndarray:
    """The row of each structured-output request's first position in a grammar bitmask
    of `num_rows` rows (see the module docstring for the two layouts)."""
    count = len(request_ids)
    if fixed_blocks:
        return np.arange(count, dtype=np.int64) * (num_rows // count)
    rows_per_request = [1 + len(scheduled_drafts.get(r, ())) for r in request_ids]
    return np.concatenate([[0], np.cumsum(rows_per_request[:-1], dtype=np.int64)])
