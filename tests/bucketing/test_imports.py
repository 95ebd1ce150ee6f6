"""bucketing stays a plain library: no vLLM, torch, NxDI, plugin or eager matplotlib."""

import subprocess
import sys

FORBIDDEN = ("vllm", "torch", "neuronx_distributed_inference", "neuron_plugin", "matplotlib")


def test_importing_every_module_loads_nothing_forbidden():
    code = ("import sys, bucketing.cli, bucketing.cost, bucketing.files, bucketing.fit, "
            "bucketing.grids, bucketing.plot, bucketing.report, bucketing.trace, "
            "bucketing.tune, bucketing.workload\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
