"""Full-size Wan2.2-T2V-A14B architecture (random bf16 weights), native vs offloaded under a 24 GB card.

Runs `flextensor_diffusers.compare` (which writes the full report) and distils the numbers the
pipeline issue asks for into one JSON file.

    python benchmarks/wan22_bench.py --out benchmarks/results/wan22_h200.json \\
        --report benchmarks/results/wan22_report --steps 4 --budget 11GiB --card 24GB

With ``--compile regional`` both runs compile every repeated block of both experts first (the
recipe's ``--compile``), and the JSON gets a ``pipeline`` record in the form of issue 12's
``compile_h200.json``. The first step of each expert then includes its compilation: use enough
steps that the median step is a compiled one (6 with Wan2.2's boundary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.compare import compare
from flextensor_diffusers.engine.config import parse_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget", default="11GiB")
    parser.add_argument("--card", default="24GB", help="memory cap of the emulated card (offloaded run)")
    parser.add_argument("--compile", default="none", choices=("none", "regional"))
    args = parser.parse_args()
    recipe_argv = [
        "--random-weights",
        args.size,
        "--frames",
        str(args.frames),
        "--height",
        str(args.height),
        "--width",
        str(args.width),
        "--steps",
        str(args.steps),
        "--budget",
        args.budget,
        "--vae-tiling",
        "on",
        "--compile",
        args.compile,
        "--profile-dir",
        str(args.report / "profiles"),
    ]
    report = compare("wan22_t2v", recipe_argv, args.report, offload_memory_cap=args.card)
    native, offloaded = report["runs"]["native"], report["runs"]["offloaded"]
    # The first step of a run also moves the text encoder out and the first expert in; the
    # steady per-step figure is the median.
    result = {
        "model": "Wan2.2-T2V-A14B architecture, random bf16 weights (transformer, transformer_2, UMT5-XXL), fp32 VAE",
        "device": report["device_name"],
        "torch": report["versions"]["torch"],
        "diffusers": report["versions"]["diffusers"],
        "frames": args.frames,
        "height": args.height,
        "width": args.width,
        "cfg": True,
        "steps": args.steps,
        "vae_tiling": True,
        "compile": args.compile,
        "budget_bytes": parse_bytes(args.budget),
        "card_cap_bytes": parse_bytes(args.card),
        "native_peak_allocated_bytes": native.get("peak_allocated_bytes"),
        "offload_peak_allocated_bytes": offloaded.get("peak_allocated_bytes"),
        "native_step_s": statistics.median(native["step_s"]) if native.get("step_s") else None,
        "offload_step_s": statistics.median(offloaded["step_s"]) if offloaded.get("step_s") else None,
        "native_steps_s": native.get("step_s"),
        "offload_steps_s": offloaded.get("step_s"),
        "native_generation_s": native.get("generation_s"),
        "offload_generation_s": offloaded.get("generation_s"),
        "offload_profiling_generation_s": offloaded.get("profiling_s"),
        "bitwise_equal": report.get("fidelity", {}).get("latents", {}).get("bitwise_equal"),
        "frames_identical": report.get("fidelity", {}).get("frames", {}).get("identical"),
        "report": str(args.report / "report.json"),
    }
    if result["native_step_s"] and result["offload_step_s"]:
        result["step_overhead_pct"] = round(100 * (result["offload_step_s"] / result["native_step_s"] - 1), 3)
    if args.compile != "none":
        result["pipeline"] = {
            "native_compiled_step_s": result["native_step_s"],
            "offload_compiled_step_s": result["offload_step_s"],
            "offload_peak_allocated_bytes": result["offload_peak_allocated_bytes"],
            "bitwise_equal": result["bitwise_equal"],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
