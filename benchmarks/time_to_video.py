"""Issue 48: the whole Wan2.2-T2V-A14B run as a user meets it, from nothing to an mp4, phase by phase.

One process builds the full pipeline once (two experts with distinct seeds, UMT5, Wan VAE; published sizes,
random weights: the recipe's ``--random-weights full``, `recipes.models.build_wan22_t2v`), then runs each
configuration of ``--configs`` on it in turn, each as the recipe runs it (`recipes.wan22_t2v` options, its
`common.place_natively` / `common.enable_offload`, ``output_type="np"``, `media.video.to_uint8_frames` and
`write_mp4`), and takes it back before the next (``disable_flextensor_offload``, hooks removed, weights on the CPU):

* ``native``: every component on the device (`common.place_natively`); where the weights cannot fit the device
  (more than 90 % of its free memory) or the generation runs out of its memory, diffusers'
  ``enable_model_cpu_offload`` instead, and the row's ``native_mode`` says so;
* ``ram``: ``host_budget=None`` (every host copy in RAM); its first run has no saved profile (the package profiles
  inside the user's generation), its later runs plan from the profile the first saved (``--profile-dir``);
* ``host32_compressed``, ``host24_compressed``: ``host_budget`` 32 GiB / 24 GiB with ``compression="lossless"``;
  the first run encodes (no payload file yet), the later ones read the payload file and the saved profile;
* ``flextensor``: NVIDIA's flextensor 0.5.0, when importable, on both experts' blocks (``include_patterns
  ["blocks.*"]``, as `peers.set_up` drives it, each expert under ``--budget``), the text encoder and the VAE moved
  in and out whole by accelerate's model hooks; not importable: a row that says so, with no figures.

``--later-runs`` (default 1) later runs follow each first run of ``ram`` and the host configurations (none after
``NAME:first`` in ``--configs``). ``NAME:later``: later runs only, in a new process, from the profile and payload
file an earlier process left in ``--workdir`` (``NAME:first`` with the same ``--workdir`` and ``--keep-workdir``):
a user's second command. At 40 steps one configuration takes most of a 10-minute GPU call, so the rows of one
benchmark come from several processes: ``--reference`` takes the frames' digest (``frames_sha256``, the SHA-256 of
the decoded float frames) from an earlier run's JSON (its native row), and every row here is compared with it
(native's own frames too: native is deterministic across processes, or this says it is not).

Per row, seconds: ``load_s`` (the build, once per process and the same in every row: built in the process, not read
from disk: ``load`` says so), ``enable_s`` (placing or enabling), ``profiling_s`` (a separate profiling generation:
0, the recipe runs none; ``profiled_in`` and ``unplanned_forwards`` say where the plans came from),
``text_encoding_s`` (``encode_prompt``), ``steps_s`` (from the prompt's embeddings to the last step's end, each
step's end device-synchronised in ``callback_on_step_end``; ``step_s`` per step), ``decode_s`` (from the last step to
the pipeline's return: VAE decode and the frames to NumPy), ``mp4_s`` (uint8 frames and the mp4), ``total_s``
(``load_s`` plus this configuration's wall time from the start of its placing to the mp4 written: every part
measured, none extrapolated) and ``first_step_at_s`` (``load_s`` plus the time from the configuration's start to its
first step's end: from the command's start, as if the command had built the pipeline and run this configuration
alone). Memory: ``peak_host_anon_bytes`` and ``peak_host_file_bytes`` (RssAnon, RssFile of /proc/self/status,
sampled every ``--sample-ms`` on a thread over the configuration; ``peak_host_anon_after_enable_bytes`` from
enable's return on: weights built in memory are all anonymous RAM when enable begins, so only that figure can be
within a host budget; ``peak_host_anon_within_budget`` and ``peak_host_anon_after_enable_within_budget`` say which
is), ``peak_allocated_bytes`` (`bench_common.PeakWatch`: the engine's resets folded in) against ``budget_bytes``;
``cache_dir_bytes``: the run's cache folder after the generation, bytes by file suffix (payload files only: no raw
cache file for weights built in memory). ``bitwise_equal``: the decoded frames against native's (``torch.equal``;
against the first row's where native did not run: ``bitwise_against``; against ``--reference``'s digest where
given).

``--time-limit``: a configuration starts only with the longest one so far (x 1.25) left; the JSON is written after
every row, so a run cut off keeps its rows. ``--small``: tiny random weights on the CPU (9 frames of 32 x 32 unless
given, a 400 KB budget, host budgets as `tiers_bench.host_budget_of` maps them for the tiny pipeline and planned for
the host copies alone): the smoke test.

    bash benchmarks/gpu_proof.sh time_to_video                                   # on one H100/H200
    python3 benchmarks/time_to_video.py --configs native,ram --steps 40 --out $OUT/time_to_video_h100.json
    python benchmarks/time_to_video.py --small --configs native,ram --steps 2 --out /tmp/ttv.json   # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_common as bc
import numpy as np
import torch

import flextensor_diffusers as ft  # noqa: F401  (adds enable_flextensor_offload to diffusers' pipelines)
from flextensor_diffusers.engine import parse_bytes
from flextensor_diffusers.media.video import to_uint8_frames, write_mp4
from flextensor_diffusers.pipelines.offload import pipeline_offload
from flextensor_diffusers.recipes import common, wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline

CONFIGS = ("native", "ram", "host32_compressed", "host24_compressed", "flextensor")
#: Configurations with later runs (a saved profile, a payload file).
REPEATED = ("ram", "host32_compressed", "host24_compressed")
HOST_BUDGETS = {"host32_compressed": "32GiB", "host24_compressed": "24GiB"}
#: The tiny pipeline's host budgets: the VAE plus this many experts plus 64 KiB (`tiers_bench.host_budget_of`).
SMALL_HOST_EXPERTS = {"host32_compressed": 1.25, "host24_compressed": 1.0}
RECIPE_STEPS = 40
#: A native placement is tried when the weights take at most this share of the device's free memory.
NATIVE_SHARE = 0.9
#: A configuration starts only with this many times the longest one so far left of ``--time-limit``.
ESTIMATE_MARGIN = 1.25
LOAD_NOTE = (
    "built in process with random weights ({size}: recipes.models.build_wan22_t2v, the recipe's --random-weights "
    "{size}), once for every row of this run; not read from disk"
)


@dataclass(frozen=True)
class Run:
    """One row to make: a configuration, and whether it is its first run in this process."""

    config: str
    first_run: bool

    @property
    def label(self) -> str:
        return f"{self.config}:{'first' if self.first_run else 'later'}"


def planned_runs(configs: list[str], later_runs: int) -> list[Run]:
    """Native first (its frames are the reference), then each configuration's first run and its later ones (none
    for ``NAME:first``; no first run for ``NAME:later``); flextensor last, since its offload may leave state of its
    own in the experts."""
    runs = [Run("native", True)] if "native" in configs else []
    for item in sorted(configs, key=lambda c: c == "flextensor"):
        name, _, only = item.partition(":")
        if name == "native":
            continue
        if only != "later":
            runs.append(Run(name, True))
        runs += [Run(name, False) for _ in range(later_runs if name in REPEATED and only != "first" else 0)]
    return runs


def frames_digest(video: np.ndarray) -> str:
    """SHA-256 of the decoded frames' bytes, their dtype and shape: equal digests, bitwise equal frames."""
    frames = np.ascontiguousarray(video)
    digest = hashlib.sha256(f"{frames.dtype}:{frames.shape}:".encode())
    digest.update(frames.tobytes())
    return digest.hexdigest()


