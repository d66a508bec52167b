"""Typed, validated recipe options: built once from the command line, read by everything after.

A recipe's ``parse_args`` returns a frozen `RecipeOptions` (or a subclass with the recipe's own
fields). Everything that can be checked without the weights is checked here, so that a wrong
value stops in a second with one line naming the flag, not after minutes of loading: numbers and
sizes against the model's architecture, frame counts, the budget's syntax, input files and the
optional packages a recipe needs. Values the run derives later (the rank's shared-memory
namespace, a source clip's frames) are returned by the functions that derive them, never written
back into the options.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..engine.config import COMPRESSION_MODES, NO_COMPRESSION, format_bytes, parse_bytes
from ..engine.errors import BudgetError, FlexTensorError
from ..pipelines.compile import COMPILE_MODES
from ..storage.plan import MachineFacts, Rule, StorageOptionError, StorageRequest, resolve_storage
from .models import load_config

#: Units of ``--budget`` that are powers of ten (a spec sheet's GB), worth a note with the GiB value.
DECIMAL_UNITS = ("kb", "mb", "gb", "tb")


class OptionsError(FlexTensorError, ValueError):
    """A command-line value that cannot work; the message names the flag and the fix."""


@dataclass(frozen=True)
class SizeDefaults:
    """Defaults that depend on the weights: tiny random weights run in seconds on a CPU at these."""

    frames: int
    height: int
    width: int
    steps: int


@dataclass(frozen=True, kw_only=True)
class RecipeOptions:
    """What every recipe takes. Frozen: a run reads it, nothing writes into it."""

    recipe: str
    model: Path | None = None
    random_weights: str | None = None
    prompt: str
    negative_prompt: str
    frames: int
    height: int
    width: int
    steps: int
    guidance: float
    seed: int = 0
    budget: str = "auto"
    host_budget: str | None = "auto"  # None: every host copy in RAM (--host-budget none)
    cache_dir: Path | None = None
    compression: str = NO_COMPRESSION
    raw_copies: str | None = None  # None: the offload's choice ("none" under a host budget with compression)
    compression_cache: bool = False
    background_encoding: bool | None = None  # None: the offload's choice (on a GPU where it can be)
    verify_loads: bool | None = None  # None: the offload's choice (on under a host tier with compression on a GPU)
    profile_dir: Path | None = Path("profiles")
    profiling_generation: bool = False  # a short generation first, so that every step of the real one is planned
    device: str | None = None
    no_offload: bool = False
    vae_tiling: str = "auto"
    compile: str = "none"
    gpus: int = 1
    output: Path
    fps: int
    json: Path | None = None
    verbose: bool = False
    quiet: bool = False

    #: The pipeline's name in recipes/models.py and assets/ (its architecture configs).
    architecture: ClassVar[str] = ""

    @property
    def size(self) -> str:
        """Which defaults apply: ``tiny`` for tiny random weights, else ``full``."""
        return "tiny" if self.random_weights == "tiny" else "full"

    @property
    def vae_tiling_choice(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.vae_tiling]

    def as_json(self) -> dict[str, Any]:
        """The options as JSON values (paths as strings, records as objects), for summaries and reports."""
        return {f.name: json_value(getattr(self, f.name)) for f in fields(self)}


def json_value(value: Any) -> Any:
    """``value`` as JSON can hold it: a path as a string, a tuple as a list, a frozen record as an object."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [json_value(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_value(getattr(value, f.name)) for f in fields(value)}
    return value


@dataclass(frozen=True)
class LoraFile:
    """One ``--lora PATH[:SCALE]``: a local LoRA file (safetensors) and the weight of its adapter."""

    path: Path
    scale: float = 1.0


#: The one file type ``--lora`` reads: safetensors holds tensors only (a pickle could run code).
LORA_SUFFIX = ".safetensors"


