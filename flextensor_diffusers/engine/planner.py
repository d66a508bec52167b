"""Planning: which units stay resident and how many streaming slots, from a measured profile.

Pure functions over plain data, so that the decisions can be tested on synthetic profiles on any
machine in milliseconds. The runtime executes exactly the schedule simulated here:

* every streamed unit has a fixed slot (its first-appearance rank among streamed units, modulo the
  number of slots), so its parameters are permanent views of that slot;
* a load into a slot is issued on the copy stream right after the compute of the slot's previous
  occupant has been enqueued, and waits for that compute to finish;
* the schedule is cyclic: the last loads of one forward prefetch the first units of the next;
* a compressed load (see `codec`) copies its payload into the slot's staging buffer as soon as the
  staging buffer's previous payload is decoded, and is decoded on a stream of its own once the slot
  is free: copies, decodes and compute overlap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .config import format_bytes
from .errors import BudgetError

#: The CUDA caching allocator rounds every block up to this many bytes, and its peak counts the rounded sizes.
CUDA_ALLOCATION_GRANULE = 512


def allocated(nbytes: int, granule: int) -> int:
    """What a buffer of ``nbytes`` adds to an allocator's count: its size rounded up to ``granule``."""
    return -(-nbytes // granule) * granule


@dataclass(frozen=True)
class Call:
    """One execution of a unit inside a forward, in order."""

    unit: int
    compute_ms: float
    gap_before_ms: float = 0.0  # compute outside any unit between the previous call and this one


@dataclass
class WorkloadProfile:
    """What profiling measured; all a plan depends on."""

    unit_names: list[str]
    unit_bytes: list[int]
    calls: list[Call]
    tail_ms: float  # compute after the last unit call
    bandwidth_bytes_per_ms: float  # host→device
    activation_peak_bytes: int  # peak allocated by the process during a forward, less the handle's own copies
    resident_bytes: int  # weights that are not in any unit (always on the device)
    #: Bytes a load of each unit moves over the link when it differs from ``unit_bytes`` (a unit kept
    #: compressed in host memory and decoded on the device); None: every load moves the raw bytes.
    transfer_bytes: list[int] | None = None
    #: Measured decode time of each compressed unit (0 for the others); None: not measured (decodes
    #: are then taken as free, e.g. on the CPU).
    decode_ms: list[float] | None = None
    #: The allocator's block granule: every device buffer counts as its size rounded up to it (512 for the
    #: CUDA caching allocator, whose peak counts rounded blocks; 1 where sizes count as they are).
    allocation_granule: int = 1

    def allocated(self, nbytes: int) -> int:
        """What a device buffer of ``nbytes`` adds to the allocator's count."""
        return allocated(nbytes, self.allocation_granule)

    def transfer(self, unit: int) -> int:
        return self.transfer_bytes[unit] if self.transfer_bytes is not None else self.unit_bytes[unit]

    def decodes(self, unit: int) -> bool:
        """A load of ``unit`` moves a compressed payload and decodes it."""
        return self.transfer(unit) != self.unit_bytes[unit]

    def decode(self, unit: int) -> float:
        return self.decode_ms[unit] if self.decode_ms is not None and self.decodes(unit) else 0.0

    @property
    def compressed(self) -> frozenset[int]:
        return frozenset(u for u in range(len(self.unit_bytes)) if self.decodes(u))

    def loading_raw(self, units: frozenset[int] | set[int]) -> WorkloadProfile:
        """This profile with ``units`` loaded as raw bytes (no payload, no decode, no staging room)."""
        if self.transfer_bytes is None or not units:
            return self
        transfer = [self.unit_bytes[u] if u in units else t for u, t in enumerate(self.transfer_bytes)]
        return dataclasses.replace(self, transfer_bytes=transfer)

    def paying_compressed(self) -> frozenset[int]:
        """Compressed units whose loads are faster that way: the payload's copy and the decode (which
        overlap) both take less than copying the raw bytes."""
        bw = self.bandwidth_bytes_per_ms
        faster = [u for u in self.compressed if max(self.transfer(u) / bw, self.decode(u)) < self.unit_bytes[u] / bw]
        return frozenset(faster)

    def staging_bytes(self, streamed: list[int]) -> int:
        """Device room one slot needs to receive a compressed load before decoding it into the slot."""
        return max((self.transfer(u) for u in streamed if self.transfer(u) != self.unit_bytes[u]), default=0)

    @property
    def compute_ms(self) -> float:
        return sum(c.compute_ms + c.gap_before_ms for c in self.calls) + self.tail_ms


@dataclass
class Plan:
    """Residency and slots; ``slot_of[u]`` is None for a resident unit."""

    resident: frozenset[int]
    num_slots: int
    slot_bytes: int
    slot_of: list[int | None]
    predicted_ms: float
    lower_bound_ms: float
    memory_bytes: int  # predicted peak allocated: resident weights + residents + slots + activations
    budget_bytes: int
    staging_bytes: int = 0  # per slot: room for a compressed load before it is decoded into the slot
    compressed: frozenset[int] = frozenset()  # streamed units whose loads move a payload and decode it
    transfer_bytes: int = 0  # bytes over the link per forward
    loads: list[tuple[int, int] | None] = field(default_factory=list)  # after call p: (slot, unit) to load
    first_loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, unit) to prime

    @property
    def streamed(self) -> list[int]:
        return [u for u, s in enumerate(self.slot_of) if s is not None]

    def summary(self) -> dict:
        return {
            "resident_units": sorted(self.resident),
            "streamed_units": len(self.streamed),
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "predicted_ms": round(self.predicted_ms, 3),
            "lower_bound_ms": round(self.lower_bound_ms, 3),
            "memory_bytes": self.memory_bytes,
            "budget_bytes": self.budget_bytes,
            "compressed_units": len(self.compressed),
        }


