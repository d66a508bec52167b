"""Native vs offloaded: the same generation twice, same seed, and a report of what differs and what it cost.

examples:
  flextensor-compare --recipe wan22_t2v --out report/ -- --random-weights tiny
  flextensor-compare --recipe wan22_t2v --out report/ -- --random-weights tiny \\
      --frames 9 --height 32 --width 32 --steps 2

Everything after ``--`` goes to the recipe (``flextensor-wan22-t2v --help`` and the like list it; its
``--output`` is not used: the videos go into ``--out``). Writes ``native.mp4``, ``offloaded.mp4``,
``strip.png``, ``steps.png``, ``frames.png``, ``memory.png`` (on a GPU), ``report.json`` and a
self-contained ``report.html`` into ``--out``, each whole or not at all. Both runs use the recipe's
``--compile`` mode. A native run that runs out of memory is a result ("native: out of memory at <stage>"),
not a crash; an optional perceptual metric (LPIPS, ST-LPIPS) that cannot load is a note in the report.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import logging
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.config import format_bytes, parse_bytes
from ..engine.errors import BudgetError
from ..engine.peaks import PeakWindow, open_window
from ..media import files
from ..media.video import read_mp4, to_uint8_frames, write_mp4
from ..recipes import common
from ..recipes.interruption import RunProgress
from ..recipes.options import OptionsError, RecipeOptions, writable
from ..storage.setup_threads import progress_bars
from . import quality

logger = logging.getLogger(__name__)

RECIPES = ("wan22_t2v", "ltx2_outpaint", "cosmos_transfer25")


class Recorder:
    """Stage and step boundaries of one generation: times, allocated memory, per-stage peaks, latents.

    A stage is the component running (text encoder, transformer, ...) or the VAE decode; at each
    change the allocator's peak since the last change is kept for the stage that ended (a `PeakWindow` per stage,
    the profiling forwards' resets folded in); ``reserved_peak`` is the caching allocator's over the whole
    generation.
    """

    def __init__(self, pipe: Any, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stage = "loading"
        self.samples: list[dict[str, Any]] = []
        self.step_ends: list[float] = []
        self.latents: torch.Tensor | None = None
        self.stage_peaks: dict[str, int] = {}
        self.reserved_peak: int | None = None
        self._generation: PeakWindow | None = None  # from `start`
        self._stage: PeakWindow | None = None  # from the current stage's start
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
        if self.cuda and self._stage is not None:
            torch.cuda.synchronize(self.device)
            peak = self._stage.peak()
            self.stage_peaks[self.stage] = max(self.stage_peaks.get(self.stage, 0), peak)
            self._stage = open_window(self.device)
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
            self._generation = open_window(self.device)
            self._stage = open_window(self.device)
        self._sample("start")

    def finish(self) -> dict[str, int]:
        """Close the last stage; the peak allocated bytes of every stage (empty on the CPU)."""
        self._switch("done")
        if self._generation is not None:
            self.reserved_peak = self._generation.reserved_peak()
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


#: Recipe options that compare does not use: it writes native.mp4 and offloaded.mp4 into --out.
UNUSED_OPTIONS = ("output", "json", "no_offload", "gpus")


def _arguments(options: RecipeOptions) -> dict[str, Any]:
    """The recipe's options as JSON, without those compare does not use (so the report shows no ``--output``)."""
    return {k: v for k, v in options.as_json().items() if k not in UNUSED_OPTIONS}


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_generation(recipe: Any, pipe: Any, options: RecipeOptions, device: torch.device) -> dict[str, Any]:
    """One full generation with recording; OOM becomes ``{"status": "out of memory", "stage": ...}``."""
    recorder = Recorder(pipe, device)
    try:
        recorder.start()
        generation = common.timed(
            device,
            lambda: recipe.generate(
                pipe,
                options,
                device,
                options.steps,
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
        "peak_reserved_bytes": recorder.reserved_peak,
        "memory_timeline": recorder.samples,
        "frames": to_uint8_frames(generation.output[0]),
        "latents": recorder.latents,
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cap_device_memory(device: torch.device, cap: str | None) -> None:
    """Emulate a smaller card: the caching allocator refuses to grow past ``cap``."""
    if cap and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" names none
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(cap) / total), index)


def check_cap(flag: str, cap: str | None) -> None:
    """A memory cap must parse as a positive size (``abc`` is refused, not ignored)."""
    if cap is None:
        return
    try:
        parse_bytes(cap)
    except BudgetError:
        raise OptionsError(f"{flag} {cap}: pass a positive size with a unit, e.g. {flag} 24GB") from None


