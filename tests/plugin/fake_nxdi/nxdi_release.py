"""Put one release of the NxDI double on sys.path for a test and take it away after."""

from __future__ import annotations

import sys
from pathlib import Path

from neuron_plugin.patches import NxDIModules

ROOT = Path(__file__).parent
PACKAGE = "neuronx_distributed_inference"


def purge() -> None:
    """Forget every imported module of the double (releases differ at import time)."""
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")
                 or n == "fake_contrib" or n.startswith("fake_contrib.")]:
        del sys.modules[name]


def load_release(release: str, monkeypatch) -> NxDIModules:
    """Import the double as `release` (see _release.py); pair with purge() after."""
    monkeypatch.setenv("FAKE_NXDI_RELEASE", release)
    monkeypatch.syspath_prepend(str(ROOT))
    purge()
    from neuronx_distributed_inference.models import model_base, model_wrapper
    from neuronx_distributed_inference.modules.attention import attention_base
    from neuronx_distributed_inference.modules.generation import sampling
    from neuronx_distributed_inference.utils import hf_adapter

    gemma3 = None
    if release != "0.7":  # models/gemma3 ships from 0.8 (listed in MODEL_TYPES from 0.9)
        from neuronx_distributed_inference.models.gemma3 import modeling_gemma3 as gemma3
    return NxDIModules(model_base, model_wrapper, hf_adapter, attention_base, sampling, gemma3)