def check_local_file(flag: str, path: Path, suffix: str, kind: str) -> None:
    """A local file a flag names (a LoRA, a GGUF transformer): its suffix, and that it is there: nothing is
    downloaded, so a missing file is the user's to fix, in one line."""
    if path.suffix.lower() != suffix:
        raise OptionsError(f"{flag} {path}: {kind} weights are read from {suffix} files: pass {flag} PATH{suffix}")
    if not path.is_file():
        raise OptionsError(
            f"{flag} {path}: no such file: pass {flag} PATH to a local {kind} file (nothing is downloaded)"
        )


def lora_file(text: str) -> LoraFile:
    """``--lora PATH[:SCALE]`` checked before anything loads: a number after the last ``:`` (a path ending in
    ``.safetensors`` has none), a ``.safetensors`` file that exists, whose header reads and names LoRA weights."""
    path_text, scale = text, 1.0
    if not text.endswith(LORA_SUFFIX) and ":" in text:
        path_text, _, scale_text = text.rpartition(":")
        try:
            scale = float(scale_text)
        except ValueError:
            scale = math.nan
        if not math.isfinite(scale):
            raise OptionsError(
                f"--lora {text}: the LoRA's scale after ':' must be a number: pass e.g. --lora {path_text}:0.8"
            )
    path = Path(path_text)
    check_local_file("--lora", path, LORA_SUFFIX, "LoRA")
    names = safetensors_names(path)
    if not any("lora" in name for name in names):
        raise OptionsError(
            f"--lora {path} holds no LoRA weights (none of its {len(names)} tensors has 'lora' in its name): "
            "pass a LoRA file, e.g. one saved with save_lora_weights"
        )
    return LoraFile(path=path, scale=scale)


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (no tensor is read); a file that does not parse is refused."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # the parser's own error type, or an OSError
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OptionsError(
            f"--lora {path} is not a readable safetensors file ({reason}): pass a LoRA saved as safetensors"
        ) from None


#: What a flag's value is, in its usage and help (argparse would write the flag's name in capitals).
METAVARS = {
    "model": "PATH",
    "input": "PATH",
    "output": "PATH",
    "json": "PATH",
    "profile_dir": "DIR",
    "prompt": "TEXT",
    "negative_prompt": "TEXT",
    "budget": "SIZE",
    "host_budget": "SIZE",
    "cache_dir": "DIR",
    "guidance": "SCALE",
    "canvas": "WxH",
    "source_size": "WxH",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout, names values by kind, appends each flag's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "default:" in text or default is None or default is False:
            return text
        if default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return METAVARS.get(action.dest, "N" if action.type is int else action.dest.upper())


def recipe_parser(
    prog: str,
    description: str | None,
    defaults: dict[str, SizeDefaults],
    sizes: bool = True,
    frames_help: str | None = None,
) -> argparse.ArgumentParser:
    """The arguments every recipe shares; size-dependent ones default to None (filled by `common_values`).

    ``prog``: the recipe's command (``flextensor-wan22-t2v``), named in usage lines however it was launched.
    ``sizes=False``: the recipe sets height and width itself (LTX-2's ``--canvas``). Flags are never
    abbreviated (``--frame`` is an error, not ``--frames``).
    """
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter, allow_abbrev=False
    )
    add_generation(parser, defaults, sizes, frames_help)
    add_memory(parser)
    add_run(parser)
    return parser