def reference_digest(path: Path) -> tuple[str, str]:
    """The frames' digest of ``path``'s native row (else its first row with one), and how rows name it."""
    result = json.loads(path.read_text())
    rows = [r for r in result.get("runs", []) if r.get("frames_sha256")]
    native = [r for r in rows if r["config"] == "native"]
    if not rows:
        raise SystemExit(f"--reference {path}: no row with frames_sha256 (a result of this script since it has one)")
    row = (native or rows)[0]
    label = f"{row['config']}:{'first' if row['first_run'] else 'later'} of {path.name} ({row.get('code_commit')})"
    return label, row["frames_sha256"]


# ---------------------------------------------------------------------------------------- measuring


class HostPeaks:
    """Peaks of RssAnon and RssFile, each on its own, over a configuration (`bench_common.HostMemorySampler` each)."""

    def __init__(self, interval_s: float) -> None:
        self._anon = bc.HostMemorySampler(lambda: bc.proc_status_bytes("RssAnon"), interval_s)
        self._file = bc.HostMemorySampler(lambda: bc.proc_status_bytes("RssFile"), interval_s)

    @property
    def anon(self) -> int:
        return self._anon.peak()

    @property
    def file(self) -> int:
        return self._file.peak()

    @property
    def anon_after_enable(self) -> int:
        """RssAnon's peak from `enable_returned` on."""
        return self._anon.peaks.get("after enable", 0)

    def enable_returned(self) -> None:
        self._anon.set_phase("after enable")
        self._file.set_phase("after enable")

    def __enter__(self) -> HostPeaks:
        self._anon.start()
        self._file.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._anon.stop()
        self._file.stop()


