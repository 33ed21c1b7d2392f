"""Each model loader as a test parameter, skipped (saying why) where it does not run on this machine."""

from __future__ import annotations

import pytest

from cache_impl.weights.loaders import LOADERS, loader_unavailable


def available(loader: str):
    """A loader as a parameter, skipped (saying why) where it does not run."""
    reason = loader_unavailable(loader)
    return pytest.param(loader, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


EACH_LOADER = [available(loader) for loader in LOADERS]
