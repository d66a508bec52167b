"""`OffloadHandle`: one offloaded model, and the public face of the engine.

The handle wires together the objects that each own one thing, and routes the model's boundary calls to them:

* `HostCopies` (host_copies.py): the host bytes, the weights' truth; packing, compressed copies, spilling;
* `DeviceCopies` (device_copies.py): device buffers laid out by the plan, and every load into them;
* `Binding` (binding.py) and `Edits` (edits.py): what each tensor views, and edits reaching the host copies;
* `Planning` (planning.py): the budget, the workloads' profiles and the plan in force;
* `BoundaryCalls` (calls.py): the model's workload and unit calls, routed to the current phase;
* the current phase (phases.py): what a forward does at its start, around each unit call and at its end;
* `SteadySchedule` (schedule.py): the planned loads on the copy stream; `Profiler`: the measured forwards;
* `SetUp` (setup.py): everything offloading adds to a model, and its undoing.

Set-up packs every unit into host memory; then the first forward of a workload discovers the order of the units,
the next ones profile it, and a plan is made under the budget. `release` gives all device memory back and
`activate` takes it again with the same plan: that is how a pipeline keeps only its active component on the GPU.

Whoever offloads the model (a pipeline) may be told of its moments through `HandleHooks` (hooks.py), given at
construction and never changed. What other layers may use: `offload`, `offload_shared`, the handle's public methods
and properties, and its ``host`` (`HostCopies`), which the pipelines' host tiers move between RAM and disk.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..storage.payload_cache import PayloadCache
from ..storage.raw_homes import RawHome
from ..storage.shared_host import SharedHostMemory
from .boundaries import refuse_whole_model_compile
from .calls import BoundaryCalls
from .config import OffloadConfig, resolve_budget, resolve_device
from .errors import BudgetError, FlexTensorError, OffloadStateError
from .hooks import HandleHooks
from .load_checks import LoadCheckError, LoadChecks, LoadCheckSummary
from .phases import Discovery, OnDemand, Phase, Phases, Removed, Steady
from .planner import Plan, WorkloadProfile
from .planning import Planning
from .profile import model_fingerprint
from .profiler import Clock, Profiler
from .schedule import SteadySchedule, TransferTotals
from .setup import SetUp, assemble
from .stats import OffloadStats, SetupTimes, collect_stats
from .units import UnitLayout, find_units, plan_layout

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
        raw_home: compressed only (``raw_copies="none"`` or ``"disk"``), where the raw bytes of units kept compressed
            wait (`RawHome`; the pipelines give their weight files); None: ``"none"`` keeps none (their payloads are
            their host copy), ``"disk"`` a cache file in ``config.cache_dir``.
        hooks: what the handle tells whoever offloaded the model (`HandleHooks`; a pipeline's); None: nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        config: OffloadConfig,
        layout: UnitLayout | None = None,
        raw_home: RawHome | None = None,
        hooks: HandleHooks[OffloadHandle] | None = None,
    ) -> None:
        started = time.perf_counter()
        self._refuse_model(model, config)
        self.model, self.config = model, config
        self.hooks: HandleHooks[OffloadHandle] = hooks if hooks is not None else HandleHooks()
        self.device = resolve_device(config.device)
        self.cuda = self.device.type == "cuda"
        # Another process packed these weights into shared memory: point at them, copy nothing.
        self.attaching = config.shared_host is not None and not config.shared_host.create
        if layout is None:
            selected = find_units(model, config.include_patterns, config.exclude_patterns)
            # Weights shared between processes are laid out alike in each (canonically); others keep their place.
            shared = config.shared_host is not None
            layout = plan_layout(model, selected, self.device, meta_ok=self.attaching, canonical=shared)
        copies = assemble(model, layout, self.device, config.shared_host)
        self.host, self.device_copies, self.binding, self.edits = (
            copies.host,
            copies.device,
            copies.binding,
            copies.edits,
        )
        self.units = layout.units
        #: ``verify_loads``: every unit call compares its device bytes with its weights (`load_checks`).
        self.load_checks = LoadChecks(self.units, self.device, self.host.readable) if config.verify_loads else None
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
        """What changes from call to call: the phase, counters, timings, and the boundary calls (`BoundaryCalls`,
        which hold the position in the current forward)."""
        self.phases = Phases(self, Discovery if self.units else Steady)
        self.counters = {"discovery": 0, "profiling": 0, "steady": 0, "desyncs": 0, "plans": 0, "activations": 0}
        self.measured_forwards = 0
        self.clock = Clock(self.device)
        self.profiler = Profiler(self.device, self.clock)
        self.totals = TransferTotals(unit_stall_ms=[0.0] * len(self.units))
        self.schedule = SteadySchedule(self.device_copies, self.clock, self.config.measure_stalls, self.totals)
        self.calls = BoundaryCalls(self)  # set-up routes the model's calls here

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
    def workload_entry(self) -> str:
        """The entry method of the workload call in progress (``forward``, or a VAE's ``decode``, ...)."""
        return self.calls.workload_entry

    @property
    def plan(self) -> Plan | None:
        return self.planning.plan

    @property
    def profile(self) -> WorkloadProfile | None:
        return self.planning.profile

    @property
    def shortfall(self) -> BudgetError | None:
        """The measured minimum exceeded the budget (phase over budget): the error, raised before the next
        forward (``hooks.budget_refusal`` may say otherwise)."""
        return self.planning.shortfall

    @property
    def raw_on_disk(self) -> bool:
        """Compressed only (``raw_copies="none"`` or ``"disk"``): the raw host copies wait in a raw home, or are
        nowhere; loads decode compressed copies (`HostForm.raw_in_ram`)."""
        return not self.host.form.raw_in_ram

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
        if self.hooks.on_activate is not None:
            self.hooks.on_activate(self)
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

    # ------------------------------------------------------------------------------------ loads and removal

    def check_loads(self) -> LoadCheckSummary | None:
        """With ``verify_loads``: wait for every comparison enqueued so far and raise `LoadCheckError` when a unit
        computed with bytes that are not its weights; else the comparisons made (None without ``verify_loads``)."""
        if self.load_checks is None:
            return None
        summary = self.load_checks.summary()  # one wait for the device
        if summary.faults:
            raise LoadCheckError(type(self.model).__name__, summary.faults)
        return summary

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


def offload(
    model: nn.Module,
    config: OffloadConfig | None = None,
    hooks: HandleHooks[OffloadHandle] | None = None,
    **kwargs: Any,
) -> OffloadHandle:
    """Stream ``model``'s units from host memory under a GPU budget; returns the handle.

    ``offload(model, include_patterns=["blocks.*"], gpu_budget="24GiB")`` is the same as passing an
    `OffloadConfig`. ``model``'s blocks may be compiled (``compile_repeated_blocks``, or ``block.compile()`` on
    each unit) before or after; whole-model compilation is refused (see `boundaries`). ``hooks``: see `HandleHooks`.
    """
    if config is None:
        config = OffloadConfig(**kwargs)
    elif kwargs:
        raise TypeError("pass either an OffloadConfig or keyword arguments, not both")
    return OffloadHandle(model, config, hooks=hooks)


def offload_shared(
    model: nn.Module,
    config: OffloadConfig,
    namespace: str,
    group: Any = None,
    root: str | Path = "/dev/shm",
    hooks: HandleHooks[OffloadHandle] | None = None,
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
            handle = offload(model, dataclasses.replace(config, shared_host=shared), hooks)
        except Exception as exc:  # reach the barrier anyway, so that the others fail instead of waiting
            error = exc
    dist.barrier(group)
    if error is not None:
        raise error
    if handle is None:  # raises "no shared weights" when the creator failed
        handle = offload(model, dataclasses.replace(config, shared_host=shared), hooks)
    return handle
