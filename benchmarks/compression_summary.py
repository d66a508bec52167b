"""Issue 16's summary file, ``compression_h200.json``, assembled from measured result files (nothing is run).

One row per compressed run (``flextensor_diffusers_lossless*`` at a budget) of the ``peers.py`` files given.
The raw and native step times of a row come from the same file as the compressed run; flextensor's from the
same file when it ran there, else from another given file of the same workload and budget (``flextensor_from``
names it), else null. The raw-bytes lower bound is the raw bytes the compressed run's plan streams per
forward over the link bandwidth that run profiled. Ratios and the decode rate come from ``codec_bench.py``
files (``--codec``: the random Wan2.2 block and the decode rate; ``--trained``: trained weights, whose
ratio is exact byte counts and does not depend on the device).

    python benchmarks/compression_summary.py benchmarks/results/peers_device_encode_17f_h200.json \\
        benchmarks/results/peers_cache_flextensor_17f_h200.json benchmarks/results/peers_lossless_81f_h200.json \\
        --out benchmarks/results/compression_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench_common import write_json

RESULTS = Path(__file__).resolve().parent / "results"
COMPRESSED = "flextensor_diffusers_lossless"
RAW = "flextensor_diffusers"


def method_of(row: dict[str, Any]) -> str:
    return row["method"].split("@")[0]


def measured(runs: list[dict[str, Any]], method: str, budget: int | None = None) -> list[dict[str, Any]]:
    """The rows of ``method`` (at ``budget``) that ran, in run order."""
    return [
        r
        for r in runs
        if method_of(r) == method and "error" not in r and (budget is None or r.get("budget_bytes") == budget)
    ]


def last(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return rows[-1] if rows else None


def summary_row(
    compressed: dict[str, Any], source: Path, peers: dict[Path, dict[str, Any]], order: int
) -> dict[str, Any]:
    """The issue's run record for ``compressed`` (the ``order``-th run of its method and budget in ``source``)."""
    run = peers[source]
    budget = compressed["budget_bytes"]
    raw = last(measured(run["runs"], RAW, budget))
    native = last(measured(run["runs"], "native"))
    flextensor, flextensor_from = last(measured(run["runs"], "flextensor", budget)), source
    if flextensor is None:
        others = [p for p, r in peers.items() if r["workload"] == run["workload"] and r["device"] == run["device"]]
        found = [(p, last(measured(peers[p]["runs"], "flextensor", budget))) for p in others]
        flextensor_from, flextensor = next(((p, f) for p, f in found if f is not None), (None, None))
    lower_bound_s = compressed["streamed_raw_bytes"] / compressed["bandwidth_bytes_per_ms"] / 1e3
    return {
        "workload": run["workload"],
        "method": method_of(compressed),
        "run_of_method": order,  # a method named twice (the payload cache: written, then read)
        "budget_bytes": budget,
        "raw_step_s": raw["step_s"] if raw else None,
        "compressed_step_s": compressed["step_s"],
        "raw_lower_bound_s": round(lower_bound_s, 5),
        "flextensor_step_s": flextensor["step_s"] if flextensor else None,
        "native_step_s": native["step_s"] if native else None,
        "stored_host_bytes": compressed["stored_host_bytes"],
        "weights_bytes": compressed["weights_bytes"],
        "bitwise_equal": all(r["bitwise_equal"] for r in (compressed, raw, flextensor) if r is not None),
        "compressed_units_streamed": compressed.get("streamed_compressed_units"),
        "setup_s": compressed["setup_s"],
        "raw_setup_s": raw["setup_s"] if raw else None,
        "payload_cache": compressed.get("payload_cache"),
        "from": source.name,
        "flextensor_from": flextensor_from.name if flextensor_from else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peers", nargs="+", type=Path, help="peers.py result files")
    parser.add_argument("--codec", type=Path, default=RESULTS / "codec_h200.json")
    parser.add_argument("--trained", type=Path, default=RESULTS / "codec_ratio_trained_cpu.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "compression_h200.json")
    args = parser.parse_args()
    peers = {path: json.loads(path.read_text()) for path in args.peers}
    rows = []
    for path, run in peers.items():
        seen: dict[tuple[str, int], int] = {}
        for r in run["runs"]:
            if method_of(r).startswith(COMPRESSED) and "error" not in r and not r.get("resumed"):
                key = (method_of(r), r["budget_bytes"])
                seen[key] = seen.get(key, 0) + 1
                rows.append(summary_row(r, path, peers, seen[key]))
    codec = json.loads(args.codec.read_text())["units"][0]
    trained = [
        u["ratio"] for u in json.loads(args.trained.read_text())["units"] if u["name"].startswith("trained_bf16")
    ]
    summary = {
        "ratio_random": codec["ratio"],
        "ratio_trained": min(trained),
        "ratio_trained_max": max(trained),
        "decode_GBps": codec["decode_best_gbps"],
        "ratios_from": [args.codec.name, args.trained.name],
        "decode_from": args.codec.name,
        "runs": rows,
    }
    print(json.dumps(summary, indent=2))
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
