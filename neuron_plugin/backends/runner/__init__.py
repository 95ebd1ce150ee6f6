"""The backend in its own process, behind the NxD contract.

The Neuron SDK (torch 2.9, NxDI pinning transformers 4.5x) and current vLLM (torch 2.13,
transformers 5) cannot share a Python environment, so the backend can run in the SDK's
interpreter as a runner process (`server.py`) that the vLLM worker starts and drives
(`client.py`): JSON control messages on the runner's stdin/stdout, arrays through two
shared-memory arenas sized once from the settings (`protocol.py`). Nothing crosses as a
pickle. Nothing here imports vLLM.
"""
