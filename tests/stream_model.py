"""CUDA's ordering rules for streams and events, modelled on the CPU, to find races in what the engine enqueues.

On a CPU every copy and decode is synchronous, so a test there never sees two streams race; on a GPU a race shows
only when the timing is unlucky. This model sees it every time. Each stream keeps a *vector clock*: how much of
every stream's work it is ordered after. Enqueueing work advances the stream's own entry; ``wait_event`` and
``wait_stream`` merge in the clock an event recorded, or the other stream's clock now; an event never recorded
holds an empty clock, so waiting on it orders nothing (as on a GPU). A read or a write of a named buffer
(`StreamModel.access`) is ordered after an earlier one when its clock holds the earlier one's position on the
earlier one's stream. `StreamModel.races` lists every pair of accesses to one buffer, one of them a write, that
the streams would run in either order: the bytes one of them sees then depend on timing.

`StreamModel.install` puts the model in place of ``torch.cuda.Stream``, ``Event``, ``current_stream`` and
``stream`` (the context that makes a stream current), which is all `engine.schedule` uses.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch


def _merge(into: dict[int, int], clock: dict[int, int]) -> None:
    for stream, position in clock.items():
        into[stream] = max(into.get(stream, 0), position)


class FakeEvent:
    """An event: the clock of the stream it was last recorded on, as it was then (empty until recorded)."""

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.clock: dict[int, int] = {}

    def record(self, stream: FakeStream) -> None:
        self.clock = dict(stream.clock)


class FakeStream:
    """A stream: its vector clock, its own entry counting the work enqueued on it."""

    def __init__(self, model: StreamModel, name: str) -> None:
        self.id = next(model.ids)
        self.name = name
        self.clock = {self.id: 0}

    def enqueue(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def wait_event(self, event: FakeEvent) -> None:
        _merge(self.clock, event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        _merge(self.clock, other.clock)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<{self.name} stream>"


@dataclass(frozen=True)
class Access:
    """A read or a write of ``buffer`` enqueued on ``stream`` as its ``position``-th work, with the clock it ran
    under."""

    stream: FakeStream
    position: int
    clock: dict[int, int]
    buffer: str
    write: bool
    what: str

    def after(self, earlier: Access) -> bool:
        return self.clock.get(earlier.stream.id, 0) >= earlier.position

    def __repr__(self) -> str:
        return f"{'write' if self.write else 'read'} of {self.buffer} on {self.stream.name} ({self.what})"


class StreamModel:
    """The streams made while installed (the current one first: ``compute``) and every access, in the order the
    host enqueued them."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.accesses: list[Access] = []
        self._names = iter(["copy", "decode"])  # as `SteadySchedule` makes them

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **_: FakeStream(self, next(self._names, "side")))
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self._made_current)

    @contextlib.contextmanager
    def _made_current(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def access(self, buffer: str, write: bool, what: str) -> None:
        """Enqueue a read (or a write) of ``buffer`` on the current stream."""
        stream = self.current
        position = stream.enqueue()
        self.accesses.append(Access(stream, position, dict(stream.clock), buffer, write, what))

    def races(self) -> list[tuple[Access, Access]]:
        """Pairs (earlier, later, in the order enqueued) of accesses to one buffer, one of them a write, that the
        streams do not order: the later one may run first, or while the earlier one runs."""
        found = []
        for j, later in enumerate(self.accesses):
            for earlier in self.accesses[:j]:
                if earlier.buffer == later.buffer and (earlier.write or later.write) and not later.after(earlier):
                    found.append((earlier, later))
        return found
