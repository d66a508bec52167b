"""The host tier's report: where the host budget went, where each component waits and what its reads cost.

Built as a plain dictionary (written to JSON by the benchmarks, compared across runs) and rendered as lines
of the offload report (`format_host_tier`).
"""

from __future__ import annotations

from typing import Any

from ...engine import format_bytes
from .forecast import SwitchForecast
from .hand_over import HandOverRecord
from .placement import Placement
from .records import Reading, Switch

#: Where a component waits on disk, as the report names it.
WEIGHTS_FILES, CACHE_FILE, PAYLOAD_FILE = "weights files", "cache file", "compressed file"


def tier_report(
    placement: Placement,
    switches: list[Switch],
    readings: list[Reading],
    forecasts: list[SwitchForecast],
    hand_overs: list[HandOverRecord],
    locked_pool: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Budget and where it went (the process's own memory at enable, the reserve, the host copies' share),
    RAM, per component its bytes, where it is, where it waits and its reads; per switch the read, the wait,
    what was read ahead and the read's bandwidth; disk read bandwidth; the reads under way; the forecast of
    each switch that reads from disk; the RAM handed over during components' last forwards; and the locked pool's
    buffers and driver calls (`storage.locked_pool`; on a host without CUDA its buffers are handed on unlocked)."""
    budget = placement.budget
    read_s = sum(s.read_s for s in switches)
    nbytes = sum(s.nbytes for s in switches)
    components = _components(placement, switches)
    return {
        "host_budget_bytes": budget.budget,
        "process_own_bytes": budget.overhead.own_bytes,
        "host_reserve_bytes": budget.overhead.reserve_bytes,
        "weights_budget_bytes": budget.weights_budget,
        "host_ram_bytes": placement.ram_bytes(),
        "peak_host_ram_bytes": placement.peak_ram_bytes,
        "on_disk": [n for n, c in components.items() if c["host"] == "disk"],
        "disk_reads_s": [round(s.read_s, 4) for s in switches],
        "disk_read_s": round(read_s, 4),
        "wait_s": round(sum(s.wait_s for s in switches), 4),
        "hidden_s": round(sum(s.hidden_s for s in switches), 4),
        "read_ahead_bytes": sum(s.read_ahead_bytes for s in switches),
        "disk_read_gbps": round(nbytes / read_s / 1e9, 3) if read_s > 0 else None,
        "switches": [s.as_dict() for s in switches],
        "reading": [r.as_dict() for r in readings],
        "forecasts": [f.as_dict() for f in forecasts],
        "hand_overs": [h.as_dict() for h in hand_overs],
        "locked_pool": locked_pool,
        "cache_folder": str(placement.folder),
        "components": components,
    }


def _components(placement: Placement, switches: list[Switch]) -> dict[str, dict[str, Any]]:
    """Per component: its bytes, where it is now, where it waits on disk, and the totals of its reads."""
    components = {}
    for name, handle in placement.handles.items():
        mine = [s for s in switches if s.component == name]
        components[name] = {
            "bytes": handle.host.stored_bytes,  # in RAM when all there (compressed only: payloads, not raw)
            "host": handle.host.where().label,
            "source": _source(placement, name),
            "reads": len(mine),
            "disk_read_s": round(sum(s.read_s for s in mine), 4),
            "wait_s": round(sum(s.wait_s for s in mine), 4),
            "read_ahead_bytes": sum(s.read_ahead_bytes for s in mine),
        }
    return components


def _source(placement: Placement, name: str) -> str:
    """Where a component waits on disk: its weight files, a cache file, or (compressed only) its payload file,
    its raw bytes in the weight files or a cache file."""
    if placement.handles[name].host.form.moves_payloads:
        return PAYLOAD_FILE
    return WEIGHTS_FILES if name in placement.sources else CACHE_FILE


def format_host_tier(tier: dict[str, Any]) -> list[str]:
    """The host tier's lines of the offload report: where the host budget went, a summary, one row per
    component, then one line per forecast switch."""
    disk = ", ".join(tier["on_disk"]) or "none"
    gbps = f" at {tier['disk_read_gbps']:.2f} GB/s" if tier.get("disk_read_gbps") else ""
    lines = [
        f"host budget {format_bytes(tier['host_budget_bytes'])}: the process's own memory at enable "
        f"{format_bytes(tier['process_own_bytes'])}, reserve {format_bytes(tier['host_reserve_bytes'])}, "
        f"host copies {format_bytes(tier['weights_budget_bytes'])}",
        f"host copies in RAM {format_bytes(tier['host_ram_bytes'])} of {format_bytes(tier['weights_budget_bytes'])} "
        f"(peak {format_bytes(tier['peak_host_ram_bytes'])}); on disk now: {disk}; "
        f"{len(tier['disk_reads_s'])} reads from disk, {tier['disk_read_s']:.2f} s{gbps}, "
        f"waited {tier['wait_s']:.2f} s ({tier['hidden_s']:.2f} s hidden: "
        f"{format_bytes(tier.get('read_ahead_bytes', 0))} read ahead, the rest while computing)",
    ]
    lines += _component_table(tier["components"])
    lines += [_forecast_line(f) for f in tier.get("forecasts", [])]
    pool = tier.get("locked_pool")
    if pool:
        lines.append(
            f"payload buffers handed on: {pool['reused']} reads served without a new buffer, "
            f"{pool['locked']} locked and {pool['unlocked']} unlocked; {pool['lent']} lent "
            f"({format_bytes(pool['slack_bytes'])} beyond their payloads), {pool['idle']} idle "
            f"({format_bytes(pool['idle_bytes'])})"
        )
    return lines


def _component_table(components: dict[str, dict[str, Any]]) -> list[str]:
    """One aligned row per component (names left-aligned, figures right-aligned) under a header."""
    rows = [("host copies", "bytes", "now", "waits in", "reads", "read ahead", "read s", "wait s")]
    for name, c in components.items():
        rows.append(
            (
                name,
                format_bytes(c["bytes"]),
                c["host"],
                c["source"],
                str(c["reads"]),
                format_bytes(c.get("read_ahead_bytes", 0)),
                f"{c['disk_read_s']:.2f}",
                f"{c['wait_s']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(w) if i in (0, 2, 3) else cell.rjust(w) for i, (cell, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return lines


def _forecast_line(f: dict[str, Any]) -> str:
    """One forecast switch: what is read ahead, the wait expected, and the host budget that hides it."""
    hidden = (
        "hidden at this budget"
        if f["wait_s"] == 0
        else f"hidden from a host budget of {format_bytes(f['hidden_from_host_budget'])}"
    )
    return (
        f"forecast: {f['after']} -> {f['component']}: {format_bytes(f['read_ahead_bytes'])} of "
        f"{format_bytes(f['nbytes'])} read ahead, ~{f['wait_s']:.3g} s waited at {f['disk_gbps']:.2f} GB/s "
        f"(one forward of {f['forward_s']:.2f} s overlaps the rest); {hidden}"
    )
