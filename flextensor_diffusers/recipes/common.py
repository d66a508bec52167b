"""What every recipe does: the command line, loading, where the plans come from, timing, the summary.

A recipe module provides:

- ``parse_args(argv) -> options``: a frozen `RecipeOptions` (or subclass), every value checked
  that can be checked without the weights (`options.OptionsError` names the flag);
- ``load(options, device, attach=False)``: the pipeline, CPU-first, with whatever inputs it derives
  from the options kept on the pipeline (``attach``: build on the meta device, for a rank that
  attaches to another's shared weights);
- ``generate(pipe, options, device, steps, output_type, **extra)`` and
  ``profiling_generation(pipe, options, device)`` (the short generation ``--profiling-generation`` runs first);
- optionally ``DECODED_ON_DEVICE = True`` (the generation asks for ``output_type="pt"``: the decoded video
  stays on the device and is written to the mp4 in chunks, each made uint8 there, so that a long video never
  sits in host memory whole), ``finish_chunk(pipe, options, pixels, start)`` (with it: edits each uint8
  chunk of frames ``start:start+len(pixels)`` before it is written) and ``describe(pipe, options)`` (extra
  summary fields).

`run_recipe` does the rest; `main` runs a command line's arguments (errors propagate), `cli` is the
command itself (one line per user error, exit status 2); `flextensor_diffusers.reports.compare` drives the
same functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine import Phase, format_bytes, open_window
from ..engine.config import resolve_budget
from ..engine.errors import BudgetError, FlexTensorError, HostBudgetError
from ..media import files
from ..media.video import Mp4Writer, to_uint8_frames, uint8_chunks, write_mp4
from ..pipelines.offload import check_setup_budget, format_report, pipeline_offload, resolve_vae_tiling
from ..storage.setup_threads import progress_bars
from . import parallel
from .interruption import INTERRUPT_EXIT, Interrupted, RunProgress
from .options import RecipeOptions, budget_note, budget_suggestion
from .parallel import Placement

#: What a Ctrl-C before a run began (while options were read) says.
NOT_STARTED = "interrupted (Ctrl-C) before the run began; nothing written"
#: Exit status of a run stopped by a user error (argparse's own errors exit with 2 as well).
USAGE_EXIT = 2


def call_arguments(options: RecipeOptions, steps: int, output_type: str) -> dict[str, Any]:
    """The pipeline-call arguments every recipe passes the same way (a seeded CPU generator)."""
    return {
        "prompt": options.prompt,
        "negative_prompt": options.negative_prompt,
        "num_frames": options.frames,
        "height": options.height,
        "width": options.width,
        "num_inference_steps": steps,
        "guidance_scale": options.guidance,
        "generator": torch.Generator(device="cpu").manual_seed(options.seed),
        "output_type": output_type,
    }


def place_natively(pipe: Any, options: RecipeOptions, device: torch.device) -> None:
    """Everything on the device, with the VAE tiling choice an offloaded run under --budget makes."""
    tiled = resolve_vae_tiling(options.vae_tiling_choice, resolve_budget(options.budget, device))  # before the move
    pipe.to(device)
    if tiled and hasattr(pipe, "vae"):
        pipe.vae.enable_tiling()


def enable_offload(pipe: Any, options: RecipeOptions, device: torch.device, shared_host: str | None = None) -> None:
    """``shared_host``: the namespace of one host copy for all ranks of a ``--gpus N`` job. Where the raw copies
    wait, the payload cache and load verification are passed only as typed (else the offload chooses: under a
    host tier with compression, compressed copies only, cached, and on a GPU verified), so that ``--host-budget
    auto`` may still turn the tier on."""
    typed: dict[str, Any] = {}
    if options.raw_copies is not None:
        typed["raw_copies"] = options.raw_copies
    if options.compression_cache:
        typed["compression_cache"] = True
    if options.verify_loads is not None:
        typed["verify_loads"] = options.verify_loads
    if options.background_encoding is not None:
        typed["background_encoding"] = options.background_encoding
    pipe.enable_flextensor_offload(
        budget=options.budget,
        profile_dir=options.profile_dir,
        device=device,
        vae_tiling=options.vae_tiling_choice,
        shared_host=shared_host,
        host_budget=options.host_budget,
        cache_dir=options.cache_dir,
        compression=options.compression,
        **typed,
    )


def compile_denoisers(pipe: Any, options: RecipeOptions) -> list[str]:
    """``--compile``: the same compilation for a native and an offloaded run (compare's premise)."""
    from ..pipelines.compile import compile_pipeline

    return compile_pipeline(pipe, options.compile)


def init_device(options: RecipeOptions, device: torch.device, attach: bool = False) -> str | torch.device:
    """Where random weights are made: on the GPU for full sizes (quick), on the meta device for a
    rank that attaches to another's shared copy, else on the CPU."""
    if attach:
        return "meta"
    return device if options.random_weights == "full" and device.type == "cuda" else "cpu"


def device_of(options: RecipeOptions, rank_device: str | None = None) -> torch.device:
    """The compute device, with its index (``cuda:0``, not ``cuda``); a torchrun rank's own GPU first."""
    from ..engine.config import resolve_device

    return resolve_device(rank_device or options.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timed:
    seconds: float
    peak_allocated_bytes: int | None
    output: Any


def timed(device: torch.device, fn: Callable[[], Any]) -> Timed:
    """Run ``fn``; wall time after device synchronisation, and the peak allocated memory of its run (a window of
    its own, `engine.peaks`: the profiling forwards' resets are folded in)."""
    window = None
    if device.type == "cuda":
        synchronize(device)
        window = open_window(device)
    start = time.perf_counter()
    output = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    return Timed(seconds=seconds, peak_allocated_bytes=window.peak() if window else None, output=output)


def workload_key(pipe: Any, device: torch.device, **shape: Any) -> str:
    """A digest of the components' fingerprints, the device and the generation's shapes."""
    state = pipeline_offload(pipe)
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
    files.write_text(index, json.dumps(data, indent=1))


#: The counters of `OffloadHandle.stats().forwards` that count forwards (the others count activations, plans).
FORWARD_PHASES = ("discovery", "profiling", "steady")
#: The counters of forwards that ran unplanned (units loaded on demand while the order and times were measured).
UNPLANNED_PHASES = ("discovery", "profiling")


def all_steady(pipe: Any) -> bool:
    """Every component that ran has its plan, except one that ran a single forward (the VAE: one decode per
    generation, none in a latents-only profiling generation), which a generation cannot profile: a process that
    generates again plans it, and it keeps its own profile in ``--profile-dir`` then."""
    state = pipeline_offload(pipe)
    return state is None or all(
        h.phase is Phase.STEADY or sum(h.counters[k] for k in FORWARD_PHASES) <= 1 for h in state.handles.values()
    )


def unplanned_forwards(pipe: Any) -> dict[str, int]:
    """Per component, the forwards (and entry calls) that ran unplanned so far: discovery and profiling ones."""
    state = pipeline_offload(pipe)
    if state is None:
        return {}
    return {name: sum(h.counters[k] for k in UNPLANNED_PHASES) for name, h in state.handles.items()}


#: Where a run's plans came from (the summary's ``profiled_in``).
IN_GENERATION, SAVED_PROFILE, PROFILING_GENERATION = "generation", "saved profile", "profiling generation"


@dataclass(frozen=True)
class ProfileSource:
    """Where the plans of an offloaded run come from (``where``: `IN_GENERATION`, `SAVED_PROFILE` or
    `PROFILING_GENERATION`), the profiling generation's seconds when one ran, and the workload's key in
    ``--profile-dir``'s index with what is written there once it is profiled."""

    where: str
    profiling_generation_s: float | None
    key: str
    description: dict[str, Any]


# ---------------------------------------------------------------------------------------- progress


def bars_disabled(quiet: bool) -> bool | None:
    """tqdm's ``disable``: off with --quiet; None lets tqdm turn bars off when not writing to a terminal."""
    return True if quiet else None


@contextlib.contextmanager
def stage(label: str, quiet: bool) -> Iterator[None]:
    """A one-step labelled bar around a stage with no steps of its own (loading, packing and pinning)."""
    from tqdm.auto import tqdm

    with tqdm(total=1, desc=label, disable=bars_disabled(quiet), bar_format="{desc}: {elapsed}", leave=True) as bar:
        yield
        bar.update(1)


def label_generation(pipe: Any, label: str, quiet: bool) -> None:
    """Name diffusers' denoising bar (``profiling generation`` or ``generation``)."""
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(desc=label, disable=bars_disabled(quiet))


# ---------------------------------------------------------------------------------------- the run


def summary(
    options: RecipeOptions,
    device: torch.device,
    generation: Timed,
    source: ProfileSource | None,
    pipe: Any,
    unplanned: dict[str, int],
) -> dict[str, Any]:
    """The run's summary (printed, and written to ``--json``). ``profiled_in``: where the plans came from (the
    generation's own first forwards, a saved profile, a profiling generation; None natively); ``unplanned_forwards``:
    the generation's forwards that ran unplanned (``unplanned``: per component); ``total_s``: the profiling
    generation and the generation, what the video cost after set-up."""
    state = pipeline_offload(pipe)
    ram = state.host_ram.ram if state and state.host_ram else None  # read when offload was enabled
    profiling_s = source.profiling_generation_s if source is not None else None
    return {
        "recipe": options.recipe,
        "weights": str(options.model) if options.model else f"random ({options.random_weights})",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "offload": not options.no_offload,
        "budget": options.budget,
        "budget_bytes": state.budget_bytes if state else None,
        "compile": options.compile,
        "compression": options.compression,
        "host_budget": options.host_budget,
        # the RAM the process could take at enable (the least of the host's, its cgroups' and its rlimits') and where
        # that figure came from: what host_budget "auto" and the refusal before packing decided from
        "ram_available_bytes": ram.nbytes if ram else None,
        "ram_available_source": ram.describe() if ram else None,
        "frames": options.frames,
        "height": options.height,
        "width": options.width,
        "steps": options.steps,
        "seed": options.seed,
        "generation_s": round(generation.seconds, 3),
        "profiling_generation_s": None if profiling_s is None else round(profiling_s, 3),
        "total_s": round(generation.seconds + (profiling_s or 0.0), 3),
        "profiled_in": source.where if source is not None else None,
        "unplanned_forwards": sum(unplanned.values()) if source is not None else None,
        "unplanned_forwards_by_component": unplanned if source is not None else None,
        "peak_allocated_bytes": generation.peak_allocated_bytes,
        "output": str(options.output),
        "options": options.as_json(),
        "offload_report": state.report() if state else None,
    }


def offload_and_profile(
    recipe: Any, pipe: Any, options: RecipeOptions, device: torch.device, placement: Placement, progress: RunProgress
) -> ProfileSource:
    """Enable offload, and say where its plans will come from: a saved profile of this workload (``--profile-dir``),
    else the generation itself (each component's first forwards discover and profile it, on demand, and its plan
    takes over in the same generation; outputs are bitwise either way), or, with ``--profiling-generation``, a
    short generation run here first. A budget the measured activations do not fit is refused at the next forward
    of any component (`PipelineOffload.budget_error`), in the first steps, not after the generation."""
    new_folder = options.profile_dir is not None and not options.profile_dir.exists()
    with progress.during("packing and pinning the weights"), stage("packing and pinning weights", options.quiet):
        enable_offload(pipe, options, device, shared_host=placement.shared_host)
    source = profile_source(pipe, options, device, placement.rank.world_size)
    where = source.where
    if placement.rank.leader:
        folder = options.profile_dir or "nowhere (no --profile-dir)"
        then = {
            SAVED_PROFILE: "found: planned from the first step",
            PROFILING_GENERATION: "none yet: a short profiling generation first",
            IN_GENERATION: "none yet: each component's first forwards profile it, in this generation",
        }[where]
        then += " (a new folder)" if new_folder else ""
        budget = format_bytes(pipeline_offload(pipe).budget_bytes)
        print(f"offload: budget {budget} on {device}; profile in {folder}: {then}")
    if where != PROFILING_GENERATION:
        return source
    label_generation(pipe, "profiling generation", options.quiet)
    with progress.during("the profiling generation"):
        seconds = timed(device, lambda: recipe.profiling_generation(pipe, options, device)).seconds
    remember_if_planned(pipe, options, source, placement)
    return dataclasses.replace(source, profiling_generation_s=seconds)


def profile_source(pipe: Any, options: RecipeOptions, device: torch.device, gpus: int) -> ProfileSource:
    """Where an offloaded pipeline's plans will come from for this workload: a saved profile when ``--profile-dir``'s
    index holds it, else a profiling generation when ``--profiling-generation`` asks for one, else the generation."""
    shape = {"frames": options.frames, "height": options.height, "width": options.width}
    key = workload_key(pipe, device, **shape, cfg=options.guidance > 1, gpus=gpus)
    if profiled_before(options.profile_dir, key):
        where = SAVED_PROFILE
    else:
        where = PROFILING_GENERATION if options.profiling_generation else IN_GENERATION
    return ProfileSource(where, None, key, {**shape, "recipe": options.recipe})


def remember_if_planned(pipe: Any, options: RecipeOptions, source: ProfileSource, placement: Placement) -> None:
    """Record the workload in ``--profile-dir``'s index once every component that ran has its plan (`all_steady`):
    a later run then says it plans from a saved profile (and skips ``--profiling-generation``). The leader only."""
    if source.where != SAVED_PROFILE and placement.rank.leader and all_steady(pipe):
        remember_profiled(options.profile_dir, source.key, source.description)


def load_for_run(
    recipe: Any, options: RecipeOptions, device: torch.device, placement: Placement, progress: RunProgress
) -> Any:
    """The pipeline, loaded CPU-first, split across ranks and compiled as asked; random weights are first
    checked against the budget on a meta-device build (the smallest workable budget follows from the
    architecture), so a budget that cannot work stops before any weight is made."""
    # Not under --quantize: the meta build's weights would be unquantized (torchao's on meta cannot be packed), and
    # its minimum too high; enabling offload checks the budget against the quantized weights instead.
    if not options.no_offload and options.random_weights is not None and not getattr(options, "quantize", None):
        with progress.during("checking the budget"):
            check_setup_budget(
                recipe.load(options, device, attach=True), resolve_budget(options.budget, device), device
            )
    with progress.during("loading the weights"), stage("loading weights", options.quiet):
        pipe = recipe.load(options, device, attach=placement.attach_to_shared)
    parallel.split_transformers(pipe, placement.rank)
    with progress.during("compiling"):
        compile_denoisers(pipe, options)
    return pipe


def run_recipe(recipe: Any, options: RecipeOptions) -> dict[str, Any]:
    """Load, compile, offload (or not), generate (profiling inside the generation unless a profile of the workload
    is saved, or ``--profiling-generation`` runs one first), write the mp4 and the summary.

    A Ctrl-C anywhere is raised as an `Interrupted` that names the stage and what was and was not written.
    """
    placement = parallel.set_up(options)
    outputs = [options.output, *([options.json] if options.json else [])] if placement.rank.leader else []
    progress = RunProgress(options.recipe, outputs)
    with progress.interruptible(), progress_bars(not options.quiet):
        device = device_of(options, placement.device)
        pipe = load_for_run(recipe, options, device, placement, progress)
        source = None
        if options.no_offload:
            with progress.during("moving the weights to the device"):
                place_natively(pipe, options, device)
        else:
            source = offload_and_profile(recipe, pipe, options, device, placement, progress)
        label_generation(pipe, "generation", options.quiet)
        before = unplanned_forwards(pipe)
        with progress.during("the generation"):
            output_type = "pt" if getattr(recipe, "DECODED_ON_DEVICE", False) else "np"
            result = timed(device, lambda: recipe.generate(pipe, options, device, options.steps, output_type))
        unplanned = {name: n - before[name] for name, n in unplanned_forwards(pipe).items()}
        if source is not None:
            remember_if_planned(pipe, options, source, placement)
        info = summary(options, device, result, source, pipe, unplanned)
        info["gpus"] = placement.rank.world_size
        if placement.rank.leader:  # every rank has the whole video; one writes it
            write_outputs(recipe, pipe, options, result, info, progress)
    parallel.finish()
    return info


def write_outputs(
    recipe: Any, pipe: Any, options: RecipeOptions, result: Timed, info: dict[str, Any], progress: RunProgress
) -> None:
    """The mp4 (and ``--json``), each written whole or not at all; the summary printed between them."""
    info["replaced_output"] = options.output.exists()
    made = files.missing_folder(options.output)
    info["made_folder"] = None if made is None else str(made)
    with progress.during(f"writing {options.output}"):
        video = result.output[0]
        result.output = None  # the chunks below are the only other reference: freed as written
        if isinstance(video, torch.Tensor):
            writer = write_decoded_video(recipe, pipe, options, video)
            info["frames_written"], info["codec"] = writer.frames, writer.codec
        else:
            frames = to_uint8_frames(video)
            info["frames_written"] = len(frames)
            info["codec"] = write_mp4(options.output, frames, fps=options.fps)
    progress.wrote(options.output)
    if hasattr(recipe, "describe"):
        info.update(recipe.describe(pipe, options))
    print_summary(info)
    if options.json:
        notes = written_notes(options.json)
        with progress.during(f"writing {options.json}"):
            files.write_text(options.json, json.dumps(info, indent=1))
        progress.wrote(options.json)
        print(f"wrote {options.json}" + (f" ({'; '.join(notes)})" if notes else ""))


def write_decoded_video(recipe: Any, pipe: Any, options: RecipeOptions, video: torch.Tensor) -> Mp4Writer:
    """A decoded (F, 3, H, W) video in [0, 1], on any device, into ``options.output`` a chunk at a time: each
    made uint8 and YUV where the video is (`uint8_chunks`, `Mp4Writer.write_tensor`: the same bytes as
    `write_mp4` of the same frames), edited by the recipe's ``finish_chunk`` first."""
    finish = getattr(recipe, "finish_chunk", None)
    with Mp4Writer(options.output, fps=options.fps) as writer:
        for start, pixels in uint8_chunks(video):
            writer.write_tensor(finish(pipe, options, pixels, start) if finish else pixels)
    return writer


def written_notes(path: Path) -> list[str]:
    """What writing ``path`` is about to do besides writing it: replace a file, make its folder."""
    made = files.missing_folder(path)
    return [
        *(["replaced the file that was there"] if path.exists() else []),
        *([f"made the folder {made}"] if made is not None else []),
    ]


#: Phases of a component that has not been planned yet (its blocks load on demand).
UNPLANNED = ("discovery", "profiling")


def unplanned_note(report: dict[str, Any]) -> str | None:
    """A line for the components the table shows unplanned after the run (the VAE: one decode per generation),
    saying why and when they would be planned."""
    names = [name for name, c in report["components"].items() if c["phase"] in UNPLANNED]
    if not names:
        return None
    its = "its" if len(names) == 1 else "their"
    return (
        f"phase: {', '.join(names)} ran once in this run (a VAE decodes once per generation), so {its} blocks "
        "loaded on demand, each kept on the device for the rest of the call while a quarter of the budget holds "
        "them; a component is planned (steady) after its second call, in a process that generates again"
    )


def profiling_said(info: dict[str, Any]) -> str:
    """Where the generation's plans came from, and what that cost it, in words."""
    unplanned = info["unplanned_forwards"]
    if info["profiled_in"] is None:
        return "native"
    forwards = f"{unplanned} forward{'s' if unplanned != 1 else ''} unplanned"
    if info["profiled_in"] == PROFILING_GENERATION:
        return f"after a profiling generation of {info['profiling_generation_s']:.2f} s; {forwards}"
    if info["profiled_in"] == SAVED_PROFILE:
        return f"planned from a saved profile; {forwards}"
    return f"profiled in its first forwards: {forwards}, included"


def print_summary(info: dict[str, Any]) -> None:
    peak = info["peak_allocated_bytes"]
    notes = [
        *(["replaced the file that was there"] if info.get("replaced_output") else []),
        *([f"made the folder {info['made_folder']}"] if info.get("made_folder") else []),
    ]
    extra = "".join(f"; {note}" for note in notes)
    print(f"wrote {info['output']} ({info['frames_written']} frames, {info['width']}x{info['height']}{extra})")
    print(
        f"generation {info['generation_s']:.2f} s ({profiling_said(info)}), peak allocated GPU memory "
        f"{format_bytes(peak) if peak is not None else 'n/a (CPU)'}"
    )
    if info["offload_report"] is not None:
        print(format_report(info["offload_report"]))
        note = unplanned_note(info["offload_report"])
        if note:
            print(note)


# ---------------------------------------------------------------------------------------- command line


def flag_value(argv: list[str], flag: str, default: str) -> str:
    """The value given to ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), else ``default``."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def error_line(exc: BaseException, budget: str, host_budget: str = "auto") -> str:
    """One line for a deliberate error, in the command line's words (``--budget``, not ``gpu_budget``)."""
    if isinstance(exc, HostBudgetError) and exc.required_bytes is not None:
        if host_budget.strip().lower() == "auto":  # its refusal names the RAM it came from, and more RAM as the fix
            return " ".join(str(exc).split())
        fix = budget_suggestion(exc.required_bytes)
        return (
            f"--host-budget {host_budget} cannot hold the largest component, which must be in RAM while it runs, "
            "next to the process's own memory and a reserve: "
            f"the smallest workable host budget is {spaced(fix)}; pass --host-budget {fix}"
        )
    if isinstance(exc, BudgetError):
        required = getattr(exc, "required_bytes", None)
        if required is not None:
            fix = budget_suggestion(required)
            return (
                f"--budget {budget} is too small for this pipeline: the smallest workable budget is "
                f"{spaced(fix)}; pass --budget {fix}"
            )
        return " ".join(str(exc).replace("gpu_budget", "--budget").split())
    if isinstance(exc, torch.OutOfMemoryError):
        return (
            f"the GPU ran out of memory under --budget {budget} ({str(exc).splitlines()[0][:160]}): pass a smaller "
            "--budget (the card also holds what other processes and the allocator's cache use), or fewer --frames "
            "or a smaller size"
        )
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return " ".join(str(exc).split())


def spaced(size: str) -> str:
    """``122.01KiB`` as prose: ``122.01 KiB`` (a byte count stays as it is, with ``bytes``)."""
    number = size.rstrip("KMGTiB")
    return f"{number} {size[len(number) :]}" if number != size else f"{size} bytes"


@contextlib.contextmanager
def user_errors(argv: list[str]) -> Iterator[None]:
    """Deliberate errors end the command with one line on stderr and exit status 2; a Ctrl-C with one line
    (what was interrupted, what was and was not written) and exit status 130; ``-v``: the traceback too."""
    verbose = "-v" in argv or "--verbose" in argv
    try:
        yield
    except (FlexTensorError, OSError, torch.OutOfMemoryError) as exc:  # OSError: a file the user named
        if verbose:
            traceback.print_exc()
        budgets = flag_value(argv, "--budget", "auto"), flag_value(argv, "--host-budget", "auto")
        print(f"error: {error_line(exc, *budgets)}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT) from None
    except KeyboardInterrupt as exc:
        if verbose:
            traceback.print_exc()
        print(str(exc) if isinstance(exc, Interrupted) else NOT_STARTED, file=sys.stderr)
        raise SystemExit(INTERRUPT_EXIT) from None


def main(recipe: Any, argv: list[str] | None) -> dict[str, Any] | None:
    """A recipe's program: parse and check, re-launch under torchrun for ``--gpus N``, run.

    Errors propagate (Python callers and tests see the exception); `cli` is the command line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    options = recipe.parse_args(argv)
    setup_logging(options.verbose)
    note = budget_note(options.budget)
    if note and parallel.current().leader:
        print(note)
    parallel.launch_if_needed(options, recipe.__spec__.name, argv)
    return recipe.run(options)


def cli(recipe: Any, argv: list[str] | None) -> dict[str, Any] | None:
    """`main` as a command: a deliberate error is one line on stderr and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with user_errors(argv):
        return main(recipe, argv)


class _QuietEmptyFp32Warning(logging.Filter):
    """diffusers warns on every ``.to(dtype)`` of a model whose fp32 list is empty ("kept in float32: []")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("diffusers.models.modeling_utils").addFilter(_QuietEmptyFp32Warning())
