"""Where each switch's wait went, from the unit timelines a tiers or host tier bench saved (`switch_timelines`).

For every switch of every configuration's generations it prints: the bytes read ahead and read after the switch,
the rate of the reads after it (from the switch to the last unit read), how many units the component asked for
before they were read and the time it spent waiting for them, the first unit it waited for, and the step's
exposed time beside the tier's own ``wait_s`` and ``bring_in_s``; then the RAM each expert handed over during its
last forwards (`host_tier.hand_over`), and each component's time between unit calls per steady forward.

Usage: ``python benchmarks/switch_timeline.py benchmarks/results/tiers_h200.json [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def summarise(timeline: dict[str, Any], record: dict[str, Any] | None) -> dict[str, Any]:
    """One switch: its unit timeline (`records.UnitArrival` rows) and the tier's record of it (``switches``)."""
    units = timeline["units"]
    after = [u for u in units if u["read_s"] is not None and u["read_s"] > 0]
    waited = [u for u in units if u["asked_s"] is not None and u["read_s"] is not None and u["read_s"] > u["asked_s"]]
    last_read = max((u["read_s"] for u in after), default=0.0)
    bytes_after = sum(u["nbytes"] for u in after)
    first_wait = min(waited, key=lambda u: u["asked_s"], default=None)
    return {
        "component": timeline["component"],
        "units": len(units),
        "read_ahead_bytes": sum(u["nbytes"] for u in units if u["read_s"] is not None and u["read_s"] <= 0),
        "read_after_bytes": bytes_after,
        "read_after_GBps": round(bytes_after / last_read / 1e9, 3) if last_read > 0 else None,
        "last_read_s": round(last_read, 4),
        "waited_units": len(waited),
        "waited_s": round(sum(u["taken_s"] - u["asked_s"] for u in waited), 4),
        "first_wait": None
        if first_wait is None
        else {"position": first_wait["position"], "asked_s": first_wait["asked_s"], "read_s": first_wait["read_s"]},
        "tier_wait_s": None if record is None else record.get("wait_s"),
        "bring_in_s": None if record is None else record.get("bring_in_s"),
    }


def between_units(row: dict[str, Any]) -> dict[str, float]:
    """Each component's time between unit calls per steady forward (``between_units_ms`` of the report; none
    from code before it was counted)."""
    components = (row.get("report") or {}).get("components") or {}
    per_forward = {}
    for name, component in components.items():
        steady = (component.get("forwards") or {}).get("steady")
        if steady and component.get("between_units_ms") is not None:
            per_forward[name] = round(component["between_units_ms"] / steady, 3)
    return per_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    out: dict[str, Any] = {}
    for row in data.get("pipeline", []):
        for gen in ("warmup", "measured"):
            info = row.get(gen) or {}
            timelines = info.get("switch_timelines") or []
            records = info.get("switches") or []
            exposed = row.get("switch_exposed_s") if gen == "measured" else None
            rows = [summarise(t, records[i] if i < len(records) else None) for i, t in enumerate(timelines)]
            if not rows:
                continue
            out[f"{row['config']}/{gen}"] = {"switches": rows, "switch_exposed_s": exposed}
            print(f"{row['config']} {gen}" + (f" (steps' exposed time {exposed} s)" if exposed else ""))
            for r in rows:
                first = r["first_wait"]
                print(
                    f"  {r['component']}: {r['read_ahead_bytes'] / 1e9:.2f} GB ahead, "
                    f"{r['read_after_bytes'] / 1e9:.2f} GB after at {r['read_after_GBps']} GB/s "
                    f"(last at {r['last_read_s']:.2f} s); waited for {r['waited_units']} units, {r['waited_s']:.2f} s"
                    + (f", first unit {first['position']} asked at {first['asked_s']:.2f} s" if first else "")
                    + f"; tier wait {r['tier_wait_s']} s, bring-in {r['bring_in_s']} s"
                )
        handed = ((row.get("report") or {}).get("host_tier") or {}).get("hand_overs") or []
        if handed:
            out[f"{row['config']}/hand_overs"] = handed
            print(f"{row['config']}: RAM handed over during last forwards (both generations)")
            for h in handed:
                print(
                    f"  {h['component']}: {h['let_go_bytes'] / 1e9:.2f} GB let go ({h['let_go_units']} units), "
                    f"{h['taken_back_units']} taken back"
                )
        between = between_units(row)
        if between:
            out[f"{row['config']}/between_units_ms_per_forward"] = between
            print(
                f"{row['config']}: between units per steady forward (the device idle or the model's own work): "
                + ", ".join(f"{name} {ms:.1f} ms" for name, ms in between.items())
            )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
