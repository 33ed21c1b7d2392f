"""The model loaders kvgate measures and serves with, by name, and how each reads: facts the config, the
gates and the report share, torch-free (the loaders themselves are cache_impl/loaders.py)."""

LOADERS = ("safetensors", "runai_streamer", "fastsafetensors")
# These read with O_DIRECT where the filesystem takes it: the page cache never serves them, so a
# load right after another is as cold as the first (the mmap'd `safetensors` is served by it).
READS_WITH_O_DIRECT = frozenset({"runai_streamer", "fastsafetensors"})
