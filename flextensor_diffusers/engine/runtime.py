"""The hot path: hooks, the copy stream, the slot ring and its events.

Life of a handle:

1. **Set-up** (`OffloadHandle.__init__`): each unit, and the *base* (every weight outside units),
   is packed into one flat host buffer, pinned in place. The base is copied to the device once and
   stays there while the model is active; every unit is bound to one shared *profiling slot*. Any
   failure undoes all of it.
2. **Discovery** (first forward): units are loaded on demand, on the compute stream, and the order
   in which they run is recorded (a unit may run several times; the order need not follow
   registration). This forward also warms up kernels and allocator.
3. **Profiling** (next ``profiling_runs`` forwards): still on demand; events time each load, each
   unit's compute and the gaps between units; the activation peak is read from the allocator.
4. **Plan** (`planner.plan_residency`): resident units get their own device copy; streamed units
   get a fixed slot out of a ring of ``num_slots`` and are bound to it once, so a forward does no
   per-parameter work.
5. **Steady state**: a unit's pre-hook makes the compute stream wait for that unit's *ready* event;
   its post-hook records the slot's *free* event and issues the next load into that slot on the
   copy stream, which first waits for *free*. A slot is therefore overwritten only after every
   kernel that reads it has run. Loads wrap around, so the end of one forward prefetches the start
   of the next. No synchronisation and no allocation happen here.

If a forward departs from the planned order (other inputs, control flow), the handle waits for the
copy stream, finishes that forward on demand, and profiles the next forward again.

`release` gives all device memory back (tensors point at their pinned host copies) and
`activate` takes it again with the same plan: that is how a pipeline keeps only its active
component on the GPU.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import weakref
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import OffloadConfig, format_bytes, parse_bytes, resolve_device
from .errors import BudgetError, FlexTensorError, InferenceOnlyError, OffloadStateError, ProfileMismatchError
from .planner import Call, Plan, WorkloadProfile, plan_residency
from .profile import SavedProfile, device_name, model_fingerprint, workload_signature
from .stats import OffloadStats, UnitStats
from .units import Unit, find_units, pack_unit, pin_unit, plan_layout, restore_unit, tensor_nbytes

logger = logging.getLogger(__name__)

#: Every module that is part of an offloaded model, so that offloading it again is refused.
_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class Phase(StrEnum):
    DISCOVERY = "discovery"
    PROFILING = "profiling"
    STEADY = "steady"
    ON_DEMAND = "on demand"  # remove() stopped half-way: remaining units load on demand, nothing is planned
    REMOVED = "removed"


class _Clock:
    """Timestamps on a stream: CUDA timing events (pooled), or the wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pool: list[torch.cuda.Event] = []

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def done(self, mark: Any) -> bool:
        return mark.query() if self.cuda else True

    def release(self, *marks: Any) -> None:
        if self.cuda:
            self._pool.extend(marks)