def assign_slots(calls: list[Call], resident: frozenset[int], num_slots: int, num_units: int) -> list[int | None]:
    """Fixed slot per streamed unit: its rank of first appearance among streamed calls, modulo slots."""
    slot_of: list[int | None] = [None] * num_units
    rank = 0
    for call in calls:
        if call.unit not in resident and slot_of[call.unit] is None:
            slot_of[call.unit] = rank % num_slots
            rank += 1
    for u in range(num_units):  # a unit never called still needs a home for on-demand use
        if u not in resident and slot_of[u] is None:
            slot_of[u] = rank % num_slots
            rank += 1
    return slot_of


def schedule_loads(
    calls: list[Call], slot_of: list[int | None]
) -> tuple[list[tuple[int, int] | None], list[tuple[int, int]]]:
    """Loads to issue after each call, and the loads that prime each slot before the first forward.

    After the call that is a slot's visit, the slot's next visit in cyclic order is loaded, unless it
    is the same unit (its weights are still there).
    """
    visits: dict[int, list[int]] = {}
    for p, call in enumerate(calls):
        slot = slot_of[call.unit]
        if slot is not None:
            visits.setdefault(slot, []).append(p)
    loads: list[tuple[int, int] | None] = [None] * len(calls)
    first: list[tuple[int, int]] = []
    for slot, positions in sorted(visits.items()):
        first.append((slot, calls[positions[0]].unit))
        for i, p in enumerate(positions):
            nxt = calls[positions[(i + 1) % len(positions)]].unit
            if nxt != calls[p].unit:
                loads[p] = (slot, nxt)
    first.sort(key=lambda sl: next(p for p, c in enumerate(calls) if c.unit == sl[1]))
    return loads, first


def simulate(profile: WorkloadProfile, resident: frozenset[int], num_slots: int, cycles: int = 2) -> float:
    """Predicted time of one forward in steady state: the last of ``cycles`` simulated forwards.

    Three streams: compute runs calls in order, waiting for a streamed unit's load; copy runs loads
    in issue order, a raw load waiting for its slot's previous occupant to finish computing, a
    compressed one for its staging buffer's previous payload to be decoded; decode runs the decodes
    in the same order, each waiting for its payload and its slot. A forward ends when all streams
    are idle: callers often synchronise between forwards (a sampler step, a timer), so the loads
    that prefetch the next forward must hide behind this forward's compute, not behind the next
    one's. Back-to-back forwards can only be faster than predicted.
    """
    calls = profile.calls
    if len(resident) == len(profile.unit_bytes) or not calls:
        return profile.compute_ms
    slot_of = assign_slots(calls, resident, num_slots, len(profile.unit_bytes))
    loads, first = schedule_loads(calls, slot_of)
    streams = _LoadStreams(profile)
    for slot, unit in first:
        streams.load(slot, unit, slot_free_at=0.0)
    t = 0.0
    start = 0.0
    for _ in range(cycles):
        t = start = streams.start_cycle(t)
        for p, call in enumerate(calls):
            t += call.gap_before_ms
            if slot_of[call.unit] is not None:
                t = max(t, streams.ready[call.unit])
            t += call.compute_ms
            load = loads[p]
            if load is not None:
                streams.load(*load, slot_free_at=t)
        t += profile.tail_ms
    return max(t, streams.idle_at) - start


