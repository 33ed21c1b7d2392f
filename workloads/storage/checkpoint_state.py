"""A rank's training state as tensors: built from the spec's seed, allocated fresh for a restore, compared.

The values are random normals (incompressible, as real weights and moments are), each tensor from
its own generator seeded by the spec's seed and the tensor's name, so any process rebuilds any
rank's state bit for bit.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from workloads.storage.checkpoint import CheckpointSpec, TensorPlan

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _place(state: dict, path: tuple[str, ...], tensor: torch.Tensor) -> None:
    node = state
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = tensor


def _get(state: dict, path: tuple[str, ...]) -> torch.Tensor:
    node: dict | torch.Tensor = state
    for key in path:
        if not isinstance(node, dict):
            raise TypeError(f"{'.'.join(path)}: expected nested dicts down to a tensor, found a "
                            f"{type(node).__name__} at {key!r}")
        node = node[key]
    if not isinstance(node, torch.Tensor):
        raise TypeError(f"{'.'.join(path)}: expected a tensor, found {type(node).__name__}")
    return node


def _values(plan: TensorPlan, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(plan.fqn.encode()))
    return torch.randn(plan.numel, generator=generator, dtype=torch.float32).to(DTYPES[plan.dtype])


def build_state(spec: CheckpointSpec, rank: int, device: torch.device) -> dict:
    """The rank's state dict: {"model": {block: {"weight": bf16}}, "optimizer": {block: {field: fp32}}}."""
    state: dict = {}
    for plan in spec.rank_tensors(rank):
        _place(state, plan.path, _values(plan, spec.seed).to(device))
    return state


def empty_state(spec: CheckpointSpec, rank: int, device: torch.device) -> dict:
    """Fresh, uninitialised tensors of the rank's shapes and dtypes (a restore's destination)."""
    state: dict = {}
    for plan in spec.rank_tensors(rank):
        _place(state, plan.path, torch.empty(plan.numel, dtype=DTYPES[plan.dtype], device=device))
    return state


def differences(spec: CheckpointSpec, rank: int, expected: dict, found: dict) -> list[str]:
    """Tensors whose bytes differ: 'optimizer.rank1_block0.exp_avg: 3 of 16777216 bytes differ'."""
    found_differences = []
    for plan in spec.rank_tensors(rank):
        message = _compare(plan, _get(expected, plan.path), _get(found, plan.path))
        if message:
            found_differences.append(message)
    return found_differences


def _compare(plan: TensorPlan, expected: torch.Tensor, found: torch.Tensor) -> Optional[str]:
    if found.dtype != expected.dtype or found.shape != expected.shape:
        return (f"{plan.fqn}: expected {expected.dtype} {tuple(expected.shape)}, "
                f"found {found.dtype} {tuple(found.shape)}")
    a, b = expected.view(torch.uint8), found.view(torch.uint8)
    if torch.equal(a, b):
        return None
    return f"{plan.fqn}: {int((a != b).sum())} of {a.numel()} bytes differ"
