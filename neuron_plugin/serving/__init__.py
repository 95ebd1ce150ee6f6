"""The engine-side serving path (imports vLLM): settings written into vLLM's config,
the worker, the model runner and its observers."""
