"""Discovery and profiling: typed records of what a forward did, turned into a `WorkloadProfile`.

A profiling forward loads every streamed unit on demand into the one profiling slot and times, on
the compute stream, each load (for a compressed unit: its copy and its decode apart), each unit's
compute and the gaps between units; the allocator's peak gives the activation memory. Several
profiling forwards of the same order are averaged.

The activation peak of a forward is read from torch's process-wide peak counter, which has to be reset when the
forward begins: read without a reset it would give any larger peak from before (another component's, the
caller's). That reset goes through `peaks.open_window`, which keeps the value it takes from the counter, so that
`peaks.max_memory_allocated` (``flextensor_diffusers.max_memory_allocated``, the handle's stats and the pipeline's
report) still gives the process's true peak; torch's own counter, after a generation that profiled, covers only
the time since the last profiling forward began. Profiling forwards of several handles, one after the other or one
inside another, each read their own window. Steady forwards reset nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import peaks
from .planner import Call, WorkloadProfile


class Clock:
    """Timestamps on a stream: CUDA timing events (pooled), or the host's clock on the CPU.

    ``now`` (seconds) is the host's clock: `time.perf_counter` unless given. Given, it also marks the streams of a
    CUDA device, in place of events: tests drive the engine with a clock that moves only when they say, so that
    what it measures is known exactly."""

    def __init__(self, device: torch.device, now: Callable[[], float] | None = None) -> None:
        self.cuda = device.type == "cuda" and now is None
        self.now = now or time.perf_counter
        self._pool: list[torch.cuda.Event] = []

    def seconds(self) -> float:
        """The host's clock: for host-side intervals (a workload's duration), on any device."""
        return self.now()

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        if not self.cuda:
            return self.now()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def done(self, mark: Any) -> bool:
        return mark.query() if self.cuda else True

    def wait(self, mark: Any) -> None:
        """Return once the work before ``mark`` has run: an event is synchronised on; a host-clock mark (the CPU,
        or an injected clock) was taken after it already."""
        if self.cuda:
            mark.synchronize()

    def release(self, *marks: Any) -> None:
        if self.cuda:
            self._pool.extend(marks)


@dataclass(frozen=True)
class OpenCall:
    """A unit call whose compute has not finished yet: its marks so far."""

    unit: int
    start: Any
    staged: Any  # between a compressed load's copy and its decode; None for a raw load or none
    loaded: Any
    load_bytes: int


@dataclass(frozen=True)
class CallMark:
    """One unit call of a profiling forward: clock marks before and after its load and its compute."""

    unit: int
    start: Any
    staged: Any  # None unless the load was a compressed copy followed by a decode
    loaded: Any
    finished: Any
    load_bytes: int  # 0 when the slot already held the unit

    def marks(self) -> list[Any]:
        return [m for m in (self.start, self.staged, self.loaded, self.finished) if m is not None]


@dataclass(frozen=True)
class ProfiledRun:
    """One profiling forward, reduced to numbers."""

    calls: tuple[Call, ...]
    tail_ms: float
    load_ms: float  # copies only: decodes are not link time
    load_bytes: int
    activation_peak_bytes: int
    decode_ms: dict[int, float]  # per compressed unit loaded in this forward

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(c.unit for c in self.calls)


class Profiler:
    """Records the unit calls of discovery and profiling forwards; owns no device memory."""

    def __init__(self, device: torch.device, clock: Clock) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.observed: list[int] = []  # units called in the current forward, in order
        self.runs: list[ProfiledRun] = []
        self._marks: list[CallMark] = []
        self._open: OpenCall | None = None
        self._forward_start: Any = None
        self._own_bytes = 0
        self._window: peaks.PeakWindow | None = None  # the profiling forward's peak (CUDA)
        self._earlier_peak = 0  # activations measured in this forward before the handle's own bytes last grew

    def start_forward(self, profiling: bool, own_bytes: int = 0) -> None:
        """``own_bytes``: the device memory the handle holds (its weights' copies). Everything else the
        process has allocated at the peak counts as this workload's *activations*: its temporaries, and
        tensors alive when it starts (the caller's inputs, a pipeline's latents and prompt embeddings, other
        models, library workspaces). The budget bounds the process's whole peak, so it has to hold them all.
        The peak is this forward's own: a window opened now (`peaks.open_window`, see the module docstring)."""
        self.observed, self._marks, self._open = [], [], None
        self._earlier_peak, self._window = 0, None
        if profiling:
            if self.cuda:
                self._window = peaks.open_window(self.device)
                self._own_bytes = own_bytes
            self._forward_start = self.clock.mark()

    def own_bytes_grow(self, nbytes: int) -> None:
        """The handle is about to take ``nbytes`` more device memory during this profiling forward (a unit kept on
        the device, `DeviceCopies.keep`): the activations so far are read against what it held until now, and a
        new window measures the rest against what it holds from now on, so that neither counts the new copy as an
        activation nor lets it hide one."""
        if self._window is not None:
            self._earlier_peak = max(self._earlier_peak, self._window.peak() - self._own_bytes)
            self._window = peaks.open_window(self.device)
        self._own_bytes += nbytes

    def abandon(self) -> None:
        """The forward did not finish: forget its marks."""
        self.clock.release(*(m for c in self._marks for m in c.marks()))
        self.observed, self._marks, self._open = [], [], None

    def observe(self, unit: int) -> None:
        """``unit`` was called in a discovery forward (loaded on demand, not timed)."""
        self.observed.append(unit)

    def restart(self) -> None:
        """Forget every profiled run: what they measured no longer holds (other inputs, compiled units)."""
        self.abandon()
        self.runs = []

    def before_unit(self, unit: int, load: Callable[[Callable[[], None]], bool], nbytes: int) -> None:
        """Time ``load(on_staged)`` (returns whether it copied; calls ``on_staged`` between a compressed
        copy and its decode) as the load of ``unit``, ``nbytes`` over the link."""
        start = self.clock.mark()
        staged: list[Any] = []
        loaded = load(lambda: staged.append(self.clock.mark()))
        self._open = OpenCall(unit, start, staged[0] if staged else None, self.clock.mark(), nbytes if loaded else 0)
        self.observed.append(unit)

    def after_unit(self) -> None:
        if self._open is not None:
            call = self._open
            finished = self.clock.mark()
            self._marks.append(CallMark(call.unit, call.start, call.staged, call.loaded, finished, call.load_bytes))
            self._open = None

    def end_forward(self) -> ProfiledRun:
        end = self.clock.mark()
        if self.cuda:
            assert self._window is not None, "end_forward without a profiling start_forward"
            torch.cuda.synchronize(self.device)
            peak = max(self._earlier_peak, self._window.peak() - self._own_bytes)
        else:
            peak = 0  # the CPU allocator keeps no peak; planning on the CPU ignores activations
        calls, load_ms, load_bytes, decode_ms = [], 0.0, 0, {}
        previous = self._forward_start
        for mark in self._marks:
            compute = self.clock.ms(mark.loaded, mark.finished)
            calls.append(Call(unit=mark.unit, compute_ms=compute, gap_before_ms=self.clock.ms(previous, mark.start)))
            if mark.load_bytes:
                load_ms += self.clock.ms(mark.start, mark.staged or mark.loaded)
                load_bytes += mark.load_bytes
            if mark.staged is not None:
                decode_ms[mark.unit] = self.clock.ms(mark.staged, mark.loaded)
            previous = mark.finished
        run = ProfiledRun(tuple(calls), self.clock.ms(previous, end), load_ms, load_bytes, peak, decode_ms)
        self.abandon()
        self.clock.release(self._forward_start, end)
        self.runs.append(run)
        return run

    def _decode_per_unit(self, decoded: dict[int, list[float]], unit_bytes: list[int]) -> list[float] | None:
        """Fastest measured decode time per unit; a unit not decoded while profiled is estimated from the
        others' time per byte. The fastest, not the mean: a decode is the same work every time, and what
        else lands in one sample only adds to it (a Triton specialisation compiled at its first launch
        while the stream waits, a stall), which a mean over two or three profiled forwards would turn
        into "decoding is slower than the link". None on
        the CPU, where loads are synchronous copies and decoding runs torch ops: nothing there stands for
        what a GPU would do, so plans take decodes as free."""
        if not decoded or not self.cuda:
            return None
        fastest = {u: min(ms) for u, ms in decoded.items()}
        per_byte = sum(fastest.values()) / sum(unit_bytes[u] for u in fastest)
        return [fastest.get(u, per_byte * unit_bytes[u]) for u in range(len(unit_bytes))]

    def workload_profile(
        self, unit_names: list[str], unit_bytes: list[int], resident_bytes: int, measure_bandwidth: Any
    ) -> WorkloadProfile:
        """Average the runs with the latest run's order; ``measure_bandwidth()`` when none loaded anything."""
        same = [r for r in self.runs if r.order == self.runs[-1].order]
        calls = [
            Call(
                unit=call.unit,
                compute_ms=sum(r.calls[k].compute_ms for r in same) / len(same),
                gap_before_ms=sum(r.calls[k].gap_before_ms for r in same) / len(same),
            )
            for k, call in enumerate(same[-1].calls)
        ]
        loaded = [r for r in same if r.load_ms > 0]
        bandwidth = sum(r.load_bytes / r.load_ms for r in loaded) / len(loaded) if loaded else measure_bandwidth()
        decoded: dict[int, list[float]] = {}
        for r in same:
            for unit, ms in r.decode_ms.items():
                decoded.setdefault(unit, []).append(ms)
        self.runs = []
        return WorkloadProfile(
            unit_names=unit_names,
            unit_bytes=unit_bytes,
            calls=calls,
            tail_ms=sum(r.tail_ms for r in same) / len(same),
            bandwidth_bytes_per_ms=bandwidth,
            activation_peak_bytes=max(r.activation_peak_bytes for r in same),
            resident_bytes=resident_bytes,
            decode_ms=self._decode_per_unit(decoded, unit_bytes),
        )
