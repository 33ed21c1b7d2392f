"""The model loaders kvgate measures and serves with, by name, and how each reads: facts the config, the
gates and the report share, torch-free (the loaders themselves are cache_impl/weights/loaders.py)."""

from typing import Literal, get_args

LoaderName = Literal["kvgate", "safetensors", "runai_streamer", "fastsafetensors"]
LOADERS: tuple[LoaderName, ...] = get_args(LoaderName)
# kvgate's own loader (the storage's best path: parallel O_DIRECT reads into huge pages); the others are the field's
KVGATE_LOADER: LoaderName = "kvgate"
FIELD_LOADERS = tuple(name for name in LOADERS if name != KVGATE_LOADER)
# These read with O_DIRECT where the filesystem takes it: the page cache never serves them, so a
# load right after another is as cold as the first (the mmap'd `safetensors` is served by it).
READS_WITH_O_DIRECT = frozenset({"kvgate", "runai_streamer", "fastsafetensors"})
