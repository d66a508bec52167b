"""Steady state: the planned loads on the copy stream, and the events that order them.

For each streamed unit, the compute stream waits for its *ready* event before the unit runs; after
the unit is enqueued, the slot's *free* event is recorded and the slot's next occupant is loaded on
the copy stream, which first waits for *free*. A slot is therefore overwritten only after every
kernel that reads it has run. Loads wrap around, so the end of one forward prefetches the start of
the next. Nothing here synchronises or allocates.

A compressed load has two parts on two streams. The copy stream moves the payload into the slot's
staging buffer once the buffer's previous payload is decoded (*staged-free*), without waiting for
the slot, and records *arrived*; the decode stream waits for *arrived* and *free*, decodes into the
slot, and records *ready* and *staged-free*. Copies thus run ahead of compute by one payload per
slot, and decodes overlap the next copies.

Those events order the schedule's own loads only. Work on the compute stream that writes a slot or a staging
buffer outside them (an on-demand load: a slot made stale by an edit, a unit called while the schedule is not
primed; a resident fill) or reads a slot outside a planned call (a call that raised before `after`, a call made
while not primed) is covered by the copy and decode streams waiting for the compute stream: when following a
plan, at every `prime`, and at the next `issue` after such a load (`DeviceCopies.compute_loads` moved past the
count last waited for). A wait on an event never recorded is no wait at all, so nothing else would order them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .device_copies import DeviceCopies
from .planner import Plan
from .profiler import Clock


@dataclass(frozen=True)
class PendingTiming:
    """A pair of clock marks whose interval is folded into the totals once both have completed."""

    kind: Literal["copy", "decode", "stall", "between"]
    unit: int
    start: Any
    end: Any


@dataclass
class TransferTotals:
    """Copy, decode and stall time since set-up (ms), and the time between units (``between_units_ms``: from the
    end of one unit's compute to the start of the next one's in the same steady forward, on the compute stream
    where there is one). That time is the model's own work between its units, and the device idling because the
    thread that issues the work fell behind: a host thread holding it back (a lock, a driver call) shows there, not
    in stalls, which are waits for loads."""

    copy_ms: float = 0.0
    decode_ms: float = 0.0
    stall_ms: float = 0.0
    between_units_ms: float = 0.0
    unit_stall_ms: list[float] = field(default_factory=list)


class SteadySchedule:
    """Executes one plan: order, position in the forward, events, prime / issue / leave.

    ``primed``: the first load of every slot has been issued for the next forward. A schedule that
    is not primed (after activation, or after a forward that raised or left the plan) primes at
    the start of the next forward.
    """

    def __init__(self, copies: DeviceCopies, clock: Clock, measure_stalls: bool, totals: TransferTotals) -> None:
        self.copies = copies
        self.clock = clock
        self.cuda = copies.cuda
        self.device = copies.device
        self.measure_stalls = measure_stalls
        self.totals = totals
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.decode_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.plan: Plan | None = None
        self.order: list[int] = []
        self.primed = False
        #: This forward is the component's last before a switch: loads for the next forward are not issued.
        self.last_forward = False
        self._next_forward_loads: set[int] = set()  # positions whose load is the next forward's (the plan's)
        self.last_calls: dict[int, int] = {}  # unit index -> the position of its last call in a forward
        self._ready: list[torch.cuda.Event] = []
        self._free: list[torch.cuda.Event] = []
        self._arrived: list[torch.cuda.Event] = []
        self._staging_free: list[torch.cuda.Event] = []
        self._pending: list[PendingTiming] = []
        self._unit_end: Any = None  # a mark after the last unit call's compute in this forward (measure_stalls)
        self._compute_loads_waited = 0  # `DeviceCopies.compute_loads` when the side streams last waited for compute

    def follow(self, plan: Plan, order: list[int]) -> None:
        """Start following ``plan`` over freshly laid-out device buffers (not primed yet)."""
        self.plan, self.order, self.primed = plan, order, False
        self.forward_ended()
        self._next_forward_loads = {
            pos for pos, load in enumerate(plan.loads) if load is not None and load[1] not in order[pos + 1 :]
        }
        self.last_calls = {index: pos for pos, index in enumerate(order)}
        if self.cuda:
            # New slots may reuse memory that kernels still queued on the compute stream read; resident fills
            # decoded through a staging buffer on it.
            self._wait_for_compute()
            self._ready = [torch.cuda.Event(enable_timing=self.measure_stalls) for _ in self.copies.units]
            self._free = [torch.cuda.Event() for _ in range(plan.num_slots)]
            self._arrived = [torch.cuda.Event() for _ in range(plan.num_slots)]
            self._staging_free = [torch.cuda.Event() for _ in range(plan.num_slots)]

    def prime(self) -> None:
        """Issue the first load of every slot (those not already holding their first unit)."""
        assert self.plan is not None
        self.forward_ended()  # (after a forward that raised: its last unit's end is no start of this one's gap)
        if self.cuda:
            # Since the last `after` of each slot, the compute stream may have read a slot (a call that raised, or
            # one made while not primed) or loaded one on demand, which no *free* or *staged-free* event covers:
            # the first loads wait for all of it. Once per priming, never per unit.
            self._wait_for_compute()
        for slot, index in self.plan.first_loads:
            if self.copies.slot_owner[slot] != index:
                self.issue(slot, index)
        self.primed = True

    def leave(self) -> None:
        """Stop following the plan: make the compute stream wait for every issued copy and decode."""
        if self.cuda and self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            compute.wait_stream(self.decode_stream)
        self.primed = False
        self.forward_ended()

    def _wait_for_compute(self) -> None:
        """The copy and decode streams wait for the work queued on the compute stream so far (no host wait)."""
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # type: ignore[union-attr]
        self.decode_stream.wait_stream(compute)  # type: ignore[union-attr]
        self._compute_loads_waited = self.copies.compute_loads

    def on_plan(self, index: int, pos: int) -> bool:
        return pos < len(self.order) and self.order[pos] == index

    def before(self, index: int) -> None:
        """The compute stream waits until ``index``'s weights are in its slot."""
        if self.measure_stalls and self._unit_end is not None:
            self._pending.append(PendingTiming("between", index, self._unit_end, self.clock.mark()))
            self._unit_end = None
        if self.plan.slot_of[index] is None or not self.cuda:  # type: ignore[union-attr]
            return
        stream = torch.cuda.current_stream(self.device)
        if self.measure_stalls:
            before = self.clock.mark()
            stream.wait_event(self._ready[index])
            self._pending.append(PendingTiming("stall", index, before, self.clock.mark()))
        else:
            stream.wait_event(self._ready[index])

    def after(self, index: int, pos: int) -> None:
        """Mark ``index``'s slot free once its compute is done and issue the slot's next load."""
        plan = self.plan
        assert plan is not None
        slot = plan.slot_of[index]
        if slot is not None and self.cuda:
            self._free[slot].record(torch.cuda.current_stream(self.device))
        if self.measure_stalls:
            self._drop_unit_end()  # a unit called again before the next one began: only the latest end counts
            self._unit_end = self.clock.mark()
        load = plan.loads[pos]
        if load is not None and not (self.last_forward and pos in self._next_forward_loads):
            self.issue(*load)

    def forward_ended(self) -> None:
        """The forward is over (or left the plan): the time after its last unit call is not between units."""
        self._drop_unit_end()

    def _drop_unit_end(self) -> None:
        """Release the mark taken after the last unit call (`after`): no time between units is measured from it."""
        if self._unit_end is not None:
            self.clock.release(self._unit_end)
            self._unit_end = None

    def end_last_forward(self) -> None:
        """The last forward is over, its loads for the next forward not issued: a next forward primes them."""
        self.last_forward, self.primed = False, False

    def issue(self, slot: int, index: int) -> None:
        """Load ``index`` into ``slot`` on the copy stream once the slot's last reader has finished
        (a compressed load: see the module docstring)."""
        copies = self.copies
        copies.evict(slot)  # on the host, before the copy's time is marked
        if self.cuda and copies.compute_loads != self._compute_loads_waited:
            # A load on the compute stream since the streams last waited for it (a slot reloaded on demand after
            # an edit, mid-forward): its decode read the slot's staging buffer, which this copy may overwrite, and
            # *staged-free* (recorded on the decode stream) does not cover it. Rare; one attribute test otherwise.
            self._wait_for_compute()
        if self.cuda and index in copies.decoding:
            self._issue_compressed(slot, index)
        elif self.cuda:
            stream = self.copy_stream
            with torch.cuda.stream(stream):
                stream.wait_event(self._free[slot])
                start = self.clock.mark(stream) if self.measure_stalls else None
                copies.stage(index, slot)
                self._ready[index].record(stream)
                if start is not None:
                    self._pending.append(PendingTiming("copy", index, start, self.clock.mark(stream)))
        else:
            start = time.perf_counter()
            copies.copy_in(index, slot)
            self.totals.copy_ms += (time.perf_counter() - start) * 1e3
        copies.note_load(slot, index)

    def _issue_compressed(self, slot: int, index: int) -> None:
        copy, decode = self.copy_stream, self.decode_stream
        with torch.cuda.stream(copy):
            copy.wait_event(self._staging_free[slot])
            start = self.clock.mark(copy) if self.measure_stalls else None
            self.copies.stage(index, slot)
            self._arrived[slot].record(copy)
            if start is not None:
                self._pending.append(PendingTiming("copy", index, start, self.clock.mark(copy)))
        with torch.cuda.stream(decode):
            decode.wait_event(self._arrived[slot])
            decode.wait_event(self._free[slot])
            start = self.clock.mark(decode) if self.measure_stalls else None
            self.copies.decode_staged(index, slot)
            self._ready[index].record(decode)
            self._staging_free[slot].record(decode)
            if start is not None:
                self._pending.append(PendingTiming("decode", index, start, self.clock.mark(decode)))

    def harvest(self, wait: bool) -> None:
        """Fold finished copy/stall pairs into the totals; with ``wait``, all of them."""
        if not self._pending:
            return
        if wait and self.cuda:
            torch.cuda.synchronize(self.device)
        keep = []
        for timing in self._pending:
            if not self.clock.done(timing.end):
                keep.append(timing)
                continue
            ms = self.clock.ms(timing.start, timing.end)
            if timing.kind == "copy":
                self.totals.copy_ms += ms
            elif timing.kind == "decode":
                self.totals.decode_ms += ms
            elif timing.kind == "between":
                self.totals.between_units_ms += ms
            else:
                self.totals.stall_ms += ms
                self.totals.unit_stall_ms[timing.unit] += ms
            self.clock.release(timing.start, timing.end)
        self._pending = keep
