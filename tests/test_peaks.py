"""The process's peak of device memory is never hidden: every reset the engine makes of torch's counter is folded
into what `flextensor_diffusers.max_memory_allocated` and every `PeakWindow` report (`engine.peaks`).

On the CPU, torch's counters are replaced by `FakeCounters`, which keeps them as the CUDA allocator does: the
peak is the largest total allocated since the last reset, and a reset lowers it to the total allocated now."""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import peaks
from flextensor_diffusers.engine.profiler import Clock, Profiler
from tests.clocks import ManualClock

MiB = 2**20


class FakeCounters:
    """torch.cuda's allocated / reserved totals and their peaks, for device 0, moved by the test."""

    def __init__(self) -> None:
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.resets = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int, release: bool = False) -> None:
        self.allocated -= nbytes
        if release:  # empty_cache: the cached blocks go back too
            self.reserved = self.allocated

    def reset(self, device: object = None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.resets += 1

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCounters:
        monkeypatch.setattr(peaks, "_records", {})  # a process of its own
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        return self


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> FakeCounters:
    return FakeCounters().install(monkeypatch)


def test_the_process_peak_keeps_what_the_engines_resets_took_from_torchs_counter(counters: FakeCounters) -> None:
    counters.allocate(100 * MiB)
    counters.free(100 * MiB)
    peaks.open_window("cuda")  # a profiling forward begins
    counters.allocate(30 * MiB)
    assert torch.cuda.max_memory_allocated() == 30 * MiB  # what torch's counter shows now
    assert ft.max_memory_allocated() == ft.max_memory_allocated(torch.device("cuda", 0)) == 100 * MiB
    peaks.open_window(0)  # another profiling forward: its reset folds 30 MiB, less than 100
    counters.allocate(150 * MiB)
    assert ft.max_memory_allocated() == 180 * MiB


def test_resetting_through_the_package_starts_the_process_peak_over(counters: FakeCounters) -> None:
    counters.allocate(100 * MiB)
    counters.free(100 * MiB)
    peaks.open_window()
    counters.allocate(10 * MiB)
    ft.reset_peak_memory_stats()
    assert ft.max_memory_allocated() == 10 * MiB  # what is allocated now; the folded 100 MiB is before the reset
    counters.allocate(5 * MiB)
    counters.free(5 * MiB)
    assert ft.max_memory_allocated() == 15 * MiB
    peaks.open_window()
    assert ft.max_memory_allocated() == 15 * MiB and torch.cuda.max_memory_allocated() == 10 * MiB


def test_torchs_own_reset_leaves_the_folded_peak_in_place(counters: FakeCounters) -> None:
    """The documented limit: after torch's reset alone, the package's peak still holds what came before it."""
    counters.allocate(100 * MiB)
    counters.free(100 * MiB)
    peaks.open_window()
    torch.cuda.reset_peak_memory_stats()
    assert ft.max_memory_allocated() == 100 * MiB


def test_windows_nest_each_keeping_its_own_peak(counters: FakeCounters) -> None:
    """A benchmark's window around a generation, a report's window per stage and a profiling forward's window
    inside it: each reset is folded, each window answers for its own time only."""
    counters.allocate(500 * MiB)  # before every window
    counters.free(500 * MiB)
    generation = peaks.open_window()
    counters.allocate(80 * MiB)
    counters.free(80 * MiB)
    stage = peaks.open_window()
    counters.allocate(20 * MiB)
    counters.free(20 * MiB)
    profiling = peaks.open_window()
    counters.allocate(7 * MiB)
    assert (profiling.peak(), stage.peak(), generation.peak()) == (7 * MiB, 20 * MiB, 80 * MiB)
    assert ft.max_memory_allocated() == 500 * MiB
    counters.allocate(90 * MiB)  # a peak after every window opened counts in all of them
    assert profiling.peak() == stage.peak() == generation.peak() == 97 * MiB


def test_reserved_memorys_peak_is_folded_too(counters: FakeCounters) -> None:
    counters.allocate(64 * MiB)
    counters.free(64 * MiB, release=True)
    window = peaks.open_window()
    peaks.open_window()
    counters.allocate(8 * MiB)
    assert torch.cuda.max_memory_reserved() == 8 * MiB
    assert peaks.max_memory_reserved() == 64 * MiB and window.reserved_peak() == 8 * MiB


def test_only_the_values_that_can_still_be_largest_are_kept(counters: FakeCounters) -> None:
    for size in (10, 30, 20, 5):
        counters.allocate(size * MiB)
        counters.free(size * MiB)
        peaks.open_window()
    assert [value for _, value in peaks._records[0].folds["allocated"].pairs] == [30 * MiB, 20 * MiB, 5 * MiB]


def test_a_cpu_device_is_refused_naming_the_fix() -> None:
    with pytest.raises(ft.FlexTensorError, match="pass a CUDA device"):
        ft.max_memory_allocated("cpu")


def test_a_profiling_forward_measures_its_own_activations_and_hides_no_earlier_peak(counters: FakeCounters) -> None:
    """The profiler resets torch's counter as a profiling forward begins (its activations are what the forward
    allocates beyond the handle's own bytes, however large an earlier peak was); the process's peak keeps the
    earlier one."""
    counters.allocate(900 * MiB)  # another component's peak, before this forward
    counters.free(900 * MiB)
    counters.allocate(40 * MiB)  # the handle's weights on the device
    profiler = Profiler(torch.device("cuda", 0), Clock(torch.device("cuda", 0), now=ManualClock()))
    profiler.start_forward(True, own_bytes=40 * MiB)
    counters.allocate(12 * MiB)  # the forward's activations
    counters.free(12 * MiB)
    run = profiler.end_forward()
    assert run.activation_peak_bytes == 12 * MiB
    assert counters.resets == 1 and torch.cuda.max_memory_allocated() == 52 * MiB
    assert ft.max_memory_allocated() == 900 * MiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_after_a_generation_that_profiled_the_package_reports_the_peak_torchs_counter_lost() -> None:
    """On a GPU: 256 MiB allocated and freed before set-up is the process's peak; the profiling forward resets
    torch's counter, so torch's shows less after the forwards, while the package and the handle's stats show it."""
    from tests.models import Stack

    torch.manual_seed(0)
    model, x = Stack(dim=64, depth=4), torch.randint(0, 50, (2, 16), device="cuda")
    ft.reset_peak_memory_stats()
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del big
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget="1GiB", device="cuda")
    with torch.inference_mode():
        for _ in range(3):  # discovery, profiling, steady
            model(x)
    torch.cuda.synchronize()
    assert handle.counters["profiling"] >= 1
    assert torch.cuda.max_memory_allocated() < 256 * MiB
    assert ft.max_memory_allocated() >= 256 * MiB and handle.stats().peak_allocated_bytes >= 256 * MiB
    handle.remove()
