"""The embedded model's weights: from the seed, or from a safetensors directory with a chosen loader.

`export_weights` writes a seeded model's parameters as a checkpoint directory the way models ship
(shards, `model.safetensors.index.json`, the checksum sidecar), with the preset and its ModelArgs
in the metadata, so that a directory names the model it holds. `load_weights` builds the preset's
model without initialising it (on the meta device, then placed), checks every tensor's name, shape
and dtype against it, loads with one of `cache_impl.weights.loaders.LOADERS` straight into the parameters,
and verifies each tensor against the sidecar. The cache fingerprint's weights digest is then taken
from the loaded parameters, so KV cached under other weights is unreachable.

Either way the result carries a `WeightsLoad`: where the weights came from, how long they took by
phase, and when they were ready (epoch seconds), for the server's start line and /health.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from cache_impl.engine.hf_export import EXPORTED_FILES
from cache_impl.engine.model import PRESETS, ModelArgs, Transformer, build_model
from cache_impl.weights.loaders import DEFAULT_CONCURRENCY, check_destinations, load_checkpoint, verify_loaded
from cache_impl.weights.safetensors_dir import (
    CHECKSUMS_NAME,
    INDEX_NAME,
    CheckpointFormatError,
    SafetensorsDir,
    read_safetensors_dir,
    write_safetensors_dir,
)

PRESET_KEY = "kvgate.preset"
MODEL_ARGS_KEY = "kvgate.model_args"
SEED_KEY = "kvgate.seed"


@dataclass(frozen=True)
class WeightsLoad:
    """How the weights got into the model: `source` is "seed N" or the directory."""

    source: str
    preset: str
    seconds: float
    finished_at: float                        # epoch seconds: the parameters hold the weights, checked
    loader: Optional[str] = None
    nbytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    folded: dict[str, str] = field(default_factory=dict)
    device_read_bytes: int = 0
    cold: Optional[bool] = None
    verify_seconds: float = 0.0
    verified_against: Optional[str] = None
    missing: tuple[str, ...] = ()             # what verifies a load that the directory lacks (`unverifiable`)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One phrase for the start line; it says when the weights could not be verified."""
        if self.loader is None:
            return f"weights from {self.source} ({self.seconds:.2f} s)"
        phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.phases.items() if name not in self.folded)
        lacking = " and no ".join(self.missing)
        unverified = (f", not fully verified: {self.source} has no {lacking} (--require-checksums refuses it)"
                      if self.missing else "")
        return (f"weights from {self.source} via {self.loader} ({self.nbytes / 2**20:.1f} MiB in {self.seconds:.2f} s: "
                f"{phases} s{'' if self.cold else ', warm'}){unverified}")


def model_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The parameters a checkpoint holds, by name (the rope tables are computed, not stored)."""
    return dict(model.state_dict())


def export_weights(directory: Path, preset: str, seed: int, shard_bytes: int, overwrite: bool = False,
                   progress=None) -> SafetensorsDir:
    """Write the seeded model's weights (`build_model(preset, seed)`) as a checkpoint directory."""
    model = build_model(preset, seed, torch.device("cpu"))
    tensors = model_tensors(model)
    metadata = {PRESET_KEY: preset, MODEL_ARGS_KEY: json.dumps(asdict(model.args), sort_keys=True), SEED_KEY: str(seed)}

    def sources():
        for name, tensor in sorted(tensors.items()):
            flat = tensor.detach().contiguous().reshape(-1)
            yield name, str(tensor.dtype), list(tensor.shape), flat.view(torch.uint8).numpy()

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # one format in a directory: a Hugging Face export's files are cleared (or refused) with kvgate's own
    return write_safetensors_dir(directory, sources(), shard_bytes, progress, metadata, total, overwrite,
                                 also=EXPORTED_FILES)


def seeded_weights(preset: str, seed: int, device: torch.device) -> tuple[Transformer, WeightsLoad]:
    """The model with weights from the seed, timed like a load."""
    start = time.perf_counter()
    model = build_model(preset, seed, device)
    return model, WeightsLoad(f"seed {seed}", preset, time.perf_counter() - start, time.time())


