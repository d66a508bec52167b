"""`BoundaryCalls`: the model's calls as the handle sees them, routed to the current phase.

Set-up routes every call of the model, of its entry methods (a VAE's ``decode``) and of its units here
(`boundaries`). A *workload* call is the outermost entry call (``AutoencoderKL.forward`` calls ``encode`` and
``decode``: one workload): as it begins, a refusal is raised (over budget, a wrong load found earlier), device memory
is taken, the workload's plan or profile is chosen and the phase told; as each unit is called the phase brings it
into device memory, and as the workload ends or raises the phase is told again. This object owns what changes
within one workload call: the nesting depth, the position among its unit calls, the unit being called.

What it works on (the device copies, schedule, phases, planning) belongs to the handle, seen through `Routed`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .boundaries import refuse_if_inside_whole_model_compile
from .call_guards import (
    measuring_out_of_memory_error,
    nested_call_error,
    outside_a_call_error,
    refuse_autograd,
    refuse_views_of,
)
from .errors import BudgetError, FlexTensorError
from .phases import Phase
from .profile import workload_signature

if TYPE_CHECKING:
    from torch import nn

    from ..storage.host_copies import HostCopies
    from .binding import Binding
    from .device_copies import DeviceCopies
    from .hooks import HandleHooks, UnitDone
    from .load_checks import LoadChecks
    from .phases import Phases
    from .planning import Planning
    from .profiler import Clock, Profiler
    from .schedule import SteadySchedule
    from .stats import SetupTimes
    from .units import Unit

logger = logging.getLogger(__name__)


class Routed(Protocol):
    """What the boundary calls work on: the handle's parts, and its verbs that take and give device memory."""

    model: nn.Module
    units: list[Unit]
    cuda: bool
    device: torch.device
    hooks: HandleHooks[Any]
    load_checks: LoadChecks | None
    host: HostCopies
    binding: Binding
    device_copies: DeviceCopies
    schedule: SteadySchedule
    profiler: Profiler
    clock: Clock
    phases: Phases
    planning: Planning
    setup_times: SetupTimes

    @property
    def phase(self) -> Phase: ...

    @property
    def active(self) -> bool: ...

    @property
    def budget_bytes(self) -> int: ...

    def activate(self) -> None: ...

    def release(self) -> None: ...


