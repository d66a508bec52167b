"""`OffloadHandle`: one offloaded model, and the public face of the engine.

The handle wires together the objects that each own one thing, and routes the model's boundary calls to them:

* `HostCopies` (host_copies.py): the host bytes, the weights' truth; packing, compressed copies, spilling;
* `DeviceCopies` (device_copies.py): device buffers laid out by the plan, and every load into them;
* `Binding` (binding.py) and `Edits` (edits.py): what each tensor views, and edits reaching the host copies;
* `Planning` (planning.py): the budget, the workloads' profiles and the plan in force;
* the current phase (phases.py): what a forward does at its start, around each unit call and at its end;
* `SteadySchedule` (schedule.py): the planned loads on the copy stream; `Profiler`: the measured forwards;
* `SetUp` (setup.py): everything offloading adds to a model, and its undoing.

Set-up packs every unit into host memory; then the first forward of a workload discovers the order of the units,
the next ones profile it, and a plan is made under the budget. `release` gives all device memory back and
`activate` takes it again with the same plan: that is how a pipeline keeps only its active component on the GPU.

What other layers may use: `offload`, `offload_shared`, the handle's public methods and properties, and its
``host`` (`HostCopies`), which the pipelines' host tiers move between RAM and disk.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..storage.payload_cache import PayloadCache
from ..storage.raw_homes import RawHome
from ..storage.shared_host import SharedHostMemory
from .boundaries import refuse_if_inside_whole_model_compile, refuse_whole_model_compile
from .call_guards import (
    measuring_out_of_memory_error,
    nested_call_error,
    outside_a_call_error,
    refuse_autograd,
    refuse_views_of,
)
from .config import OffloadConfig, resolve_budget, resolve_device
from .errors import BudgetError, FlexTensorError, OffloadStateError
from .load_checks import LoadCheckError, LoadChecks, LoadCheckSummary
from .phases import Discovery, OnDemand, Phase, Phases, Removed, Steady
from .planner import Plan, WorkloadProfile
from .planning import Planning
from .profile import model_fingerprint, workload_signature
from .profiler import Clock, Profiler
from .schedule import SteadySchedule, TransferTotals
from .setup import SetUp, SetupTimes, assemble
from .stats import OffloadStats, collect_stats
from .units import Unit, UnitLayout, find_units, plan_layout

logger = logging.getLogger(__name__)

#: Told that a unit made its last call of a forward, with an event that completes once that call is done on the
#: device (None on the CPU, where it is done already): see `OffloadHandle.on_forward`.
UnitDone = Callable[[Unit, "torch.cuda.Event | None"], None]

#: Every module that is part of an offloaded model, so that offloading it again is refused.
_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def is_offloaded(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it is part of an offloaded model now."""
    return any(m in _OFFLOADED for m in model.modules())


