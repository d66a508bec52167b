"""The process's peak of allocated device memory, with nothing hidden by the engine's own resets.

torch keeps one peak counter per device for the whole process (`torch.cuda.max_memory_allocated`). Only
`torch.cuda.reset_peak_memory_stats` lowers it, and nothing sets it back up. A profiling forward needs the peak of
that forward alone (`profiler.Profiler`: its activations). Read without a reset, the counter gives the larger of
that and every earlier peak (the text encoder's, another component's, the caller's), so a forward whose activations
stay under an earlier peak would measure that earlier peak. Two other ways were weighed and left: the allocator's
history (`torch.cuda.memory._record_memory_history`) records every allocation with its stack, far too slow for
a forward; reading the counter before and after a forward only says whether the forward went above every earlier
peak.

So the engine still resets the counter, but only through `open_window`, which first *folds* the value the counter
held into a record kept here. A `PeakWindow` then answers the peak since it opened: the largest folded value after
its start, or the counter, whichever is larger. Windows nest and overlap freely (two components profiling in turn,
a benchmark's window around a whole generation, a report's window per stage): each reset inside a window is folded,
so no window loses a peak to another's reset.

`max_memory_allocated` is the process's own window: the true peak since the process started, or since the last
`reset_peak_memory_stats` of this module, whatever the engine reset in between. torch's counter, read after a
generation that profiled, covers only the time since the last profiling forward began. Reset the peak with this
module's `reset_peak_memory_stats` (which resets torch's too), not torch's: after torch's alone, this module's peak
still holds what came before it.

The reset lowers the reserved memory's peak as well (`torch.cuda.max_memory_reserved`): it is folded the same way.
Per device and counter, the record keeps (reset number, value folded at that reset) pairs with decreasing values: a
pair followed by a larger value can never be the largest after any start, so it is dropped. What stays is one pair
per reset at most, and only while every later reset folded less: in practice a handful.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import FlexTensorError

DeviceLike = torch.device | str | int | None


def device_index(device: DeviceLike = None) -> int:
    """The CUDA device's index (``None``, ``"cuda"`` and a ``cuda`` device without one: the current device)."""
    if isinstance(device, int):
        return device
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device)
    if device.type != "cuda":
        raise FlexTensorError(f"device memory peaks are kept for CUDA devices, not {device}: pass a CUDA device")
    return device.index if device.index is not None else torch.cuda.current_device()


#: The peaks torch keeps per device that its reset lowers, and how each is read (looked up at each read).
READERS: dict[str, Callable[[int], int]] = {
    "allocated": lambda index: torch.cuda.max_memory_allocated(index),
    "reserved": lambda index: torch.cuda.max_memory_reserved(index),
}


@dataclass
class _Folds:
    """One counter's values before the resets, as (reset number, value) with decreasing values."""

    pairs: list[tuple[int, int]] = field(default_factory=list)

    def fold(self, reset: int, value: int) -> None:
        while self.pairs and self.pairs[-1][1] <= value:
            self.pairs.pop()
        self.pairs.append((reset, value))

    def largest_after(self, start: int) -> int:
        """The largest value folded at a reset after reset ``start`` (0: none)."""
        at = bisect.bisect_right(self.pairs, (start, float("inf")))
        return self.pairs[at][1] if at < len(self.pairs) else 0


@dataclass
class _DeviceRecord:
    """One device's folded peaks per counter, the ``resets`` made here so far, and the reset the process's window
    began with."""

    resets: int = 0
    process_start: int = 0
    folds: dict[str, _Folds] = field(default_factory=lambda: {stat: _Folds() for stat in READERS})

    def fold_and_reset(self, index: int) -> int:
        """Fold every counter of device ``index``, then reset them; the reset's number."""
        self.resets += 1
        for stat, read in READERS.items():
            self.folds[stat].fold(self.resets, read(index))
        torch.cuda.reset_peak_memory_stats(index)
        return self.resets

    def peak(self, index: int, stat: str, start: int) -> int:
        """Counter ``stat``'s peak since reset ``start``."""
        return max(self.folds[stat].largest_after(start), READERS[stat](index))


_lock = threading.Lock()
_records: dict[int, _DeviceRecord] = {}


def _record(index: int) -> _DeviceRecord:
    return _records.setdefault(index, _DeviceRecord())


@dataclass(frozen=True)
class PeakWindow:
    """The peaks on one CUDA device since the window opened (`open_window`), every later reset made through this
    module folded in. Read them after synchronising the device, to include kernels still queued."""

    device_index: int
    start: int  # the number of the reset it opened with

    def peak(self) -> int:
        """The largest allocated total since the window opened."""
        with _lock:
            return _record(self.device_index).peak(self.device_index, "allocated", self.start)

    def reserved_peak(self) -> int:
        """The largest total the caching allocator reserved since the window opened."""
        with _lock:
            return _record(self.device_index).peak(self.device_index, "reserved", self.start)


def open_window(device: DeviceLike = None) -> PeakWindow:
    """Reset torch's peak counters of ``device`` (their values kept here first) and open a window from now."""
    index = device_index(device)
    with _lock:
        return PeakWindow(index, _record(index).fold_and_reset(index))


def max_memory_allocated(device: DeviceLike = None) -> int:
    """The process's peak of allocated memory on ``device`` since it started, or since the last
    `reset_peak_memory_stats` here: `torch.cuda.max_memory_allocated` with the engine's own resets folded in."""
    index = device_index(device)
    with _lock:
        record = _record(index)
        return record.peak(index, "allocated", record.process_start)


def max_memory_reserved(device: DeviceLike = None) -> int:
    """`max_memory_allocated`'s twin for the memory the caching allocator reserved."""
    index = device_index(device)
    with _lock:
        record = _record(index)
        return record.peak(index, "reserved", record.process_start)


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Start the process's peaks on ``device`` over from what is allocated and reserved now, torch's counters with
    them. Windows open at this moment keep every peak folded after their start."""
    index = device_index(device)
    with _lock:
        record = _record(index)
        record.process_start = record.fold_and_reset(index)
