"""Test doubles at the NxD Inference boundary (see neuronx_distributed_inference/)."""
