"""Test double of NxD Inference (neuronx-distributed-inference) at the plugin's seam.

It reproduces what the plugin and its patches meet in NxDI, release by release
(`_release`, FAKE_NXDI_RELEASE: 0.7, 0.8, 0.9, 0.9-ef2731e), never more leniently:
every module's docstring names the NxDI file and functions it follows. In short:
NeuronConfig and autobucketing decide the compiled graphs; ModelWrapper chooses the
bucket, pads, completes and sorts batches as NxDI does; neuronx-distributed's router
(`_nxd_runtime`) accepts only the exact input shapes of a compiled graph; the graphs
take the last token at argmax(position_ids), read the block KV cache through cropped
block tables and sample on device with NxDI's Sampler. With speculation NxDI builds a
speculation model (n-gram verification) or a fused draft-and-target model instead of
the token-generation model, and their graphs verify drafts as NxDI's do (_nxd_runtime). The "device" stores token ids
as its KV cache and answers with logits that peak at a function of exactly the keys a
query attends, so a wrong slot, line, block, prefix, pad or last-token choice shows.
"""

# NxDI's package exports its version (__init__.py: `from ._version import __version__`;
# _version.py "0.8.0" at cd3abf3, "0.9.0" at ef2731e).
from neuronx_distributed_inference._release import VERSION as __version__  # noqa: E402,F401
