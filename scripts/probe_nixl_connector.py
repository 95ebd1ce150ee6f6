"""Can vLLM's NixlConnector run on the Neuron platform? Builds its scheduler side and its
worker side the way vLLM's engine and worker do, with this plugin's platform active, and
prints how far each gets (docs/configuration/disaggregation.md).

Needs the `nixl` package beside vLLM: `pip install --no-deps nixl==1.5.1
nixl-cu13==1.5.1` (a plain `pip install nixl` replaces the CPU torch with a CUDA one).
The plugin refuses NixlConnector before start-up, so the probe sets it on the resolved
config afterwards, as if it had been admitted.

    python scripts/probe_nixl_connector.py --model models/tiny-llama
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import KVCacheConfig

    print(f"platform {type(current_platform).__name__}, device_type {current_platform.device_type}")
    config = EngineArgs(
        model=str(args.model), dtype="float32", max_model_len=512, max_num_seqs=4,
        enable_prefix_caching=True,
    ).create_engine_config()  # fmt: skip
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"
    )
    blocks = config.cache_config.num_gpu_blocks_override or 0
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29555", 0, "gloo")
        initialize_model_parallel(1, 1)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            try:
                NixlConnector(config, role, KVCacheConfig(blocks, [], []))
                print(f"{role.name}: constructed")
            except Exception as exc:  # the finding is the exception and where it arose
                where = traceback.extract_tb(exc.__traceback__)[-1]
                print(
                    f"{role.name}: {type(exc).__name__}: {exc} "
                    f"({Path(where.filename).name} line {where.lineno}: {where.line})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