def add_generation(
    parser: argparse.ArgumentParser, defaults: dict[str, SizeDefaults], sizes: bool, frames_help: str | None
) -> None:
    """The weights and what to generate from them."""
    tiny, full = defaults["tiny"], defaults["full"]
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="local diffusers folder with the real weights (never downloaded)")
    source.add_argument(
        "--random-weights",
        choices=("tiny", "full"),
        help="built-in architecture with random weights: tiny (CPU, seconds) or full (published sizes)",
    )
    parser.add_argument("--prompt", help="what to generate")
    parser.add_argument("--negative-prompt", default="blurry, low quality, static", help="what to steer away from")
    parser.add_argument(
        "--frames",
        type=int,
        help=frames_help or f"frames of the video (default: {full.frames}; {tiny.frames} with tiny weights)",
    )
    if sizes:
        parser.add_argument(
            "--height",
            type=int,
            help=f"video height in pixels (default: {full.height}; {tiny.height} with tiny weights)",
        )
        parser.add_argument(
            "--width", type=int, help=f"video width in pixels (default: {full.width}; {tiny.width} with tiny weights)"
        )
    parser.add_argument(
        "--steps", type=int, help=f"denoising steps (default: {full.steps}; {tiny.steps} with tiny weights)"
    )
    parser.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance scale (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the CPU generator (same seed, same video)")


def add_memory(parser: argparse.ArgumentParser) -> None:
    """Where the weights live: the GPU budget, host memory, compression, profiles."""
    parser.add_argument(
        "--budget", default="auto", help="GPU memory budget, e.g. 24GiB or 500MB; auto: the device's free memory"
    )
    parser.add_argument(
        "--host-budget",
        default="auto",
        help="the process's host memory (anonymous and page-locked), e.g. 32GiB; its own memory and a 1 GiB reserve "
        "come off the top, the weights' host copies get the rest; components that do not fit wait on disk, in the "
        "weight files they were loaded from or in cache files. auto (the default): all in RAM when they fit in "
        "80%% of the RAM available (the least of the host's, the room under the process's cgroup memory limit, as "
        "a container or Slurm job sets, and its rlimits), else a host budget of what the process holds plus that; "
        "none: all in RAM",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="where cache files go (default: your own cache folder, ~/.cache/flextensor-diffusers or under "
        "$XDG_CACHE_HOME, made 0700); a folder that is a symlink, another user's or writable by other users is refused",
    )
    parser.add_argument(
        "--compression",
        choices=COMPRESSION_MODES,
        default=NO_COMPRESSION,
        help="lossless: stream blocks compressed and decode them on the GPU, bit-exact",
    )
    parser.add_argument(
        "--raw-copies",
        choices=("ram", "disk", "none"),
        default=None,
        help="with --compression lossless, where the raw host copies wait, host RAM holding the compressed copies "
        "only: none (the default with --host-budget; else ram): in the weight files they were loaded from where "
        "those hold them, else nowhere (the compressed copy is the host copy; nothing raw is written); disk: in the "
        "weight files, else in a cache file (--cache-dir)",
    )
    parser.add_argument(
        "--compression-cache",
        action="store_true",
        help="with --compression lossless: keep the compressed copies in a file (--cache-dir) and read them back "
        "next time instead of encoding (each is checked against the weights)",
    )
    parser.add_argument(
        "--background-encoding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --compression lossless and no compressed copies to read (--compression-cache): start at once "
        "and compress the blocks on the GPU between the forwards of the first generations, which stream them raw "
        "meanwhile (from RAM, or with --host-budget or --raw-copies from the weight files or a cache file; with "
        "--raw-copies none, the default with --host-budget, only blocks the weight files all hold, else first), "
        "instead of compressing every block first. Default: on a GPU whose budget holds the encoder's room for one "
        "block; else off",
    )
    parser.add_argument(
        "--verify-loads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check on the GPU, around every block call, that the bytes it computes with are its weights; a wrong "
        "load fails the run instead of writing a wrong video (costs two reads of each block per call). Default: on "
        "under a host budget with --compression lossless on a GPU, else off",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=Path("profiles"),
        help="where profiles are kept; a matching one plans each component from its first forward",
    )
    parser.add_argument(
        "--profiling-generation",
        action="store_true",
        help="without a matching profile, run a short generation first (latents only) that profiles the denoisers, "
        "so that every step of the real one is planned (for timing steps); by default the real generation's first "
        "forwards profile each component and its plan takes over in the same generation",
    )


def add_run(parser: argparse.ArgumentParser) -> None:
    """How the run goes: device, offload or not, compilation, GPUs, what it writes and says."""
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--no-offload", action="store_true", help="run natively (everything on the device)")
    parser.add_argument(
        "--vae-tiling",
        choices=("auto", "on", "off"),
        default="auto",
        help="diffusers' VAE tiling; auto: on for budgets under 40 GiB",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="none",
        help="torch.compile the denoisers: regional (each repeated block once; works with offload) or full "
        "(each denoiser whole; with --no-offload only)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="split each generation across N GPUs of this host (context parallelism, launched with torchrun)",
    )
    parser.add_argument(
        "--json", help="also write the run's summary here, a .json file (missing folders are created, and said)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details; show tracebacks on errors")


def command_name(recipe: str) -> str:
    """The console script that runs ``recipe`` (``wan22_t2v`` -> ``flextensor-wan22-t2v``): the one way the
    documentation launches it (pyproject.toml installs it)."""
    return "flextensor-" + recipe.replace("_", "-")


def add_output(parser: argparse.ArgumentParser, default: str) -> None:
    """``--output``: where the mp4 goes, and what happens to what is there."""
    parser.add_argument(
        "--output",
        default=default,
        help="the mp4 to write; missing folders are created, and a file already there is replaced once the new "
        "one is complete (the summary says which)",
    )


def common_values(ns: argparse.Namespace, recipe: str, defaults: dict[str, SizeDefaults]) -> dict[str, Any]:
    """The shared fields of `RecipeOptions` from parsed arguments, size defaults filled in, checked."""
    chosen = defaults["tiny" if ns.random_weights == "tiny" else "full"]
    values = {f.name: getattr(ns, f.name) for f in fields(RecipeOptions) if hasattr(ns, f.name)}
    values["recipe"] = recipe
    for name in ("frames", "height", "width", "steps"):
        if values.get(name) is None:
            values[name] = getattr(chosen, name)
    require_weights(ns.model, ns.random_weights, recipe)
    for flag, value in (("--frames", values["frames"]), ("--steps", values["steps"]), ("--gpus", ns.gpus)):
        positive(flag, value)
    positive("--fps", ns.fps)
    if ns.guidance < 0:
        raise OptionsError(f"--guidance {ns.guidance} must be 0 or more (1 turns guidance off)")
    check_budget(ns.budget)
    if ns.host_budget.strip().lower() == "none":
        values["host_budget"] = None
    else:
        check_budget(ns.host_budget, "--host-budget")
    check_device(ns.device, ns.gpus)
    check_compile(ns.compile, ns.no_offload)
    check_storage(ns, values["host_budget"])
    for flag in OUTPUT_SUFFIXES:  # kept as typed until checked: a trailing "/" says the user named a folder
        if getattr(ns, flag[2:], None) is not None:
            values[flag[2:]] = check_output(flag, getattr(ns, flag[2:]))
    for flag in FOLDER_FLAGS:
        value = getattr(ns, flag[2:].replace("-", "_"), None)
        if value is not None:
            writable(flag, value)
    return values


#: Output flags and the suffix each file must have; folder flags name folders.
OUTPUT_SUFFIXES = {"--output": ".mp4", "--json": ".json"}
FOLDER_FLAGS = ("--profile-dir", "--cache-dir", "--out")


def check_output(flag: str, text: str | Path) -> Path:
    """An output file's name as typed, checked before anything loads: not a folder (an existing one, or a name
    ending in ``/``), the suffix of what is written there, and a folder that can be made and written (missing
    folders are created when the file is written). The path."""
    suffix = OUTPUT_SUFFIXES[flag]
    path = Path(text)
    if str(text).endswith(("/", os.sep)) or path.is_dir():
        raise OptionsError(f"{flag} {text} is a folder: pass {flag} {path / ('NAME' + suffix)}")
    if path.suffix.lower() != suffix:
        raise OptionsError(f"{flag} {path}: the file written there is {suffix}: pass {flag} {path.with_suffix(suffix)}")
    writable(flag, path)
    return path


def writable(flag: str, path: Path) -> None:
    """The first existing folder on the way to ``path`` (a file's folder; for folder flags, the folder itself)
    must be writable: checked now, not after the run."""
    folder = path.absolute() if flag in FOLDER_FLAGS else path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK) or not can_create_in(folder):
        raise OptionsError(f"{flag} {path}: {folder} is not a writable folder: pass {flag} somewhere you can write")


