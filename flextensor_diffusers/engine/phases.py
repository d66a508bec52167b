"""The phases of an offloaded model, one small object each: what a forward does at its start, around each unit
call and at its end.

1. **Discovery** (first forward of a workload): units load on demand; their order is recorded.
2. **Profiling** (the next ``profiling_runs`` forwards): loads, compute, gaps and the activation peak are
   timed; then a plan is made (`planning.Planning`), or the budget falls short of the measured minimum.
3. **Steady**: the schedule follows the plan; no synchronisation, allocation or per-parameter work.
4. **Desynced**: a forward left the planned order (other control flow); it finishes on demand and the next
   forward is profiled again.
5. **Over budget**: the measured minimum exceeds the budget: the error is raised before the next forward (a
   pipeline raises it before the next forward of any of its components, naming the smallest budget for them all).
6. **On demand** / **removed**: ``remove()`` stopped half-way, or finished: units load on demand, nothing is
   planned.

The handle holds one phase object and hands it each boundary call; a phase switches the handle to the next
phase with `Phases.switch`. A phase owns no state beyond its kind: what it works on (the schedule, the profiler,
the device copies) is the handle's, seen through `PhaseContext`.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from .planner import Plan, allocated, everything_resident

if TYPE_CHECKING:
    from ..storage.host_copies import HostCopies
    from .config import OffloadConfig
    from .device_copies import DeviceCopies
    from .profiler import Profiler
    from .schedule import SteadySchedule
    from .units import Unit

logger = logging.getLogger(__name__)

#: Before a plan exists, units are all resident when the weights take at most this share of the budget: the
#: rest is left for activations, which are not measured yet.
PROFILE_RESIDENT_SHARE = 0.25


class Phase(StrEnum):
    DISCOVERY = "discovery"
    PROFILING = "profiling"
    STEADY = "steady"
    DESYNCED = "desynced"
    OVER_BUDGET = "over budget"
    ON_DEMAND = "on demand"
    REMOVED = "removed"


class PlanSource(Protocol):
    """What the phases ask of the planning: the plan in force, and a plan made once profiling is done."""

    plan: Plan | None

    def finish_profiling(self) -> None: ...


class PhaseContext(Protocol):
    """What the phases work on: the handle's parts and counters (the handle is one)."""

    units: list[Unit]
    config: OffloadConfig
    host: HostCopies
    device_copies: DeviceCopies
    schedule: SteadySchedule
    profiler: Profiler
    counters: dict[str, int]
    measured_forwards: int
    resident_weight_bytes: int
    phases: Phases

    @property
    def planning(self) -> PlanSource: ...

    @property
    def budget_bytes(self) -> int: ...

    @property
    def workload_entry(self) -> str: ...


class PhaseBehaviour:
    """Defaults: units load on demand, nothing is recorded, a failure leaves the schedule."""

    kind: Phase

    def __init__(self, handle: PhaseContext) -> None:
        self.handle = handle

    def layout(self) -> Plan | None:
        """What activation lays out in this phase: None is one shared profiling slot."""
        return None

    def start(self) -> None:
        """A workload call begins (its plan or profile is chosen already)."""

    def before_unit(self, index: int, pos: int, in_workload: bool) -> None:
        """Bring unit ``index`` (call ``pos`` of this forward) into device memory before it runs."""
        self.handle.device_copies.load_now(index)

    def after_unit(self, index: int, pos: int, in_workload: bool) -> None:
        """Unit ``index`` has been enqueued."""

    def end(self) -> None:
        """The workload call returned."""

    def fail(self) -> None:
        """The workload call raised: resynchronise at the next one."""
        self.handle.schedule.leave()


class Unplanned(PhaseBehaviour):
    """Discovery and profiling lay out every unit resident when all weights take at most
    `PROFILE_RESIDENT_SHARE` of the budget (a VAE, say: no loads while it is profiled), else one shared slot.

    An entry method (a VAE's ``decode`` or ``encode``) runs once per generation and calls its units once per frame
    or tile: through one shared slot, each unit would load as many times, where a native run moves each weight to
    the device once. Its unplanned calls therefore *keep* each unit they load (`keeps`): the unit gets a device copy
    of its own, filled at its first call and used by every later one, so that each unit the call runs is loaded
    once, as natively, and the units it does not run (the encoder's, during a decode) are not loaded at all. Kept
    copies stay within the same share of the budget as an all-resident layout, so that the activations, not
    measured yet, keep the rest (past it, units load through the slot on demand, as before); a profiling call
    counts them as the handle's own memory from the moment each is taken (`Profiler.own_bytes_grow`), so its
    measured activations are exact. Plans are not made from the sizes alone: the activations, the call order and
    the compute times are what a plan needs, and only a measured call gives them. ``forward`` workloads (a
    transformer's, a text encoder's) call each unit once: keeping them would take room from their activations
    and save no load, so they stay on the slot.
    """

    def layout(self) -> Plan | None:
        h = self.handle
        unit_bytes = [u.nbytes for u in h.units]
        if h.resident_weight_bytes + sum(unit_bytes) <= PROFILE_RESIDENT_SHARE * h.budget_bytes:
            return everything_resident(unit_bytes, h.resident_weight_bytes, h.budget_bytes)
        return None

    def keeps(self, index: int, in_workload: bool) -> bool:
        """Whether unit ``index``, called now in an unplanned workload call, is kept on the device (see the class
        docstring): an entry method's call, a unit on the slot, and room for it within the share."""
        h = self.handle
        if not in_workload or h.workload_entry == "forward":
            return False
        copies = h.device_copies
        if copies.slot_of[index] is None:
            return False
        taken = copies.device_bytes + allocated(h.units[index].nbytes, copies.allocation_granule)
        return taken <= PROFILE_RESIDENT_SHARE * h.budget_bytes