@dataclass
class GenerationClock:
    """Wall-clock marks of one generation (perf_counter seconds), the device synchronised at each."""

    device: torch.device
    encode_s: float = 0.0
    encode_end: float | None = None
    step_ends: list[float] = field(default_factory=list)

    def mark(self) -> float:
        bc.sync(self.device)
        return time.perf_counter()

    def on_step(self, _pipe: Any, _i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``callback_on_step_end``: the step's end."""
        self.step_ends.append(self.mark())
        return kwargs

    @contextlib.contextmanager
    def timing_encode_prompt(self, pipe: Any) -> Iterator[None]:
        """``pipe.encode_prompt`` timed (an instance attribute over the method, removed after): the text encoding."""
        original = pipe.encode_prompt

        def encode_prompt(*args: Any, **kwargs: Any) -> Any:
            start = self.mark()
            try:
                return original(*args, **kwargs)
            finally:
                self.encode_end = self.mark()
                self.encode_s += self.encode_end - start

        pipe.encode_prompt = encode_prompt
        try:
            yield
        finally:
            del pipe.encode_prompt


# ---------------------------------------------------------------------------------------- placing


@dataclass
class Placement:
    """What a configuration set up on the pipeline: how to take it back, and what the row says of it."""

    undo: Callable[[], None]
    budget_bytes: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)


def weights_bytes(pipe: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for name in ("transformer", "transformer_2", "text_encoder", "vae")
        if getattr(pipe, name, None) is not None
        for t in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()]
    )


def cache_dir_bytes(folder: Path | None) -> dict[str, int]:
    """Bytes on disk in ``folder`` by file suffix, right after the generation: a host budget with compression writes
    payload files (``.payloads``) and, for weights built in memory, no raw cache file (``.raw``) any more (issue 48:
    the raw files of the pipeline built in memory filled the GPU machine's 64 GB disk)."""
    sizes: dict[str, int] = {}
    for path in folder.iterdir() if folder is not None and folder.exists() else ():
        if path.is_file():
            sizes[path.suffix] = sizes.get(path.suffix, 0) + path.stat().st_blocks * 512
    return sizes


def native_mode(pipe: Any, device: torch.device, asked: str) -> str:
    """``device`` (every component on it) where the weights fit, else ``model_cpu_offload``."""
    if asked != "auto" or device.type != "cuda":
        return "device" if asked == "auto" else asked
    free, _total = torch.cuda.mem_get_info(device)
    return "device" if weights_bytes(pipe) <= NATIVE_SHARE * free else "model_cpu_offload"


