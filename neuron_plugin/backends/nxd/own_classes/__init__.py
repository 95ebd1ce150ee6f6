"""What the plugin's own classes on NxDI's base classes share (families/gemma4,
families/qwen3_5): attention and MLP layers, the config.json loader, the refusals.
`refusals` imports no NxDI (compat reads it in vLLM's environment); the rest do."""
