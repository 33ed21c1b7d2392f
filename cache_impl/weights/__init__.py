"""Model weights on storage: the safetensors directory format, the loaders, reads at the storage's best (O_DIRECT)."""
