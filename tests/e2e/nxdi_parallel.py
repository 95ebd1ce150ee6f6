"""For the probes that run under an interpreter with NxD Inference: the process group
and model-parallel state NxDI's modules are built under, as NxDI's to_cpu starts them
for one process (application_base.py to_cpu, ef2731e lines 561-595), on a free port."""

from __future__ import annotations

import os
import socket

import torch


def model_parallel_of_one() -> None:
    from neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    torch.distributed.init_process_group("gloo", world_size=1, rank=0)
    initialize_model_parallel(tensor_model_parallel_size=1, skip_collective_init=True)
