"""What the host tier records of its reads: a `Switch` per component brought in from disk (kept for the
report and the forecasts) and a `Reading` per read under way (what RAM it may still take, what it has read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..disk_reads import ReadJob

#: `Reading.kind` of the active component's read (it computes while its units arrive).
READ_BACK = "read back"
#: `Reading.kind` of the read of a component expected soon (paused when the budget holds no more of it).
READ_AHEAD = "read ahead"


@dataclass
class Switch:
    """One component brought in from disk: what its read cost and how much of it the component waited for."""

    component: str
    nbytes: int
    read_ahead_bytes: int = 0  # read while another component ran, before this one became active
    read_s: float = 0.0  # the reader's busy time on it, ahead and after (wall clock, paused time excluded)
    wait_s: float = 0.0  # time it was kept from computing: `bring_in`'s own, then blocked in the gate
    bring_in_s: float = 0.0  # of ``wait_s``, `bring_in`'s own: moving others out, starting the read
    complete: bool = False  # every unit arrived (False: still arriving, or given up)
    prefetched: bool = field(init=False)  # some of it was read ahead (a field: records are read with asdict)

    def __post_init__(self) -> None:
        self.prefetched = self.read_ahead_bytes > 0

    @property
    def hidden_s(self) -> float:
        """Read time spent while a component computed."""
        return max(0.0, self.read_s - self.wait_s)

    @property
    def gbps(self) -> float | None:
        """The read's bandwidth, once every unit arrived (a read given up measured only part of it)."""
        return round(self.nbytes / self.read_s / 1e9, 3) if self.complete and self.read_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "nbytes": self.nbytes,
            "read_ahead_bytes": self.read_ahead_bytes,
            "prefetched": self.prefetched,
            "read_s": round(self.read_s, 4),
            "wait_s": round(self.wait_s, 4),
            "bring_in_s": round(self.bring_in_s, 4),
            "gbps": self.gbps,
            "complete": self.complete,
        }


@dataclass(frozen=True)
class Reading:
    """A read under way: its job and whether it is the active component's (`READ_BACK`) or one ahead."""

    kind: str
    job: ReadJob

    def as_dict(self) -> dict[str, Any]:
        """The component, the kind of read, and bytes read, allowed and in all."""
        job = self.job
        total = sum(job.nbytes)
        return {
            "component": job.component,
            "kind": self.kind,
            "read_bytes": job.read_bytes,
            "allowed_bytes": min(job.allowed, total),
            "nbytes": total,
        }
