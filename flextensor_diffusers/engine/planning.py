"""`Planning`: a handle's workloads, their profiles and the plan in force, under its budget.

A *workload* is one call of ``forward`` or of an entry method (a VAE's ``decode``) with given input shapes; each
has its own profile and plan, kept in memory (and on disk with ``profile_dir``), so switching between known
workloads plans again without profiling. A plan is made from a profile by the pure planner (`planner`); here it
is adopted: the device copies laid out for it and the schedule set to follow it, or, when the budget is under
the measured minimum, the shortfall kept to be raised before the next forward.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .config import format_bytes, parse_bytes
from .errors import BudgetError, OffloadStateError
from .phases import Desynced, OverBudget, Phase, Phases, Steady
from .planner import Plan, WorkloadProfile, check_budget, plan_residency, smallest_budget
from .profile import ProfileStore, SavedProfile, device_name

if TYPE_CHECKING:
    from torch import nn

    from ..storage.host_copies import HostCopies
    from .config import OffloadConfig
    from .device_copies import DeviceCopies
    from .profiler import Clock, Profiler
    from .schedule import SteadySchedule
    from .units import Unit

logger = logging.getLogger(__name__)


class PlanningContext(Protocol):
    """What planning works on: the handle's model, parts and counters (the handle is one)."""

    model: nn.Module
    config: OffloadConfig
    fingerprint: dict[str, Any]
    device: torch.device
    units: list[Unit]
    resident_weight_bytes: int
    host: HostCopies
    device_copies: DeviceCopies
    phases: Phases
    counters: dict[str, int]
    schedule: SteadySchedule
    profiler: Profiler
    clock: Clock

    @property
    def phase(self) -> Phase: ...

    @property
    def active(self) -> bool: ...

    @property
    def raw_on_disk(self) -> bool: ...


