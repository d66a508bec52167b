"""A clock that moves only when a test says, for the handle's timings: what they measure is then known exactly,
whatever the machine's speed or load, and no test sleeps or bounds a wall-clock figure."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from flextensor_diffusers.engine import handle as handle_module
from flextensor_diffusers.engine.profiler import Clock
from flextensor_diffusers.storage import arrivals
from flextensor_diffusers.storage.device_encoding import EncodeJob


class ManualClock:
    """Seconds that pass only through `advance` (from any thread): the handle's `Clock` (`drive_handles_by`), and
    `disk_reads.clock` in the host tier's tests (a fake read advances it by its seconds)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.seconds

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def __deepcopy__(self, memo: dict) -> ManualClock:
        return self  # a model copied with it (a probe) keeps the test's one clock


def drive_handles_by(monkeypatch: pytest.MonkeyPatch, clock: ManualClock) -> None:
    """Handles set up from now on mark time with ``clock`` (`Clock`'s ``now``, on the CPU as on CUDA, in place of
    events): their profiled compute and gaps, stalls, time between units, and a forward's duration (which paces
    the encoding between forwards) are the seconds the test advanced it by."""

    def clock_for(device: torch.device) -> Clock:
        return Clock(device, now=clock)

    monkeypatch.setattr(handle_module, "Clock", clock_for)


def encoding_takes(monkeypatch: pytest.MonkeyPatch, clock: ManualClock, seconds: float) -> None:
    """Each unit the host encoder makes between forwards advances ``clock`` by ``seconds``, so that how many a gap
    encodes (paced by the forward before it, on the same clock) is known exactly."""
    real = arrivals.EncodingBetweenForwards._on_host

    def taking_seconds_each(jobs: list[EncodeJob]) -> Iterator[tuple[int, object]]:
        for made in real(jobs):
            clock.advance(seconds)
            yield made

    monkeypatch.setattr(arrivals.EncodingBetweenForwards, "_on_host", staticmethod(taking_seconds_each))
