"""`neuron-plugin quantize MODEL [vllm serve flags]`: write the quantized checkpoint a
configuration serves, ahead of serving.

The configuration is resolved exactly as `vllm serve MODEL [flags]` resolves it, so its
`override_neuron_config` quantization keys (`quantized: true`,
`quantized_checkpoints_path`, `quantization_type`, `quantization_dtype`,
`modules_to_not_convert`) say what to write and where. On the nxd backend NxDI's own
`save_quantized_state_dict` writes it (in the backend's environment, through the runner
when VLLM_NEURON_BACKEND_PYTHON is set); on the reference backend the plugin writes the
same layout (int8). `vllm serve` with the same flags then loads it.
"""

from __future__ import annotations

import argparse

from neuron_plugin import BACKEND_ENV, BACKENDS
from neuron_plugin.tools.serve_args import add_serve_command, engine_config_from_serve_args


def _options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quantize")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"backend whose quantizer writes the checkpoint (default: ${BACKEND_ENV}, else "
        f"what `vllm serve` with these flags would use, else nxd)",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_serve_command(
        subparsers,
        "quantize",
        run,
        _options,
        "write the quantized checkpoint of a `vllm serve` configuration "
        "(override_neuron_config quantized keys)",
    )


def run(args: argparse.Namespace) -> int:
    from neuron_plugin.backends.loader import quantize_configuration
    from neuron_plugin.core.checkpoint import safetensors_shapes
    from neuron_plugin.core.memory import DTYPE_BYTES
    from neuron_plugin.core.quantization import check_output_folder, quantized_weight_bytes
    from neuron_plugin.core.settings import NeuronConfigError
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    _, vllm_config = engine_config_from_serve_args(args.argv, _options, prog=args.prog)
    settings = settings_from_vllm_config(vllm_config)
    quantization = settings.quantization
    if quantization is None:
        raise NeuronConfigError(
            "neuron-plugin quantize: the configuration is not quantized; pass "
            '--additional-config \'{"override_neuron_config": {"quantized": true, '
            '"quantized_checkpoints_path": "DIR", "quantization_type": '
            '"per_channel_symmetric"}}\' (the flags you serve with).'
        )
    model = vllm_config.model_config.model
    check_output_folder(quantization, model)
    written = quantize_configuration(settings, model)
    full, quantized = quantized_weight_bytes(
        safetensors_shapes(model), quantization, DTYPE_BYTES[settings.dtype]
    )
    print(
        f"wrote the {quantization.describe()} checkpoint of {model} to {written['path']} "
        f"({settings.backend} backend, {int(written['bytes']) / 2**20:.1f} MiB on disk); "
        f"weights on the device: {quantized / 2**20:.1f} MiB instead of "
        f"{full / 2**20:.1f} MiB at {settings.dtype}. Serve it with the same flags."
    )
    return 0
