"""What every recipe does: arguments, loading, the profiling generation, timing, the summary.

A recipe module provides ``parse_args(argv)``, ``load(args, device)`` (the pipeline, CPU-first,
with whatever inputs it derives from the arguments), ``generate(pipe, args, device, steps,
output_type, **extra)`` and ``profiling_generation(pipe, args, device)``; optionally
``finish_frames(pipe, args, frames)`` and ``describe(pipe, args)`` (extra summary fields).
`run_recipe` does the rest, and `flextensor_diffusers.compare` drives the same four functions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine import Phase, format_bytes
from ..pipelines.offload import resolve_budget, resolve_vae_tiling


def add_common_arguments(parser: argparse.ArgumentParser, frames: int, height: int, width: int, steps: int) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="local diffusers folder with the real weights")
    source.add_argument(
        "--random-weights",
        choices=("tiny", "full"),
        help="built-in architecture with random weights: tiny (CPU, seconds) or full (published sizes)",
    )
    parser.add_argument("--prompt", default="a red fox running through a snowy forest, cinematic")
    parser.add_argument("--negative-prompt", default="blurry, low quality, static")
    parser.add_argument("--frames", type=int, default=frames)
    parser.add_argument("--height", type=int, default=height)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default="auto", help="GPU memory budget, e.g. 24GiB (default: free memory)")
    parser.add_argument("--profile-dir", type=Path, default=Path("profiles"))
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--no-offload", action="store_true", help="run natively (everything on the device)")
    parser.add_argument(
        "--vae-tiling",
        choices=("auto", "on", "off"),
        default="auto",
        help="diffusers' VAE tiling: auto turns it on for budgets under 40 GiB",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="split each generation across N GPUs of this host (context parallelism, launched with torchrun)",
    )
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    parser.add_argument("-v", "--verbose", action="store_true")


def call_arguments(args: argparse.Namespace, steps: int, output_type: str) -> dict[str, Any]:
    """The pipeline-call arguments every recipe passes the same way (a seeded CPU generator)."""
    return {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "num_frames": args.frames,
        "height": args.height,
        "width": args.width,
        "num_inference_steps": steps,
        "guidance_scale": args.guidance,
        "generator": torch.Generator(device="cpu").manual_seed(args.seed),
        "output_type": output_type,
    }


def require_weights(args: argparse.Namespace, recipe: str) -> None:
    """Stop with instructions when neither real weights nor random weights were asked for."""
    if args.model is None and args.random_weights is None:
        sys.exit(
            f"{recipe}: no weights. Pass --model PATH with a local diffusers folder of the model (download it "
            "yourself; this package never downloads weights), or --random-weights tiny|full to run the built-in "
            "architecture with random weights (tiny runs on a CPU in seconds)."
        )


def vae_tiling(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "on": True, "off": False}[args.vae_tiling]


def place_natively(pipe: Any, args: argparse.Namespace, device: torch.device) -> None:
    """Everything on the device, with the VAE tiling choice an offloaded run under --budget makes."""
    tiled = resolve_vae_tiling(vae_tiling(args), resolve_budget(args.budget, device))  # "auto": before the move
    pipe.to(device)
    if tiled and hasattr(pipe, "vae"):
        pipe.vae.enable_tiling()


def enable_offload(pipe: Any, args: argparse.Namespace, device: torch.device) -> None:
    pipe.enable_flextensor_offload(
        budget=args.budget,
        profile_dir=args.profile_dir,
        device=device,
        vae_tiling=vae_tiling(args),
        shared_host=getattr(args, "shared_host", None),  # set by --gpus N: one host copy for the ranks
    )


def init_device(args: argparse.Namespace, device: torch.device) -> str | torch.device:
    """Where random weights are made: on the GPU for full sizes (quick), on the meta device for a
    rank that attaches to another's shared copy, else on the CPU."""
    if getattr(args, "attach_to_shared", False):
        return "meta"
    return device if args.random_weights == "full" and device.type == "cuda" else "cpu"