class Planning:
    """The current workload's signature, profile and plan; the budget; the profiles of every workload seen."""

    def __init__(self, handle: PlanningContext, budget_bytes: int) -> None:
        self.handle = handle
        self.budget_bytes = budget_bytes
        config = handle.config
        self.profiles = ProfileStore(
            type(handle.model).__name__,
            handle.fingerprint,
            device_name(handle.device),
            config.profile,
            config.profile_dir,
            config.reprofile_on_mismatch,
        )
        self.profile: WorkloadProfile | None = None
        self.plan: Plan | None = None
        #: The measured minimum exceeded the budget (phase over budget); raised before the next forward.
        self.shortfall: BudgetError | None = None
        self._saved: SavedProfile | None = None  # the profile the current plan was made from
        self._signature: str | None = None

    # ------------------------------------------------------------------------------------ budgets

    def smallest_budget(self, profile: WorkloadProfile | None = None) -> int:
        """The least budget for ``profile`` (default: the current one; none yet: the set-up minimum). Raw loads
        need no staging room, and the planner falls back to them when the budget is too small to stage
        payloads, so compression never raises the minimum, unless the raw copies wait on disk."""
        profile = profile or self.profile
        activations = profile.activation_peak_bytes if profile is not None else 0
        return smallest_budget(*self._minimum_terms(), activations, *self._allowances())

    def weights_minimum(self) -> int:
        """The set-up minimum, whatever profile is current: weights outside units and two slots, no activations.
        What a budget leaves the activations is the budget less this."""
        return smallest_budget(*self._minimum_terms(), 0, *self._allowances())

    def check_budget(self, budget: int, profile: WorkloadProfile | None = None) -> None:
        """Raise `BudgetError`, naming the smallest workable budget, when ``budget`` is under it."""
        activations = profile.activation_peak_bytes if profile is not None else 0
        check_budget(budget, *self._minimum_terms(), activations, *self._allowances())

    def staging_refusal(self, payload_bytes: int) -> str | None:
        """With the raw copies on disk every load of a unit kept compressed decodes, so each slot needs room for the
        largest payload, ``payload_bytes``: why the budget cannot hold that with the activations measured so far
        (naming the budget it needs), for payloads made after set-up (`CompressedCopies.adopt_arrival`); None when
        it can, or when the raw copies are in RAM (a raw load is then always possible)."""
        h = self.handle
        if not h.config.compressed_only:
            return None
        activations = self.profile.activation_peak_bytes if self.profile is not None else 0
        margin, _, granule = self._allowances()
        try:
            check_budget(self.budget_bytes, *self._minimum_terms(), activations, margin, payload_bytes, granule)
        except BudgetError as exc:
            return f"{exc}; the model streams its raw bytes from where they wait on disk meanwhile"
        return None

    def _minimum_terms(self) -> tuple[int, list[int]]:
        return self.handle.resident_weight_bytes, [u.nbytes for u in self.handle.units]

    def _allowances(self) -> tuple[float, int, int]:
        """Activation margin, staging room every slot needs (raw copies on disk: every load decodes), granule."""
        h = self.handle
        disk = h.config.compressed_only  # asked for: checked before the raw copies move to disk
        staging = max((e.payload.numel() for e in h.host.encoded.values()), default=0) if disk else 0
        return h.config.activation_margin, staging, h.device_copies.allocation_granule

    def set_budget(self, budget: int | str) -> Plan | None:
        """Change the budget; with a measured profile the workload is planned again at once. A budget under
        the minimum is refused and the plan stays."""
        new = parse_bytes(budget)
        self.check_budget(new, self.profile)
        self.budget_bytes = new
        if self.handle.phase in (Phase.STEADY, Phase.OVER_BUDGET) and self.profile is not None:
            self.apply(self.profile)
        return self.plan

    def shortfall_error(self) -> BudgetError:
        assert self.shortfall is not None
        return BudgetError(str(self.shortfall), required_bytes=self.shortfall.required_bytes)

    # ------------------------------------------------------------------------------------ workloads

    def enter_workload(self, signature: str) -> None:
        """Inputs not seen by the current plan: adopt a known or saved profile for them, or profile them."""
        if signature == self._signature:
            return
        first = self._signature is None
        self._signature = signature
        saved = self.profiles.find(signature, first)
        if saved is not None:
            self._saved = saved
            self.apply(saved.profile)
            return
        if not first:
            logger.info("inputs of %s differ from the profiled workloads; profiling again", self._name)
            self.handle.phases.profile_again()

    def finish_profiling(self) -> None:
        h = self.handle
        profile = h.profiler.workload_profile(
            [u.name for u in h.units], [u.nbytes for u in h.units], h.resident_weight_bytes, self._measure_bandwidth
        )
        self._saved = self.profiles.record(self._signature or "", profile)
        self.apply(profile)

    def save(self, path: str | Path) -> Path:
        if self._saved is None:
            raise OffloadStateError("nothing to save yet: run the model until profiling is done (phase 'steady')")
        return self._saved.save(path)

    def forget_workloads(self) -> None:
        """Known profiles no longer describe the model (its units were compiled)."""
        self.profiles.known.clear()

    # ------------------------------------------------------------------------------------ plans

    def apply(self, profile: WorkloadProfile) -> None:
        """Plan under the budget and lay out resident copies and slots accordingly; a budget the measured
        minimum does not fit leaves the handle over budget, on demand. Unit sizes, the bytes compressed loads
        move and the allocator's granule are this run's (a saved profile may come from another layout or
        another encoding of the weights)."""
        h = self.handle
        profile.unit_bytes = [u.nbytes for u in h.units]
        profile.resident_bytes = h.resident_weight_bytes
        if h.host.encoded:
            profile.transfer_bytes = [h.host.transfer_bytes(u.index) for u in h.units]
        profile.allocation_granule = h.device_copies.allocation_granule
        self.profile = profile
        try:
            config = h.config
            plan = plan_residency(
                profile, self.budget_bytes, config.max_slots, config.activation_margin, not h.raw_on_disk
            )
        except BudgetError as exc:
            # Kept without the traceback it was caught with: its frames reach, through their callers, the call
            # that profiled, and would keep that call's inputs and output (a decoded video) alive until the
            # collector ran, counted as the next workload's activations.
            self.shortfall = exc.with_traceback(None)
            h.phases.switch(OverBudget)
            logger.warning("%s: %s", self._name, exc)
            return
        self.shortfall, self.plan = None, plan
        h.phases.switch(Steady)
        h.counters["plans"] += 1
        if h.active:
            h.schedule.leave()
            h.device_copies.lay_out(plan)
            self.follow()
        logger.info(
            "%s plan: %d resident, %d streamed through %d slots; predicted %.2f ms/forward (lower bound %.2f ms), "
            "memory %s of budget %s",
            self._name,
            len(plan.resident),
            len(plan.streamed),
            plan.num_slots,
            plan.predicted_ms,
            plan.lower_bound_ms,
            format_bytes(plan.memory_bytes),
            format_bytes(self.budget_bytes),
        )

    def follow(self) -> None:
        """The schedule follows the plan over freshly laid-out device copies (steady or desynced phases)."""
        h = self.handle
        if self.plan is not None and isinstance(h.phases.current, (Steady, Desynced)) and h.units:
            h.schedule.follow(self.plan, [c.unit for c in self.profile.calls])  # type: ignore[union-attr]

    def drop(self) -> None:
        """No plan from now on (removal)."""
        self.plan = None

    def _measure_bandwidth(self) -> float:
        """Bytes per ms of one host→device copy of the largest unit (when profiling loaded nothing); with the
        raw copies on disk, of the largest compressed copy, which is what loads then read."""
        h = self.handle
        if h.raw_on_disk and h.host.encoded:
            source = max((e.payload for e in h.host.encoded.values()), key=lambda t: t.numel())
        else:  # raw on disk with nothing compressed yet (encoded between forwards): gathered from where it waits
            source = h.host.raw_tensor(max(h.units, key=lambda u: u.nbytes))
        scratch = torch.empty(source.numel(), dtype=torch.uint8, device=h.device)
        start = h.clock.mark()
        scratch.copy_(source, non_blocking=True)
        end = h.clock.mark()
        h.clock.wait(end)
        return source.numel() / max(h.clock.ms(start, end), 1e-6)

    @property
    def _name(self) -> str:
        return type(self.handle.model).__name__
