"""Issue 16's summary file, ``compression_h200.json``, assembled from measured result files (nothing is run).

Each run row names the files its figures come from. Within a row, the raw and compressed step times come
from the same ``peers.py`` run; flextensor's comes from the run that measured it at the same budget (named
in ``flextensor_from``), or is null. The raw-bytes lower bound is the raw bytes the compressed run's plan
streams per forward over the link bandwidth that run profiled.

    python benchmarks/compression_summary.py --out benchmarks/results/compression_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CODEC = "codec_h200.json"  # decode throughput and the random block's ratio (decoder unchanged since)
TRAINED = "codec_ratio_trained_cpu.json"  # exact byte counts: the ratio does not depend on the device
#: (compressed method, budget, file of the compressed and raw runs, file of flextensor's run or None)
ROWS = [
    (
        "flextensor_diffusers_lossless",
        2800000000,
        "peers_device_encode_17f_h200.json",
        "peers_cache_flextensor_17f_h200.json",
    ),
    ("flextensor_diffusers_lossless", 15062659584, "peers_device_encode_17f_h200.json", None),
    (
        "flextensor_diffusers_lossless_disk",
        2800000000,
        "peers_device_encode_17f_h200.json",
        "peers_cache_flextensor_17f_h200.json",
    ),
    (
        "flextensor_diffusers_lossless_cached",
        2800000000,
        "peers_cache_flextensor_17f_h200.json",
        "peers_cache_flextensor_17f_h200.json",
    ),
    ("flextensor_diffusers_lossless", 9234179686, "peers_lossless_81f_h200.json", None),
]


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def row(runs: list[dict[str, Any]], method: str, budget: int | None = None) -> dict[str, Any] | None:
    """The last measured row of ``method`` (at ``budget``) in a peers result; None when it did not run."""
    found = [r for r in runs if r["method"].split("@")[0] == method and "error" not in r]
    found = [r for r in found if budget is None or r.get("budget_bytes") == budget]
    return found[-1] if found else None


def run_row(method: str, budget: int, source: str, flextensor_source: str | None) -> dict[str, Any]:
    measured = load(source)
    compressed = row(measured["runs"], method, budget)
    assert compressed is not None, f"{method}@{budget} did not run in {source}"
    raw = row(measured["runs"], "flextensor_diffusers", budget)
    native = row(measured["runs"], "native")
    flextensor = row(load(flextensor_source)["runs"], "flextensor", budget) if flextensor_source else None
    lower_bound_s = compressed["streamed_raw_bytes"] / compressed["bandwidth_bytes_per_ms"] / 1e3
    equal = [r["bitwise_equal"] for r in (compressed, raw, flextensor) if r is not None]
    return {
        "workload": measured["workload"],
        "method": method,
        "budget_bytes": budget,
        "raw_step_s": raw["step_s"] if raw else None,
        "compressed_step_s": compressed["step_s"],
        "raw_lower_bound_s": round(lower_bound_s, 5),
        "flextensor_step_s": flextensor["step_s"] if flextensor else None,
        "native_step_s": native["step_s"] if native else None,
        "stored_host_bytes": compressed["stored_host_bytes"],
        "weights_bytes": compressed["weights_bytes"],
        "bitwise_equal": all(equal),
        "compressed_units_streamed": compressed.get("streamed_compressed_units"),
        "setup_s": compressed["setup_s"],
        "raw_setup_s": raw["setup_s"] if raw else None,
        "payload_cache": compressed.get("payload_cache"),
        "from": source,
        "flextensor_from": flextensor_source if flextensor else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "compression_h200.json")
    args = parser.parse_args()
    codec, trained = load(CODEC)["units"][0], load(TRAINED)["units"]
    summary = {
        "ratio_random": codec["ratio"],
        "ratio_trained": min(u["ratio"] for u in trained if u["name"].startswith("trained_bf16")),
        "ratio_trained_max": max(u["ratio"] for u in trained if u["name"].startswith("trained_bf16")),
        "decode_GBps": codec["decode_best_gbps"],
        "ratios_from": [CODEC, TRAINED],
        "decode_from": CODEC,
        "runs": [run_row(*spec) for spec in ROWS],
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
