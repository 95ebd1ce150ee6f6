"""Which NxDI release the double reproduces, from FAKE_NXDI_RELEASE (read at import).

- "2.27": NxDI 0.7 as measured in the field: the adapter passes tensor_capture_hook
  (read from kwargs), forward() has no such parameter.
- "2.28": NxDI 0.8 as published on GitHub: the adapter reads tensor_capture_hook as an
  undefined global; forward() has no such parameter; batch bucketing exists.
- "2.29": NxDI 0.9: forward() takes tensor_capture_hook.
- "fixed": a hypothetical release with every defect the plugin patches fixed (the
  adapter passes prefix-caching context lengths, a context equal to a bucket uses it).
"""

import os

RELEASES = ("2.27", "2.28", "2.29", "fixed")
RELEASE = os.environ.get("FAKE_NXDI_RELEASE", "2.27")
if RELEASE not in RELEASES:
    raise ValueError(f"FAKE_NXDI_RELEASE={RELEASE!r}; use one of {RELEASES}")

FORWARD_TAKES_HOOK = RELEASE in ("2.29", "fixed")
ADAPTER_HOOK_UNDEFINED = RELEASE == "2.28"
ADAPTER_PASSES_PREFIX_LENS = RELEASE == "fixed"
CTE_TAKES_EQUAL_BUCKET = RELEASE == "fixed"
HAS_BATCH_BUCKETING = RELEASE != "2.27"
