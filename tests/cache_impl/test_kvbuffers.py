"""KVBuffers: finished request KV is reused by a request it fits, and what is kept is bounded."""

import torch

from cache_impl.engine.kvbuffers import KVBuffers


def _buffers(max_idle: int = 2) -> KVBuffers:
    return KVBuffers(lambda positions: torch.empty((1, 2, 1, positions, 4)), max_idle=max_idle)


def test_a_buffer_given_back_serves_a_request_it_fits_and_no_larger_than_twice():
    buffers = _buffers()
    first = buffers.take(512)
    buffers.give(first)
    assert buffers.take(300) is first               # 512 holds 300, within twice its size
    buffers.give(first)
    assert buffers.take(200) is not first           # 512 would waste more than half: a fresh one
    assert buffers.take(600).shape[3] == 600        # too small for 600: a fresh one of exactly that size
    assert (buffers.reused, buffers.allocated) == (1, 3)


def test_the_smallest_fitting_buffer_is_chosen_and_at_most_max_idle_are_kept():
    buffers = _buffers(max_idle=2)
    small, large, extra = buffers.take(256), buffers.take(480), buffers.take(1024)
    assert buffers.give(large) is None and buffers.give(small) is None
    assert buffers.take(250) is small               # not the first idle one, the smallest that holds it
    assert buffers.give(small) is None
    assert buffers.give(extra) == large.nbytes      # over max_idle: the oldest idle one is let go
    assert buffers.idle_bytes == small.nbytes + extra.nbytes


def test_the_kept_buffers_are_listed_for_their_owner_to_measure():
    buffers = _buffers(max_idle=2)
    kept = buffers.take(256)
    buffers.give(kept)
    assert [b is kept for b in buffers.idle()] == [True] and buffers.idle_bytes == kept.nbytes
