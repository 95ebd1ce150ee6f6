"""Llama: the decoder every other family is described against."""

from neuron_plugin.backends.reference.architecture import Architecture

ARCHITECTURES = {"LlamaForCausalLM": Architecture("llama", windowed=False)}
