"""The engine's scheduler on its own: admission, its order, cancel and the step's batch (no model, no tensors)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from cache_impl.engine.generation import GenerationRequest, QueueFullError
from cache_impl.engine.scheduler import Scheduler
from cache_impl.engine.sequence import Sequence


def _request(prompt_len: int = 4, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(list(range(1, prompt_len + 1)), max_tokens, lambda event: None)


def _started(scheduler: Scheduler, request: GenerationRequest, generated: int = 0) -> Sequence:
    """What the engine makes of an admitted request (its KV left out: the scheduler never reads it)."""
    seq = Sequence(request, list(request.prompt_tokens) + [7] * generated, kv=None, buffer=None)
    scheduler.start(seq)
    return seq


def test_the_scheduler_imports_no_torch():
    code = "import cache_impl.engine.scheduler, sys; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_requests_are_admitted_oldest_first_up_to_max_running():
    scheduler = Scheduler(max_running=2, max_waiting=8, max_context=100)
    requests = [_request() for _ in range(5)]
    for request in requests:
        scheduler.add(request)
    assert scheduler.next_admitted() == requests[:2]
    for request in requests[:2]:
        _started(scheduler, request)
    assert scheduler.next_admitted() == []                       # both slots taken: the rest wait
    assert list(scheduler.waiting) == requests[2:]
    assert scheduler.finish(scheduler.running[0])
    assert scheduler.next_admitted() == [requests[2]]            # a freed slot goes to the oldest waiting


def test_a_finished_sequence_leaves_the_running_set_once():
    scheduler = Scheduler(max_running=2, max_waiting=2, max_context=100)
    seq = _started(scheduler, _request())
    assert scheduler.finish(seq) is True
    assert scheduler.finish(seq) is False                         # finished twice: released once
    assert scheduler.running == []


@pytest.mark.parametrize("prompt_len, max_tokens, message", [
    (0, 4, "the prompt is empty"),
    (90, 11, r"prompt \(90 tokens\) plus max_tokens \(11\) exceeds the model's context of 100 tokens"),
])
def test_a_prompt_that_cannot_fit_is_refused_before_it_queues(prompt_len, max_tokens, message):
    scheduler = Scheduler(max_running=1, max_waiting=1, max_context=100)
    with pytest.raises(ValueError, match=message):
        scheduler.add(_request(prompt_len, max_tokens))
    assert not scheduler.waiting
    scheduler.add(_request(90, 10))                               # exactly the context fits
    assert len(scheduler.waiting) == 1


@pytest.mark.parametrize("bad", [-1, 50])
def test_a_prompt_with_a_token_id_outside_the_vocabulary_is_refused_before_it_queues(bad):
    scheduler = Scheduler(max_running=1, max_waiting=1, max_context=100, vocab_size=50)
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, 50\), found {bad} \(1 outside\)"):
        scheduler.add(GenerationRequest([1, bad, 2], 4, lambda event: None))
    assert not scheduler.waiting
    scheduler.add(GenerationRequest([0, 49], 4, lambda event: None))     # both ends of the vocabulary
    assert len(scheduler.waiting) == 1


def test_the_queue_refuses_only_when_the_waiting_and_the_running_are_both_full():
    scheduler = Scheduler(max_running=1, max_waiting=1, max_context=100)
    scheduler.add(_request())
    scheduler.add(_request())                                     # nothing runs yet: the queue may grow
    _started(scheduler, scheduler.next_admitted()[0])
    with pytest.raises(QueueFullError, match="1 requests are already waiting"):
        scheduler.add(_request())
    assert len(scheduler.waiting) == 1


def test_a_stopped_scheduler_refuses_new_requests_and_hands_back_the_waiting_once_idle():
    scheduler = Scheduler(max_running=1, max_waiting=4, max_context=100)
    first, second, third = _request(), _request(), _request()
    scheduler.add(first)
    scheduler.add(second)
    seq = _started(scheduler, scheduler.next_admitted()[0])
    scheduler.stop()
    with pytest.raises(QueueFullError, match="shutting down"):
        scheduler.add(third)
    assert scheduler.next_admitted() == []                        # the running one finishes first
    scheduler.finish(seq)
    assert scheduler.next_admitted() is None
    assert scheduler.drain() == [second] and not scheduler.waiting


def test_next_admitted_waits_for_a_request_from_another_thread():
    scheduler = Scheduler(max_running=1, max_waiting=1, max_context=100)
    request, admitted = _request(), []
    waiter = threading.Thread(target=lambda: admitted.append(scheduler.next_admitted()))
    waiter.start()
    scheduler.add(request)
    waiter.join(30)
    assert admitted == [[request]]


def test_cancelled_sequences_are_picked_out_of_the_running_set():
    scheduler = Scheduler(max_running=3, max_waiting=1, max_context=100)
    kept, cancelled = _started(scheduler, _request()), _started(scheduler, _request())
    cancelled.request.cancelled.set()
    assert scheduler.cancelled() == [cancelled]
    assert kept not in scheduler.cancelled()


def test_one_prefill_chunk_for_the_oldest_prefilling_sequence_and_a_decode_step_for_the_others():
    scheduler = Scheduler(max_running=4, max_waiting=1, max_context=100)
    decoding = _started(scheduler, _request(), generated=2)
    older, newer = _started(scheduler, _request()), _started(scheduler, _request())
    also_decoding = _started(scheduler, _request(), generated=1)
    assert scheduler.next_prefill() is older
    assert scheduler.decode_batch() == [decoding, also_decoding]
    scheduler.finish(older)
    assert scheduler.next_prefill() is newer


def test_nothing_to_prefill_when_every_sequence_decodes():
    scheduler = Scheduler(max_running=2, max_waiting=1, max_context=100)
    seq = _started(scheduler, _request(), generated=1)
    assert scheduler.next_prefill() is None and scheduler.decode_batch() == [seq]