class _LoadStreams:
    """The copy and decode streams of `simulate`: when each load's weights are ready in its slot."""

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile
        self.copy_t = 0.0
        self.decode_t = 0.0
        self.staging_free: dict[int, float] = {}
        self.ready: dict[int, float] = {}

    def load(self, slot: int, unit: int, slot_free_at: float) -> None:
        profile = self.profile
        copy_ms = profile.transfer(unit) / profile.bandwidth_bytes_per_ms
        if not profile.decodes(unit):
            self.copy_t = max(self.copy_t, slot_free_at) + copy_ms
            self.ready[unit] = self.copy_t
            return
        self.copy_t = max(self.copy_t, self.staging_free.get(slot, 0.0)) + copy_ms
        self.decode_t = max(self.decode_t, self.copy_t, slot_free_at) + profile.decode(unit)
        self.staging_free[slot] = self.ready[unit] = self.decode_t

    @property
    def idle_at(self) -> float:
        return max(self.copy_t, self.decode_t)

    def start_cycle(self, t: float) -> float:
        """A forward starts once the previous one has finished on every stream."""
        start = max(t, self.idle_at)
        self.copy_t = self.decode_t = start
        return start


def streamed_bytes_per_forward(profile: WorkloadProfile, resident: frozenset[int], num_slots: int) -> int:
    slot_of = assign_slots(profile.calls, resident, num_slots, len(profile.unit_bytes))
    loads, _ = schedule_loads(profile.calls, slot_of)
    return sum(profile.transfer(load[1]) for load in loads if load is not None)


def lower_bound(profile: WorkloadProfile, resident: frozenset[int], num_slots: int) -> float:
    """No schedule beats max(all compute, streamed bytes / bandwidth)."""
    copy_ms = streamed_bytes_per_forward(profile, resident, num_slots) / profile.bandwidth_bytes_per_ms
    return max(profile.compute_ms, copy_ms)


def memory_needed(profile: WorkloadProfile, resident: frozenset[int], num_slots: int, margin: float) -> int:
    """The peak the plan allocates: every device buffer as the allocator counts it, and the activations (all
    the process holds besides the handle's copies) with their margin."""
    streamed = [u for u in range(len(profile.unit_bytes)) if u not in resident]
    staging, size = profile.staging_bytes(streamed), profile.allocated
    slot = size(max(profile.unit_bytes[u] for u in streamed)) + size(staging) if streamed else 0
    slots = num_slots * slot
    residents = sum(size(profile.unit_bytes[u]) for u in resident)
    activations = int(profile.activation_peak_bytes * (1 + margin))
    return size(profile.resident_bytes) + residents + slots + activations


def smallest_budget(
    resident_bytes: int,
    unit_bytes: list[int],
    activation_peak_bytes: int = 0,
    margin: float = 0.0,
    staging_bytes: int = 0,
    granule: int = 1,
) -> int:
    """The least budget streaming can run in: weights outside units + 2 slots of the largest unit
    (one computing, one loading; each with room for a compressed load) + the activation peak with its
    margin, each buffer as the allocator counts it (``granule``). The one place this rule lives: at set-up
    activations are not known yet (0); after profiling they are."""
    slots = 2 * (allocated(max(unit_bytes), granule) + allocated(staging_bytes, granule)) if unit_bytes else 0
    return allocated(resident_bytes, granule) + slots + int(activation_peak_bytes * (1 + margin))


def check_budget(
    budget: int,
    resident_bytes: int,
    unit_bytes: list[int],
    activation_peak_bytes: int = 0,
    margin: float = 0.0,
    staging_bytes: int = 0,
    granule: int = 1,
) -> None:
    """Raise `BudgetError` (with ``required_bytes``) when ``budget`` is under `smallest_budget`."""
    need = smallest_budget(resident_bytes, unit_bytes, activation_peak_bytes, margin, staging_bytes, granule)
    if budget >= need:
        return
    parts = f"weights outside units {format_bytes(resident_bytes)}"
    if unit_bytes:
        parts += f" + 2 slots of the largest unit, {format_bytes(max(unit_bytes))}"
        if staging_bytes:
            parts += f", each with {format_bytes(staging_bytes)} of room for a compressed load"
    if activation_peak_bytes:
        parts += (
            f" + activation peak {format_bytes(activation_peak_bytes)} (+{margin:.0%}; everything else the process "
            "holds on the device while it runs)"
        )
    raise BudgetError(
        f"gpu_budget {format_bytes(budget)} is smaller than the least this needs: {format_bytes(need)} ({parts}). "
        f"Pass gpu_budget >= {need}, stream smaller units (finer include_patterns), or shrink the workload "
        "(fewer frames, smaller resolution, VAE tiling)",
        required_bytes=need,
    )


def everything_resident(unit_bytes: list[int], resident_bytes: int, budget: int) -> Plan:
    """Every unit resident, no slots: the layout while a small model is profiled (see the runtime)."""
    n = len(unit_bytes)
    return Plan(
        resident=frozenset(range(n)),
        num_slots=0,
        slot_bytes=0,
        slot_of=[None] * n,
        predicted_ms=0.0,
        lower_bound_ms=0.0,
        memory_bytes=resident_bytes + sum(unit_bytes),
        budget_bytes=budget,
    )


