"""Host buffers own their pages (registration cannot collide), a lock never outlives its pages, and a failed
registration leaves no CUDA error."""

from __future__ import annotations

import gc
import logging
import mmap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.storage import host_memory
from flextensor_diffusers.storage.host_memory import (
    HUGE_PAGE,
    HUGE_PAGE_MIN_BYTES,
    host_buffer,
    pin_in_place,
    shared_file_buffer,
    unpin_in_place,
)
from tests.models import Stack, device_headroom


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
    unpin_in_place(a)  # not locked any more: nothing to undo, no error left behind either
    assert torch.ones(4, device="cuda").sum().item() == 4
    unpin_in_place(b)


def mapped(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


@pytest.mark.parametrize("kind", ["anonymous", "shared file"])
def test_a_locked_buffer_is_unlocked_before_its_pages_go_whoever_drops_it(monkeypatch, tmp_path, kind: str) -> None:
    """A lock left on unmapped pages makes later copies read the old pages (wrong weights, no error): a buffer
    (a host copy, or shared weights in a file) dropped while locked is unregistered once, while still mapped;
    one unpinned first is not unregistered again; a second lock of a locked buffer is refused without a call."""
    calls: list[tuple[str, int, bool]] = []

    def register(address: int, nbytes: int, flags: int) -> int:
        calls.append(("register", address, mapped(address)))
        return 0

    def unregister(address: int) -> int:
        calls.append(("unregister", address, mapped(address)))
        return 0

    runtime = SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister)
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: runtime)

    def new(nbytes: int) -> torch.Tensor:
        return host_buffer(nbytes) if kind == "anonymous" else shared_file_buffer(tmp_path / f"{nbytes}.bin", nbytes)

    dropped, view = new(10_000), None
    assert pin_in_place(dropped) and not pin_in_place(dropped)
    address, view = dropped.data_ptr(), dropped[100:]
    del dropped
    assert [c[0] for c in calls] == ["register"]  # a view still holds the pages
    del view
    gc.collect()
    assert calls == [("register", address, True), ("unregister", address, True)]
    calls.clear()
    unpinned = new(HUGE_PAGE_MIN_BYTES)
    assert pin_in_place(unpinned)
    unpin_in_place(unpinned)
    del unpinned
    gc.collect()
    assert [c[0] for c in calls] == ["register", "unregister"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_handle_dropped_without_remove_leaves_no_lock_behind(caplog) -> None:
    """A model offloaded and then dropped without ``remove()`` (a test that failed, a user's ``del``) leaves no
    range registered: the next model's buffers, placed at the same addresses, lock in place and compute
    natively. (On the H200 such a leak made two later tests compute garbage.)"""

    def offload_and_run() -> tuple[torch.Tensor, torch.Tensor, ft.OffloadHandle]:
        torch.manual_seed(0)
        model, x = Stack(dim=32, depth=6), torch.randint(0, 50, (2, 16))
        with torch.inference_mode():
            ref = model.to("cuda")(x.cuda()).cpu()
        model.to("cpu")
        budget = 300_000 + device_headroom("cuda", model, x)
        handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=budget, device="cuda")
        with torch.inference_mode():
            outs = [model(x.cuda()).cpu() for _ in range(4)]
        assert all(torch.equal(o, ref) for o in outs)
        return ref, outs[-1], handle

    offload_and_run()  # handle and model dropped here, never removed
    gc.collect()
    with caplog.at_level(logging.WARNING, logger=host_memory.__name__):
        for _ in range(3):
            _, _, handle = offload_and_run()
            handle.remove()
    assert not [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
