"""resident_bytes: the pages of host tensors in RAM now, not their bytes."""

import sys

import pytest
import torch

from cache_impl.engine.resident import PAGE, resident_bytes
from cache_impl.platform.buffers import huge_page_empty

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) is Linux's")


def test_a_fresh_mapping_holds_no_pages_until_touched_and_then_those_touched():
    buffer = huge_page_empty(8 << 20)
    assert buffer.nbytes == 8 << 20 and resident_bytes([buffer]) == 0
    buffer[: 2 << 20].fill_(1)                                      # one huge page (or 512 small ones)
    assert resident_bytes([buffer]) == 2 << 20
    buffer.fill_(2)
    assert resident_bytes([buffer]) == 8 << 20


def test_tensors_that_share_pages_count_them_once():
    buffer = huge_page_empty(4 << 20)
    buffer.fill_(1)
    assert resident_bytes([buffer, buffer[: 1 << 20], buffer[3 << 20 :]]) == 4 << 20
    small = torch.ones(10, dtype=torch.uint8)                        # in the allocator's heap, within one page
    assert resident_bytes([small, small[5:]]) == PAGE


def test_a_view_holds_its_whole_storage_so_that_is_what_counts():
    buffer = huge_page_empty(8 << 20)
    buffer.fill_(1)
    every_other_mib = buffer.view(8, 1 << 20)[::2]
    assert resident_bytes([every_other_mib]) == resident_bytes([buffer[:1].expand(1 << 22)]) == 8 << 20


def test_tensors_off_the_host_hold_none_of_its_memory():
    assert resident_bytes([torch.empty(1 << 20, device="meta")]) == 0
    assert resident_bytes([]) == 0
