"""Qwen3 on NxDI: equal in every feature its CPU mode runs."""

from neuron_plugin.backends.nxd.families import NxDFamily
from neuron_plugin.backends.nxd.support import COMMON, by_release

FAMILY = NxDFamily(support=by_release(COMMON))