def plan_residency(
    profile: WorkloadProfile, budget: int, max_slots: int = 6, margin: float = 0.05, raw_fallback: bool = True
) -> Plan:
    """The plan with the least predicted step time whose memory fits ``budget``.

    A model kept compressed is planned twice: loading compressed the units whose loads are faster
    that way (`WorkloadProfile.paying_compressed`), and loading every unit raw, which needs no
    staging room and so fits smaller budgets or keeps more units resident. The faster plan wins; when
    both hide their loads equally, the one that moves fewer bytes over the link (and leaves it to
    other transfers). Without ``raw_fallback`` (raw copies are not in RAM: a raw load would read a file)
    every unit kept compressed loads compressed, paying or not.
    """
    if not profile.compressed or not raw_fallback:
        return _plan_one(profile, budget, max_slots, margin)
    candidates = {profile.compressed - profile.paying_compressed(), profile.compressed}
    plans: list[Plan] = []
    refusals: list[BudgetError] = []
    for raw in candidates:
        try:
            plans.append(_plan_one(profile.loading_raw(raw), budget, max_slots, margin))
        except BudgetError as exc:  # without its traceback: kept in a list its own frame holds, it made a cycle
            refusals.append(exc.with_traceback(None))
    if not plans:
        raise min(refusals, key=lambda exc: exc.required_bytes)
    return min(plans, key=lambda plan: (round(plan.predicted_ms, 6), plan.transfer_bytes, plan.memory_bytes))


def _plan_one(profile: WorkloadProfile, budget: int, max_slots: int, margin: float) -> Plan:
    """Everything resident when it fits. Otherwise, for each slot count, units are made resident one
    at a time, each time the one whose residency shortens the simulated step most (ties: the
    largest, which saves the most transfer), while the budget allows. Units whose loads are hardest
    to hide behind neighbouring compute therefore become resident first.
    """
    n = len(profile.unit_bytes)
    everything = frozenset(range(n))
    if memory_needed(profile, everything, 0, margin) <= budget:
        return _make_plan(profile, everything, 0, budget, margin)
    staging = profile.staging_bytes(list(range(n)))
    check_budget(
        budget,
        profile.resident_bytes,
        profile.unit_bytes,
        profile.activation_peak_bytes,
        margin,
        staging,
        profile.allocation_granule,
    )
    best: tuple[float, int, frozenset[int], int] | None = None
    for slots in range(2, max_slots + 1):
        if memory_needed(profile, frozenset(), slots, margin) > budget:
            break
        resident: frozenset[int] = frozenset()
        current = simulate(profile, resident, slots)
        while True:
            choice: tuple[float, int, int] | None = None
            for u in range(n):
                if u in resident:
                    continue
                trial = resident | {u}
                if len(trial) == n or memory_needed(profile, trial, slots, margin) > budget:
                    continue
                t = simulate(profile, trial, slots)
                key = (t, -profile.unit_bytes[u], u)
                if choice is None or key < choice:
                    choice = key
            if choice is None or choice[0] > current + 1e-9:
                break
            current = choice[0]
            resident = resident | {choice[2]}
        key = (current, memory_needed(profile, resident, slots, margin), resident, slots)
        if best is None or key[:2] < best[:2]:
            best = key
    assert best is not None
    return _make_plan(profile, best[2], best[3], budget, margin)


def _make_plan(profile: WorkloadProfile, resident: frozenset[int], slots: int, budget: int, margin: float) -> Plan:
    n = len(profile.unit_bytes)
    if len(resident) == n:
        return Plan(
            resident=resident,
            num_slots=0,
            slot_bytes=0,
            slot_of=[None] * n,
            predicted_ms=profile.compute_ms,
            lower_bound_ms=profile.compute_ms,
            memory_bytes=memory_needed(profile, resident, 0, margin),
            budget_bytes=budget,
            loads=[None] * len(profile.calls),
        )
    slot_of = assign_slots(profile.calls, resident, slots, n)
    loads, first = schedule_loads(profile.calls, slot_of)
    streamed = [u for u in range(n) if u not in resident]
    return Plan(
        resident=resident,
        num_slots=slots,
        slot_bytes=max(profile.unit_bytes[u] for u in streamed),
        staging_bytes=profile.staging_bytes(streamed),
        compressed=frozenset(u for u in streamed if profile.decodes(u)),
        transfer_bytes=streamed_bytes_per_forward(profile, resident, slots),
        slot_of=slot_of,
        predicted_ms=simulate(profile, resident, slots),
        lower_bound_ms=lower_bound(profile, resident, slots),
        memory_bytes=memory_needed(profile, resident, slots, margin),
        budget_bytes=budget,
        loads=loads,
        first_loads=first,
    )