def device_of(args: argparse.Namespace) -> torch.device:
    """The compute device, with its index (``cuda:0``, not ``cuda``)."""
    from ..engine.config import resolve_device

    return resolve_device(args.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timed:
    seconds: float
    peak_allocated_bytes: int | None
    output: Any


def timed(device: torch.device, fn: Callable[[], Any]) -> Timed:
    """Run ``fn`` with peak-memory counters reset; wall time after device synchronisation."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    output = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return Timed(seconds=seconds, peak_allocated_bytes=peak, output=output)


def workload_key(pipe: Any, device: torch.device, **shape: Any) -> str:
    """A digest of the components' fingerprints, the device and the generation's shapes."""
    state = getattr(pipe, "_flextensor", None)
    prints = {name: h.fingerprint["sha256"] for name, h in state.handles.items()} if state else {}
    payload = {"pipeline": type(pipe).__name__, "device": str(device), "components": prints, "shape": shape}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def profiled_before(profile_dir: Path | None, key: str) -> bool:
    index = (profile_dir / "workloads.json") if profile_dir else None
    return bool(index and index.exists() and key in json.loads(index.read_text()))


def remember_profiled(profile_dir: Path | None, key: str, description: dict[str, Any]) -> None:
    if profile_dir is None:
        return
    index = profile_dir / "workloads.json"
    data = json.loads(index.read_text()) if index.exists() else {}
    data[key] = description
    profile_dir.mkdir(parents=True, exist_ok=True)
    index.write_text(json.dumps(data, indent=1))


def all_steady(pipe: Any) -> bool:
    state = getattr(pipe, "_flextensor", None)
    return state is None or all(h.phase is Phase.STEADY for h in state.handles.values())


def summary(
    args: argparse.Namespace,
    device: torch.device,
    generation: Timed,
    profiling_s: float | None,
    pipe: Any,
    output: Path,
) -> dict[str, Any]:
    state = getattr(pipe, "_flextensor", None)
    return {
        "recipe": args.recipe,
        "weights": str(args.model) if args.model else f"random ({args.random_weights})",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "offload": not args.no_offload,
        "budget": args.budget,
        "frames": args.frames,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "seed": args.seed,
        "generation_s": round(generation.seconds, 3),
        "profiling_generation_s": None if profiling_s is None else round(profiling_s, 3),
        "peak_allocated_bytes": generation.peak_allocated_bytes,
        "output": str(output),
        "offload_report": state.report() if state else None,
    }


def main(recipe: Any, argv: list[str] | None) -> dict[str, Any] | None:
    """A recipe's command line: parse, re-launch under torchrun for ``--gpus N``, run."""
    from . import parallel

    args = recipe.parse_args(argv)
    setup_logging(args.verbose)
    parallel.launch_if_needed(args, recipe.__spec__.name, sys.argv[1:] if argv is None else argv)
    return recipe.run(args)


def run_recipe(recipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Load, offload (or not), profile once per workload, generate, write the mp4 and the summary."""
    from ..video import to_uint8_frames, write_mp4
    from . import parallel

    require_weights(args, args.recipe)
    me = parallel.set_up(args)
    device = device_of(args)
    pipe = recipe.load(args, device)
    parallel.split_transformers(pipe, me)
    profiling_s = None
    if args.no_offload:
        place_natively(pipe, args, device)
    else:
        enable_offload(pipe, args, device)
        shape = {"frames": args.frames, "height": args.height, "width": args.width}
        key = workload_key(pipe, device, **shape, cfg=args.guidance > 1, gpus=me.world_size)
        if not profiled_before(args.profile_dir, key):
            profiling_s = timed(device, lambda: recipe.profiling_generation(pipe, args, device)).seconds
            if all_steady(pipe) and me.leader:
                remember_profiled(args.profile_dir, key, {**shape, "recipe": args.recipe})
    result = timed(device, lambda: recipe.generate(pipe, args, device, args.steps, "np"))
    info = summary(args, device, result, profiling_s, pipe, args.output)
    info["gpus"] = me.world_size
    if me.leader:  # every rank has the whole video; one writes it
        frames = to_uint8_frames(result.output[0])
        if hasattr(recipe, "finish_frames"):
            frames = recipe.finish_frames(pipe, args, frames)
        write_mp4(args.output, frames, fps=args.fps)
        if hasattr(recipe, "describe"):
            info.update(recipe.describe(pipe, args))
        print_summary(info, pipe)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(info, indent=1))
    parallel.finish()
    return info


def print_summary(info: dict[str, Any], pipe: Any) -> None:
    peak = info["peak_allocated_bytes"]
    print(f"wrote {info['output']}")
    print(
        f"generation {info['generation_s']:.2f} s (discovery and profiling excluded"
        + (f"; profiling generation {info['profiling_generation_s']:.2f} s" if info["profiling_generation_s"] else "")
        + f"), peak allocated GPU memory {format_bytes(peak) if peak is not None else 'n/a (CPU)'}"
    )
    if getattr(pipe, "_flextensor", None) is not None:
        print(pipe.flextensor_report(as_text=True))


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
