"""models/layer_boundary_marker.py (NxDI 0.9 ef2731e lines 1-60): ModuleMarkerStartWrapper /
ModuleMarkerEndWrapper, modules whose forward is a Neuron custom call
(`xla_hlo_call` with AwsNeuronModuleMarkerStartForward / EndForward) that returns its
inputs on a device and cannot run anywhere else: called here, as on a CPU, it raises."""

from torch import nn


class _Marker(nn.Module):
    target = ""

    def forward(self, *args):
        raise NotImplementedError(
            f"{self.target} is a Neuron custom call (xla_hlo_call): it runs on a Neuron "
            f"device only")


class ModuleMarkerStartWrapper(_Marker):
    target = "AwsNeuronModuleMarkerStartForward"


class ModuleMarkerEndWrapper(_Marker):
    target = "AwsNeuronModuleMarkerEndForward"
