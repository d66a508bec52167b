"""What happened: bytes moved, stalls, overlap and memory, per handle and per unit; where set-up time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..storage.codec import CODED_DTYPES
from . import peaks
from .config import format_bytes
from .phases import Phase

if TYPE_CHECKING:
    import torch

    from ..storage.host_copies import HostCopies
    from ..storage.payload_cache import PayloadCache
    from .config import OffloadConfig
    from .device_copies import DeviceCopies
    from .phases import Phases
    from .planner import Plan, WorkloadProfile
    from .schedule import TransferTotals
    from .units import Unit


@dataclass
class SetupTimes:
    """Where set-up time went (ms): unit layout, copies into the flat buffers and their page-locking (with
    compression they overlap ``compress``), hooks. With ``background_encoding`` ``compress`` is the gaps between
    forwards the encoding took so far, summed (after set-up returned)."""

    layout: float = 0.0
    pack: float = 0.0
    hooks: float = 0.0
    compress: float | None = None  # only with compression

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in vars(self).items() if v is not None}


class Reported(Protocol):
    """What a snapshot reads: the handle's parts, counters and totals (the handle is one)."""

    config: OffloadConfig
    device: torch.device
    cuda: bool
    units: list[Unit]
    host: HostCopies
    device_copies: DeviceCopies
    phases: Phases
    totals: TransferTotals
    counters: dict[str, int]
    measured_forwards: int
    resident_weight_bytes: int
    setup_times: SetupTimes

    @property
    def phase(self) -> Phase: ...

    @property
    def budget_bytes(self) -> int: ...

    @property
    def plan(self) -> Plan | None: ...

    @property
    def profile(self) -> WorkloadProfile | None: ...

    @property
    def payload_cache(self) -> PayloadCache | None: ...


@dataclass
class UnitStats:
    name: str
    nbytes: int
    placement: str  # "resident", "slot k", or "slot 0 (on demand)" before a plan exists
    calls_per_forward: int = 0
    compute_ms_per_forward: float | None = None  # profiled
    loads: int = 0
    stall_ms: float = 0.0
    compression: str | None = None  # with compression on: how the unit streams, and why raw where it is


@dataclass
class OffloadStats:
    """A snapshot of one handle. ``overlap_pct`` is the share of copy time hidden behind compute."""

    phase: str
    device: str
    budget_bytes: int
    resident_weight_bytes: int  # weights outside units, always on the device
    forwards: dict[str, int]
    bytes_streamed: int = 0
    loads: int = 0
    copy_ms: float = 0.0
    decode_ms: float = 0.0  # compressed loads' decodes, on a stream of their own (0 without compression)
    stall_ms: float = 0.0
    between_units_ms: float = 0.0  # steady forwards' time between unit calls (`schedule.TransferTotals`)
    measured_forwards: int = 0
    #: The process's peak on the device since it started or since `flextensor_diffusers.reset_peak_memory_stats`,
    #: the profiling forwards' resets folded in (`peaks.max_memory_allocated`); None on the CPU.
    peak_allocated_bytes: int | None = None
    plan: dict[str, Any] | None = None
    setup_ms: dict[str, float] = field(default_factory=dict)  # layout, pack (with pinning), hooks (compress)
    payload_cache: str | None = None  # with compression_cache: what set-up did with the file, and its path
    #: Bytes a load of every unit moves (compressed copies where kept); equals the units' bytes without.
    transfer_unit_bytes: int = 0
    unit_bytes: int = 0
    units: list[UnitStats] = field(default_factory=list)

    @property
    def overlap_pct(self) -> float | None:
        if self.copy_ms <= 0 or self.device == "cpu":  # CPU copies are synchronous: nothing can overlap
            return None
        return max(0.0, 100.0 * (1.0 - self.stall_ms / self.copy_ms))

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["overlap_pct"] = self.overlap_pct
        return data

    def __str__(self) -> str:
        overlap = "n/a" if self.overlap_pct is None else f"{self.overlap_pct:.1f}%"
        peak = "n/a" if self.peak_allocated_bytes is None else format_bytes(self.peak_allocated_bytes)
        lines = [
            f"phase {self.phase} on {self.device}, budget {format_bytes(self.budget_bytes)}, peak allocated {peak}",
            f"streamed {format_bytes(self.bytes_streamed)} in {self.loads} loads; copy {self.copy_ms:.1f} ms, "
            f"decode {self.decode_ms:.1f} ms, "
            f"stall {self.stall_ms:.1f} ms, overlap {overlap}, between units {self.between_units_ms:.1f} ms "
            f"(steady forwards measured: {self.measured_forwards})",
        ]
        if self.setup_ms:
            lines.append("set-up " + ", ".join(f"{k} {v:.1f} ms" for k, v in self.setup_ms.items()))
        if self.payload_cache:
            lines.append(f"payload cache: {self.payload_cache}")
        if self.plan:
            lines.append(
                f"plan: {self.plan['streamed_units']} streamed, {len(self.plan['resident_units'])} resident, "
                f"{self.plan['num_slots']} slots; predicted {self.plan['predicted_ms']:.2f} ms/forward, "
                f"lower bound {self.plan['lower_bound_ms']:.2f} ms"
            )
        width = max((len(u.name) for u in self.units), default=4)
        lines.append(f"{'unit':<{width}}  {'size':>11}  {'placement':<10} calls  compute ms  loads  stall ms")
        for u in self.units:
            compute = "" if u.compute_ms_per_forward is None else f"{u.compute_ms_per_forward:.3f}"
            lines.append(
                f"{u.name:<{width}}  {format_bytes(u.nbytes):>11}  {u.placement:<10} {u.calls_per_forward:>5}  "
                f"{compute:>10}  {u.loads:>5}  {u.stall_ms:>8.2f}" + (f"  {u.compression}" if u.compression else "")
            )
        return "\n".join(lines)