def can_create_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder``: ``os.access`` says yes to root everywhere (``/proc`` too), so
    a nameless temporary file is made and dropped at once."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_compile(mode: str, no_offload: bool) -> None:
    """Whole-denoiser compilation cannot be streamed (its graph would break at every block): native runs only."""
    if mode == "full" and not no_offload:
        raise OptionsError(
            "--compile full compiles each denoiser whole, which offloading cannot stream: pass --compile regional "
            "(each repeated block compiled once, streamed between blocks), or --no-offload"
        )


def check_device(device: str | None, gpus: int) -> None:
    """``--device cuda[:N]`` needs a visible CUDA device (``--gpus N`` is checked when it launches)."""
    import torch

    if device is None or not device.startswith("cuda") or gpus > 1:
        return
    if not torch.cuda.is_available():
        raise OptionsError(
            f"--device {device}: no CUDA device is visible (a CPU build of torch, or CUDA_VISIBLE_DEVICES): "
            "pass --device cpu, or leave --device out to use the CPU"
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise OptionsError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA devices")


def positive(flag: str, value: int) -> None:
    if value < 1:
        raise OptionsError(f"{flag} {value} must be a positive whole number")


def require_weights(model: Path | None, random_weights: str | None, recipe: str) -> None:
    """Stop with instructions when neither real weights nor random weights were asked for."""
    if model is None and random_weights is None:
        raise OptionsError(
            f"{recipe}: no weights: pass --model PATH (a local diffusers folder; nothing is ever downloaded) "
            "or --random-weights tiny|full (the built-in architecture with random weights; tiny runs on a CPU "
            "in seconds)"
        )
    if model is not None and not (model / "model_index.json").exists():
        raise OptionsError(
            f"--model {model} is not a diffusers model folder (no model_index.json): download the weights there "
            "first, or run with --random-weights tiny|full"
        )


def check_storage(ns: argparse.Namespace, host_budget: str | None) -> None:
    """The storage flags' combinations, refused before anything loads by the offload's own rules (the storage plan,
    `storage.plan.resolve_storage`), in the flags' words (`storage_refusal`). Whether ``--host-budget auto`` turns
    a host tier on is known only once the weights are loaded (no RAM facts here): the offload refuses then what
    that tier cannot combine."""
    asked = StorageRequest(
        compression=ns.compression,
        raw_copies=ns.raw_copies,
        compression_cache=getattr(ns, "compression_cache", False) or None,  # the flag, or the plan's choice
        background_encoding=getattr(ns, "background_encoding", None),
        verify_loads=getattr(ns, "verify_loads", None),
        shared_host=ns.gpus > 1 and not ns.no_offload,  # --gpus N: the ranks share one host copy
        host_budget=host_budget,
    )
    try:
        resolve_storage(asked, MachineFacts(device_kind="cpu" if ns.device == "cpu" else "cuda"))
    except StorageOptionError as exc:
        raise OptionsError(storage_refusal(exc, ns)) from None


def storage_refusal(exc: StorageOptionError, ns: argparse.Namespace) -> str:
    """A storage plan's refusal in the flags' words (the plan's own line where no flag says it otherwise)."""
    gpus = f"--gpus {ns.gpus}"
    words = {
        Rule.RAW_DISK_WITHOUT_COMPRESSION: f"--raw-copies {ns.raw_copies} keeps only compressed copies in RAM, and "
        "there are none: add --compression lossless",
        Rule.CACHE_WITHOUT_COMPRESSION: "--compression-cache caches compressed copies, and there are none: add "
        "--compression lossless",
        Rule.BACKGROUND_WITHOUT_RAW_STREAM: "--background-encoding compresses while the raw copies stream: add "
        "--compression lossless",
        Rule.COMPRESSION_WITH_SHARED_HOST: f"--compression {ns.compression} cannot be combined with {gpus} yet (the "
        "ranks share one raw host copy of the weights): drop --compression, or run on one GPU",
        Rule.HOST_BUDGET_WITH_SHARED_HOST: f"--host-budget cannot be combined with {gpus} yet (the ranks share one "
        "host copy of the weights, all in RAM): drop --host-budget, or run on one GPU",
        Rule.TIER_KEEPS_COMPRESSED_ONLY: "--host-budget with --compression keeps the compressed copies only (the raw "
        "ones wait on disk): drop --raw-copies ram",
    }
    return words.get(exc.rule, str(exc))


def check_budget(text: str, flag: str = "--budget") -> None:
    """``--budget``, ``--host-budget``: "auto" or a positive byte count with a unit; named in the flag's own words."""
    if text.strip().lower() == "auto":
        return
    number = re.match(r"\s*(-?[0-9]*\.?[0-9]+)", text)
    if number and float(number.group(1)) <= 0:
        raise OptionsError(f"{flag} {text} must be positive: pass e.g. {flag} 24GiB")
    try:
        parse_bytes(text)
    except BudgetError:
        raise OptionsError(
            f"{flag} {text}: cannot parse it: pass bytes or a number with a unit, e.g. 24GiB, 500MB, or auto"
        ) from None


def budget_note(text: str) -> str | None:
    """A line that states what a decimal-unit budget means in GiB (``24gb`` is 22.35 GiB, not 24)."""
    unit = text.strip().lower().lstrip("0123456789. ")
    if unit not in DECIMAL_UNITS:
        return None
    return (
        f"budget: {text} = {format_bytes(parse_bytes(text))} ({unit.upper()} are powers of ten; "
        f"write {unit[0].upper()}iB for powers of two)"
    )


def budget_suggestion(required_bytes: int) -> str:
    """The smallest workable budget as a flag value that works as typed: in the unit `format_bytes` picks for
    it, rounded up to the hundredth (``122.01KiB``, not a "0.01GiB" that hides the answer)."""
    value, unit = float(required_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return str(required_bytes)
    hundredths = math.ceil(value * 100)
    while parse_bytes(f"{hundredths / 100:.2f}{unit}") < required_bytes:  # float rounding, at most once
        hundredths += 1
    return f"{hundredths / 100:.2f}{unit}"


def transformer_config(options: RecipeOptions) -> dict[str, Any] | None:
    """The denoiser's architecture, read before any weight: from assets/ or the model folder's config."""
    if options.model is not None:
        path = options.model / "transformer" / "config.json"
        return json.loads(path.read_text()) if path.exists() else None
    return load_config(options.architecture, options.random_weights)["transformer"]


def frames_of_form(flag: str, frames: int, factor: int, model: str) -> None:
    """``frames`` must be ``factor * k + 1`` (the VAE's temporal compression); suggest the neighbours."""
    if (frames - 1) % factor:
        below = (frames - 1) // factor * factor + 1
        raise OptionsError(
            f"{flag} {frames}: {model} makes {factor}k+1 frames: pass {flag} {below} or {below + factor}"
        )


def multiple_of(flag: str, value: int, factor: int, model: str) -> None:
    if value < factor or value % factor:
        below = max(factor, value // factor * factor)
        raise OptionsError(f"{flag} {value}: {model} needs a multiple of {factor}: pass {flag} {below}")


def require_package(module: str, purpose: str, install: str) -> None:
    """Stop before loading when an optional package the run needs is missing."""
    if importlib.util.find_spec(module) is None:
        raise OptionsError(f"{purpose} needs the {module} package: {install}")


def existing_file(flag: str, path: Path) -> Path:
    if not path.is_file():
        raise OptionsError(f"{flag} {path}: no such file: pass {flag} PATH to an mp4")
    return path
