"""Repeated rounds of a short measurement: at least min, then more while they fit the budget, at most max."""

from __future__ import annotations

from kvcore.sampling import RoundsConfig


def test_rounds_of_milliseconds_repeat_to_the_most_and_rounds_of_seconds_stop_at_the_least():
    rounds = RoundsConfig(min=3, max=15, budget_s=0.5)

    def taken(seconds_each: float, stalled: tuple[int, ...] = ()) -> int:
        spent: list[float] = []
        while rounds.more(spent):
            spent.append(0.5 if len(spent) in stalled else seconds_each)
        return len(spent)

    assert taken(0.005) == 15
    assert taken(0.1) == 5          # 5 x 0.1 fits 0.5 s, a sixth would not
    assert taken(2.0) == 3          # the least, whatever they take
    assert taken(0.015, stalled=(0, 5)) == 15      # stalled rounds (vLLM's 500 ms) do not spend what more are for


def test_a_plain_number_is_exactly_that_many_rounds_and_min_alone_sets_max():
    assert [RoundsConfig.model_validate(2).more([0.0] * n) for n in range(4)] == [True, True, False, False]
    assert RoundsConfig.model_validate({"min": 4, "budget_s": 9}).max == 4