def weights_preset(checkpoint: SafetensorsDir, asked: Optional[str]) -> str:
    """The preset a checkpoint holds (its metadata), checked against the one asked for; a directory without
    the metadata (not written by export-weights) takes the one asked for."""
    named = checkpoint.metadata.get(PRESET_KEY)
    if named is None:
        if asked is None:
            raise CheckpointFormatError(f"{checkpoint.path}: expected the preset in its metadata ({PRESET_KEY}, as "
                                        f"kvgate export-weights writes it) or a preset given, found neither")
        return asked
    if named not in PRESETS:
        raise CheckpointFormatError(f"{checkpoint.path}: metadata {PRESET_KEY}: expected one of {', '.join(PRESETS)}, "
                                    f"found {named!r}")
    if asked is not None and asked != named:
        raise CheckpointFormatError(f"{checkpoint.path}: expected weights of the preset {asked} (as asked), found "
                                    f"the preset {named} in its metadata")
    stored = checkpoint.metadata.get(MODEL_ARGS_KEY)
    if stored is None:
        return named
    try:
        stored_args = json.loads(stored)
    except ValueError:
        raise CheckpointFormatError(f"{checkpoint.path}: metadata {MODEL_ARGS_KEY}: expected the model's arguments "
                                    f"as JSON, found {stored[:80]!r}") from None
    if stored_args != json.loads(json.dumps(asdict(PRESETS[named]))):
        raise CheckpointFormatError(f"{checkpoint.path}: metadata {MODEL_ARGS_KEY}: expected the arguments of the "
                                    f"preset {named} ({asdict(PRESETS[named])}), found {stored}")
    return named


def unverifiable(checkpoint: SafetensorsDir) -> tuple[str, ...]:
    """What the checkpoint lacks of what verifies a load: the checksum sidecar (each tensor's bytes) and
    the index (every shard there), by file name."""
    lacking = {CHECKSUMS_NAME: checkpoint.checksums is None, INDEX_NAME: not (checkpoint.path / INDEX_NAME).is_file()}
    return tuple(sorted(name for name, lacks in lacking.items() if lacks))


def load_weights(directory: Path, asked_preset: Optional[str], loader: str, device: torch.device,
                 concurrency: int = DEFAULT_CONCURRENCY, require_checksums: bool = False,
                 ) -> tuple[Transformer, WeightsLoad]:
    """The preset's model with its weights loaded from `directory` by `loader`; CheckpointFormatError when
    the directory is malformed, does not match the preset, or a tensor's bytes differ from its checksum,
    and, with `require_checksums`, before any tensor is read when it lacks its sidecar or index."""
    checkpoint = read_safetensors_dir(directory)
    missing = unverifiable(checkpoint)
    if missing and require_checksums:
        raise CheckpointFormatError(f"--require-checksums: expected {checkpoint.path} to hold {CHECKSUMS_NAME} and "
                                    f"{INDEX_NAME}, found no {' and no '.join(missing)}")
    preset = weights_preset(checkpoint, asked_preset)
    model = _empty_model(PRESETS[preset], device)
    destinations = model_tensors(model)
    check_destinations(checkpoint, destinations, f"the preset {preset}")
    result = load_checkpoint(checkpoint, loader, device, destinations, concurrency)
    verify_start = time.perf_counter()
    against = verify_loaded(result, checkpoint) if checkpoint.checksums is not None else None
    verify_seconds = time.perf_counter() - verify_start
    model.setup_rope()
    finished_at = time.time()
    load = WeightsLoad(str(checkpoint.path), preset, result.seconds, finished_at, loader, result.nbytes,
                       result.phases, result.folded, result.device_read_bytes, result.cold, verify_seconds, against,
                       missing)
    return model, load


# the initialisers torch's modules call from their reset_parameters (torch.nn.init's in-place functions)
_INITIALISERS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                 "trunc_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def _initialisers_skipped() -> Iterator[None]:
    """torch.nn.init's initialisers as no-ops while modules whose every parameter is loaded next are built: their
    parameters stay torch.empty's. (Built on the meta device instead, then to_empty, torch runs its Python
    reference kernels, whose first use imports its compiler stack: ~2 s of a 6-s service start on a 2-core VM.)"""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _empty_model(args: ModelArgs, device: torch.device) -> Transformer:
    """The model's modules with parameters allocated on `device` but not initialised (they are loaded next)."""
    with torch.device(device), _initialisers_skipped():
        model = Transformer(args)
    return model.eval()
