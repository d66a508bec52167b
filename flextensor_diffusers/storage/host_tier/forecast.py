"""What a switch from disk is expected to wait at this host budget, and from which budget it would not.

A user who sees the generation stall at each expert switch needs to know whether more host RAM would hide
it, and how much: the forecast answers that from the disk bandwidth measured so far and the component's
planned forward time, and a slow switch is warned of once, naming that budget.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...engine import format_bytes
from ..host_budget import HostOverhead
from .records import Switch

if TYPE_CHECKING:
    from ...engine import OffloadHandle

logger = logging.getLogger(__name__)

#: A switch that kept its component waiting this long for disk reads is worth a warning (once per component)
#: naming the host budget that would hide it: the user may have the RAM, and otherwise knows why steps stall.
SLOW_SWITCH_S = 2.0


class BudgetSplit(Protocol):
    """The host budget's split a forecast needs (`placement.TierBudget`; tests pass a stand-in)."""

    @property
    def weights_budget(self) -> int: ...

    @property
    def overhead(self) -> HostOverhead: ...


@dataclass(frozen=True)
class SwitchForecast:
    """What a switch to ``component`` is expected to keep it waiting, from the disk bandwidth measured so far
    and the component's planned forward time. ``after`` is the last component before it that does not fit in
    RAM next to it (the low-noise expert before the next generation's high-noise one): while ``after`` runs,
    only what the budget leaves next to it is read ahead. Reading also goes on while the smaller components
    between them run (a VAE, a text encoder); that is left out, so for such a switch this is an upper bound.

    Its units arrive in the order its first forward needs them, so that forward computes while the bytes not
    read ahead arrive; a second forward of the same step (CFG's) needs them all in RAM already. So the wait is
    about (bytes not read ahead) / (disk bandwidth) less one forward, and it vanishes once the read ahead
    covers all but one forward's worth of reading: ``hidden_from_host_budget`` is the host budget from which
    it does (what the read ahead may use next to ``after``, plus what the budget keeps for the process)."""

    component: str
    after: str
    nbytes: int
    read_ahead_bytes: int  # the most the budget lets be read while ``after`` runs
    disk_gbps: float
    forward_s: float
    wait_s: float
    hidden_from_host_budget: int

    @classmethod
    def of(
        cls,
        component: str,
        after: str,
        nbytes: int,
        after_bytes: int,
        tier: BudgetSplit,
        disk_gbps: float,
        forward_s: float,
    ) -> SwitchForecast:
        """``nbytes``, ``after_bytes``: the two components' host copies; ``tier``: its budget and share."""
        ahead = min(nbytes, max(0, tier.weights_budget - after_bytes))
        per_forward = int(disk_gbps * 1e9 * forward_s)  # bytes read while one forward computes
        wait = max(0.0, (nbytes - ahead) / (disk_gbps * 1e9) - forward_s)
        hidden_from = tier.overhead.nbytes + after_bytes + max(0, nbytes - per_forward)
        return cls(component, after, nbytes, ahead, disk_gbps, forward_s, wait, hidden_from)

    def as_dict(self) -> dict[str, Any]:
        rounded = {
            "disk_gbps": round(self.disk_gbps, 3),
            "forward_s": round(self.forward_s, 4),
            "wait_s": round(self.wait_s, 3),
        }
        return {**dataclasses.asdict(self), **rounded}


def forecast_switches(
    switches: list[Switch],
    seen_before: Mapping[str, str],
    handles: Mapping[str, OffloadHandle],
    budget: BudgetSplit,
) -> list[SwitchForecast]:
    """A `SwitchForecast` per switch seen so far whose two components do not fit in RAM together (so the
    second waits on disk), once reads have measured the disk and the component has a plan. ``seen_before``:
    for each component, the one seen running right before it (`ComponentOrder.seen_before`)."""
    done = [s for s in switches if s.complete and s.read_s > 0]
    if not done:
        return []
    gbps = sum(s.nbytes for s in done) / sum(s.read_s for s in done) / 1e9
    packed = {name: handle.host.stored_bytes for name, handle in handles.items()}
    forecasts = []
    for name, handle in handles.items():
        nbytes = packed[name]
        after, passed = seen_before.get(name), {name}
        while after is not None and after not in passed and packed[after] + nbytes <= budget.weights_budget:
            passed.add(after)  # small enough to run next to it: the read ahead goes on meanwhile
            after = seen_before.get(after)
        if after is None or after in passed or handle.plan is None:
            continue
        forward_s = handle.plan.predicted_ms / 1e3
        forecasts.append(SwitchForecast.of(name, after, nbytes, packed[after], budget, gbps, forward_s))
    return forecasts


class SlowSwitchWarning:
    """Warns once per component of a switch that waited `SLOW_SWITCH_S` or more for disk, naming the host budget
    its forecast says would hide it (``forecasts``: the tier's current ones; ``host_budget``: the user's)."""

    def __init__(self, host_budget: int, forecasts: Callable[[], list[SwitchForecast]]) -> None:
        self._host_budget = host_budget
        self._forecasts = forecasts
        self._warned: set[str] = set()

    def check(self, switch: Switch) -> None:
        """After ``switch`` completed: warn when it was slow, not warned of yet, and a larger budget would help."""
        name = switch.component
        if switch.wait_s < SLOW_SWITCH_S or name in self._warned:
            return
        forecast = next((f for f in self._forecasts() if f.component == name), None)
        if forecast is None or forecast.hidden_from_host_budget <= self._host_budget:
            return  # no plan yet to forecast with, or a wait this budget should not see again
        self._warned.add(name)
        logger.warning(
            "host tier: %s waited %.1f s for its weights from disk (%.2f GB/s, %s of %s read ahead); a host budget "
            "of %s would hide that (flextensor_report() forecasts each switch)",
            name,
            switch.wait_s,
            forecast.disk_gbps,
            format_bytes(switch.read_ahead_bytes),
            format_bytes(switch.nbytes),
            format_bytes(forecast.hidden_from_host_budget),
        )
