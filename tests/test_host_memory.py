"""Host buffers own their pages (registration cannot collide) and a failed registration leaves no CUDA error."""

from __future__ import annotations

import mmap

import pytest
import torch

from flextensor_diffusers.engine.host_memory import (
    HUGE_PAGE,
    HUGE_PAGE_MIN_BYTES,
    host_buffer,
    pin_in_place,
    unpin_in_place,
)


def pages(t: torch.Tensor) -> range:
    first = t.data_ptr() // mmap.PAGESIZE
    return range(first, (t.data_ptr() + t.numel() - 1) // mmap.PAGESIZE + 1)


def test_host_buffers_start_on_a_page_and_share_no_page() -> None:
    buffers = [host_buffer(n) for n in (1, 4095, 10_000, 3 << 20)]
    assert [b.numel() for b in buffers] == [1, 4095, 10_000, 3 << 20]
    assert all(b.data_ptr() % mmap.PAGESIZE == 0 for b in buffers)
    spans = [set(pages(b)) for b in buffers]
    assert all(not (a & b) for i, a in enumerate(spans) for b in spans[i + 1 :])
    big = host_buffer(HUGE_PAGE_MIN_BYTES + 123)
    assert big.data_ptr() % HUGE_PAGE == 0 and big.numel() == HUGE_PAGE_MIN_BYTES + 123
    big.fill_(7)
    assert int(big[-1]) == 7 and host_buffer(0).numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_neighbouring_buffers_pin_in_place_and_a_failure_leaves_no_cuda_error() -> None:
    a, b = host_buffer(5000), host_buffer(5000)
    assert pin_in_place(a) and pin_in_place(b) and a.is_pinned() and b.is_pinned()
    assert not pin_in_place(a)  # registered already: refused, and the error must not reach the next launch
    assert torch.ones(4, device="cuda").sum().item() == 4
    unpin_in_place(a)
    unpin_in_place(a)  # not registered any more: logged, no error left behind either
    assert torch.ones(4, device="cuda").sum().item() == 4
    unpin_in_place(b)
