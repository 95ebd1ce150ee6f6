"""The NxD Inference backend, by concern: `models` (architecture -> NxDI class),
`neuron_config` (settings -> NeuronConfig), `arguments` (contract -> NxDI call
arguments), `nxdi` (the one NxDI import, patched), `cpu_mode` (NxDI's own CPU mode) and
`backend` (the `NxDBackend` itself). Only `nxdi` imports NxD Inference, and only when a
backend is built, so everything else (explain-config, doctor, tests) runs without it."""