class BoundaryCalls:
    """The workload and unit calls of ``handle``'s model (see the module docstring)."""

    def __init__(self, handle: Routed) -> None:
        self.handle = handle
        #: The entry method of the workload call in progress (``forward``, or a VAE's ``decode``, ...): the phases
        #: keep the units an unplanned entry call loads (`phases.Unplanned.keeps`).
        self.workload_entry = "forward"
        self._unit_done: UnitDone | None = None  # this forward's, from ``hooks.on_forward``
        self._depth = 0  # nesting of entry calls (AutoencoderKL.forward calls encode and decode)
        self._workload_started = 0.0  # when the outermost entry call began (`Clock.seconds`)
        self._pos = 0  # unit calls so far in the current workload call
        self._open_unit: int | None = None  # the unit being called now (units never nest)

    # ------------------------------------------------------------------------------------ workload calls

    def enter_forward(self, args: tuple, kwargs: dict) -> None:
        refuse_if_inside_whole_model_compile(self.handle.model)
        self._enter(args, kwargs, "forward")

    def entry(self, name: str) -> Callable[[tuple, dict], None]:
        def enter(args: tuple, kwargs: dict) -> None:
            self._enter(args, kwargs, name)

        return enter

    def _enter(self, args: tuple, kwargs: dict, entry: str) -> None:
        h = self.handle
        self._depth += 1
        if self._depth > 1:  # inside another entry call of this model: one workload
            return
        self._workload_started = h.clock.seconds()
        self._refuse_workload()
        h.host.compressed.encode_if_no_file()  # the payload file, checked after set-up, was missing or refused
        if h.host.compressed.arrived:  # the payload file's copies, read since set-up: measured from now on
            self._take_arrived_payloads()
        if not h.active:
            h.activate()
        elif h.binding.sweep():  # edits since the last forward: slots loaded ahead may be stale
            h.schedule.leave()
        self._pos, self._open_unit = 0, None
        if h.phase in (Phase.ON_DEMAND, Phase.REMOVED) or not h.units:
            return
        signature = workload_signature(args, kwargs)
        self.workload_entry = entry
        h.planning.enter_workload(signature if entry == "forward" else f"{entry}:{signature}")
        h.phases.current.start()
        self._ask_unit_done()

    def _refuse_workload(self) -> None:
        """Raise what refuses the workload call beginning now, its depth reset: ``hooks.budget_refusal``'s answer when
        set, else the handle's own shortfall (over budget); then a wrong load an earlier forward made, read back
        since."""
        h = self.handle
        refusal = self._budget_refusal()
        if refusal is not None:
            self._depth = 0
            raise refusal
        if h.load_checks is not None:
            try:
                h.load_checks.raise_faults(type(h.model).__name__, wait=False)
            except FlexTensorError:
                self._depth = 0
                raise

    def _budget_refusal(self) -> BudgetError | None:
        h = self.handle
        if h.hooks.budget_refusal is not None:
            return h.hooks.budget_refusal()
        return h.planning.shortfall_error() if h.phase is Phase.OVER_BUDGET else None

    def _ask_unit_done(self) -> None:
        """A forward begins: tell ``hooks.on_forward``, which may ask, for a forward on plan, to be told of each unit
        done (`UnitDone`). Such a forward issues no load for the next one (the component is expected to switch out
        after it)."""
        h = self.handle
        self._unit_done = None
        if h.hooks.on_forward is None:
            return
        on_plan = h.phase is Phase.STEADY and h.schedule.primed
        unit_done = h.hooks.on_forward(h, on_plan)
        if unit_done is not None and on_plan:
            self._unit_done = unit_done
            h.schedule.last_forward = True

    def _take_arrived_payloads(self) -> None:
        """Set-up did not wait for its payloads (the payload file, `setup.may_read_payloads_later`, or the encoder
        between forwards) and they have all arrived (at a forward's start; made between forwards: at the end of the
        gap that made the last): they are kept, each proven at its first decoded load, and every workload is
        measured again from a discovery forward, whose on-demand loads decode and prove them, so that plans may
        decode them."""
        h = self.handle
        h.release()
        if h.host.compressed.adopt_arrival(h.planning.staging_refusal):  # else none kept, with a warning saying why
            h.planning.forget_workloads()
            h.phases.rediscover()

    def exit_workload(self, output: Any = None) -> None:
        h = self.handle
        self._depth -= 1
        if self._depth == 0 and h.load_checks is not None:
            h.load_checks.end_of_forward()
        if self._depth == 0:
            h.binding.after_call(h.device_copies.base, h.phase in (Phase.DISCOVERY, Phase.PROFILING))
            h.phases.current.end()
            self._end_unit_done()
            h.host.compressed.encode_if_no_file()
            if h.host.compressed.encoding_between_forwards:
                self._encode_between_forwards()
                if h.host.compressed.arrived:  # the last unit made: kept now, so that a host tier may move them
                    self._take_arrived_payloads()
            h.host.form.release_raw_for_edits()  # payloads only: edited raw bytes go once their payloads are proven

    def _encode_between_forwards(self) -> None:
        """``background_encoding``: the workload is over; encode the next units for as long as it took (so the raw
        forwards meanwhile run at least half as fast), its device memory given back first on CUDA, since the
        device encoder may take the whole budget (the next forward takes it back: `activate`). As many units as
        ``hooks.encoding_room`` made host RAM for (a pipeline's host tier), when given."""
        h = self.handle
        gap_started = h.clock.seconds()
        if h.cuda:
            h.release()
        room = h.hooks.encoding_room
        try:
            with room(h) if room is not None else contextlib.nullcontext() as limit:
                seconds = gap_started - self._workload_started
                h.host.compressed.encode_between_forwards(seconds, h.clock.seconds, limit)
        finally:
            gap_ms = 1e3 * (h.clock.seconds() - gap_started)
            h.setup_times.compress = (h.setup_times.compress or 0.0) + gap_ms

    def _end_unit_done(self) -> None:
        """The forward whose units were told done is over: the next one (if the component runs again after all)
        primes its loads anew."""
        if self._unit_done is not None:
            self._unit_done = None
            self.handle.schedule.end_last_forward()

    def fail_workload(self, exc: BaseException) -> BaseException | None:
        """The workload raised: forget its partial records and resynchronise at the next one. A device
        mismatch is what using a streamed unit's weights outside its call gives on CUDA (they view their host
        copy then): that is said, with the fix."""
        h = self.handle
        measuring = h.phase in (Phase.DISCOVERY, Phase.PROFILING)
        self._depth, self._open_unit = 0, None
        self._end_unit_done()
        h.profiler.abandon()
        h.phases.current.fail()
        logger.debug("a forward of %s raised; resynchronising at the next one", type(h.model).__name__)
        if isinstance(exc, RuntimeError) and "same device" in str(exc) and h.cuda:
            return outside_a_call_error(type(h.model).__name__, exc)
        if isinstance(exc, torch.OutOfMemoryError) and measuring and not isinstance(exc, BudgetError):
            room = h.budget_bytes - h.planning.weights_minimum()
            free = torch.cuda.memory_reserved(h.device) - torch.cuda.memory_allocated(h.device) if h.cuda else 0
            return measuring_out_of_memory_error(type(h.model).__name__, h.budget_bytes, room, exc, free)
        return None

    def units_compiled(self) -> None:
        """A unit was compiled after set-up: its compute times change, so every workload is measured again,
        after a warm-up forward (which compiles), and planned from the compiled times."""
        self.handle.planning.forget_workloads()
        self.handle.phases.rediscover()

    # ------------------------------------------------------------------------------------ unit calls

    def unit_entry(self, index: int) -> Callable[[tuple, dict], None]:
        h = self.handle
        unit = h.units[index]
        grads = [p for p in unit.module.parameters() if p.requires_grad]

        def enter(args: tuple, kwargs: dict) -> None:
            if self._open_unit is not None:
                outer, self._open_unit = h.units[self._open_unit].name, None
                raise nested_call_error(unit.name, outer)
            if torch.is_grad_enabled():
                streamed = h.device_copies.slot_of[index] is not None
                refuse_autograd(unit.name, grads, streamed, args, kwargs)
            if not h.active:
                h.activate()  # a unit called on its own, outside the model's forward
            pos, self._pos = self._pos, self._pos + 1
            h.phases.current.before_unit(index, pos, self._depth > 0)
            h.device_copies.bind_for_call(index)
            if h.load_checks is not None:
                self._check_load(index, before=True)
            self._open_unit = index

        return enter

    def unit_exit(self, index: int) -> Callable[[Any], None]:
        h = self.handle
        name = h.units[index].name

        def exit_(output: Any) -> None:
            self._open_unit = None
            h.binding.after_call(h.units[index], h.phase in (Phase.DISCOVERY, Phase.PROFILING))
            slot = h.device_copies.slot_of[index]
            if slot is not None and h.device_copies.buffers.slots:
                refuse_views_of(h.device_copies.buffers.slots[slot], name, output)
            if h.load_checks is not None:  # before the slot is handed on
                self._check_load(index, before=False)
            h.phases.current.after_unit(index, self._pos - 1, self._depth > 0)
            if self._unit_done is not None and h.schedule.last_calls.get(index) == self._pos - 1:
                self._tell_unit_done(index)

        return exit_

    def _tell_unit_done(self, index: int) -> None:
        """Unit ``index`` made its last call of this forward: tell ``hooks.on_forward``'s listener, with an event on
        the compute stream that completes once the call (and so every load it computed with) is done."""
        h = self.handle
        if h.phase is not Phase.STEADY:  # left the plan: its positions no longer say which call is the last
            return
        event = None
        if h.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(h.device))
        self._unit_done(h.units[index], event)  # type: ignore[misc]

    def unit_failed(self, exc: BaseException) -> None:
        self._open_unit = None

    def _check_load(self, index: int, before: bool) -> None:
        """``verify_loads``: compare the device bytes unit ``index`` computes with (before its call), or computed
        with (after it), with its weights. Not while its tensors hold a write the binding has not handled yet (a
        unit that updates its own buffers, called again before its edit is found): those bytes are its weights
        now, which its host copy learns only when the edit is found."""
        h = self.handle
        unit = h.units[index]
        flat = h.binding.on_device(unit)
        if flat is None or h.load_checks is None or not h.binding.unchanged(unit):
            return
        if before:
            how = f"{h.device_copies.load_path(index)}, {h.phase} phase"
            h.load_checks.before_call(unit, flat, how)
        else:
            h.load_checks.after_call(unit, flat)