class OffloadHandle:
    """Streams the units of ``model`` under ``config.gpu_budget``; see the module docstring."""

    def __init__(self, model: nn.Module, config: OffloadConfig) -> None:
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
        layout = plan_layout(model, selected, meta_ok=self._attaching)
        #: Where set-up time went (ms): finding units and their layout, copying into the flat host
        #: buffers, page-locking them, hooks plus the first device copy of the base.
        self.setup_ms = {"layout": 1e3 * (time.perf_counter() - started), "pack": 0.0, "pin": 0.0, "hooks": 0.0}
        self.units: list[Unit] = layout.units
        self.base: Unit = layout.base
        self._loose = [(t, t.device) for t in layout.loose]  # (tensor, device it came from)
        self.resident_weight_bytes = layout.resident_bytes
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        on_device = sum(tensor_nbytes(t) for t in tensors.values() if t.device == self.device)
        self.budget_bytes = self._checked_budget(config.budget_bytes(self.device, already_on_device=on_device))
        self.fingerprint = model_fingerprint(model, [u.name for u in self.units])
        self.device_name = device_name(self.device)
        self._from_file: SavedProfile | None = self._load_profile(config.profile) if config.profile else None
        self._saved: SavedProfile | None = None  # the profile the current plan was made from

        self.phase = Phase.DISCOVERY if self.units else Phase.STEADY
        self.plan: Plan | None = None
        self.profile: WorkloadProfile | None = None
        self.active = False
        #: Called with this handle before it takes device memory (a pipeline releases the others).
        self.on_activate: Callable[[OffloadHandle], None] | None = None
        self.counters = {"discovery": 0, "profiling": 0, "steady": 0, "desyncs": 0, "plans": 0, "activations": 0}
        self._clock = _Clock(self.device)
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._hooks: list[Any] = []
        self._unit_hooks: dict[int, list[Any]] = {}
        self._base_buffer: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []
        self._resident_buffers: dict[int, torch.Tensor] = {}
        self._slot_of: list[int | None] = [0] * len(self.units)
        self._slot_owner: list[int | None] = [None]
        self._dst: list[torch.Tensor | None] = [None] * len(self.units)
        self._bytes = [u.nbytes for u in self.units]
        self._order: list[int] = []  # planned unit order of one forward
        self._in_forward = False
        self._in_sync = False
        self._pos = 0
        self._signature: str | None = None
        self._observed: list[int] = []
        self._marks: list[list[Any]] = []
        self._profiled_runs: list[tuple[list[int], list[list[float]], float, float, int]] = []
        self._pending: list[tuple[str, int, Any, Any]] = []
        self._unit_stall_ms = [0.0] * len(self.units)
        self._unit_loads = [0] * len(self.units)
        self._bytes_streamed = 0
        self._copy_ms = 0.0
        self._stall_ms = 0.0
        self._measured_forwards = 0
        try:
            self._set_up()
        except BaseException:
            self._undo()
            raise
        _OFFLOADED.update(model.modules())

    # ------------------------------------------------------------------------------------ set-up

    def _checked_budget(self, budget: int) -> int:
        largest = max((u.nbytes for u in self.units), default=0)
        smallest = self.resident_weight_bytes + 2 * largest
        if budget < smallest:
            raise BudgetError(
                f"gpu_budget {format_bytes(budget)} is smaller than the least streaming needs: "
                f"{format_bytes(smallest)} (weights outside units {format_bytes(self.resident_weight_bytes)} + "
                f"2 slots of the largest unit, {format_bytes(largest)}). Pass gpu_budget >= {smallest}, "
                "or stream smaller units (finer include_patterns)"
            )
        return budget

    def _load_profile(self, path: str | Path) -> SavedProfile | None:
        if not Path(path).exists():
            return None
        saved = SavedProfile.load(path)
        reason = saved.mismatch(self.fingerprint, self.device_name)
        if reason is None:
            return saved
        if not self.config.reprofile_on_mismatch:
            raise ProfileMismatchError(
                f"profile {path} does not match: {reason}. Delete it or point OffloadConfig.profile elsewhere, "
                "or pass reprofile_on_mismatch=True to profile again"
            )
        logger.warning("profile %s does not match (%s); profiling again", path, reason)
        return None

    def _profile_path(self, signature: str) -> Path | None:
        """Where the profile of this model, device and workload lives (None: not kept)."""
        if self.config.profile is not None:
            return Path(self.config.profile)
        if self.config.profile_dir is None:
            return None
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.device_name).strip("-").lower()
        workload = hashlib.sha256(signature.encode()).hexdigest()[:12]
        name = f"{type(self.model).__name__}-{self.fingerprint['sha256'][:12]}-{slug}-{workload}.json"
        return Path(self.config.profile_dir) / name

    def _set_up(self) -> None:
        pin = self.cuda and self.config.pin_memory
        shared = self.config.shared_host
        if shared is not None:
            if self._loose:
                raise FlexTensorError(
                    f"shared host memory cannot hold tensors that share storage ({len(self._loose)} here, e.g. "
                    "weights tied outside one unit): offload without shared_host"
                )
            shared.open(self.fingerprint["sha256"], {u.index: u.nbytes for u in [self.base, *self.units]})
        with torch.no_grad(), torch.inference_mode(False):
            desc = "packing + pinning weights" if pin else "packing weights"
            if self._attaching:
                desc = "attaching to shared weights"
            for unit in tqdm([self.base, *self.units], desc=desc, disable=None, leave=False):
                host = shared.buffer(unit.index) if shared is not None else None
                start = time.perf_counter()
                pack_unit(unit, host=host, filled=self._attaching)
                packed = time.perf_counter()
                self.setup_ms["pack"] += 1e3 * (packed - start)
                if pin:
                    pin_unit(unit, attached=self._attaching)
                    self.setup_ms["pin"] += 1e3 * (time.perf_counter() - packed)
        if shared is not None and shared.create:
            shared.publish(self.fingerprint["sha256"])
        hooking = time.perf_counter()
        self._hooks.append(self.model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._on_forward_end))
        for unit in self.units:
            self._unit_hooks[unit.index] = [
                unit.module.register_forward_pre_hook(self._pre_hook(unit.index)),
                unit.module.register_forward_hook(self._post_hook(unit.index)),
                unit.module._register_state_dict_hook(self._state_dict_hook(unit)),
            ]
        self._hooks.append(self.model._register_state_dict_hook(self._state_dict_hook(self.base)))
        self.activate()
        self.setup_ms["hooks"] = 1e3 * (time.perf_counter() - hooking)

    def _undo(self) -> None:
        """Put back everything set-up changed; safe to call at any point of set-up."""
        for hook in self._hooks + [h for hs in self._unit_hooks.values() for h in hs]:
            hook.remove()
        self._hooks, self._unit_hooks = [], {}
        with torch.no_grad(), torch.inference_mode(False):
            self._drop_device_buffers()
            for unit in [self.base, *self.units]:
                if unit.host is not None:
                    restore_unit(unit)
        if self.config.shared_host is not None:
            self.config.shared_host.unlink()

    # ------------------------------------------------------------------------------------ device memory

    def activate(self) -> None:
        """Take device memory: the base, then the plan's resident units and slots (or the profiling slot)."""
        if self.active:
            return
        if self.on_activate is not None:
            self.on_activate(self)
        with torch.no_grad(), torch.inference_mode(False):
            buffer = torch.empty(self.base.nbytes, dtype=torch.uint8, device=self.device)
            buffer.copy_(self.base.host, non_blocking=True)
            self.base.bind(buffer)
            self._base_buffer = buffer
            for t, _ in self._loose:
                t.data = t.data.to(self.device)
            self.active = True
            self._lay_out_units()
        self.counters["activations"] += 1

    def release(self) -> None:
        """Give back all device memory; tensors point at their host copies until `activate`."""
        if not self.active:
            return
        with torch.no_grad(), torch.inference_mode(False):
            self._drop_device_buffers()
        self.active = False

    def _drop_device_buffers(self) -> None:
        self._unbind_units()
        if self.base.host is not None:
            self.base.bind(self.base.host)
        for t, origin in self._loose:
            t.data = t.data.to(origin)
        self._base_buffer = None

    def _unbind_units(self) -> None:
        """Point the units at their host copies and drop their slots and resident copies."""
        self._leave_schedule()
        for unit in self.units:
            if unit.host is not None:  # during a failed set-up, not every unit is packed yet
                unit.bind(unit.host)
        self._slots, self._resident_buffers, self._dst = [], {}, [None] * len(self.units)

    def _lay_out_units(self) -> None:
        """Device buffers for the units: per the plan, or one shared slot before a plan exists."""
        self._unbind_units()  # old device buffers go before new ones are taken
        if not self.units:
            return
        plan = self.plan
        if plan is None:
            slot = torch.empty(max(self._bytes), dtype=torch.uint8, device=self.device)
            self._slots = [slot]
            self._slot_of = [0] * len(self.units)
            self._slot_owner = [None]
            for unit in self.units:
                unit.bind(slot)
                self._dst[unit.index] = slot[: unit.nbytes]
            return
        for index in sorted(plan.resident):
            buffer = torch.empty(self._bytes[index], dtype=torch.uint8, device=self.device)
            buffer.copy_(self.units[index].host, non_blocking=True)
            self.units[index].bind(buffer)
            self._resident_buffers[index] = buffer
        self._slots = [
            torch.empty(plan.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(plan.num_slots)
        ]
        for index, slot in enumerate(plan.slot_of):
            if slot is not None:
                self.units[index].bind(self._slots[slot])
                self._dst[index] = self._slots[slot][: self._bytes[index]]
        self._slot_of = list(plan.slot_of)
        self._slot_owner = [None] * plan.num_slots
        if self.cuda:
            # New slots may reuse memory that kernels still queued on the compute stream read.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            timing = self.config.measure_stalls
            self._ready = [torch.cuda.Event(enable_timing=timing) for _ in self.units]
            self._free = [torch.cuda.Event() for _ in range(plan.num_slots)]
        if self.phase is Phase.STEADY:
            self._prime()

    # ------------------------------------------------------------------------------------ hooks

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._before_unit(index)

        return hook

    def _post_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._after_unit(index)

        return hook

    def _state_dict_hook(self, unit: Unit) -> Callable[..., None]:
        """state_dict() reads host copies: a slot may hold another unit's weights."""

        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            if unit.host is None:
                return
            for packed in unit.tensors:
                for rel in packed.names:
                    if prefix + rel in state_dict:
                        state_dict[prefix + rel] = packed.view_of(unit.host)

        return hook

    def _before_unit(self, index: int) -> None:
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.units[index].module.parameters()):
            raise InferenceOnlyError(
                f"unit {self.units[index].name!r} has parameters that require grad and autograd is on: "
                "streamed weights are for inference only. Run under torch.no_grad() or torch.inference_mode(), "
                "or call model.requires_grad_(False)"
            )
        if not self.active:
            self.activate()  # a unit called on its own, outside the model's forward
        pos = self._pos
        self._pos += 1
        if self._in_sync:
            plan = self.plan
            assert plan is not None
            if self._in_forward and pos < len(self._order) and self._order[pos] == index:
                if plan.slot_of[index] is not None and self.cuda:
                    stream = torch.cuda.current_stream(self.device)
                    if self.config.measure_stalls:
                        before = self._clock.mark()
                        stream.wait_event(self._ready[index])
                        self._pending.append(("stall", index, before, self._clock.mark()))
                    else:
                        stream.wait_event(self._ready[index])
                return
            self._desync(index, pos)
        if self.phase is Phase.PROFILING and self._in_forward:
            start = self._clock.mark()
            loaded = self._load_now(index)
            self._marks.append([index, start, self._clock.mark(), None, loaded])
        else:
            self._load_now(index)
        if self._in_forward and self.phase in (Phase.DISCOVERY, Phase.PROFILING):
            self._observed.append(index)

    def _after_unit(self, index: int) -> None:
        if self._in_sync:
            slot = self.plan.slot_of[index]  # type: ignore[union-attr]
            if slot is not None and self.cuda:
                self._free[slot].record(torch.cuda.current_stream(self.device))
            load = self.plan.loads[self._pos - 1]  # type: ignore[union-attr]
            if load is not None:
                self._issue(*load)
        elif self.phase is Phase.PROFILING and self._in_forward and self._marks:
            self._marks[-1][3] = self._clock.mark()

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.active:
            self.activate()
        if self._in_forward:  # the previous forward raised before finishing
            logger.warning("previous forward of %s did not finish; resynchronising", type(self.model).__name__)
            self._leave_schedule()
            self._marks, self._observed = [], []
        self._in_forward = True
        self._pos = 0
        if self.phase is Phase.ON_DEMAND or not self.units:
            return
        signature = workload_signature(args, kwargs)
        if signature != self._signature:
            self._new_workload(signature)
        if self.phase is Phase.STEADY:
            if not self._in_sync:
                self._prime()
        else:
            self._observed = []
            if self.phase is Phase.PROFILING:
                self._marks = []
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                    self._alloc_at_start = torch.cuda.memory_allocated(self.device)
                self._forward_start = self._clock.mark()

    def _new_workload(self, signature: str) -> None:
        """Inputs not seen by the current plan: adopt a saved profile for them, or profile them."""
        first = self._signature is None
        self._signature = signature
        path = self._profile_path(signature)
        saved = None
        if first and self._from_file is not None:
            saved, self._from_file = self._from_file, None
        elif self.config.profile_dir is not None and path is not None:
            saved = self._load_profile(path)
        if saved is not None:
            if saved.workload == signature:
                self._saved = saved
                self._apply(saved.profile)
                return
            if not self.config.reprofile_on_mismatch:
                raise ProfileMismatchError(
                    f"profile {path} was recorded for inputs {saved.workload}, these are {signature}. "
                    "Delete it, use profile_dir= to keep one profile per workload, or pass "
                    "reprofile_on_mismatch=True to profile this workload"
                )
            logger.warning("profile %s was recorded for other inputs; profiling again", path)
        if not first:
            logger.info("inputs of %s differ from the profiled workload; profiling again", type(self.model).__name__)
            self._leave_schedule()
            self.phase = Phase.PROFILING
            self._profiled_runs = []

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._in_forward = False
        if self.phase is Phase.DISCOVERY:
            self.counters["discovery"] += 1
            self._check_all_ran()
            self.phase = Phase.PROFILING
        elif self.phase is Phase.PROFILING:
            self.counters["profiling"] += 1
            self._record_profiling_run()
            if len(self._profiled_runs) >= self.config.profiling_runs:
                self._make_and_apply_plan()
        elif self.phase is Phase.STEADY:
            self.counters["steady"] += 1
            if self._in_sync:
                self._measured_forwards += 1
            elif self.units:
                self.phase = Phase.PROFILING
                self._profiled_runs = []
            self._harvest(wait=False)

    # ------------------------------------------------------------------------------------ loading

    def _load_now(self, index: int) -> bool:
        """On-demand load on the compute stream (ordered after whatever last read the slot)."""
        slot = self._slot_of[index]
        if slot is None or self._slot_owner[slot] == index:
            return False
        self._dst[index].copy_(self.units[index].host, non_blocking=True)  # type: ignore[union-attr]
        self._slot_owner[slot] = index
        self._unit_loads[index] += 1
        self._bytes_streamed += self._bytes[index]
        return True

    def _issue(self, slot: int, index: int) -> None:
        """Load ``index`` into ``slot`` on the copy stream once the slot's last reader has finished."""
        host = self.units[index].host
        if self.cuda:
            stream = self._copy_stream
            with torch.cuda.stream(stream):
                stream.wait_event(self._free[slot])
                if self.config.measure_stalls:
                    start = self._clock.mark(stream)
                    self._dst[index].copy_(host, non_blocking=True)
                    self._ready[index].record(stream)
                    self._pending.append(("copy", index, start, self._clock.mark(stream)))
                else:
                    self._dst[index].copy_(host, non_blocking=True)
                    self._ready[index].record(stream)
        else:
            start = time.perf_counter()
            self._dst[index].copy_(host)
            self._copy_ms += (time.perf_counter() - start) * 1e3
        self._slot_owner[slot] = index
        self._unit_loads[index] += 1
        self._bytes_streamed += self._bytes[index]

    def _prime(self) -> None:
        """Issue the first load of every slot (those not already holding their first unit)."""
        assert self.plan is not None
        for slot, index in self.plan.first_loads:
            if self._slot_owner[slot] != index:
                self._issue(slot, index)
        self._in_sync = True

    def _leave_schedule(self) -> None:
        """Stop following the plan: make the compute stream wait for every issued copy."""
        if self.cuda and self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self._in_sync = False

    def _desync(self, index: int, pos: int) -> None:
        expected = self.units[self._order[pos]].name if pos < len(self._order) else "end of forward"
        logger.warning(
            "unit %r ran out of the planned order (call %d, expected %s); finishing this forward with on-demand "
            "loads and profiling the next one again",
            self.units[index].name,
            pos,
            expected,
        )
        self.counters["desyncs"] += 1
        self._leave_schedule()

    # ------------------------------------------------------------------------------------ planning

    def _check_all_ran(self) -> None:
        never = [u.name for u in self.units if u.index not in set(self._observed)]
        if never:
            logger.warning(
                "%d unit(s) did not run in the first forward (e.g. %s); they are loaded on demand if they do",
                len(never),
                ", ".join(never[:3]),
            )

    def _record_profiling_run(self) -> None:
        end = self._clock.mark()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._alloc_at_start
        else:
            peak = 0  # the CPU allocator keeps no peak; planning on the CPU ignores activations
        rows: list[list[float]] = []
        load_ms = 0.0
        load_bytes = 0
        previous = self._forward_start
        for index, start, loaded, finished, did_load in self._marks:
            if finished is None:
                continue
            rows.append([index, self._clock.ms(loaded, finished), self._clock.ms(previous, start)])
            if did_load:
                load_ms += self._clock.ms(start, loaded)
                load_bytes += self._bytes[index]
            previous = finished
        tail = self._clock.ms(previous, end)
        self._clock.release(*(m for row in self._marks for m in row[1:4] if m is not None), self._forward_start, end)
        self._marks = []
        bandwidth = load_bytes / load_ms if load_ms > 0 else 0.0
        self._profiled_runs.append(([int(r[0]) for r in rows], rows, tail, bandwidth, peak))

    def _measure_bandwidth(self) -> float:
        """Bytes per ms of one host→device copy of the largest unit (when profiling loaded nothing)."""
        unit = max(self.units, key=lambda u: u.nbytes)
        scratch = torch.empty(unit.nbytes, dtype=torch.uint8, device=self.device)
        start = self._clock.mark()
        scratch.copy_(unit.host, non_blocking=True)
        end = self._clock.mark()
        if self.cuda:
            end.synchronize()
        return unit.nbytes / max(self._clock.ms(start, end), 1e-6)

    def _make_and_apply_plan(self) -> None:
        runs = self._profiled_runs
        order = runs[-1][0]
        same = [r for r in runs if r[0] == order]
        calls = []
        for k, unit in enumerate(order):
            compute = sum(r[1][k][1] for r in same) / len(same)
            gap = sum(r[1][k][2] for r in same) / len(same)
            calls.append(Call(unit=unit, compute_ms=compute, gap_before_ms=gap))
        loaded = [r for r in same if r[3] > 0]
        bandwidth = sum(r[3] for r in loaded) / len(loaded) if loaded else self._measure_bandwidth()
        profile = WorkloadProfile(
            unit_names=[u.name for u in self.units],
            unit_bytes=list(self._bytes),
            calls=calls,
            tail_ms=sum(r[2] for r in same) / len(same),
            bandwidth_bytes_per_ms=bandwidth,
            activation_peak_bytes=max(r[4] for r in same),
            resident_bytes=self.resident_weight_bytes,
        )
        self._profiled_runs = []
        self._saved = SavedProfile(self.fingerprint, self.device_name, self._signature or "", profile)
        path = self._profile_path(self._signature or "")
        if path is not None:
            self._saved.save(path)
            logger.info("saved profile %s", path)
        self._apply(profile)

    def _apply(self, profile: WorkloadProfile) -> None:
        """Plan under the budget and lay out resident copies and slots accordingly."""
        plan = plan_residency(profile, self.budget_bytes, self.config.max_slots, self.config.activation_margin)
        self.plan = plan
        self.profile = profile
        self._order = [c.unit for c in profile.calls]
        self.phase = Phase.STEADY
        self.counters["plans"] += 1
        if self.active:
            with torch.no_grad(), torch.inference_mode(False):
                self._lay_out_units()
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

    # ------------------------------------------------------------------------------------ reporting

    def _harvest(self, wait: bool) -> None:
        """Fold finished copy/stall event pairs into the totals; with ``wait``, all of them."""
        if not self._pending:
            return
        if wait and self.cuda:
            torch.cuda.synchronize(self.device)
        keep = []
        for kind, index, start, end in self._pending:
            if not self._clock.done(end):
                keep.append((kind, index, start, end))
                continue
            ms = self._clock.ms(start, end)
            if kind == "copy":
                self._copy_ms += ms
            else:
                self._stall_ms += ms
                self._unit_stall_ms[index] += ms
            self._clock.release(start, end)
        self._pending = keep

    def stats(self) -> OffloadStats:
        """Totals since set-up (synchronises the device to read pending events)."""
        self._harvest(wait=True)
        calls: dict[int, int] = {}
        compute: dict[int, float] = {}
        if self.profile is not None:
            for call in self.profile.calls:
                calls[call.unit] = calls.get(call.unit, 0) + 1
                compute[call.unit] = compute.get(call.unit, 0.0) + call.compute_ms
        units = []
        for unit in self.units:
            if self.plan is None:
                placement = "on demand"
            elif unit.index in self.plan.resident:
                placement = "resident"
            else:
                placement = f"slot {self.plan.slot_of[unit.index]}"
            units.append(
                UnitStats(
                    name=unit.name,
                    nbytes=unit.nbytes,
                    placement=placement,
                    calls_per_forward=calls.get(unit.index, 0),
                    compute_ms_per_forward=compute.get(unit.index),
                    loads=self._unit_loads[unit.index],
                    stall_ms=self._unit_stall_ms[unit.index],
                )
            )
        return OffloadStats(
            phase=self.phase.value,
            device=str(self.device),
            budget_bytes=self.budget_bytes,
            resident_weight_bytes=self.resident_weight_bytes,
            forwards=dict(self.counters),
            bytes_streamed=self._bytes_streamed,
            loads=sum(self._unit_loads),
            copy_ms=self._copy_ms,
            stall_ms=self._stall_ms,
            measured_forwards=self._measured_forwards,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
            plan=self.plan.summary() if self.plan else None,
            setup_ms={k: round(v, 3) for k, v in self.setup_ms.items()},
            units=units,
        )

    def set_budget(self, budget: int | str) -> Plan | None:
        """Change the budget; in steady state the current profile is planned again at once."""
        self.budget_bytes = self._checked_budget(parse_bytes(budget))
        if self.phase is Phase.STEADY and self.profile is not None:
            self._apply(self.profile)
        return self.plan

    def save_profile(self, path: str | Path) -> Path:
        """Write the measured profile, for ``OffloadConfig(profile=path)`` on a later run."""
        if self._saved is None:
            raise OffloadStateError("nothing to save yet: run the model until profiling is done (phase 'steady')")
        return self._saved.save(path)

    # ------------------------------------------------------------------------------------ removal

    def remove(self) -> None:
        """Undo everything: hooks gone, every tensor bit-exact on the device it came from.

        Units are restored one by one, each all-or-nothing; if one fails (out of memory, say), the
        units not yet restored keep streaming on demand, the model still computes correctly, and
        ``remove()`` may be called again.
        """
        if self.phase is Phase.REMOVED:
            raise OffloadStateError("this handle was already removed")
        self._leave_schedule()
        self.phase = Phase.ON_DEMAND
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        with torch.no_grad(), torch.inference_mode(False):
            for unit in [*self.units, self.base]:
                if unit.host is None:
                    continue
                try:
                    restore_unit(unit)
                except BaseException as exc:
                    raise OffloadStateError(
                        f"remove() could not restore {unit.name!r} ({exc}); the rest still streams on demand. "
                        "Free memory and call remove() again"
                    ) from exc
                for hook in self._unit_hooks.pop(unit.index, []):
                    hook.remove()
                if unit.index >= 0:
                    self._slot_of[unit.index] = None
            for t, origin in self._loose:
                t.data = t.data.to(origin)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._base_buffer = None
        self._slots, self._resident_buffers, self._dst = [], {}, []
        self.active = False
        for module in self.model.modules():
            _OFFLOADED.discard(module)
        if self.config.shared_host is not None:
            self.config.shared_host.unlink()
        self.phase = Phase.REMOVED


def offload(model: nn.Module, config: OffloadConfig | None = None, **kwargs: Any) -> OffloadHandle:
    """Stream ``model``'s units from host memory under a GPU budget; returns the handle.

    ``offload(model, include_patterns=["blocks.*"], gpu_budget="24GiB")`` is the same as passing an
    `OffloadConfig`.
    """
    if config is None:
        config = OffloadConfig(**kwargs)
    elif kwargs:
        raise TypeError("pass either an OffloadConfig or keyword arguments, not both")
    return OffloadHandle(model, config)
