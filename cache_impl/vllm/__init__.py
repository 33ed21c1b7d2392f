"""kvgate's cache inside vLLM: the KV connector, its KV layout, the sidecar serving its admin routes."""
