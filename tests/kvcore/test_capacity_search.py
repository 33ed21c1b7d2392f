import math

import pytest

from kvcore.attainment import MEETS, MISSES, UNDECIDED
from kvcore.capacity import CapacitySearch, Probe, capacity_gain


def _search(truth: int, start: int = 1, most: int = 64, undecided_at: int = -1) -> CapacitySearch:
    """A search against a target whose capacity is `truth` (every probe decided right)."""
    search = CapacitySearch(start, most)
    while (load := search.next_load()) is not None:
        decision = UNDECIDED if load == undecided_at else MEETS if load <= truth else MISSES
        search.record(Probe(load, decision, 40, 0 if decision == MEETS else 40, (0.0, 0.1)))
    return search


@pytest.mark.parametrize("truth", [0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 31, 63])
def test_the_search_finds_the_capacity_exactly_ramping_then_bisecting(truth):
    search = _search(truth)
    assert search.closed and search.capacity == truth
    assert search.bounds() == (truth, truth)
    # ramp 1, 2, 4, ... to the first miss, then bisect: about 2 log2 of the capacity probes
    assert len(search.probes) <= 2 * math.ceil(math.log2(truth + 2)) + 1


def test_a_first_load_that_misses_bisects_down_and_a_capacity_above_the_most_stays_open():
    assert [p.load for p in _search(2, start=8).probes] == [8, 4, 2, 3]
    assert _search(2, start=8).capacity == 2
    top = _search(100, most=16)
    assert [p.load for p in top.probes] == [1, 2, 4, 8, 16] and not top.closed and top.capacity is None
    assert top.bounds() == (16, math.inf) and top.describe().startswith("between 16 and ? (met up to 16")


def test_an_undecided_probe_stops_the_search_with_its_bracket_open():
    search = _search(5, undecided_at=6)
    assert [p.load for p in search.probes] == [1, 2, 4, 8, 6] and search.next_load() is None
    assert not search.closed and search.bounds() == (4, 7)
    assert search.describe() == "between 4 and 7 (misses at 8; 5 probes, undecided at 6 (budget spent))"
    assert _search(4).describe() == "4 (meets at 4, misses at 5; 6 probes)"


def test_a_probe_at_another_load_than_the_searchs_next_is_refused():
    search = CapacitySearch()
    with pytest.raises(ValueError, match="probe load: expected 1"):
        search.record(Probe(2, MEETS, 40, 0, (0.0, 0.1)))


def test_the_capacity_gain_is_bounded_by_both_brackets():
    assert capacity_gain(_search(8), _search(4)) == (1.0, 1.0, 1.0)            # both closed: exact
    estimate, least, most = capacity_gain(_search(8), _search(5, undecided_at=6))
    assert estimate == 8 / 4 - 1 and least == 8 / 7 - 1 and most == 8 / 4 - 1
    estimate, least, most = capacity_gain(_search(100, most=16), _search(4))
    assert least == 16 / 4 - 1 and most == math.inf                             # open above: a least gain only
    assert capacity_gain(_search(4), _search(4)) == (0.0, 0.0, 0.0)            # A/A: no gain


def test_open_loop_loads_are_whole_steps_of_a_rate_and_the_bracket_closes_one_step_apart():
    search = CapacitySearch(0.5, 8.0, unit=0.25)
    while (load := search.next_load()) is not None:
        decision = MEETS if load <= 2.75 else MISSES
        search.record(Probe(load, decision, 40, 0 if decision == MEETS else 40, (0.0, 0.1)))
    assert [p.load for p in search.probes] == [0.5, 1.0, 2.0, 4.0, 3.0, 2.5, 2.75]
    assert search.closed and search.capacity == 2.75 and search.bounds() == (2.75, 2.75)
    assert search.describe() == "2.75 (meets at 2.75, misses at 3; 7 probes)"
    with pytest.raises(ValueError, match=r"start: expected a whole multiple of 0.25 \(the search's step\), found 0.3"):
        CapacitySearch(0.3, 8.0, unit=0.25)
