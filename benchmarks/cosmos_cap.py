"""Cosmos-Transfer2.5 at full size under a GPU memory cap: native against offloaded, peak per stage.

The published workload (93 frames, 640x480, edge control) with random weights
(assets/cosmos_transfer25/full.json: 2.41B transformer, 0.47B ControlNet, Qwen2.5-VL-7B text
encoder of 15.45 GiB, Wan2.1 VAE), a few steps: memory, not quality, is measured. Both runs go
through `flextensor_diffusers.reports.compare` (same seed, a native out-of-memory is a result, the
allocator's peak is kept for each stage); this script writes the summary the results table uses.

    python benchmarks/cosmos_cap.py --out $OUT/cosmos_transfer25_h200.json --report $OUT/cosmos_report \\
        --cap 32GB --budget 22GiB --steps 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_common import GENERATION_ONLY, check_budget, write_json

from flextensor_diffusers.engine import parse_bytes
from flextensor_diffusers.reports.compare import compare
from flextensor_diffusers.reports.quality import INF


def budget_bytes(run: dict, asked: str) -> int:
    """The budget the offloaded run resolved, as its report says (``asked`` parsed where it has none)."""
    report = run.get("offload_report") or {}
    return report.get("budget_bytes") or parse_bytes(asked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", default="32GB", help="GPU memory cap for both runs (memory fraction)")
    parser.add_argument("--budget", default="22GiB", help="the offloaded run's budget")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--frames", type=int, default=93)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--report", type=Path, default=Path("cosmos_report"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep-videos", action="store_true", help="keep native.mp4 and offloaded.mp4 in --report")
    args = parser.parse_args()
    recipe_argv = ["--random-weights", args.size, "--budget", args.budget, "--steps", str(args.steps)]
    recipe_argv += ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
    recipe_argv += ["--chunk", str(args.frames)]
    report = compare("cosmos_transfer25", recipe_argv, args.report, memory_cap=args.cap)
    native, offloaded = report["runs"]["native"], report["runs"]["offloaded"]
    result = {
        "device": report["device_name"],
        "versions": report["versions"],
        "cap_bytes": parse_bytes(args.cap),
        "budget": args.budget,
        "steps": args.steps,
        "frames": args.frames,
        "height": args.height,
        "width": args.width,
        "native_completed": native["status"] == "completed",
        "native_failure_stage": native.get("stage") if native["status"] != "completed" else None,
        "native_peak_allocated_bytes": native.get("peak_allocated_bytes"),
        "native_stage_peak_allocated_bytes": native.get("stage_peak_allocated_bytes"),
        "offload_completed": offloaded["status"] == "completed",
        "offload_peak_allocated_bytes": offloaded.get("peak_allocated_bytes"),
        "offload": check_budget(
            "Cosmos offloaded",
            budget_bytes(offloaded, args.budget),
            offloaded.get("peak_allocated_bytes"),
            GENERATION_ONLY,
        ),
        "offload_peak_reserved_bytes": offloaded.get("peak_reserved_bytes"),
        "offload_stage_peak_allocated_bytes": offloaded.get("stage_peak_allocated_bytes"),
        "offload_generation_s": offloaded.get("generation_s"),
        "offload_profiling_s": offloaded.get("profiling_s"),
        "report": str(args.report / "report.json"),
    }
    # The fidelity verdict travels in this file too: the report folder has more files than the
    # device tool brings back (8 at most), and the videos are left there only with --keep-videos.
    fidelity = report.get("fidelity")
    result["latents_bitwise_equal"] = fidelity["latents"]["bitwise_equal"] if fidelity else None
    result["frames_identical"] = fidelity["frames"]["identical"] if fidelity else None
    finite = [f["psnr_db"] for f in fidelity["frames"]["frames"] if f["psnr_db"] != INF] if fidelity else []
    result["frames_min_psnr_db"] = min(finite) if finite else (INF if fidelity else None)
    result["native_generation_s"] = native.get("generation_s")
    if not args.keep_videos:
        for video in args.report.glob("*.mp4"):
            video.unlink()
    for key in ("native_completed", "native_failure_stage", "offload_completed", "offload_peak_allocated_bytes"):
        print(f"{key}: {result[key]}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