def device_name(device: torch.device) -> str:
    """The GPU's name, or "CPU" with the processor's name where the platform gives one."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    processor = platform.processor() or platform.machine()
    return f"CPU ({processor})" if processor else "CPU"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def video_identity(out: Path, videos: dict[str, np.ndarray]) -> dict[str, Any]:
    """Whether native and offloaded are identical, on each thing it can be measured on.

    ``frames``: the uint8 frames before encoding (what the metrics compare); ``mp4_bytes``: the files
    (encoding is deterministic, so equal frames give equal files); ``decoded``: the frames read back.
    """
    native, offloaded = out / "native.mp4", out / "offloaded.mp4"
    decoded_native, decoded_offloaded = read_mp4(native), read_mp4(offloaded)
    return {
        "frames": bool(np.array_equal(videos["native"], videos["offloaded"])),
        "mp4_bytes": _sha256(native) == _sha256(offloaded),
        "decoded": bool(np.array_equal(decoded_native, decoded_offloaded)),
        "measured_on": "uint8 RGB frames before encoding (the metrics' input), the mp4 files' bytes, "
        "and the frames decoded back from the mp4 files",
    }


def recipe_module(name: str) -> Any:
    """The recipe's module (``flextensor_diffusers.recipes.NAME``); an unknown name names the known ones."""
    if name not in RECIPES:
        raise OptionsError(f"--recipe {name}: unknown recipe: pass one of {', '.join(RECIPES)}")
    return importlib.import_module(f"flextensor_diffusers.recipes.{name}")


def check_request(
    recipe: Any, recipe_argv: list[str], out: Path, memory_cap: str | None, offload_memory_cap: str | None
) -> RecipeOptions:
    """The recipe's options, every flag checked before anything loads (``--out`` and the caps included)."""
    check_cap("--memory-cap", memory_cap)
    check_cap("--offload-memory-cap", offload_memory_cap)
    check_out(out)
    options = recipe.parse_args(recipe_argv)
    if options.compile == "full":  # reached with --no-offload, which compare does not use
        raise OptionsError(
            "--compile full cannot be offloaded, and compare runs offloaded too: pass --compile regional"
        )
    return options


