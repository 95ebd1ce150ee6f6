"""Prefill/decode disaggregation: the plugin's KV connector for vLLM (`connector`), the
payload file a prefill server writes and a decode server reads (`payload`), and the
per-request `kv_transfer_params` between them (`params`). `payload` and `params` import
no vLLM."""
