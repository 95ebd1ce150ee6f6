"""Bucket grids for Neuron graphs: generators, one fit rule, cost models, tuning from
real traffic, bucket-set files and the ``neuron-buckets`` CLI.

Imports neither vLLM, torch, NxDI nor ``neuron_plugin`` (numpy and pyyaml only;
matplotlib lazily for plots), so it works as a library and a CLI anywhere. See
docs/reference/neuron-buckets.md.
"""