class OffloadHandle:
    """Streams the units of ``model`` under ``config.gpu_budget``; see the module docstring.

    Args:
        model: the module to offload; its units are the submodules ``config.include_patterns`` select.
        config: budget, patterns, compression, profiles (`OffloadConfig`).
        layout: ``model``'s units already laid out for ``config`` and its device (`units.plan_layout`), by a
            caller that checked budgets from it (the pipelines do, for every component before offloading any);
            None lays them out here.
        raw_home: with ``raw_copies="disk"``, where the raw bytes of units kept compressed wait (`RawHome`; the
            pipelines give their weight files); None: a cache file in ``config.cache_dir``.
    """

    def __init__(
        self, model: nn.Module, config: OffloadConfig, layout: UnitLayout | None = None, raw_home: RawHome | None = None
    ) -> None:
        started = time.perf_counter()
        self._refuse_model(model, config)
        self.model, self.config = model, config
        self.device = resolve_device(config.device)
        self.cuda = self.device.type == "cuda"
        # Another process packed these weights into shared memory: point at them, copy nothing.
        self.attaching = config.shared_host is not None and not config.shared_host.create
        if layout is None:
            selected = find_units(model, config.include_patterns, config.exclude_patterns)
            # Weights shared between processes are laid out alike in each (canonically); others keep their place.
            shared = config.shared_host is not None
            layout = plan_layout(model, selected, self.device, meta_ok=self.attaching, canonical=shared)
        copies = assemble(model, layout, self.device)
        self.host, self.device_copies, self.binding, self.edits = (
            copies.host,
            copies.device,
            copies.binding,
            copies.edits,
        )
        self.units = layout.units
        #: ``verify_loads``: every unit call compares its device bytes with its weights (`load_checks`).
        self.load_checks = LoadChecks(self.units, self.device, self.host.host_of) if config.verify_loads else None
        self.edits.load_checks = self.load_checks
        self.host.on_packed = self.load_checks.note_packed if self.load_checks is not None else None
        self.resident_weight_bytes = self.device_copies.resident_weight_bytes
        # A compressed model loads other bytes (and needs staging room): its profiles are its own.
        marker = [f"compression={config.compression}"] if config.compression != "none" else []
        self.fingerprint = model_fingerprint(model, [u.name for u in self.units] + marker)
        self.set_up = SetUp(self, raw_home)
        self.planning = Planning(self, resolve_budget(config.gpu_budget, self.device))
        self.planning.check_budget(self.budget_bytes)
        given = self.planning.profiles.given
        if given is not None:  # measured activations known now: check before packing anything
            self.planning.check_budget(self.budget_bytes, given.profile)
        self.setup_times = SetupTimes(layout=1e3 * (time.perf_counter() - started))
        self._start_state()
        try:
            self.set_up.run()
            if config.active_after_setup:
                self.activate()
        except BaseException:
            self._undo()
            raise
        _OFFLOADED.update(model.modules())

    @staticmethod
    def _refuse_model(model: nn.Module, config: OffloadConfig) -> None:
        refuse_whole_model_compile(model)
        if is_offloaded(model):
            raise OffloadStateError(
                f"{type(model).__name__} (or a module inside it) is already offloaded: call remove() on "
                "the existing handle before offloading again"
            )
        for name in config.entry_methods:
            if not callable(getattr(model, name, None)):
                raise FlexTensorError(f"entry method {name!r} is not a method of {type(model).__name__}")

    def _start_state(self) -> None:
        """What changes from call to call: the phase, counters, the position in the current forward."""
        self.phases = Phases(self, Discovery if self.units else Steady)
        #: Asked as each workload call begins; an error it returns is raised instead of running the call. A pipeline
        #: refuses every component's calls once any of them is over budget, naming the smallest budget for them all
        #: (`PipelineOffload.budget_error`). None: this handle refuses its own calls while it is over budget.
        self.budget_refusal: Callable[[], BudgetError | None] | None = None
        #: The entry method of the workload call in progress (``forward``, or a VAE's ``decode``, ...): the phases
        #: keep the units an unplanned entry call loads (`phases.Unplanned.keeps`).
        self.workload_entry = "forward"
        #: Called with this handle before it takes device memory (a pipeline releases the others).
        self.on_activate: Callable[[OffloadHandle], None] | None = None
        #: Called with this handle as each forward begins, and whether it follows a plan; what it returns for one
        #: that does, when not None, is told of each unit whose last call of that forward is done (`UnitDone`): a
        #: pipeline's host tier hands the RAM of a component's compressed copies over to the next component during
        #: its last forward before a switch.
        self.on_forward: Callable[[OffloadHandle, bool], UnitDone | None] | None = None
        self._unit_done: UnitDone | None = None  # this forward's, from ``on_forward``
        self.counters = {"discovery": 0, "profiling": 0, "steady": 0, "desyncs": 0, "plans": 0, "activations": 0}
        self.measured_forwards = 0
        self._depth = 0  # nesting of entry calls (AutoencoderKL.forward calls encode and decode)
        self._workload_started = 0.0  # when the outermost entry call began (`Clock.seconds`)
        self._pos = 0  # unit calls so far in the current workload call
        self._open_unit: int | None = None  # the unit being called now (units never nest)
        self.clock = Clock(self.device)
        self.profiler = Profiler(self.device, self.clock)
        self.totals = TransferTotals(unit_stall_ms=[0.0] * len(self.units))
        self.schedule = SteadySchedule(self.device_copies, self.clock, self.config.measure_stalls, self.totals)

    def _undo(self) -> None:
        """Give every tensor its own storage again and remove what set-up added (failed set-up, removal)."""
        self.device_copies.release()
        self.host.restore(self.device_copies.restored)
        self.device_copies.unpacked.restore_loose()
        self.set_up.undo()

    # ------------------------------------------------------------------------------------ state

    @property
    def phase(self) -> Phase:
        return self.phases.kind

    @property
    def budget_bytes(self) -> int:
        return self.planning.budget_bytes

    @property
    def plan(self) -> Plan | None:
        return self.planning.plan

    @property
    def profile(self) -> WorkloadProfile | None:
        return self.planning.profile

    @property
    def shortfall(self) -> BudgetError | None:
        """The measured minimum exceeded the budget (phase over budget): the error, raised before the next
        forward (`budget_refusal` may say otherwise)."""
        return self.planning.shortfall

    @property
    def raw_on_disk(self) -> bool:
        """``raw_copies="disk"``: the raw host copies wait in a cache file; loads decode compressed copies."""
        return self.host.compressed_only

    @property
    def payload_cache(self) -> PayloadCache | None:
        """With ``compression_cache``: the file of the compressed copies, read or written at set-up."""
        return self.set_up.payload_cache

    @property
    def active(self) -> bool:
        return self.device_copies.active

    def smallest_budget(self, profile: WorkloadProfile | None = None) -> int:
        """The least budget for ``profile`` (default: the current one; none yet: the set-up minimum)."""
        return self.planning.smallest_budget(profile)

    def set_budget(self, budget: int | str) -> Plan | None:
        """Change the budget; with a measured profile the workload is planned again at once. A budget under
        the minimum is refused and the handle keeps its plan."""
        return self.planning.set_budget(budget)

    def save_profile(self, path: str | Path) -> Path:
        """Write the measured profile, for ``OffloadConfig(profile=path)`` on a later run."""
        return self.planning.save(path)

    def stats(self) -> OffloadStats:
        """Totals since set-up (synchronises the device to read pending events)."""
        self.schedule.harvest(wait=True)
        return collect_stats(self)

    # ------------------------------------------------------------------------------------ device memory

    def activate(self) -> None:
        """Take device memory: the base, then the plan's resident units and slots (or the profiling slot)."""
        if self.active:
            return
        if self.on_activate is not None:
            self.on_activate(self)
        self.device_copies.activate(self.phases.current.layout())
        self.planning.follow()
        self.counters["activations"] += 1

    def release(self) -> None:
        """Give back all device memory; tensors point at their host copies until `activate`."""
        if not self.active:
            return
        self.schedule.leave()
        self.device_copies.release()

    @contextmanager
    def editing(self) -> Iterator[None]:
        """Edit weights (fuse a LoRA, load a state dict, ``param.data.copy_()``) so that the edit reaches the
        host copies, which every later load copies from. See `Edits.editing`."""
        if self.phase is Phase.REMOVED:
            raise OffloadStateError("this handle was removed: edit the model directly")
        was_active = self.active
        self.release()
        try:
            with self.edits.editing():
                yield
        finally:
            if was_active:
                self.activate()

    # ------------------------------------------------------------------------------------ workload calls

    def enter_forward(self, args: tuple, kwargs: dict) -> None:
        refuse_if_inside_whole_model_compile(self.model)
        self._enter(args, kwargs, "forward")

    def entry(self, name: str) -> Callable[[tuple, dict], None]:
        def enter(args: tuple, kwargs: dict) -> None:
            self._enter(args, kwargs, name)

        return enter

    def _enter(self, args: tuple, kwargs: dict, entry: str) -> None:
        self._depth += 1
        if self._depth > 1:  # inside another entry call of this model: one workload
            return
        self._workload_started = self.clock.seconds()
        refusal = self._budget_refusal()
        if refusal is not None:
            self._depth = 0
            raise refusal
        if self.load_checks is not None:  # a wrong load an earlier forward made, read back since
            try:
                self.load_checks.raise_faults(type(self.model).__name__, wait=False)
            except FlexTensorError:
                self._depth = 0
                raise
        self.host.compressed.encode_if_no_file()  # the payload file, checked after set-up, was missing or refused
        if self.host.compressed.arrived:  # the payload file's copies, read since set-up: measured from now on
            self._take_arrived_payloads()
        if not self.active:
            self.activate()
        elif self.binding.sweep():  # edits since the last forward: slots loaded ahead may be stale
            self.schedule.leave()
        self._pos, self._open_unit = 0, None
        if self.phase in (Phase.ON_DEMAND, Phase.REMOVED) or not self.units:
            return
        signature = workload_signature(args, kwargs)
        self.workload_entry = entry
        self.planning.enter_workload(signature if entry == "forward" else f"{entry}:{signature}")
        self.phases.current.start()
        self._ask_unit_done()

    def _budget_refusal(self) -> BudgetError | None:
        """What refuses the workload call beginning now: ``budget_refusal``'s answer when set, else this handle's own
        shortfall (over budget)."""
        if self.budget_refusal is not None:
            return self.budget_refusal()
        return self.planning.shortfall_error() if self.phase is Phase.OVER_BUDGET else None

    def _ask_unit_done(self) -> None:
        """A forward begins: tell ``on_forward``, which may ask, for a forward on plan, to be told of each unit done
        (`UnitDone`). Such a forward issues no load for the next one (the component is expected to switch out
        after it)."""
        self._unit_done = None
        if self.on_forward is None:
            return
        on_plan = self.phase is Phase.STEADY and self.schedule.primed
        unit_done = self.on_forward(self, on_plan)
        if unit_done is not None and on_plan:
            self._unit_done = unit_done
            self.schedule.last_forward = True

    def _take_arrived_payloads(self) -> None:
        """Set-up did not wait for the payload file (`setup.may_read_payloads_later`) and its copies have all
        arrived: they are kept, each proven at its first decoded load, and every workload is measured again from a
        discovery forward, whose on-demand loads decode and prove them, so that plans may decode them."""
        self.release()
        if self.host.compressed.adopt_arrival():  # else the file was refused, with a warning that says so
            self.planning.forget_workloads()
            self.phases.rediscover()

    def exit_workload(self, output: Any = None) -> None:
        self._depth -= 1
        if self._depth == 0 and self.load_checks is not None:
            self.load_checks.end_of_forward()
        if self._depth == 0:
            self.binding.after_call(self.device_copies.base, self.phase in (Phase.DISCOVERY, Phase.PROFILING))
            self.phases.current.end()
            self._end_unit_done()
            self.host.compressed.encode_if_no_file()
            if self.host.compressed.encoding_between_forwards:
                self._encode_between_forwards()

    def _encode_between_forwards(self) -> None:
        """``background_encoding``: the workload is over; encode the next units for as long as it took (so the raw
        forwards meanwhile run at least half as fast), its device memory given back first on CUDA, since the
        device encoder may take the whole budget (the next forward takes it back: `activate`)."""
        gap_started = self.clock.seconds()
        if self.cuda:
            self.release()
        try:
            self.host.compressed.encode_between_forwards(gap_started - self._workload_started, self.clock.seconds)
        finally:
            gap_ms = 1e3 * (self.clock.seconds() - gap_started)
            self.setup_times.compress = (self.setup_times.compress or 0.0) + gap_ms

    def _end_unit_done(self) -> None:
        """The forward whose units were told done is over: the next one (if the component runs again after all)
        primes its loads anew."""
        if self._unit_done is not None:
            self._unit_done = None
            self.schedule.end_last_forward()

    def fail_workload(self, exc: BaseException) -> BaseException | None:
        """The workload raised: forget its partial records and resynchronise at the next one. A device
        mismatch is what using a streamed unit's weights outside its call gives on CUDA (they view their host
        copy then): that is said, with the fix."""
        measuring = self.phase in (Phase.DISCOVERY, Phase.PROFILING)
        self._depth, self._open_unit = 0, None
        self._end_unit_done()
        self.profiler.abandon()
        self.phases.current.fail()
        logger.debug("a forward of %s raised; resynchronising at the next one", type(self.model).__name__)
        if isinstance(exc, RuntimeError) and "same device" in str(exc) and self.cuda:
            return outside_a_call_error(type(self.model).__name__, exc)
        if isinstance(exc, torch.OutOfMemoryError) and measuring and not isinstance(exc, BudgetError):
            room = self.budget_bytes - self.planning.weights_minimum()
            return measuring_out_of_memory_error(type(self.model).__name__, self.budget_bytes, room, exc)
        return None

    def units_compiled(self) -> None:
        """A unit was compiled after set-up: its compute times change, so every workload is measured again,
        after a warm-up forward (which compiles), and planned from the compiled times."""
        self.planning.forget_workloads()
        self.phases.rediscover()

    # ------------------------------------------------------------------------------------ unit calls

    def unit_entry(self, index: int) -> Callable[[tuple, dict], None]:
        unit = self.units[index]
        grads = [p for p in unit.module.parameters() if p.requires_grad]

        def enter(args: tuple, kwargs: dict) -> None:
            if self._open_unit is not None:
                outer, self._open_unit = self.units[self._open_unit].name, None
                raise nested_call_error(unit.name, outer)
            if torch.is_grad_enabled():
                streamed = self.device_copies.slot_of[index] is not None
                refuse_autograd(unit.name, grads, streamed, args, kwargs)
            if not self.active:
                self.activate()  # a unit called on its own, outside the model's forward
            pos, self._pos = self._pos, self._pos + 1
            self.phases.current.before_unit(index, pos, self._depth > 0)
            self.device_copies.bind_for_call(index)
            if self.load_checks is not None:
                self._check_load(index, before=True)
            self._open_unit = index

        return enter

    def unit_exit(self, index: int) -> Callable[[Any], None]:
        name = self.units[index].name

        def exit_(output: Any) -> None:
            self._open_unit = None
            self.binding.after_call(self.units[index], self.phase in (Phase.DISCOVERY, Phase.PROFILING))
            slot = self.device_copies.slot_of[index]
            if slot is not None and self.device_copies.buffers.slots:
                refuse_views_of(self.device_copies.buffers.slots[slot], name, output)
            if self.load_checks is not None:  # before the slot is handed on
                self._check_load(index, before=False)
            self.phases.current.after_unit(index, self._pos - 1, self._depth > 0)
            if self._unit_done is not None and self.schedule.last_calls.get(index) == self._pos - 1:
                self._tell_unit_done(index)

        return exit_

    def _tell_unit_done(self, index: int) -> None:
        """Unit ``index`` made its last call of this forward: tell ``on_forward``'s listener, with an event on the
        compute stream that completes once the call (and so every load it computed with) is done."""
        if self.phase is not Phase.STEADY:  # left the plan: its positions no longer say which call is the last
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._unit_done(self.units[index], event)  # type: ignore[misc]

    def unit_failed(self, exc: BaseException) -> None:
        self._open_unit = None

    def _check_load(self, index: int, before: bool) -> None:
        """``verify_loads``: compare the device bytes unit ``index`` computes with (before its call), or computed
        with (after it), with its weights. Not while its tensors hold a write the binding has not handled yet (a
        unit that updates its own buffers, called again before its edit is found): those bytes are its weights
        now, which its host copy learns only when the edit is found."""
        unit = self.units[index]
        flat = self.binding.on_device(unit)
        if flat is None or self.load_checks is None or not self.binding.unchanged(unit):
            return
        if before:
            how = f"{self.device_copies.load_path(index)}, {self.phase} phase"
            self.load_checks.before_call(unit, flat, how)
        else:
            self.load_checks.after_call(unit, flat)

    def check_loads(self) -> LoadCheckSummary | None:
        """With ``verify_loads``: wait for every comparison enqueued so far and raise `LoadCheckError` when a unit
        computed with bytes that are not its weights; else the comparisons made (None without ``verify_loads``)."""
        if self.load_checks is None:
            return None
        summary = self.load_checks.summary()  # one wait for the device
        if summary.faults:
            raise LoadCheckError(type(self.model).__name__, summary.faults)
        return summary

    # ------------------------------------------------------------------------------------ removal

    def wait_until_packed(self) -> None:
        """Return once every unit's host copy is packed (set-up packs raw copies on threads while the model is
        already in use, each unit adopted when first asked for); raise a unit's packing failure."""
        self.host.gate_all()

    def remove(self) -> None:
        """Undo everything: every tensor bit-exact on the device it came from, classes and hooks back.

        Units are restored one by one, each all-or-nothing; if one fails (out of memory, say), the units not
        yet restored keep streaming on demand, the model still computes correctly, and ``remove()`` may be
        called again.
        """
        if self.phase is Phase.REMOVED:
            raise OffloadStateError("this handle was already removed")
        self.schedule.leave()
        self.phases.switch(OnDemand)
        self.planning.drop()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self._undo()
        for module in self.model.modules():
            _OFFLOADED.discard(module)
        self.phases.switch(Removed)


