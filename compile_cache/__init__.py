"""Content-addressed cache of compiled Neuron artifacts, on a local directory or S3.

A configuration is described by a canonical manifest (`manifest.make_manifest`); its
digest is the cache key. `cache.CompileCache` looks entries up (checking the record's
Ed25519 signature against trusted keys, `signing`, then every file),
builds missing ones once per key across processes and hosts, and publishes them
atomically. This package imports neither vLLM, torch, NxDI nor `neuron_plugin`.
"""
