"""Prints the half-width factors (x the sample SD s) of kvcore.sequential's intervals and their simulated error rates.

`python3 tools/sequential_table.py [PATHS]`: for schedules with looks at 3..last pairs (last = 5, 8, 16, 40), the
chosen boundary's half-width at n pairs over s beside Lai's t confidence sequence's, then, over PATHS null sequences
per schedule (default 100,000; a seed other than the calibration's), the share whose interval ever excluded the
true mean when looked at after every pair from the 3rd to the last: Gaussian values, t-distributed ones with 5
degrees of freedom (a robustness check: the calibration assumes Gaussian), and a fixed-n 95% t interval looked at
the same way. Vectorized over the same factors `t_confidence_sequence` uses.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcore.sequential import Looks, boundary_of, lai_factor  # noqa: E402

LASTS = (5, 8, 16, 40)
COUNTS = (3, 4, 5, 6, 8, 12, 16)
SEED = 7


def ever_missed(x: np.ndarray, factors: np.ndarray) -> float:
    """The share of rows (mean 0) whose interval mean +- factor(n) * s excluded 0 at some n = 3 .. columns."""
    n = np.arange(1, x.shape[1] + 1, dtype=float)[2:]
    total, squares = np.cumsum(x, axis=1)[:, 2:], np.cumsum(x * x, axis=1)[:, 2:]
    mean = total / n
    sd = np.sqrt(np.maximum(squares - n * mean * mean, 0.0) / (n - 1))
    return float(np.mean(np.any(np.abs(mean) > factors * sd, axis=1)))


def main() -> None:
    paths = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    boundaries = {last: boundary_of(Looks(last)) for last in LASTS}
    print("half-width / s at n pairs")
    print("looks      shape     lam    " + "".join(f"{f'n={n}':>7}" for n in COUNTS))
    for last, b in boundaries.items():
        cells = "".join(f"{b.factor(n):7.2f}" if n <= last else f"{'':>7}" for n in COUNTS)
        print(f"3..{last:<6} {b.shape:<9} {b.lam:5.2f}  {cells}")
    print(f"{'Lai (any n)':<26}" + "".join(f"{lai_factor(n):7.2f}" for n in COUNTS))
    print(f"{'fixed-n t':<26}" + "".join(f"{_t975(n) / math.sqrt(n):7.2f}" for n in COUNTS))
    print(f"\nshare of {paths:,} null sequences ever excluding the mean, looked at after every pair from the 3rd")
    print("looks      Gaussian   t (5 df)   fixed-n t, Gaussian")
    rng = np.random.default_rng(SEED)
    for last, b in boundaries.items():
        factors = np.array(b.factors)
        fixed = np.array([_t975(n) / math.sqrt(n) for n in range(3, last + 1)])
        gaussian = rng.standard_normal((paths, last))
        heavy = rng.standard_t(5, (paths, last))
        print(f"3..{last:<6} {ever_missed(gaussian, factors):9.4f}  {ever_missed(heavy, factors):9.4f}  "
              f"{ever_missed(gaussian, fixed):9.4f}")
    print(f"(one standard error at 5%: {math.sqrt(0.05 * 0.95 / paths):.4f})")


def _t975(n: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1))


if __name__ == "__main__":
    main()
