"""Native vs offloaded: the same generation twice, same seed, and a report of what differs and what it cost.

    python -m flextensor_diffusers.compare --recipe wan22_t2v --out report/ -- --random-weights tiny \\
        --frames 9 --height 32 --width 32 --steps 2

Writes ``native.mp4``, ``offloaded.mp4``, ``strip.png``, ``memory.png``, ``steps.png``,
``frames.png``, ``report.json`` and a self-contained ``report.html`` into ``--out``. A native run
that runs out of memory is a result ("native: out of memory at <stage>"), not a crash.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import quality
from .recipes import common
from .video import to_uint8_frames, write_mp4

logger = logging.getLogger(__name__)

RECIPES = ("wan22_t2v", "ltx2_outpaint", "cosmos_transfer25")


class Recorder:
    """Stage and step boundaries of one generation: times, allocated memory, per-stage peaks, latents.

    A stage is the component running (text encoder, transformer, ...) or the VAE decode; at each
    change the allocator's peak since the last change is kept for the stage that ended.
    """

    def __init__(self, pipe: Any, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stage = "loading"
        self.samples: list[dict[str, Any]] = []
        self.step_ends: list[float] = []
        self.latents: torch.Tensor | None = None
        self.stage_peaks: dict[str, int] = {}
        self._hooks = []
        self._start = time.perf_counter()
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name != "vae":
                self._hooks.append(module.register_forward_pre_hook(self._enter(name), prepend=True))
        vae = getattr(pipe, "vae", None)
        self._vae = vae
        if vae is not None:
            self._vae_decode = vae.decode
            self._vae_decode_was_own = "decode" in vars(vae)  # e.g. offload's activating wrapper
            vae.decode = self._wrap_decode(vae.decode)

    def _sample(self, label: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.samples.append(
            {
                "t_s": round(time.perf_counter() - self._start, 4),
                "label": label,
                "allocated_bytes": torch.cuda.memory_allocated(self.device) if self.cuda else None,
            }
        )

    def _switch(self, stage: str) -> None:
        """Close the current stage (keep its peak) and open ``stage``."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.stage_peaks[self.stage] = max(self.stage_peaks.get(self.stage, 0), peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.stage = stage

    def _enter(self, name: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            if self.stage != name:
                self._switch(name)
                self._sample(f"start {name}")

        return hook

    def _wrap_decode(self, decode: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._switch("vae decode")
            self._sample("start vae decode")
            out = decode(*args, **kwargs)
            self._sample("end vae decode")
            return out

        return call

    def start(self) -> None:
        self._start = time.perf_counter()
        self.step_ends = []
        self.samples = []
        self.stage_peaks = {}
        self.stage = "start"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._sample("start")

    def finish(self) -> dict[str, int]:
        """Close the last stage; the peak allocated bytes of every stage (empty on the CPU)."""
        self._switch("done")
        return dict(self.stage_peaks)

    def on_step_end(self, pipe: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        self._sample(f"step {step + 1}")
        self.step_ends.append(self.samples[-1]["t_s"])
        self.latents = kwargs["latents"].detach().to("cpu", copy=True)
        return kwargs

    def step_times(self) -> list[float]:
        starts = [next((s["t_s"] for s in self.samples if s["label"].startswith("start transformer")), 0.0)]
        return [round(b - a, 4) for a, b in zip(starts + self.step_ends[:-1], self.step_ends, strict=True)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._vae is not None and "decode" in vars(self._vae):
            if self._vae_decode_was_own:
                self._vae.decode = self._vae_decode
            else:
                del self._vae.decode


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's arguments as JSON: paths as strings; inputs it derived (edge frames...) left out."""
    out = {}
    for key, value in vars(args).items():
        value = str(value) if isinstance(value, Path) else value
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_generation(recipe: Any, pipe: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One full generation with recording; OOM becomes ``{"status": "out of memory", "stage": ...}``."""
    recorder = Recorder(pipe, device)
    try:
        recorder.start()
        generation = common.timed(
            device,
            lambda: recipe.generate(
                pipe,
                args,
                device,
                args.steps,
                "np",
                callback_on_step_end=recorder.on_step_end,
                callback_on_step_end_tensor_inputs=["latents"],
            ),
        )
    except Exception as exc:
        if not _is_oom(exc):
            raise
        logger.warning("out of memory at %s: %s", recorder.stage, str(exc).splitlines()[0])
        stage = recorder.stage
        return {
            "status": "out of memory",
            "stage": stage,
            "error": str(exc).splitlines()[0],
            "memory_timeline": recorder.samples,
            "stage_peak_allocated_bytes": recorder.finish(),
        }
    finally:
        recorder.close()
    steps = recorder.step_times()
    stage_peaks = recorder.finish()
    return {
        "status": "completed",
        "generation_s": round(generation.seconds, 4),
        "step_s": steps,
        "mean_step_s": round(float(np.mean(steps)), 4) if steps else None,
        "peak_allocated_bytes": max(stage_peaks.values()) if stage_peaks else generation.peak_allocated_bytes,
        "stage_peak_allocated_bytes": stage_peaks,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "memory_timeline": recorder.samples,
        "frames": to_uint8_frames(generation.output[0]),
        "latents": recorder.latents,
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cap(device: torch.device, cap: str | None) -> None:
    """Emulate a smaller card: the caching allocator refuses to grow past ``cap``."""
    from .engine.config import parse_bytes

    if cap and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(cap) / total), device)


def compare(
    recipe_name: str,
    recipe_argv: list[str],
    out: str | Path,
    memory_cap: str | None = None,
    offload_memory_cap: str | None = None,
) -> dict[str, Any]:
    """Run the recipe natively, then offloaded, and write the report files into ``out``.

    ``memory_cap`` applies to both runs (a native OOM is then the expected headline result);
    ``offload_memory_cap`` only to the offloaded one, so that native output exists to compare with.
    """
    if recipe_name not in RECIPES:
        raise SystemExit(f"unknown recipe {recipe_name!r}: one of {', '.join(RECIPES)}")
    recipe = importlib.import_module(f"flextensor_diffusers.recipes.{recipe_name}")
    args = recipe.parse_args(recipe_argv)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    common.require_weights(args, recipe_name)
    device = common.device_of(args)
    pipe = recipe.load(args, device)
    _free(device)  # random full-size weights are made on the GPU, then moved to the CPU: not part of the card
    _cap(device, memory_cap)

    runs: dict[str, dict[str, Any]] = {}
    try:
        common.place_natively(pipe, args, device)
        runs["native"] = run_generation(recipe, pipe, args, device)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        runs["native"] = {"status": "out of memory", "stage": "loading weights", "error": str(exc).splitlines()[0]}
    pipe.to("cpu")
    if hasattr(pipe, "vae") and hasattr(pipe.vae, "disable_tiling"):
        pipe.vae.disable_tiling()
    _free(device)

    _cap(device, offload_memory_cap or memory_cap)
    common.enable_offload(pipe, args, device)
    start = time.perf_counter()
    recipe.profiling_generation(pipe, args, device)
    profiling_s = time.perf_counter() - start
    runs["offloaded"] = run_generation(recipe, pipe, args, device)
    runs["offloaded"]["profiling_s"] = round(profiling_s, 4)
    offload_report = pipe.flextensor_report()
    # The Recorder reset the allocator's peak counter at every stage, so the pipeline's own reading
    # covers the last stage only; the run's peak is the largest stage peak.
    offload_report["peak_allocated_bytes"] = runs["offloaded"].get("peak_allocated_bytes")
    runs["offloaded"]["offload_report"] = offload_report
    pipe.disable_flextensor_offload()

    import diffusers

    report: dict[str, Any] = {
        "recipe": recipe_name,
        "arguments": _arguments(args),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor()})",
        "budget": args.budget,
        "memory_cap": memory_cap,
        "offload_memory_cap": offload_memory_cap or memory_cap,
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "python": platform.python_version(),
        },
        "gpu_figures": "available" if device.type == "cuda" else "not available (CPU run)",
    }
    videos = {}
    for name, run in runs.items():
        if run["status"] == "completed":
            videos[name] = run["frames"]
            write_mp4(out / f"{name}.mp4", run["frames"], fps=getattr(args, "fps", 16))
    native, offloaded = runs["native"], runs["offloaded"]
    if native["status"] == "completed" and offloaded["status"] == "completed":
        report["fidelity"] = {
            "latents": quality.latent_metrics(native["latents"], offloaded["latents"]),
            "frames": quality.frame_metrics(native["frames"], offloaded["frames"]),
        }
        print(report["fidelity"]["frames"]["lpips_note"])
    else:
        report["fidelity_note"] = (
            f"native: {native['status']} at {native.get('stage')}; no comparison of outputs"
            if native["status"] != "completed"
            else "offloaded run did not complete"
        )
    report["runs"] = {
        name: {k: v for k, v in run.items() if k not in ("frames", "latents")} for name, run in runs.items()
    }
    images = {
        "memory": quality.plot_memory(report["runs"]),
        "steps": quality.plot_steps(report["runs"]),
        "frames": quality.plot_frames(report.get("fidelity", {}).get("frames")),
    }
    if videos:
        images["strip"] = quality.frame_strip(videos)
    for name, data in images.items():
        (out / f"{name}.png").write_bytes(data)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.html").write_text(quality.render_html(report, images))
    return report


IMAGES = ("memory", "steps", "frames", "strip")


def rerender(out: str | Path) -> Path:
    """Rebuild ``report.html`` from the ``report.json`` and PNGs in ``out`` (after editing or shrinking them)."""
    out = Path(out)
    report = json.loads((out / "report.json").read_text())
    images = {name: (out / f"{name}.png").read_bytes() for name in IMAGES if (out / f"{name}.png").exists()}
    path = out / "report.html"
    path.write_text(quality.render_html(report, images))
    return path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, recipe_argv = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=RECIPES)
    parser.add_argument("--rerender", type=Path, help="only rebuild report.html in this folder")
    parser.add_argument("--out", type=Path, default=Path("report"))
    parser.add_argument("--memory-cap", help="emulate a smaller card for both runs, e.g. 24GB")
    parser.add_argument("--offload-memory-cap", help="emulate a smaller card for the offloaded run only")
    known, rest = parser.parse_known_args(argv)
    if known.rerender:
        print(f"wrote {rerender(known.rerender)}")
        return
    if known.recipe is None:
        parser.error("--recipe is required")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report = compare(known.recipe, rest + recipe_argv, known.out, known.memory_cap, known.offload_memory_cap)
    for name, run in report["runs"].items():
        peak = run.get("peak_allocated_bytes")
        line = f"{name}: {run['status']}"
        if run["status"] == "completed":
            line += f", {run['generation_s']:.2f} s, mean step {run['mean_step_s']} s"
            line += f", peak {peak / 2**30:.2f} GiB" if peak is not None else ", peak n/a (CPU)"
        else:
            line += f" at {run['stage']}"
        print(line)
    if "fidelity" in report:
        print(f"latents bitwise equal: {report['fidelity']['latents']['bitwise_equal']}")
    print(f"wrote {known.out / 'report.html'}")


if __name__ == "__main__":
    main()