def collect_stats(handle: Reported) -> OffloadStats:
    """A snapshot of ``handle`` (its pending timings harvested already)."""
    calls: dict[int, int] = {}
    compute: dict[int, float] = {}
    if handle.profile is not None:
        for call in handle.profile.calls:
            calls[call.unit] = calls.get(call.unit, 0) + 1
            compute[call.unit] = compute.get(call.unit, 0.0) + call.compute_ms
    copies, host = handle.device_copies, handle.host
    layout = handle.phases.current.layout()  # once: before a plan it is made afresh at each call
    units = [
        UnitStats(
            name=unit.name,
            nbytes=unit.nbytes,
            placement=_placement(handle, layout, unit.index),
            calls_per_forward=calls.get(unit.index, 0),
            compute_ms_per_forward=compute.get(unit.index),
            loads=copies.loads[unit.index],
            stall_ms=handle.totals.unit_stall_ms[unit.index],
            compression=_compression(handle, unit) if handle.config.compression != "none" else None,
        )
        for unit in handle.units
    ]
    return OffloadStats(
        phase=handle.phase.value,
        device=str(handle.device),
        budget_bytes=handle.budget_bytes,
        resident_weight_bytes=handle.resident_weight_bytes,
        forwards=dict(handle.counters),
        bytes_streamed=copies.bytes_streamed,
        loads=sum(copies.loads),
        copy_ms=handle.totals.copy_ms,
        decode_ms=handle.totals.decode_ms,
        stall_ms=handle.totals.stall_ms,
        between_units_ms=handle.totals.between_units_ms,
        measured_forwards=handle.measured_forwards,
        peak_allocated_bytes=peaks.max_memory_allocated(handle.device) if handle.cuda else None,
        plan=handle.plan.summary() if handle.plan else None,
        setup_ms=handle.setup_times.as_dict(),
        payload_cache=handle.payload_cache.describe() if handle.payload_cache is not None else None,
        transfer_unit_bytes=sum(host.transfer_bytes(u.index) for u in handle.units),
        unit_bytes=sum(u.nbytes for u in handle.units),
        units=units,
    )


def _compression(handle: Reported, unit: Unit) -> str:
    """How ``unit`` streams under compression: its payload's ratio, or raw and why."""
    compressed = handle.host.compressed
    encoded = compressed.encoded.get(unit.index)
    if encoded is not None:
        return f"compressed {encoded.ratio:.2f}x"
    if compressed.arriving:
        return "raw until its payload is read or encoded"
    return f"raw: {raw_reason(unit)}"


def raw_reason(unit: Unit) -> str:
    """Why a unit judged by the codec streams raw: what share of its bytes the codec codes at all (floating-point
    exponents of bf16, fp16, fp32). Quantized weights (int8, float8, GGUF blocks) are copied verbatim, so a unit
    made mostly of them cannot shrink enough to pay for its decode."""
    total = sum(packed.nbytes for packed in unit.tensors)
    coded = sum(packed.nbytes for packed in unit.tensors if packed.dtype in CODED_DTYPES)
    share = coded / total if total else 0.0
    verbatim = sorted({str(p.dtype).removeprefix("torch.") for p in unit.tensors if p.dtype not in CODED_DTYPES})
    if share < 0.5:
        return (
            f"{1 - share:.0%} of its bytes are {', '.join(verbatim)}, which the codec copies verbatim (it codes "
            "only bf16/fp16/fp32 exponents): its payload would not be enough smaller to pay for decoding"
        )
    return "its payload would not be enough smaller than its bytes to pay for decoding"


def _placement(handle: Reported, layout: Plan | None, index: int) -> str:
    if layout is None:
        return "on demand"
    if handle.phase not in (Phase.STEADY, Phase.DESYNCED):
        return "resident (until planned)"
    if index in layout.resident:
        return "resident"
    return f"slot {layout.slot_of[index]}"