def check_out(out: Path) -> None:
    """``--out`` is a folder (made if missing) that can be written."""
    if out.exists() and not out.is_dir():
        folder = out.parent / "report"
        raise OptionsError(f"--out {out} is a file; the report is a folder of files: pass --out {folder}")
    writable("--out", out)


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
    A Ctrl-C is raised as an `Interrupted` naming the stage and the files written and not written.
    """
    out = Path(out)
    recipe = recipe_module(recipe_name)
    options = check_request(recipe, recipe_argv, out, memory_cap, offload_memory_cap)
    progress = RunProgress("compare", [out / name for name in MAIN_FILES])
    with progress.interruptible(), progress_bars(not options.quiet):
        device = common.device_of(options)
        if device.type != "cuda" and (memory_cap or offload_memory_cap):
            print("note: --memory-cap and --offload-memory-cap have no effect on the CPU (there is no GPU to cap)")
        with progress.during("loading the weights"), common.stage("loading weights", options.quiet):
            pipe = recipe.load(options, device)
        _free(device)  # random full-size weights are made on the GPU, then moved to the CPU: not part of the card
        cap_device_memory(device, memory_cap)
        with progress.during("compiling"):
            compiled = common.compile_denoisers(pipe, options)  # both runs use the same compiled modules
        with progress.during("the native generation"):
            runs = {"native": native_run(recipe, pipe, options, device)}
        cap_device_memory(device, offload_memory_cap or memory_cap)
        runs["offloaded"] = offloaded_run(recipe, pipe, options, device, progress)
        report = report_header(recipe_name, options, device, compiled, memory_cap, offload_memory_cap)
        write_report(out, report, runs, options.fps, progress)
    return report


def native_run(recipe: Any, pipe: Any, options: RecipeOptions, device: torch.device) -> dict[str, Any]:
    """The generation with every weight on the device (out of memory is a result); the pipeline is left on
    the CPU with VAE tiling off, as the offloaded run expects it."""
    try:
        common.place_natively(pipe, options, device)
        common.label_generation(pipe, "native generation", options.quiet)
        run = run_generation(recipe, pipe, options, device)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        run = {"status": "out of memory", "stage": "loading weights", "error": str(exc).splitlines()[0]}
    pipe.to("cpu")
    if hasattr(pipe, "vae") and hasattr(pipe.vae, "disable_tiling"):
        pipe.vae.disable_tiling()
    _free(device)
    return run


def offloaded_run(
    recipe: Any, pipe: Any, options: RecipeOptions, device: torch.device, progress: RunProgress
) -> dict[str, Any]:
    """Offload enabled, then the recorded generation, as the recipe runs it: each component's first forwards
    profile it inside that generation (their steps are the slower ones in ``step_s``), unless a saved profile
    of the workload plans them, or the recipe's ``--profiling-generation`` asks for a short generation first (then
    every recorded step is planned; its time is ``profiling_s``). ``profiled_in`` and ``unplanned_forwards`` say
    which; offload disabled after."""
    with progress.during("packing and pinning the weights"), common.stage("packing and pinning weights", options.quiet):
        common.enable_offload(pipe, options, device)
    source = common.profile_source(pipe, options, device, gpus=1)
    profiling_s = None
    if source.where == common.PROFILING_GENERATION:
        common.label_generation(pipe, "offloaded: profiling generation", options.quiet)
        with progress.during("the offloaded profiling generation"):
            start = time.perf_counter()
            recipe.profiling_generation(pipe, options, device)
            profiling_s = round(time.perf_counter() - start, 4)
    common.label_generation(pipe, "offloaded generation", options.quiet)
    before = common.unplanned_forwards(pipe)
    with progress.during("the offloaded generation"):
        run = run_generation(recipe, pipe, options, device)
    run["profiling_s"] = profiling_s
    run["profiled_in"] = source.where
    run["unplanned_forwards"] = sum(common.unplanned_forwards(pipe).values()) - sum(before.values())
    offload_report = pipe.flextensor_report()
    # The Recorder reset the allocator's peak counter at every stage, so the pipeline's own reading
    # covers the last stage only; the run's peak is the largest stage peak.
    offload_report["peak_allocated_bytes"] = run.get("peak_allocated_bytes")
    run["offload_report"] = offload_report
    with progress.during("disabling offload"):
        pipe.disable_flextensor_offload()
    return run


def report_header(
    recipe_name: str,
    options: RecipeOptions,
    device: torch.device,
    compiled: list[str],
    memory_cap: str | None,
    offload_memory_cap: str | None,
) -> dict[str, Any]:
    """What was run, where and with which versions: the report's first fields."""
    import diffusers

    cuda = device.type == "cuda"
    return {
        "recipe": recipe_name,
        "arguments": _arguments(options),
        "device": str(device),
        "device_name": device_name(device),
        "budget": options.budget,
        "compile": {"mode": options.compile, "components": compiled},
        "memory_cap": memory_cap if cuda else None,
        "offload_memory_cap": (offload_memory_cap or memory_cap) if cuda else None,
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "python": platform.python_version(),
        },
        "gpu_figures": "available" if cuda else "not available (CPU run)",
    }


#: The report's main files, in the order they are written (the plots come between the videos and report.json).
MAIN_FILES = ("native.mp4", "offloaded.mp4", "report.json", "report.html")