class Discovery(Unplanned):
    kind = Phase.DISCOVERY

    def start(self) -> None:
        self.handle.profiler.start_forward(False, self.handle.device_copies.device_bytes)

    def before_unit(self, index: int, pos: int, in_workload: bool) -> None:
        if self.keeps(index, in_workload):
            self.handle.device_copies.keep(index)
        else:
            super().before_unit(index, pos, in_workload)
        if in_workload:
            self.handle.profiler.observe(index)

    def end(self) -> None:
        h = self.handle
        h.counters["discovery"] += 1
        ran = set(h.profiler.observed)
        never = [u.name for u in h.units if u.index not in ran]
        if never:  # normal for a VAE's encoder during decode; loaded on demand if they do run
            logger.debug("%d unit(s) did not run in this workload (e.g. %s)", len(never), ", ".join(never[:3]))
        h.profiler.abandon()
        h.phases.switch(Profiling)


class Profiling(Unplanned):
    kind = Phase.PROFILING

    def start(self) -> None:
        self.handle.profiler.start_forward(True, self.handle.device_copies.device_bytes)

    def before_unit(self, index: int, pos: int, in_workload: bool) -> None:
        h = self.handle
        if not in_workload:
            super().before_unit(index, pos, in_workload)
            return
        copies = h.device_copies
        if self.keeps(index, in_workload):
            h.profiler.own_bytes_grow(allocated(h.units[index].nbytes, copies.allocation_granule))
            h.profiler.before_unit(index, lambda on_staged: copies.keep(index), copies.fill_bytes(index))
            return
        copies.make_room_for(index)  # before the load is timed: the evicted unit's write-back is not the load's
        h.profiler.before_unit(index, lambda on_staged: copies.load_now(index, on_staged), h.host.transfer_bytes(index))

    def after_unit(self, index: int, pos: int, in_workload: bool) -> None:
        if in_workload:
            self.handle.profiler.after_unit()

    def end(self) -> None:
        h = self.handle
        h.counters["profiling"] += 1
        h.profiler.end_forward()
        if len(h.profiler.runs) >= h.config.profiling_runs:
            h.planning.finish_profiling()


class Steady(PhaseBehaviour):
    kind = Phase.STEADY

    def layout(self) -> Plan | None:
        return self.handle.planning.plan

    def start(self) -> None:
        if not self.handle.schedule.primed:
            self.handle.schedule.prime()

    def before_unit(self, index: int, pos: int, in_workload: bool) -> None:
        h = self.handle
        if h.schedule.primed:
            if in_workload and h.schedule.on_plan(index, pos):
                h.schedule.before(index)
                return
            self._desync(index, pos, in_workload)
        super().before_unit(index, pos, in_workload)

    def after_unit(self, index: int, pos: int, in_workload: bool) -> None:
        if self.handle.schedule.primed:
            self.handle.schedule.after(index, pos)

    def end(self) -> None:
        h = self.handle
        h.counters["steady"] += 1
        h.measured_forwards += 1
        h.schedule.forward_ended()
        h.schedule.harvest(wait=False)

    def _desync(self, index: int, pos: int, in_workload: bool) -> None:
        h = self.handle
        order = h.schedule.order
        expected = h.units[order[pos]].name if pos < len(order) else "end of forward"
        logger.warning(
            "unit %r ran out of the planned order (call %d, expected %s); finishing this forward with on-demand "
            "loads and profiling the next one again",
            h.units[index].name,
            pos,
            expected,
        )
        h.counters["desyncs"] += 1
        h.schedule.leave()
        if in_workload:
            h.phases.switch(Desynced)


class Desynced(Steady):
    """The rest of a forward that left the plan: on demand, under the plan's layout."""

    kind = Phase.DESYNCED

    def before_unit(self, index: int, pos: int, in_workload: bool) -> None:
        PhaseBehaviour.before_unit(self, index, pos, in_workload)

    def after_unit(self, index: int, pos: int, in_workload: bool) -> None:
        pass

    def end(self) -> None:
        self.handle.counters["steady"] += 1
        self.handle.phases.profile_again()

    def fail(self) -> None:
        self.handle.phases.profile_again()


class OverBudget(PhaseBehaviour):
    kind = Phase.OVER_BUDGET


class OnDemand(PhaseBehaviour):
    kind = Phase.ON_DEMAND


class Removed(PhaseBehaviour):
    kind = Phase.REMOVED


class Phases:
    """The handle's current phase object, and the switches between phases."""

    def __init__(self, handle: PhaseContext, first: type[PhaseBehaviour]) -> None:
        self.handle = handle
        self.current: PhaseBehaviour = first(handle)

    @property
    def kind(self) -> Phase:
        return self.current.kind

    def switch(self, phase: type[PhaseBehaviour]) -> None:
        self.current = phase(self.handle)

    def profile_again(self) -> None:
        """Profile the next forward, in the current layout (loads of streamed units are timed)."""
        self._measure_again(Profiling)

    def rediscover(self) -> None:
        """Units were compiled after set-up: measure again from a warm-up forward (which compiles)."""
        if self.kind in (Phase.STEADY, Phase.PROFILING, Phase.OVER_BUDGET) and self.handle.units:
            self._measure_again(Discovery)

    def _measure_again(self, phase: type[PhaseBehaviour]) -> None:
        """What was measured no longer holds: the schedule stops, profiled runs are forgotten, ``phase`` next."""
        self.handle.schedule.leave()
        self.handle.profiler.restart()
        self.switch(phase)