def place_native(pipe: Any, options: Any, device: torch.device, mode: str) -> Placement:
    """The recipe's native placement (`common.place_natively`, VAE tiled as an offloaded run under the budget would
    be), or diffusers' model CPU offload with the same tiling choice."""
    tiled_before = bool(getattr(pipe.vae, "use_tiling", False))
    if mode == "device":
        common.place_natively(pipe, options, device)
    else:
        tiled = common.resolve_vae_tiling(options.vae_tiling_choice, common.resolve_budget(options.budget, device))
        pipe.enable_model_cpu_offload(device=device)
        if tiled:
            pipe.vae.enable_tiling()

    def undo() -> None:
        if mode != "device":
            pipe.remove_all_hooks()
        pipe.to("cpu")
        if not tiled_before and getattr(pipe.vae, "use_tiling", False):
            pipe.vae.disable_tiling()

    note = (
        "every component on the device"
        if mode == "device"
        else ("the weights do not fit the device: diffusers' enable_model_cpu_offload (each component moved in whole)")
    )
    return Placement(undo, None, {"native_mode": mode, "native_note": note})


def place_offloaded(pipe: Any, options: Any, device: torch.device) -> Placement:
    """The recipe's `common.enable_offload` with this configuration's options."""
    common.enable_offload(pipe, options, device)
    return Placement(pipe.disable_flextensor_offload, pipeline_offload(pipe).budget_bytes)


class _Routed:
    """An expert whose calls go through flextensor's offload handle, every other attribute the expert's own."""

    def __init__(self, module: torch.nn.Module, handle: Any) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_handle", handle)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._handle(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def place_flextensor(pipe: Any, options: Any, device: torch.device) -> Placement:
    """NVIDIA flextensor 0.5.0 on each expert's blocks under ``--budget`` (as `peers.set_up` drives it); the text
    encoder and the VAE moved in and out whole by accelerate's model hooks (diffusers' model CPU offload's way)."""
    os.environ.setdefault("DISABLE_BEARTYPE", "1")
    import flextensor
    from accelerate import cpu_offload_with_hook

    budget = parse_bytes(options.budget)
    total = torch.cuda.get_device_properties(device).total_memory
    experts = {name: getattr(pipe, name) for name in ("transformer", "transformer_2")}
    handles = {}
    for name, module in experts.items():
        config = flextensor.OffloadConfig(
            include_patterns=["blocks.*"], max_gpu_mem_fraction=min(1.0, budget / total), profiling_iters=1
        )
        handles[name] = flextensor.offload(module, config=config)
        object.__setattr__(pipe, name, _Routed(module, handles[name]))  # past DiffusionPipeline's config bookkeeping
    _, hook = cpu_offload_with_hook(pipe.text_encoder, execution_device=device)
    _, vae_hook = cpu_offload_with_hook(pipe.vae, execution_device=device, prev_module_hook=hook)

    def undo() -> None:
        for name, module in experts.items():
            with contextlib.suppress(Exception):
                handles[name].remove()
            object.__setattr__(pipe, name, module)
        vae_hook.remove()
        hook.remove()
        pipe.to("cpu")

    notes = {
        "flextensor_version": _version("flextensor"),
        "flextensor_note": "flextensor.offload on each expert (include_patterns blocks.*, max_gpu_mem_fraction "
        "budget/total each, profiling_iters 1); text encoder and VAE by accelerate's cpu_offload_with_hook",
    }
    return Placement(undo, budget, notes)


def _version(package: str) -> str | None:
    from importlib import metadata

    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(package)
    return None


# ---------------------------------------------------------------------------------------- one row