def offload(model: nn.Module, config: OffloadConfig | None = None, **kwargs: Any) -> OffloadHandle:
    """Stream ``model``'s units from host memory under a GPU budget; returns the handle.

    ``offload(model, include_patterns=["blocks.*"], gpu_budget="24GiB")`` is the same as passing an
    `OffloadConfig`. ``model``'s blocks may be compiled (``compile_repeated_blocks``, or ``block.compile()`` on
    each unit) before or after; whole-model compilation is refused (see `boundaries`).
    """
    if config is None:
        config = OffloadConfig(**kwargs)
    elif kwargs:
        raise TypeError("pass either an OffloadConfig or keyword arguments, not both")
    return OffloadHandle(model, config)


def offload_shared(
    model: nn.Module, config: OffloadConfig, namespace: str, group: Any = None, root: str | Path = "/dev/shm"
) -> OffloadHandle:
    """`offload` on every process of a ``torch.distributed`` job, with one host copy per host.

    The process with ``LOCAL_RANK`` 0 (or rank 0 when unset) packs; all wait at a barrier; then the others
    attach. Build the model on the meta device in the attaching processes to skip their own copy of the weights.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise FlexTensorError("offload_shared needs torch.distributed: call init_process_group first")
    creator = int(os.environ.get("LOCAL_RANK", dist.get_rank(group))) == 0
    shared = SharedHostMemory(namespace, create=creator, root=root)
    handle, error = None, None
    if creator:
        try:
            handle = offload(model, dataclasses.replace(config, shared_host=shared))
        except Exception as exc:  # reach the barrier anyway, so that the others fail instead of waiting
            error = exc
    dist.barrier(group)
    if error is not None:
        raise error
    if handle is None:  # raises "no shared weights" when the creator failed
        handle = offload(model, dataclasses.replace(config, shared_host=shared))
    return handle
