"""gates.yaml's fault schedule (`g4.faults`): each fault injected into the candidate's cache during the soak,
through kvgate's admin routes (workloads/probes/faults.py). Composed by gates/config.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from cache_impl.cache.faults import BLOCK_FAULTS, FAULT_LIMITS, IO_FAULTS
from kvcore.settings import Float, StrictModel

SCHEDULED_FAULTS = BLOCK_FAULTS + IO_FAULTS
if TYPE_CHECKING:
    FaultKind = str                          # the checker cannot read a Literal built from a tuple
else:
    FaultKind = Literal[SCHEDULED_FAULTS]    # one of SCHEDULED_FAULTS, checked by pydantic


class FaultSpec(StrictModel):
    """A fault injected into the candidate's cache during the soak (kvgate's: embedded, or its connector in vLLM).

    Stored-block faults damage a disk block of the first consistency probe's prompt and evict
    the upper tiers, so the next probe must load it; I/O faults are armed for `duration_s`.
    """

    kind: FaultKind
    at_s: Float = Field(ge=0, description="seconds after the soak's start")
    duration_s: Float = Field(default=10, gt=0, le=FAULT_LIMITS["duration_s"],
                              description="I/O faults: how long the fault stays armed")
    delay_ms: Float = Field(default=50, gt=0, le=FAULT_LIMITS["delay_ms"],
                            description="slow_disk: added delay per block read or write")