class TimeToVideo:
    """The pipeline built once, and each configuration run on it as the recipe would, one row each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="time_to_video-"))
        self.base = wan22_t2v.parse_args(recipe_argv(args, self.workdir / "unused.mp4"))
        self.device = common.device_of(self.base)
        self.result: dict[str, Any] = {
            "benchmark": "time to video (issue 48): Wan2.2-T2V-A14B from nothing to an mp4, per configuration",
            "device": bc.device_name(self.device),
            "torch": torch.__version__,
            "diffusers": _version("diffusers"),
            **bc.provenance(),
            "runs": [],
            "skipped": [],
        }
        self.reference: tuple[str, np.ndarray] | None = None
        #: ``--reference``: the frames' digest every row is compared with, and its label.
        self.reference_sha256 = reference_digest(args.reference) if args.reference else None
        self.longest_s = 0.0

    # -- the pipeline

    def build(self) -> None:
        init = common.init_device(self.base, self.device)
        start = time.perf_counter()
        self.pipe = build_pipeline("wan22_t2v", self.base.random_weights, seed=self.base.seed, init_device=init)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.load_s = time.perf_counter() - start
        experts = zip(self.pipe.transformer.parameters(), self.pipe.transformer_2.parameters(), strict=False)
        self.distinct_experts = not all(torch.equal(a, b) for a, b in list(experts)[:4])
        print(f"built {self.base.random_weights} pipeline in {self.load_s:.1f} s", flush=True)

    def options_for(self, run: Run) -> Any:
        """The recipe's options for this run: its host budget and compression, its own profile and cache folders
        (a first run gets them empty; a later run finds what the first wrote)."""
        name = run.config
        profiles, cache = self.workdir / "profiles" / name, self.workdir / "cache" / name
        if run.first_run:
            shutil.rmtree(profiles, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
        elif not any(profiles.glob("*")):  # NAME:later in a process of its own
            raise FileNotFoundError(
                f"{run.label}: no saved profile in {profiles}: run {name}:first with the same --workdir and "
                "--keep-workdir first"
            )
        cache.mkdir(parents=True, exist_ok=True)
        host_budget: str | int | None = None
        if name in HOST_BUDGETS:
            host_budget = small_host_budget(self.pipe, name) if self.args.small else HOST_BUDGETS[name]
        return dataclasses.replace(
            self.base,
            host_budget=host_budget,
            compression="lossless" if name in HOST_BUDGETS else "none",
            profile_dir=profiles,
            cache_dir=cache,
            output=self.workdir / "videos" / f"{name}_{'first' if run.first_run else 'later'}.mp4",
        )

    def place(self, run: Run, options: Any, mode: str) -> Placement:
        if run.config == "native":
            return place_native(self.pipe, options, self.device, mode)
        if run.config == "flextensor":
            return place_flextensor(self.pipe, options, self.device)
        return place_offloaded(self.pipe, options, self.device)

    # -- a run

    def measure(self, run: Run, mode: str = "auto") -> dict[str, Any]:
        """One configuration from its placing to its mp4, then taken back; its row (the frames kept aside)."""
        options = self.options_for(run)
        mode = native_mode(self.pipe, self.device, mode if run.config == "native" else "device")
        clock = GenerationClock(self.device)
        watch = bc.PeakWatch(self.device)
        with HostPeaks(self.args.sample_ms / 1e3) as host:
            start = clock.mark()
            with small_host_plan(self.args.small and run.config in HOST_BUDGETS):
                try:
                    placement = self.place(run, options, mode)
                except BaseException:
                    if run.config == "native":  # a move to the device cut short: every weight back on the CPU
                        self.pipe.to("cpu")
                    raise
                enabled = clock.mark()
                host.enable_returned()
                try:
                    before = common.unplanned_forwards(self.pipe)
                    with clock.timing_encode_prompt(self.pipe):
                        frames = wan22_t2v.generate(
                            self.pipe, options, self.device, options.steps, "np", callback_on_step_end=clock.on_step
                        )
                    returned = clock.mark()
                    unplanned = {k: n - before.get(k, 0) for k, n in common.unplanned_forwards(self.pipe).items()}
                    video = frames[0]
                    options.output.parent.mkdir(parents=True, exist_ok=True)
                    codec = write_mp4(options.output, to_uint8_frames(video), fps=options.fps)
                    written = time.perf_counter()
                    peak = watch.peak
                    cached = cache_dir_bytes(options.cache_dir)
                finally:
                    undo_start = time.perf_counter()
                    placement.undo()
                    gc.collect()
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                    teardown_s = time.perf_counter() - undo_start
        row = self.row(run, options, clock, start, enabled, returned, written)
        row |= {
            "peak_host_anon_bytes": host.anon,
            "peak_host_anon_after_enable_bytes": host.anon_after_enable,
            "peak_host_file_bytes": host.file,
            **bc.check_budget(run.label, placement.budget_bytes, peak, bc.WHOLE_RUN),
            "unplanned_forwards": unplanned,
            "profiled_in": profiled_in(run, unplanned),
            "codec": codec,
            "teardown_s": round(teardown_s, 3),
            "cache_dir_bytes": cached,
            **placement.notes,
        }
        if isinstance(options.host_budget, str) and not self.args.small:  # the tiny plan counts host copies alone
            row["host_budget_bytes"] = parse_bytes(options.host_budget)
            row["peak_host_anon_within_budget"] = host.anon <= row["host_budget_bytes"]
            row["peak_host_anon_after_enable_within_budget"] = host.anon_after_enable <= row["host_budget_bytes"]
        row |= self.compare(run, np.asarray(video))
        return row | bc.provenance()

    def row(
        self,
        run: Run,
        options: Any,
        clock: GenerationClock,
        start: float,
        enabled: float,
        returned: float,
        written: float,
    ) -> dict[str, Any]:
        """The schema's timing fields (seconds; see the module docstring)."""
        ends = clock.step_ends
        encoded = clock.encode_end or enabled
        row: dict[str, Any] = {
            "config": run.config,
            "first_run": run.first_run,
            "distinct_experts": self.distinct_experts,
            "text_encoder": self.pipe.text_encoder is not None,
            "frames": options.frames,
            "height": options.height,
            "width": options.width,
            "steps": options.steps,
            "load": LOAD_NOTE.format(size=options.random_weights),
            "load_s": round(self.load_s, 3),
            "enable_s": round(enabled - start, 3),
            "profiling_s": 0.0,
            "text_encoding_s": round(clock.encode_s, 3),
            "first_step_at_s": round(self.load_s + ends[0] - start, 3),
            "steps_s": round(ends[-1] - encoded, 3),
            "step_s": [round(b - a, 4) for a, b in zip([encoded, *ends[:-1]], ends, strict=True)],
            "decode_s": round(returned - ends[-1], 3),
            "mp4_s": round(written - returned, 3),
            "config_wall_s": round(written - start, 3),
            "total_s": round(self.load_s + written - start, 3),
            "total_scope": "load_s + this configuration's wall time from its placing to its mp4 written",
            "host_budget": options.host_budget,
            "compression": options.compression,
        }
        if options.steps < RECIPE_STEPS:
            row["steps_note"] = f"{options.steps} steps, fewer than the recipe's {RECIPE_STEPS} (--steps)"
        return row

    def compare(self, run: Run, video: np.ndarray) -> dict[str, Any]:
        """Bitwise against native's frames (or the first row's where native did not run), or ``--reference``'s
        digest of them; the row carries its own frames' digest."""
        digest = frames_digest(video)
        if self.reference_sha256 is not None:
            label, expected = self.reference_sha256
            return {"bitwise_equal": digest == expected, "bitwise_against": label, "frames_sha256": digest}
        return self._compare_in_process(run, video) | {"frames_sha256": digest}

    def _compare_in_process(self, run: Run, video: np.ndarray) -> dict[str, Any]:
        if self.reference is None:
            self.reference = (run.label, video)
            return {"bitwise_equal": True if run.config == "native" else None, "bitwise_against": run.label}
        label, frames = self.reference
        return {
            "bitwise_equal": bool(torch.equal(torch.from_numpy(frames), torch.from_numpy(video))),
            "bitwise_against": label,
        }

    # -- all rows

    def run_all(self, runs: list[Run]) -> None:
        deadline = self.start + self.args.time_limit
        for run in runs:
            left = deadline - time.perf_counter()
            if left < ESTIMATE_MARGIN * self.longest_s:
                self.skip(
                    run, f"not started: {left:.0f} s left of --time-limit, the longest run took {self.longest_s:.0f} s"
                )
                continue
            print(f"[{time.perf_counter() - self.start:7.1f} s] {run.label}", flush=True)
            try:
                row = self.measure_with_fallback(run)
            except ImportError as exc:
                self.skip(run, f"not importable: {exc}")
                continue
            except Exception as exc:  # a refused or failed configuration is a result; the others go on
                self.skip(run, f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
                traceback.print_exc()
                continue
            self.longest_s = max(self.longest_s, row["config_wall_s"])
            self.result["runs"].append(row)
            bc.write_json(self.args.out, self.result, quiet=True)
            print(summary_line(row), flush=True)

    def measure_with_fallback(self, run: Run) -> dict[str, Any]:
        """Native on the device; when that runs out of device memory, diffusers' model CPU offload (said)."""
        if run.config != "native":
            return self.measure(run)
        try:
            return self.measure(run, self.args.native_mode)
        except torch.OutOfMemoryError as exc:
            if self.args.native_mode != "auto":
                raise
            first = " ".join(str(exc).split())[:200]
            gc.collect()
            torch.cuda.empty_cache()
            row = self.measure(run, "model_cpu_offload")
            row["native_note"] += f" (every component on the device ran out of memory: {first})"
            return row

    def skip(self, run: Run, why: str) -> None:
        print(f"{run.label}: {why}", flush=True)
        self.result["skipped"].append({"config": run.config, "first_run": run.first_run, "why": why})
        bc.write_json(self.args.out, self.result, quiet=True)


def profiled_in(run: Run, unplanned: dict[str, int]) -> str | None:
    """Where an offloaded run's plans came from: a saved profile (no unplanned forward of an expert), or the
    generation's own first forwards."""
    if run.config in ("native", "flextensor"):
        return None
    experts = [unplanned.get(name, 0) for name in ("transformer", "transformer_2")]
    return "saved profile" if not any(experts) else "generation"


def summary_line(row: dict[str, Any]) -> str:
    first = "first" if row["first_run"] else "later"
    return (
        f"{row['config']:>18} {first:>5}: total {row['total_s']:8.2f} s (load {row['load_s']:.2f}, enable "
        f"{row['enable_s']:.2f}, text {row['text_encoding_s']:.2f}, steps {row['steps_s']:.2f}, decode "
        f"{row['decode_s']:.2f}, mp4 {row['mp4_s']:.2f}); first step at {row['first_step_at_s']:.2f} s; host anon "
        f"{row['peak_host_anon_bytes'] / 1e9:.2f} GB, file {row['peak_host_file_bytes'] / 1e9:.2f} GB; device "
        f"{(row['peak_allocated_bytes'] or 0) / 1e9:.2f} GB; bitwise {row['bitwise_equal']}"
    )


# ---------------------------------------------------------------------------------------- the tiny pipeline


def small_host_budget(pipe: Any, name: str) -> int:
    """The tiny pipeline's host budget for ``name``: its host copies alone (`small_host_plan`)."""

    def nbytes(module: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    return nbytes(pipe.vae) + int(SMALL_HOST_EXPERTS[name] * nbytes(pipe.transformer)) + 2**16


@contextlib.contextmanager
def small_host_plan(active: bool) -> Iterator[None]:
    """With the tiny pipeline, a host budget planned for the host copies alone (as `tiers_bench.host_copies_only`):
    the process's own memory and the tier's 1 GiB reserve would dwarf ~1 MB of weights. Where the package no longer
    has those names, nothing is patched (and the tiny budgets may be refused: the row says so)."""
    if not active:
        yield
        return
    from unittest import mock

    try:
        from flextensor_diffusers.storage import host_budget
    except ImportError:
        yield
        return
    names = {"HOST_RESERVE_BYTES": 0, "process_own_bytes": lambda modules: 0}
    with mock.patch.multiple(host_budget, **{k: v for k, v in names.items() if hasattr(host_budget, k)}):
        yield


# ---------------------------------------------------------------------------------------- command line


def recipe_argv(args: argparse.Namespace, output: Path) -> list[str]:
    """The recipe's own flags for this workload (its parser fills in the rest, as a user's command would)."""
    argv = ["--random-weights", "tiny" if args.small else "full", "--device", "cpu" if args.small else args.device]
    argv += ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
    argv += ["--steps", str(args.steps), "--budget", args.budget, "--host-budget", "none", "--seed", str(args.seed)]
    return [*argv, "--output", str(output), "-q"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma list of {', '.join(CONFIGS)} (NAME:first: no later runs of NAME; NAME:later: its later runs only, "
        "from --workdir's files of an earlier process)",
    )
    parser.add_argument("--later-runs", type=int, default=1, help="later runs after each first run of " + str(REPEATED))
    parser.add_argument("--steps", type=int, default=RECIPE_STEPS, help="denoising steps (the recipe's 40)")
    parser.add_argument("--frames", type=int, default=None, help="default 81 (--small: 9)")
    parser.add_argument("--height", type=int, default=None, help="default 480 (--small: 32)")
    parser.add_argument("--width", type=int, default=None, help="default 832 (--small: 32)")
    parser.add_argument("--budget", default=None, help="GPU budget (default 8GB; --small: 400KB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (--small: the CPU)")
    parser.add_argument(
        "--native-mode",
        choices=("auto", "device", "model_cpu_offload"),
        default="auto",
        help="native placement: auto (on the device where the weights fit, else model CPU offload)",
    )
    parser.add_argument("--time-limit", type=float, default=1e9, help="seconds: no run starts that cannot finish")
    parser.add_argument("--sample-ms", type=float, default=20.0, help="host memory sampling interval")
    parser.add_argument("--workdir", type=Path, default=None, help="profiles, payload files, videos (default: temp)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the videos, profiles and payload files")
    parser.add_argument(
        "--reference", type=Path, default=None, help="an earlier result: every row compared with its native frames"
    )
    parser.add_argument("--small", action="store_true", help="tiny random weights on the CPU: the smoke test")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (written after every row)")
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = sorted({c.partition(":")[0] for c in args.configs} - set(CONFIGS))
    if unknown:
        parser.error(f"--configs {','.join(unknown)}: not one of {', '.join(CONFIGS)}")
    suffixes = sorted({c for c in args.configs if c.partition(":")[2] not in ("", "first", "later")})
    if suffixes:
        parser.error(f"--configs {','.join(suffixes)}: NAME, NAME:first or NAME:later")
    later = [c for c in args.configs if c.endswith(":later")]
    if any(c.partition(":")[0] not in REPEATED for c in later):
        parser.error(f"--configs {','.join(later)}: only {', '.join(REPEATED)} have later runs")
    if later and args.workdir is None:
        parser.error(f"--configs {','.join(later)} reads an earlier run's files: pass its --workdir")
    if args.reference is not None and not args.reference.is_file():
        parser.error(f"--reference {args.reference}: no such file")
    args.frames = args.frames or (9 if args.small else 81)
    args.height = args.height or (32 if args.small else 480)
    args.width = args.width or (32 if args.small else 832)
    args.budget = args.budget or ("400KB" if args.small else "8GB")
    if not args.small and not torch.cuda.is_available():
        parser.error("the full pipeline needs a CUDA GPU: pass --small to check the script on the CPU")
    if args.small and "flextensor" in args.configs:
        parser.error("flextensor runs on a CUDA GPU only: drop it from --configs with --small")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    bench = TimeToVideo(args)
    bench.result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    try:
        bench.build()
        bench.run_all(planned_runs(args.configs, args.later_runs))
    finally:
        bc.write_json(args.out, bench.result)
        if not args.keep_workdir and args.workdir is None:
            shutil.rmtree(bench.workdir, ignore_errors=True)
    for row in bench.result["runs"]:
        print(summary_line(row))
    return bench.result


if __name__ == "__main__":
    main()
