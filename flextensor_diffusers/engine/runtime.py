"""`OffloadHandle`: one offloaded model, routing each call to the object of the current phase.

The work is split by what each part owns:

* `Residency` (residency.py): host buffers (the weights' truth), device copies, binding, edits, teardown;
* `Profiler` (profiler.py): discovery and profiling forwards, as typed records;
* `SteadySchedule` (schedule.py): the planned loads, the copy stream and its events;
* `Boundaries` (boundaries.py): the calls of units and entry points, kept outside ``torch.compile``.

Life of a handle, one phase at a time:

1. **Set-up**: units and the base are packed into pinned host buffers; the base goes to the device
   and every unit is bound to one shared profiling slot. Any failure undoes all of it (`Residency.teardown`).
2. **Discovery** (first forward of a workload): units load on demand; their order is recorded.
3. **Profiling** (next ``profiling_runs`` forwards): loads, compute, gaps and the activation peak are
   timed. Then the budget is checked against the measured minimum (**over budget** when it falls
   short: the rest runs on demand and the error is raised before the next forward, or by the pipeline)
   and a plan is made.
4. **Steady**: the schedule follows the plan; no synchronisation, allocation or per-parameter work.
5. **Desynced**: a forward left the planned order (other control flow); it finishes on demand and
   the next forward is profiled again.

A *workload* is one call of ``forward`` or of an entry method (a VAE's ``decode``) with given input
shapes; each has its own profile and plan, kept in memory (and on disk with ``profile_dir``), so
switching between known workloads re-plans without profiling.

`release` gives all device memory back and `activate` takes it again with the same plan: that is
how a pipeline keeps only its active component on the GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .boundaries import (
    Boundaries,
    Crossing,
    hidden,
    refuse_if_inside_whole_model_compile,
    refuse_whole_model_compile,
)
from .config import OffloadConfig, cache_folder, format_bytes, parse_bytes, resolve_budget, resolve_device
from .errors import BudgetError, FlexTensorError, InferenceOnlyError, OffloadStateError
from .payload_cache import PayloadCache, weights_key
from .planner import Plan, WorkloadProfile, check_budget, everything_resident, plan_residency, smallest_budget
from .profile import ProfileStore, SavedProfile, device_name, model_fingerprint, workload_signature
from .profiler import Clock, Profiler
from .residency import Residency, SetupTimes
from .schedule import SteadySchedule, TransferTotals
from .shared_host import SharedHostMemory
from .stats import OffloadStats, UnitStats
from .units import find_units, plan_layout

logger = logging.getLogger(__name__)

#: Before a plan exists, units are all resident when the weights take at most this share of the
#: budget: the rest is left for activations, which are not measured yet.
PROFILE_RESIDENT_SHARE = 0.25
#: Every module that is part of an offloaded model, so that offloading it again is refused.
_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class Phase(StrEnum):
    DISCOVERY = "discovery"
    PROFILING = "profiling"
    STEADY = "steady"
    DESYNCED = "desynced"  # this forward left the plan: it finishes on demand, the next one is profiled
    OVER_BUDGET = "over budget"  # the measured minimum exceeds the budget: on demand until it is raised
    ON_DEMAND = "on demand"  # remove() stopped half-way: remaining units load on demand, nothing is planned
    REMOVED = "removed"


class OffloadHandle:
    """Streams the units of ``model`` under ``config.gpu_budget``; see the module docstring."""

    def __init__(self, model: nn.Module, config: OffloadConfig) -> None:
        refuse_whole_model_compile(model)
        if any(m in _OFFLOADED for m in model.modules()):
            raise OffloadStateError(
                f"{type(model).__name__} (or a module inside it) is already offloaded: call remove() on "
                "the existing handle before offloading again"
            )
        started = time.perf_counter()
        self.model = model
        self.config = config
        self.device = resolve_device(config.device)
        self.cuda = self.device.type == "cuda"
        # Another process packed these weights into shared memory: point at them, copy nothing.
        self._attaching = config.shared_host is not None and not config.shared_host.create
        selected = find_units(model, config.include_patterns, config.exclude_patterns)
        # Weights shared between processes are laid out alike in each (canonically); others keep their placement.
        canonical = config.shared_host is not None
        layout = plan_layout(model, selected, self.device, meta_ok=self._attaching, canonical=canonical)
        for name in config.entry_methods:
            if not callable(getattr(model, name, None)):
                raise FlexTensorError(f"entry method {name!r} is not a method of {type(model).__name__}")
        self.residency = Residency(model, layout, self.device)
        self.units = layout.units
        self.resident_weight_bytes = self.residency.resident_weight_bytes
        self.budget_bytes = resolve_budget(config.gpu_budget, self.device)
        self._unit_bytes = [u.nbytes for u in self.units]
        self._check_budget(self.budget_bytes)
        # A compressed model loads other bytes (and needs staging room): its profiles are its own.
        marker = [f"compression={config.compression}"] if config.compression != "none" else []
        self.fingerprint = model_fingerprint(model, [u.name for u in self.units] + marker)
        self.device_name = device_name(self.device)
        self.profiles = ProfileStore(
            type(model).__name__,
            self.fingerprint,
            self.device_name,
            config.profile,
            config.profile_dir,
            config.reprofile_on_mismatch,
        )
        if self.profiles.given is not None:  # measured activations known now: check before packing anything
            self._check_budget(self.budget_bytes, self.profiles.given.profile)
        self.setup_times = SetupTimes(layout=1e3 * (time.perf_counter() - started))

        self.phase = Phase.DISCOVERY if self.units else Phase.STEADY
        self.plan: Plan | None = None
        self.profile: WorkloadProfile | None = None
        self._saved: SavedProfile | None = None  # the profile the current plan was made from
        self._signature: str | None = None
        #: The measured minimum exceeded the budget (phase OVER_BUDGET); raised before the next forward.
        self.shortfall: BudgetError | None = None
        #: A pipeline reports shortfalls of all its components at once: forwards then go on, on demand.
        self.defer_budget_errors = False
        #: Called with this handle before it takes device memory (a pipeline releases the others).
        self.on_activate: Callable[[OffloadHandle], None] | None = None
        self.counters = {"discovery": 0, "profiling": 0, "steady": 0, "desyncs": 0, "plans": 0, "activations": 0}
        self._measured_forwards = 0
        self._depth = 0  # nesting of entry calls (AutoencoderKL.forward calls encode and decode)
        self._pos = 0  # unit calls so far in the current workload call
        self._open_unit: int | None = None  # the unit being called now (units never nest)
        self._clock = Clock(self.device)
        self.profiler = Profiler(self.device, self._clock)
        self.totals = TransferTotals(unit_stall_ms=[0.0] * len(self.units))
        self.schedule = SteadySchedule(self.residency, self._clock, config.measure_stalls, self.totals)
        self.boundaries = Boundaries()
        self._state_dict_hooks: list[Any] = []
        self._raw_file: Path | None = None  # raw_copies="disk": the cache file of the raw host copies
        self.payload_cache: PayloadCache | None = None  # compression_cache: the file of the compressed copies
        try:
            self._set_up()
        except BaseException:
            self.residency.teardown()
            self._unhook()
            self._drop_raw_file()
            raise
        _OFFLOADED.update(model.modules())

    # ------------------------------------------------------------------------------------ set-up

    def _set_up(self) -> None:
        shared = self.config.shared_host
        if shared is not None:
            if self.residency.loose:
                raise FlexTensorError(
                    f"shared host memory cannot hold tensors that share storage ({len(self.residency.loose)} here, "
                    "e.g. weights tied outside one unit): offload without shared_host"
                )
            units = [self.residency.base, *self.units]
            shared.open(self.fingerprint["sha256"], {u.index: u.nbytes for u in units})
        pin = self.cuda and self.config.pin_memory
        packing = self.residency.start_packing(pin=pin, shared=shared, attaching=self._attaching)
        try:
            if self.config.compression == "lossless":  # units are compressed as they are packed
                start = time.perf_counter()
                self.payload_cache = self._payload_cache() if self.config.compression_cache else None
                self.residency.compressed.make(pin, self.payload_cache)
                self.setup_times.compress = 1e3 * (time.perf_counter() - start)
        finally:
            self.setup_times.pack = 1e3 * packing.finish()
        if self.config.compression == "lossless" and self.config.raw_copies == "disk":
            given = self.profiles.given.profile if self.profiles.given is not None else None
            self._check_budget(self.budget_bytes, given)  # now with the staging room every load needs
            self._raw_file = self._raw_file_path()
            self.residency.spill(self._raw_file)
        if shared is not None and shared.create:
            shared.publish(self.fingerprint["sha256"])
        hooking = time.perf_counter()
        workload = Crossing(hidden(self._enter_forward), hidden(self._exit_workload), hidden(self._fail))
        self.boundaries.border(self.model, workload)
        for name in self.config.entry_methods:
            entry = Crossing(enter=hidden(self._entry(name)), exit=workload.exit, fail=workload.fail)
            self.boundaries.wrap_entry(self.model, name, entry)
        for name in self.config.edit_methods:
            if callable(getattr(self.model, name, None)):
                self.boundaries.wrap_edit(self.model, name, self.editing)
        unit_failed = hidden(self._unit_failed)
        for unit in self.units:
            enter, exit_ = hidden(self._unit_enter(unit.index)), hidden(self._unit_exit(unit.index))
            self.boundaries.border_unit(unit.module, Crossing(enter, exit_, unit_failed, self._unit_compiled))
        self._state_dict_hooks = [
            unit.module._register_state_dict_hook(self._state_dict_hook(unit))
            for unit in [self.residency.base, *self.units]
        ]
        self.activate()
        self.setup_times.hooks = 1e3 * (time.perf_counter() - hooking)

    def _unhook(self) -> None:
        """Undo what set-up added besides packing: boundaries, state-dict hooks, shared files."""
        self.boundaries.remove()
        for hook in self._state_dict_hooks:
            hook.remove()
        self._state_dict_hooks = []
        if self.config.shared_host is not None:
            self.config.shared_host.unlink()

    def _state_dict_hook(self, unit: Any) -> Callable[..., None]:
        """state_dict() reads host copies, the weights' truth: a slot may hold another unit's weights."""

        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            if unit.host is None:
                return
            self.residency.binding.check(unit)  # an edit made in a device copy reaches the host copy first
            host = self.residency.host_of(unit)  # its final bytes, when they are still arriving from disk
            for packed in unit.tensors:
                for rel in packed.names:
                    if prefix + rel in state_dict:
                        state_dict[prefix + rel] = packed.view_of(host)

        return hook

    # ------------------------------------------------------------------------------------ budgets

    def smallest_budget(self, profile: WorkloadProfile | None = None) -> int:
        """The least budget for ``profile`` (default: the current one; none yet: the set-up minimum).

        Raw loads need no staging room, and the planner falls back to them for a compressed model
        when the budget is too small to stage payloads, so compression never raises the minimum;
        unless the raw copies wait on disk (``raw_copies="disk"``): then every load decodes."""
        profile = profile or self.profile
        activations = profile.activation_peak_bytes if profile is not None else 0
        margin = self.config.activation_margin
        staging, granule = self._staging_needed, self.residency.allocation_granule
        return smallest_budget(self.resident_weight_bytes, self._unit_bytes, activations, margin, staging, granule)

    def _check_budget(self, budget: int, profile: WorkloadProfile | None = None) -> None:
        """Raise `BudgetError` when ``budget`` is under `smallest_budget` for ``profile``."""
        activations = profile.activation_peak_bytes if profile is not None else 0
        margin = self.config.activation_margin
        staging, granule = self._staging_needed, self.residency.allocation_granule
        check_budget(budget, self.resident_weight_bytes, self._unit_bytes, activations, margin, staging, granule)

    @property
    def _raw_on_disk(self) -> bool:
        return self._raw_file is not None

    @property
    def _staging_needed(self) -> int:
        """Staging room every slot must have: the largest payload when loads cannot fall back to raw."""
        if self.config.raw_copies != "disk":
            return 0
        return max((e.payload.numel() for e in self.residency.encoded.values()), default=0)

    def _payload_cache(self) -> PayloadCache:
        """This model's payload file: named by its structure and sampled bytes of every unit."""
        hosts = {unit.index: self.residency.host_of(unit) for unit in self.units}
        key = weights_key(self.fingerprint["sha256"], self.units, hosts)
        return PayloadCache(cache_folder(self.config.cache_dir), type(self.model).__name__, key)

    def _raw_file_path(self) -> Path:
        """Where ``raw_copies="disk"`` keeps this model's raw host copies (one file per handle)."""
        name = f"{type(self.model).__name__}-{self.fingerprint['sha256'][:16]}-{os.getpid()}-{id(self):x}.raw"
        return cache_folder(self.config.cache_dir) / name

    def _drop_raw_file(self) -> None:
        if self._raw_file is not None:
            self._raw_file.unlink(missing_ok=True)
            self._raw_file = None

    # ------------------------------------------------------------------------------------ device memory

    def activate(self) -> None:
        """Take device memory: the base, then the plan's resident units and slots (or the profiling slot)."""
        if self.residency.active:
            return
        if self.on_activate is not None:
            self.on_activate(self)
        self.residency.activate(self._layout_plan())
        self._follow_plan()
        self.counters["activations"] += 1

    def release(self) -> None:
        """Give back all device memory; tensors point at their host copies until `activate`."""
        if not self.residency.active:
            return
        self.schedule.leave()
        self.residency.release()

    @property
    def active(self) -> bool:
        return self.residency.active

    def _layout_plan(self) -> Plan | None:
        """The layout of device memory now: the plan once there is one; before that, every unit
        resident when all weights take at most `PROFILE_RESIDENT_SHARE` of the budget (a VAE, say:
        no loads while it is profiled, whatever its activations), else one shared profiling slot."""
        if self.phase in (Phase.STEADY, Phase.DESYNCED):
            return self.plan
        weights = self.resident_weight_bytes + sum(self._unit_bytes)
        if self.phase in (Phase.DISCOVERY, Phase.PROFILING) and weights <= PROFILE_RESIDENT_SHARE * self.budget_bytes:
            return everything_resident(self._unit_bytes, self.resident_weight_bytes, self.budget_bytes)
        return None

    def _follow_plan(self) -> None:
        if self.plan is not None and self.phase in (Phase.STEADY, Phase.DESYNCED) and self.units:
            self.schedule.follow(self.plan, [c.unit for c in self.profile.calls])  # type: ignore[union-attr]

    @contextmanager
    def editing(self) -> Iterator[None]:
        """Edit weights in place (fuse a LoRA, load a state dict, ``param.data.copy_()``) so that the
        edit reaches the host copies, which every later load copies from. See `Residency.editing`."""
        if self.phase is Phase.REMOVED:
            raise OffloadStateError("this handle was removed: edit the model directly")
        was_active = self.active
        self.release()
        try:
            with self.residency.editing():
                yield
        finally:
            if was_active:
                self.activate()

    # ------------------------------------------------------------------------------------ workloads

    def _enter_forward(self, args: tuple, kwargs: dict) -> None:
        refuse_if_inside_whole_model_compile(self.model)
        self._enter(args, kwargs, "forward")

    def _entry(self, name: str) -> Callable[[tuple, dict], None]:
        def enter(args: tuple, kwargs: dict) -> None:
            self._enter(args, kwargs, name)

        return enter

    def _enter(self, args: tuple, kwargs: dict, entry: str) -> None:
        self._depth += 1
        if self._depth > 1:  # inside another entry call of this model: one workload
            return
        if self.phase is Phase.OVER_BUDGET and not self.defer_budget_errors:
            self._depth = 0
            raise self._shortfall_error()
        if not self.active:
            self.activate()
        elif self.residency.binding.sweep():  # edits since the last forward: slots loaded ahead may be stale
            self.schedule.leave()
        self._pos = 0
        self._open_unit = None
        if self.phase in (Phase.ON_DEMAND, Phase.REMOVED) or not self.units:
            return
        signature = workload_signature(args, kwargs)
        if entry != "forward":
            signature = f"{entry}:{signature}"
        if signature != self._signature:
            self._new_workload(signature)
        if self.phase is Phase.STEADY:
            if not self.schedule.primed:
                self.schedule.prime()
        elif self.phase in (Phase.DISCOVERY, Phase.PROFILING):
            self.profiler.start_forward(self.phase is Phase.PROFILING, self.residency.device_bytes)

    def _exit_workload(self, output: Any = None) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self.phase is Phase.DISCOVERY:
            self.counters["discovery"] += 1
            self._note_units_not_run()
            self.profiler.abandon()
            self.phase = Phase.PROFILING
        elif self.phase is Phase.PROFILING:
            self.counters["profiling"] += 1
            self.profiler.end_forward()
            if len(self.profiler.runs) >= self.config.profiling_runs:
                self._finish_profiling()
        elif self.phase is Phase.STEADY:
            self.counters["steady"] += 1
            self._measured_forwards += 1
            self.schedule.harvest(wait=False)
        elif self.phase is Phase.DESYNCED:
            self.counters["steady"] += 1
            self._start_profiling()

    def _fail(self, exc: BaseException) -> BaseException | None:
        """The workload raised: forget its partial records and resynchronise at the next one. A device
        mismatch is what using a streamed unit's weights outside its call gives on CUDA (they view their host
        copy then): that is said, with the fix."""
        self._depth = 0
        self._open_unit = None
        self.profiler.abandon()
        if self.phase is Phase.DESYNCED:
            self._start_profiling()
        else:
            self.schedule.leave()
        logger.debug("a forward of %s raised; resynchronising at the next one", type(self.model).__name__)
        if isinstance(exc, RuntimeError) and "same device" in str(exc) and self.cuda:
            return FlexTensorError(
                f"{type(self.model).__name__} used weights of a streamed unit outside that unit's call ({exc}); "
                "between its calls a streamed unit's weights stay in host memory. Call the unit as a module "
                "(block(x), not block.forward(x)), or keep it on the device with exclude_patterns=[...]"
            )
        return None

    def _new_workload(self, signature: str) -> None:
        """Inputs not seen by the current plan: adopt a known or saved profile for them, or profile them."""
        first = self._signature is None
        self._signature = signature
        saved = self.profiles.find(signature, first)
        if saved is not None:
            self._saved = saved
            self._apply(saved.profile)
            return
        if not first:
            logger.info("inputs of %s differ from the profiled workloads; profiling again", type(self.model).__name__)
            self._start_profiling()

    def _start_profiling(self) -> None:
        """Profile the next forward, in the current layout (loads of streamed units are timed)."""
        self.schedule.leave()
        self.phase = Phase.PROFILING
        self.profiler.runs = []

    def _unit_compiled(self) -> None:
        """A unit was compiled after set-up: its compute times change, so every workload is measured
        again, after a warm-up forward (which compiles), and planned from the compiled times."""
        self.profiles.known.clear()
        if self.phase in (Phase.STEADY, Phase.PROFILING, Phase.OVER_BUDGET) and self.units:
            self.schedule.leave()
            self.phase = Phase.DISCOVERY
            self.profiler.runs = []

    def _note_units_not_run(self) -> None:
        ran = set(self.profiler.observed)
        never = [u.name for u in self.units if u.index not in ran]
        if never:  # normal for a VAE's encoder during decode; loaded on demand if they do run
            logger.debug("%d unit(s) did not run in this workload (e.g. %s)", len(never), ", ".join(never[:3]))

    # ------------------------------------------------------------------------------------ units

    def _unit_enter(self, index: int) -> Callable[[tuple, dict], None]:
        unit = self.units[index]
        grads = [p for p in unit.module.parameters() if p.requires_grad]

        def enter(args: tuple, kwargs: dict) -> None:
            if self._open_unit is not None:
                raise self._nested_call_error(index)
            if torch.is_grad_enabled():
                self._refuse_autograd(index, grads, args, kwargs)
            self._before_unit(index)
            self._open_unit = index

        return enter

    def _unit_exit(self, index: int) -> Callable[[Any], None]:
        def exit_(output: Any) -> None:
            self._open_unit = None
            self._refuse_views_of_a_slot(index, output)
            self._after_unit(index)

        return exit_

    def _unit_failed(self, exc: BaseException) -> None:
        self._open_unit = None

    def _nested_call_error(self, index: int) -> FlexTensorError:
        inner, outer = self.units[index].name, self.units[self._open_unit].name  # type: ignore[index]
        self._open_unit = None
        return FlexTensorError(
            f"unit {inner!r} was called inside unit {outer!r}, which holds it through a plain reference, not as a "
            f"submodule: loading {inner!r} could overwrite the weights {outer!r} is computing with. Stream only one "
            f"of them: exclude_patterns=[{inner!r}] (or [{outer!r}])"
        )

    def _refuse_autograd(self, index: int, grads: list[nn.Parameter], args: tuple, kwargs: dict) -> None:
        """Autograd through a unit saves its weights for backward; a slot is reused before backward runs, so
        only resident units (and no weights that require grad) can be differentiated through."""
        unit = self.units[index]
        if grads and any(p.requires_grad for p in grads):
            raise InferenceOnlyError(
                f"unit {unit.name!r} has parameters that require grad and autograd is on: streamed weights "
                "are for inference only. Run under torch.no_grad() or torch.inference_mode(), or call "
                "model.requires_grad_(False)"
            )
        if self.residency.slot_of[index] is not None and _any_requires_grad(args, kwargs):
            raise InferenceOnlyError(
                f"autograd records through unit {unit.name!r} (an input requires grad), which streams through a "
                "reused GPU slot: backward would read weights another block has overwritten. Run it under "
                "torch.no_grad() or torch.inference_mode(), or keep it on the device: "
                f"exclude_patterns=[{unit.name!r}]"
            )

    def _refuse_views_of_a_slot(self, index: int, output: Any) -> None:
        """A streamed unit must not return a view of its own weights: the slot they live in is overwritten by
        the next unit it holds, and the view with it."""
        slot = self.residency.slot_of[index]
        if slot is None or not self.residency.copies.slots:
            return
        storage = self.residency.copies.slots[slot].untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == storage for t in _tensors_in(output)):
            name = self.units[index].name
            raise FlexTensorError(
                f"unit {name!r} returned a view of its own weights or buffers, which live in a GPU slot that the "
                f"next streamed unit overwrites: keep it on the device with exclude_patterns=[{name!r}], or return "
                "a copy (.clone())"
            )

    def _before_unit(self, index: int) -> None:
        if not self.active:
            self.activate()  # a unit called on its own, outside the model's forward
        self._load_for_call(index)
        self.residency.bind_for_call(index)

    def _load_for_call(self, index: int) -> None:
        pos = self._pos
        self._pos += 1
        in_workload = self._depth > 0
        if self.phase is Phase.STEADY and self.schedule.primed:
            if in_workload and self.schedule.on_plan(index, pos):
                self.schedule.before(index)
                return
            self._desync(index, pos)
        self.residency.make_room_for(index)  # before the profiler times the load
        if self.phase is Phase.PROFILING and in_workload:
            self.profiler.before_unit(
                index, lambda on_staged: self.residency.load_now(index, on_staged), self.residency.transfer_bytes(index)
            )
            return
        self.residency.load_now(index)
        if self.phase is Phase.DISCOVERY and in_workload:
            self.profiler.observed.append(index)

    def _after_unit(self, index: int) -> None:
        if self.phase is Phase.STEADY and self.schedule.primed:
            self.schedule.after(index, self._pos - 1)
        elif self.phase is Phase.PROFILING and self._depth > 0:
            self.profiler.after_unit()

    def _desync(self, index: int, pos: int) -> None:
        order = self.schedule.order
        expected = self.units[order[pos]].name if pos < len(order) else "end of forward"
        logger.warning(
            "unit %r ran out of the planned order (call %d, expected %s); finishing this forward with on-demand "
            "loads and profiling the next one again",
            self.units[index].name,
            pos,
            expected,
        )
        self.counters["desyncs"] += 1
        self.schedule.leave()
        if self._depth > 0:
            self.phase = Phase.DESYNCED

    # ------------------------------------------------------------------------------------ planning

    def _measure_bandwidth(self) -> float:
        """Bytes per ms of one host→device copy of the largest unit (when profiling loaded nothing); with
        the raw copies on disk, of the largest compressed copy, which is what loads then read."""
        if self._raw_on_disk and self.residency.encoded:
            source = max((e.payload for e in self.residency.encoded.values()), key=lambda t: t.numel())
        else:
            source = self.residency.host_of(max(self.units, key=lambda u: u.nbytes))
        scratch = torch.empty(source.numel(), dtype=torch.uint8, device=self.device)
        start = self._clock.mark()
        scratch.copy_(source, non_blocking=True)
        end = self._clock.mark()
        if self.cuda:
            end.synchronize()
        return source.numel() / max(self._clock.ms(start, end), 1e-6)

    def _finish_profiling(self) -> None:
        profile = self.profiler.workload_profile(
            [u.name for u in self.units], list(self._unit_bytes), self.resident_weight_bytes, self._measure_bandwidth
        )
        self._saved = self.profiles.record(self._signature or "", profile)
        self._apply(profile)

    def _apply(self, profile: WorkloadProfile) -> None:
        """Plan under the budget and lay out resident copies and slots accordingly; a budget the
        measured minimum does not fit leaves the handle over budget, on demand. The bytes compressed
        loads move are this run's (a saved profile may come from another encoding of the weights)."""
        if self.residency.encoded:
            profile.transfer_bytes = [self.residency.transfer_bytes(u.index) for u in self.units]
        profile.allocation_granule = self.residency.allocation_granule  # a saved profile may predate the field
        self.profile = profile
        try:
            config, fallback = self.config, not self._raw_on_disk
            plan = plan_residency(profile, self.budget_bytes, config.max_slots, config.activation_margin, fallback)
        except BudgetError as exc:
            self.shortfall = exc
            self.phase = Phase.OVER_BUDGET
            logger.warning("%s: %s", type(self.model).__name__, exc)
            return
        self.shortfall = None
        self.plan = plan
        self.phase = Phase.STEADY
        self.counters["plans"] += 1
        if self.active:
            self.schedule.leave()
            self.residency.lay_out(plan)
            self._follow_plan()
        logger.info(
            "%s plan: %d resident, %d streamed through %d slots; predicted %.2f ms/forward (lower bound %.2f ms), "
            "memory %s of budget %s",
            type(self.model).__name__,
            len(plan.resident),
            len(plan.streamed),
            plan.num_slots,
            plan.predicted_ms,
            plan.lower_bound_ms,
            format_bytes(plan.memory_bytes),
            format_bytes(self.budget_bytes),
        )

    def _shortfall_error(self) -> BudgetError:
        assert self.shortfall is not None
        return BudgetError(str(self.shortfall), required_bytes=self.shortfall.required_bytes)

    # ------------------------------------------------------------------------------------ reporting

    def stats(self) -> OffloadStats:
        """Totals since set-up (synchronises the device to read pending events)."""
        self.schedule.harvest(wait=True)
        calls: dict[int, int] = {}
        compute: dict[int, float] = {}
        if self.profile is not None:
            for call in self.profile.calls:
                calls[call.unit] = calls.get(call.unit, 0) + 1
                compute[call.unit] = compute.get(call.unit, 0.0) + call.compute_ms
        units = []
        layout = self._layout_plan()
        for unit in self.units:
            if layout is None:
                placement = "on demand"
            elif self.phase not in (Phase.STEADY, Phase.DESYNCED):
                placement = "resident (until planned)"
            elif unit.index in layout.resident:
                placement = "resident"
            else:
                placement = f"slot {layout.slot_of[unit.index]}"
            units.append(
                UnitStats(
                    name=unit.name,
                    nbytes=unit.nbytes,
                    placement=placement,
                    calls_per_forward=calls.get(unit.index, 0),
                    compute_ms_per_forward=compute.get(unit.index),
                    loads=self.residency.loads[unit.index],
                    stall_ms=self.totals.unit_stall_ms[unit.index],
                )
            )
        return OffloadStats(
            phase=self.phase.value,
            device=str(self.device),
            budget_bytes=self.budget_bytes,
            resident_weight_bytes=self.resident_weight_bytes,
            forwards=dict(self.counters),
            bytes_streamed=self.residency.bytes_streamed,
            loads=sum(self.residency.loads),
            copy_ms=self.totals.copy_ms,
            decode_ms=self.totals.decode_ms,
            stall_ms=self.totals.stall_ms,
            measured_forwards=self._measured_forwards,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
            plan=self.plan.summary() if self.plan else None,
            setup_ms=self.setup_times.as_dict(),
            payload_cache=self.payload_cache.describe() if self.payload_cache is not None else None,
            transfer_unit_bytes=sum(self.residency.transfer_bytes(u.index) for u in self.units),
            unit_bytes=sum(self._unit_bytes),
            units=units,
        )

    def set_budget(self, budget: int | str) -> Plan | None:
        """Change the budget; with a measured profile the workload is planned again at once.

        A budget under the minimum is refused and the handle keeps its plan.
        """
        new = parse_bytes(budget)
        self._check_budget(new, self.profile)
        self.budget_bytes = new
        if self.phase in (Phase.STEADY, Phase.OVER_BUDGET) and self.profile is not None:
            self._apply(self.profile)
        return self.plan

    def save_profile(self, path: str | Path) -> Path:
        """Write the measured profile, for ``OffloadConfig(profile=path)`` on a later run."""
        if self._saved is None:
            raise OffloadStateError("nothing to save yet: run the model until profiling is done (phase 'steady')")
        return self._saved.save(path)

    # ------------------------------------------------------------------------------------ removal

    def remove(self) -> None:
        """Undo everything: every tensor bit-exact on the device it came from, classes and hooks back.

        Units are restored one by one, each all-or-nothing; if one fails (out of memory, say), the
        units not yet restored keep streaming on demand, the model still computes correctly, and
        ``remove()`` may be called again.
        """
        if self.phase is Phase.REMOVED:
            raise OffloadStateError("this handle was already removed")
        self.schedule.leave()
        self.phase = Phase.ON_DEMAND
        self.plan = None
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.residency.teardown()
        self._unhook()
        self._drop_raw_file()
        for module in self.model.modules():
            _OFFLOADED.discard(module)
        self.phase = Phase.REMOVED


def offload(model: nn.Module, config: OffloadConfig | None = None, **kwargs: Any) -> OffloadHandle:
    """Stream ``model``'s units from host memory under a GPU budget; returns the handle.

    ``offload(model, include_patterns=["blocks.*"], gpu_budget="24GiB")`` is the same as passing an
    `OffloadConfig`. ``model``'s blocks may be compiled (``compile_repeated_blocks``, or
    ``block.compile()`` on each unit) before or after; whole-model compilation is refused (see `boundaries`).
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

    The process with ``LOCAL_RANK`` 0 (or rank 0 when unset) packs; all wait at a barrier; then the
    others attach. Build the model on the meta device in the attaching processes to skip their
    own copy of the weights.
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


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a call's output: the output itself, or the items of a tuple, list or dict of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _any_requires_grad(args: tuple, kwargs: dict) -> bool:
    return any(t.requires_grad for t in _tensors_in([*args, *kwargs.values()]))