def write_report(
    out: Path, report: dict[str, Any], runs: dict[str, dict[str, Any]], fps: int, progress: RunProgress
) -> None:
    """The videos, the fidelity verdict, the plots, ``report.json`` and ``report.html``, each written whole."""
    videos = {name: run["frames"] for name, run in runs.items() if run["status"] == "completed"}
    for name, frames in videos.items():
        write_file(out / f"{name}.mp4", progress, lambda path, frames=frames: write_mp4(path, frames, fps=fps))
    report["videos"] = {name: f"{name}.mp4" for name in videos}
    native, offloaded = runs["native"], runs["offloaded"]
    if len(videos) == 2:
        report["fidelity"] = {
            "latents": quality.latent_metrics(native["latents"], offloaded["latents"]),
            "frames": quality.frame_metrics(native["frames"], offloaded["frames"]),
            "identical": video_identity(out, videos),
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
    images = plots(report, videos)
    for name, data in images.items():
        write_file(out / f"{name}.png", progress, lambda path, data=data: files.write_bytes(path, data))
    write_file(out / "report.json", progress, lambda path: files.write_text(path, json.dumps(report, indent=1)))
    html = quality.render_html(report, images)
    write_file(out / "report.html", progress, lambda path: files.write_text(path, html))


def plots(report: dict[str, Any], videos: dict[str, np.ndarray]) -> dict[str, bytes]:
    """The report's PNGs: per-step times, per-frame fidelity, the memory timeline (GPU runs) and a frame strip."""
    images = {
        "steps": quality.plot_steps(report["runs"]),
        "frames": quality.plot_frames(report.get("fidelity", {}).get("frames")),
    }
    if report["device"].startswith("cuda"):  # the CPU has no allocator counters: the page says so instead
        images["memory"] = quality.plot_memory(report["runs"])
    if videos:
        images["strip"] = quality.frame_strip(videos)
    return images


def write_file(path: Path, progress: RunProgress, write: Callable[[Path], object]) -> None:
    """``write(path)`` as a named stage of ``progress``, then recorded as written."""
    with progress.during(f"writing {path}"):
        write(path)
    progress.wrote(path)


IMAGES = ("memory", "steps", "frames", "strip")


def rerender(out: str | Path) -> Path:
    """Rebuild ``report.html`` from the ``report.json`` and PNGs in ``out`` (after editing or shrinking them)."""
    out = Path(out)
    report = json.loads((out / "report.json").read_text())
    images = {name: (out / f"{name}.png").read_bytes() for name in IMAGES if (out / f"{name}.png").exists()}
    return files.write_text(out / "report.html", quality.render_html(report, images))


#: The console script (pyproject.toml) that runs `cli`.
COMMAND = "flextensor-compare"
USAGE = (
    f"{COMMAND} --recipe {{wan22_t2v,ltx2_outpaint,cosmos_transfer25}} [--out DIR]\n"
    "       [--memory-cap SIZE] [--offload-memory-cap SIZE] [-q] [-v] -- RECIPE_ARGS...\n"
    f"       {COMMAND} --rerender DIR"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=COMMAND,
        usage=USAGE,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--recipe", choices=RECIPES, help="which recipe to run twice")
    p.add_argument("--rerender", type=Path, help="only rebuild report.html in this folder")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("report"),
        help="folder for the report, made if missing; its files replace those of an earlier report (default: report)",
    )
    p.add_argument("--memory-cap", help="emulate a smaller card for both runs, e.g. 24GB (GPU only)")
    p.add_argument("--offload-memory-cap", help="emulate a smaller card for the offloaded run only (GPU only)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars (also passed to the recipe)")
    p.add_argument("-v", "--verbose", action="store_true", help="log details; show tracebacks on errors")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Compare with these arguments; the report, or None for --rerender. Errors propagate as exceptions."""
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, recipe_argv = argv[:cut], argv[cut + 1 :]
    known = parser().parse_args(argv)
    if known.rerender:
        print(f"wrote {rerender(known.rerender)}")
        return None
    if known.recipe is None:
        parser().error("--recipe is required")
    recipe_argv += [flag for flag, on in (("-q", known.quiet), ("-v", known.verbose)) if on]
    common.setup_logging(known.verbose)
    new_folder = not known.out.exists()
    report = compare(known.recipe, recipe_argv, known.out, known.memory_cap, known.offload_memory_cap)
    print_outcome(report, known.out, new_folder)
    return report


def cli(argv: list[str] | None = None) -> None:
    """`main` as a command: a deliberate error is one line on stderr and exit status 2, a Ctrl-C one line
    (what was interrupted, which files were and were not written) and exit status 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with common.user_errors(argv):
        main(argv)


def print_outcome(report: dict[str, Any], out: Path, new_folder: bool = False) -> None:
    """One line per run, the fidelity verdict, and where the page is (``new_folder``: ``out`` was made)."""
    for name, run in report["runs"].items():
        peak = run.get("peak_allocated_bytes")
        line = f"{name}: {run['status']}"
        if run["status"] == "completed":
            line += f", {run['generation_s']:.2f} s, mean step {run['mean_step_s']} s"
            line += f", peak {format_bytes(peak)}" if peak is not None else ", peak n/a (CPU)"
        else:
            line += f" at {run['stage']}"
        print(line)
    if "fidelity" in report:
        same = report["fidelity"]["identical"]
        print(
            f"latents bitwise equal: {report['fidelity']['latents']['bitwise_equal']}; frames identical: "
            f"{same['frames']} (before encoding), {same['decoded']} (decoded mp4s)"
        )
    print(f"wrote {out / 'report.html'}" + (f" (made the folder {out})" if new_folder else ""))


if __name__ == "__main__":
    cli()
