"""Full-size Wan2.2-T2V-A14B architecture (random bf16 weights), native vs offloaded under a 24 GB card.

Runs `flextensor_diffusers.reports.compare` (which writes the full report) and distils the numbers the
pipeline issue asks for into one JSON file.

    python benchmarks/wan22_bench.py --out benchmarks/results/wan22_h200.json \\
        --report benchmarks/results/wan22_report --steps 4 --budget 11GiB --card 24GB

With ``--compile regional`` both runs compile every repeated block of both experts first (the
recipe's ``--compile``), and the JSON gets a ``pipeline`` record in the form of issue 12's
``compile_h200.json``. The first step of each expert then includes its compilation: use enough
steps that the median step is a compiled one (6 with Wan2.2's boundary).

``--latents-only`` skips compare's report (no VAE decode, no video, no quality metrics): one pipeline
is built, compiled (with ``--compile``), run natively to latents, then offloaded under ``--card``,
profiled and run again; per-step times after device synchronisation, latents compared bitwise.

The offloaded run's peak allocated memory is set against its budget (``budget_bytes``,
``peak_allocated_bytes``, ``peak_within_budget``, ``peak_scope``): from before offload set-up with
``--latents-only``; the measured generation alone through compare, which resets the counter when a
generation starts.

    python benchmarks/wan22_bench.py --latents-only --compile regional --steps 4 --out compile_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import GENERATION_ONLY, PeakWatch, check_budget, write_json

from flextensor_diffusers.engine.config import parse_bytes
from flextensor_diffusers.recipes.common import synchronize
from flextensor_diffusers.reports.compare import compare


class StepClock:
    """Seconds per denoising step, each measured after device synchronisation (a pipeline callback)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[float] = []

    def start(self) -> None:
        synchronize(self.device)
        self.marks = [time.perf_counter()]

    def on_step_end(self, pipe: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        synchronize(self.device)
        self.marks.append(time.perf_counter())
        return {}

    def steps(self) -> list[float]:
        return [round(b - a, 4) for a, b in zip(self.marks, self.marks[1:], strict=False)]


def latents_only(args: argparse.Namespace, recipe_argv: list[str]) -> dict[str, Any]:
    """Native then offloaded latents of one compiled pipeline; see the module docstring."""
    from flextensor_diffusers.recipes import common, wan22_t2v
    from flextensor_diffusers.reports.compare import _free, cap_device_memory

    options = wan22_t2v.parse_args(recipe_argv)
    device = common.device_of(options)
    started = time.perf_counter()

    def note(what: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {what}", flush=True)

    pipe = wan22_t2v.load(options, device)
    _free(device)
    note("built")
    compiled = common.compile_denoisers(pipe, options)
    clock = StepClock(device)

    def generate() -> torch.Tensor:
        clock.start()
        out = wan22_t2v.generate(pipe, options, device, options.steps, "latent", callback_on_step_end=clock.on_step_end)
        return out.cpu()

    common.place_natively(pipe, options, device)
    native = generate()
    native_steps = clock.steps()
    note(f"native generation: steps {native_steps}")
    pipe.to("cpu")
    _free(device)
    cap_device_memory(device, args.card)
    watch = PeakWatch(device)  # from set-up on: the budget is a ceiling for the profiling generation too
    common.enable_offload(pipe, options, device)
    note("offload enabled")
    wan22_t2v.profiling_generation(pipe, options, device)
    note("profiling generation")
    watch.part()
    offloaded = generate()
    offload_steps = clock.steps()
    generation_peak = watch.part()
    note(f"offloaded generation: steps {offload_steps}")
    report = pipe.flextensor_report()
    budget = watch.check("Wan2.2 offloaded (latents only)", report["budget_bytes"])
    pipe.disable_flextensor_offload()
    return {
        "compiled": compiled,
        "native_steps_s": native_steps,
        "offload_steps_s": offload_steps,
        "native_step_s": statistics.median(native_steps),
        "offload_step_s": statistics.median(offload_steps),
        "native_peak_allocated_bytes": None,
        "offload_peak_allocated_bytes": generation_peak,
        "offload_budget": budget,
        "bitwise_equal": bool(torch.equal(native, offloaded)),
        "frames_identical": None,
        "offload_report": {k: v for k, v in report.items() if k != "memory_timeline"},
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget", default="11GiB")
    parser.add_argument("--card", default="24GB", help="memory cap of the emulated card (offloaded run)")
    parser.add_argument("--compile", default="none", choices=("none", "regional"))
    parser.add_argument("--latents-only", action="store_true", help="no report: see the module docstring")
    parser.add_argument("--report", type=Path, help="compare's report folder (not with --latents-only)")
    return parser


def recipe_arguments(args: argparse.Namespace) -> list[str]:
    """The wan22_t2v recipe's command line for this benchmark's workload."""
    argv = ["--random-weights", args.size, "--frames", str(args.frames), "--height", str(args.height)]
    argv += ["--width", str(args.width), "--steps", str(args.steps), "--budget", args.budget]
    return [*argv, "--vae-tiling", "on", "--compile", args.compile]


def compared(args: argparse.Namespace, recipe_argv: list[str]) -> dict[str, Any]:
    """compare's report, and what this file takes from it: both runs and the offloaded run's budget record."""
    recipe_argv = [*recipe_argv, "--profile-dir", str(args.report / "profiles")]
    report = compare("wan22_t2v", recipe_argv, args.report, offload_memory_cap=args.card)
    native, offloaded = report["runs"]["native"], report["runs"]["offloaded"]
    budget = (offloaded.get("offload_report") or {}).get("budget_bytes")
    record = check_budget("Wan2.2 offloaded", budget, offloaded.get("peak_allocated_bytes"), GENERATION_ONLY)
    return {"report": report, "native": native, "offloaded": offloaded, "budget": record}


def latents_summary(args: argparse.Namespace, recipe_argv: list[str]) -> dict[str, Any]:
    """`latents_only`'s run in the shape `compared` gives."""
    run = latents_only(args, recipe_argv)
    report = {
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__},
        "fidelity": {"latents": {"bitwise_equal": run["bitwise_equal"]}, "frames": {}},
    }
    offloaded = {"step_s": run["offload_steps_s"], "peak_allocated_bytes": run["offload_peak_allocated_bytes"]}
    return {
        "report": report,
        "native": {"step_s": run["native_steps_s"]},
        "offloaded": offloaded,
        "budget": run["offload_budget"],
        "offload_report": run["offload_report"],
    }


def main() -> None:
    arguments = parser()
    args = arguments.parse_args()
    if not args.latents_only and args.report is None:
        arguments.error("--report is required unless --latents-only")
    recipe_argv = recipe_arguments(args)
    runs = latents_summary(args, recipe_argv) if args.latents_only else compared(args, recipe_argv)
    report, native, offloaded = runs["report"], runs["native"], runs["offloaded"]
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
        "card_cap_bytes": parse_bytes(args.card),
        **runs["budget"],  # budget_bytes, peak_allocated_bytes (over peak_scope), peak_within_budget
        "native_peak_allocated_bytes": native.get("peak_allocated_bytes"),
        "offload_peak_allocated_bytes": offloaded.get("peak_allocated_bytes"),  # the measured generation
        "native_step_s": statistics.median(native["step_s"]) if native.get("step_s") else None,
        "offload_step_s": statistics.median(offloaded["step_s"]) if offloaded.get("step_s") else None,
        "native_steps_s": native.get("step_s"),
        "offload_steps_s": offloaded.get("step_s"),
        "native_generation_s": native.get("generation_s"),
        "offload_generation_s": offloaded.get("generation_s"),
        "offload_profiling_generation_s": offloaded.get("profiling_s"),
        "bitwise_equal": report.get("fidelity", {}).get("latents", {}).get("bitwise_equal"),
        "frames_identical": report.get("fidelity", {}).get("frames", {}).get("identical"),
        "report": str(args.report / "report.json") if args.report else None,
    }
    if result["native_step_s"] and result["offload_step_s"]:
        result["step_overhead_pct"] = round(100 * (result["offload_step_s"] / result["native_step_s"] - 1), 3)
    if args.latents_only:
        result["latents_only"] = True  # no VAE decode, frames not compared
        result["offload_report"] = runs["offload_report"]
    if args.compile != "none":
        result["pipeline"] = {
            "native_compiled_step_s": result["native_step_s"],
            "offload_compiled_step_s": result["offload_step_s"],
            "offload_peak_allocated_bytes": result["offload_peak_allocated_bytes"],
            "bitwise_equal": result["bitwise_equal"],
        }
    write_json(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
