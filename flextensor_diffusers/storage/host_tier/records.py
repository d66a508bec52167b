"""What the host tier records of its reads: a `Switch` per component brought in from disk (kept for the
report and the forecasts), with an `UnitArrival` per unit taken (when its read ended, when the component asked
for it: where a switch's wait went), and a `Reading` per read under way (what RAM it may still take, what it has
read); `ReadRecords` holds both, for the parts that count them and the parts that make them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .. import disk_reads
from ..disk_reads import ReadJob

#: `Reading.kind` of the active component's read (it computes while its units arrive).
READ_BACK = "read back"
#: `Reading.kind` of the read of a component expected soon (paused when the budget holds no more of it).
READ_AHEAD = "read ahead"


@dataclass(frozen=True)
class UnitArrival:
    """One unit of a switch, in seconds from the switch's start: when the reader delivered it (negative: read
    ahead), when the component asked for it (None: taken without being asked, as the switch away from it
    completes the read) and when it was taken. A unit asked for before it was read kept the component waiting."""

    position: int  # 0: the base, i + 1: unit i
    nbytes: int
    read_s: float | None
    asked_s: float | None
    taken_s: float

    @property
    def asked_before_read(self) -> bool:
        """The component asked for it before the reader delivered it: it waited for the disk."""
        return self.asked_s is not None and self.read_s is not None and self.read_s > self.asked_s


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
    began_at: float = field(default_factory=lambda: disk_reads.clock(), repr=False)
    arrivals: list[UnitArrival] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.prefetched = self.read_ahead_bytes > 0

    def note_taken(self, position: int, nbytes: int, read_at: float | None, asked_at: float | None) -> None:
        """Unit ``position`` was taken now, read at ``read_at`` and asked for at ``asked_at`` (`disk_reads.clock`)."""
        now = disk_reads.clock()

        def since(at: float | None) -> float | None:
            return None if at is None else round(at - self.began_at, 4)

        self.arrivals.append(
            UnitArrival(position, nbytes, since(read_at), since(asked_at), round(now - self.began_at, 4))
        )

    def timeline(self) -> list[dict[str, Any]]:
        """Every unit taken so far, in the order taken (`UnitArrival`, as dicts)."""
        return [asdict(a) for a in self.arrivals]

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
            "waited_units": sum(a.asked_before_read for a in self.arrivals),
            "last_read_s": max((a.read_s for a in self.arrivals if a.read_s is not None), default=None),
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


class ReadRecords:
    """The host tier's reads: every switch from disk so far, in order (`ReadBack` appends each), and the reads
    under way, in the order the reader runs them: the active component's read back (``back``, kept by `ReadBack`),
    then the read aheads in the order expected (``ahead``, by component, kept by `ReadAheads`).

    Built before any part of the tier, it is given whole to those that count what the reads hold (`Placement`, and
    its `PoolRoom`) and to those that start and end them: none reads another part that is not built yet."""

    def __init__(self) -> None:
        self.switches: list[Switch] = []
        self.back: ReadJob | None = None
        self.ahead: dict[str, ReadJob] = {}

    def readings(self) -> list[Reading]:
        """The reads under way: the read back, then the read aheads in order."""
        back = [] if self.back is None else [Reading(READ_BACK, self.back)]
        return back + [Reading(READ_AHEAD, job) for job in self.ahead.values()]

    @property
    def reserved_bytes(self) -> int:
        """RAM the reads under way may still take before the host copies adopt it (`ReadJob.reserved_bytes`)."""
        return sum(r.job.reserved_bytes for r in self.readings())
