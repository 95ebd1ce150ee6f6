"""An NxDI contrib model package, registered through the neuron_plugin.nxdi_models
entry-point group by the tests (a dist-info written at test time)."""
