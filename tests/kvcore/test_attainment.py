import random

import pytest

from kvcore.attainment import MEETS, MISSES, UNDECIDED, MissShare, requests_to_decide_when_all_meet


def test_a_load_where_every_request_meets_is_decided_after_34_and_one_where_all_miss_after_5():
    assert requests_to_decide_when_all_meet(0.10) == 34
    assert MissShare(33, 0, 0.10).decision() == UNDECIDED and MissShare(34, 0, 0.10).decision() == MEETS
    assert MissShare(4, 4, 0.10).decision() == UNDECIDED and MissShare(5, 5, 0.10).decision() == MISSES
    # near the allowance nothing is decided from a hundred requests; far from it, it is
    assert MissShare(100, 9, 0.10).decision() == UNDECIDED
    assert MissShare(100, 30, 0.10).decision() == MISSES and MissShare(200, 4, 0.10).decision() == MEETS


def test_the_interval_holds_the_share_and_excludes_the_allowance_exactly_when_decided():
    for n, s in [(10, 0), (40, 4), (100, 20), (300, 12), (50, 50)]:
        share = MissShare(n, s, 0.10)
        low, high = share.interval()
        assert low <= s / n <= high
        assert (share.decision() != UNDECIDED) == (not low <= 0.10 <= high)
    assert MissShare(0, 0, 0.10).interval() == (0.0, 1.0)


@pytest.mark.parametrize("p, wrong", [(0.10, MEETS), (0.16, MEETS), (0.06, MISSES)])
def test_looking_after_every_request_decides_wrongly_in_at_most_alpha_of_paths(p, wrong):
    rng, paths, wrongs = random.Random(1970), 600, 0
    for _ in range(paths):
        misses = 0
        for n in range(1, 401):
            misses += rng.random() < p
            decision = MissShare(n, misses, 0.10).decision()
            if decision != UNDECIDED:
                wrongs += decision == wrong
                break
    assert wrongs / paths <= 0.05 + 0.02     # alpha, and three binomial SDs of 600 paths


def test_a_share_outside_its_range_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="misses: expected 0..3"):
        MissShare(3, 4, 0.1)
    with pytest.raises(ValueError, match="allowed: expected a share in"):
        MissShare(3, 1, 1.0)
