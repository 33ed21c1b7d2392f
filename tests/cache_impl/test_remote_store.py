"""The Mooncake store wrapper's get: a value the pool holds is not a miss because one transfer ran out of lease."""

import pytest

from cache_impl.cache.tiers.remote import MooncakeStore, StoreUnavailable


class _Client:
    """Mooncake's client as the wrapper sees it: get gives b"" on any failure; is_exist 1, 0 or < 0 (error)."""

    def __init__(self, gets, exists):
        self.gets, self.exists, self.calls = list(gets), exists, 0

    def get(self, name):
        self.calls += 1
        return self.gets.pop(0)

    def is_exist(self, name):
        return self.exists


def _store(client):
    store = MooncakeStore.__new__(MooncakeStore)   # no pool to reach: only get's logic is under test
    store._store = client
    return store


def test_a_get_that_ran_out_of_lease_on_a_held_value_is_tried_again():
    client = _Client([b"", b"value"], exists=1)
    assert _store(client).get("k") == b"value" and client.calls == 2


def test_a_value_the_pool_does_not_hold_is_a_miss_at_once_and_a_held_one_failing_twice_too():
    assert _store(_Client([b""], exists=0)).get("k") is None
    client = _Client([b"", b""], exists=1)
    assert _store(client).get("k") is None and client.calls == 2


def test_a_pool_that_cannot_say_whether_it_holds_the_value_is_unavailable():
    with pytest.raises(StoreUnavailable, match="is_exist returned -1"):
        _store(_Client([b""], exists=-1)).get("k")
