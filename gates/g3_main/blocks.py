"""G3's sampling of alternating blocks: pairs until their interval (kvcore/block_pairs.py) decides every rule of
the level, and the A/A check of an interval.

How it works: docs/methods/side-by-side.md (gates/g3_main/blocks.py).
"""

from __future__ import annotations

from typing import Callable, Optional

from kvcore.block_pairs import level_looks, pair_figures
from kvcore.rules import Rule
from kvcore.sequential import sample_until_decided
from workloads.loadgen.blocks import LevelSampling

JUDGED_PER_LEVEL = {True: ("ttft_p50_reduction", "throughput_gain"), False: ("ttft_p50_reduction",)}


def level_sampler(rule_of: Callable[[str], Optional[Rule]], closed_loop: bool) -> Callable[[LevelSampling], dict]:
    """A `SweepSettings.sample_level`: pairs until the interval decides every rule G3 judges at the level
    (`kvcore.sequential.sample_until_decided`), or the most blocks, or the level's time budget."""
    judged = [(metric, rule) for metric in JUDGED_PER_LEVEL[closed_loop] if (rule := rule_of(metric)) is not None]

    def sample(sampling: LevelSampling) -> dict:
        looks = level_looks(sampling.maximum)

        def intervals() -> list:
            figures = pair_figures(sampling.pairs, looks)
            return [figures.interval_of(metric) for metric, _ in judged]

        stopping = sample_until_decided(sampling.take_pair, intervals, [rule for _, rule in judged],
                                        sampling.minimum, sampling.maximum, sampling.budget_s)
        return stopping.to_dict()

    return sample


def excludes_null(interval: Optional[tuple[float, float]]) -> bool:
    """Whether an interval of a reduction or a gain excludes 0 (in A/A: a false decision)."""
    return interval is not None and (interval[0] > 0.0 or interval[1] < 0.0)
