"""Issue 15's GPU proof: Wan2.2-T2V-A14B (random bf16 weights) from a diffusers folder under a host budget.

Saves the full-size pipeline's ``transformer``, ``transformer_2``, ``vae`` and ``scheduler`` as a diffusers
folder (no text encoder: the generations get seeded random ``prompt_embeds`` / ``negative_prompt_embeds``
of UMT5-XXL's output shape, so the pipeline is loaded with ``text_encoder=None, tokenizer=None``), then
runs two child processes, each with a 24 GB card emulated (``set_per_process_memory_fraction``):

* all-pinned: ``from_pretrained`` + ``enable_flextensor_offload(budget="8GiB")``, every host copy in
  pinned RAM;
* tiered: page cache dropped (``/proc/sys/vm/drop_caches`` where permitted, else ``posix_fadvise`` on the
  folder's files), ``from_pretrained`` + ``enable_flextensor_offload(budget="8GiB", host_budget="32GiB")``:
  one expert's host copies wait on disk, in the folder's own safetensors files.

Each runs a warm-up generation (discovery and profiling, both experts) and a measured one (81 frames
832x480, CFG, ``--steps`` steps crossing the expert boundary), timing every step with
``callback_on_step_end`` after ``torch.cuda.synchronize`` and sampling RssAnon + RssShmem every 50 ms.
The parent compares the latents bitwise and writes ``--out``: peak host memory against the host budget,
peak allocated GPU memory of each run (from before enable) against the GPU budget, per-step time of
both runs, each switch's disk read and the part of it a step paid, whether the reads came from the disk
(``/proc/self/io``), and a 40-step overhead extrapolated from those (the formula is in the JSON).

Disk: the folder (two 28.6 GB experts and the VAE) takes ~54 GiB, and the host tier writes a cache file
for the VAE (saved in fp32, loaded in bf16); a disk that cannot hold both is refused before anything is
written, and so is a folder on tmpfs (its reads would not come from a disk) unless ``--allow-tmpfs``.

    python benchmarks/host_tier_bench.py --out $OUT/host_tier_h200.json      # full size, on the GPU
    python benchmarks/host_tier_bench.py --size tiny --out /tmp/host_tier_tiny.json   # CPU, seconds

The JSON is written after every phase (and the children write theirs after every phase of theirs),
so a run cut off by ``--time-limit`` or the caller keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_common import HostMemorySampler, PeakWatch, anon_shmem_bytes, sync, write_json

from flextensor_diffusers.engine import format_bytes, parse_bytes

EXPERTS = ("transformer", "transformer_2")
#: Seed offsets of `models.build_wan22_t2v` (the text encoder's +2 is not built here).
SEED_OFFSET = {"transformer": 0, "transformer_2": 1, "vae": 3}
#: UMT5's output length for Wan (``max_sequence_length`` of the pipeline).
TEXT_TOKENS = 512
#: Steps of the extrapolated generation.
STEPS_40 = 40
OVERHEAD_FORMULA = (
    "overhead_40_steps_pct = 100 * (40 * (tiered_step_s - all_pinned_step_s) + sum(switch_exposed_s)) "
    "/ (40 * all_pinned_step_s), where tiered_step_s and all_pinned_step_s are medians of the measured "
    "generation's steady steps, and switch_exposed_s[k] is the tiered minus the all-pinned duration of the "
    "k-th step that comes once per switch. Those are the steps that switch a component (the generation's first "
    "step, which brings the high-noise expert back, and its first low-noise step) and, where steps are left "
    "besides, the steps that end a component's run (the one before each switch, and the last: a component hands "
    "its RAM over during its last forward); the steady steps are the others. A generation of any length has "
    "each of those once, as the measured one; with too few steps for steady ones besides (4: every step "
    "switches or ends a run), the steps that end a run are the steady ones (step_roles.rule 'switch steps only')"
)
#: Marks a work folder this script made (and may empty).
MARKER = ".host_tier_bench"
#: Phases of the tiered run whose host memory the host budget bounds.
BUDGETED_PHASES = ["load", "enable", "warmup", "measured"]


def now(start: float) -> str:
    return f"[{time.perf_counter() - start:7.1f} s]"


# ---------------------------------------------------------------------------------------- the pipeline


def wan_config(size: str) -> dict[str, Any]:
    from flextensor_diffusers.recipes.models import load_config

    return load_config("wan22_t2v", size)


def make_component(name: str, cfg: dict[str, Any], init_device: str, seed: int) -> torch.nn.Module:
    """One component with `models.build_wan22_t2v`'s random init (made on ``init_device``, then on the
    CPU unless meta), in the dtype ``from_pretrained(torch_dtype=...)`` would give it."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from flextensor_diffusers.recipes.models import _random

    if name == "vae":
        build, dtype = (lambda: AutoencoderKLWan(**cfg["vae"])), getattr(torch, cfg["vae_dtype"])
    else:
        build, dtype = (lambda: WanTransformer3DModel(**cfg[name])), getattr(torch, cfg["dtype"])
    return _random(build, init_device, dtype, seed + SEED_OFFSET[name])


def component_bytes(cfg: dict[str, Any]) -> dict[str, int]:
    """Weight bytes of each saved component, from a meta-device build (nothing allocated)."""
    sizes = {}
    for name in (*EXPERTS, "vae"):
        module = make_component(name, cfg, "meta", 0)
        sizes[name] = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return sizes


def scheduler(cfg: dict[str, Any]) -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**{k: v for k, v in cfg["scheduler"].items() if not k.startswith("_")})


@contextlib.contextmanager
def host_copies_only() -> Iterator[None]:
    """The tiny pipeline plans a host budget for its host copies alone: the process's own memory (~0.5 GB
    of Python and torch) and the tier's 1 GiB reserve, which a host budget holds besides the host copies,
    would dwarf its ~1 MB of weights (and refuse the tiny budgets)."""
    from unittest import mock

    from flextensor_diffusers.storage import host_budget

    with mock.patch.multiple(host_budget, HOST_RESERVE_BYTES=0, process_own_bytes=lambda modules: 0):
        yield


# ---------------------------------------------------------------------------------------- disk


def check_disk(folder: Path, sizes: dict[str, int], margin: int, allow_tmpfs: bool) -> dict[str, Any]:
    """The folder's filesystem, refused when it cannot hold the folder and the VAE's cache file, or is tmpfs."""
    where = folder.resolve()
    while not where.exists():
        where = where.parent
    mount, fstype = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()  # the longest mount point that holds the folder is its filesystem
            if len(parts) >= 3 and str(where).startswith(parts[1]) and len(parts[1]) > len(mount):
                mount, fstype = parts[1], parts[2]
    free = shutil.disk_usage(where).free
    need = sum(sizes.values()) + sizes["vae"] + margin  # the folder, the VAE's cache file (bf16: less), a margin
    disk = {"mount": mount, "fstype": fstype, "free_bytes": free, "needed_bytes": need}
    if free < need:
        raise SystemExit(
            f"not enough disk: {mount} has {format_bytes(free)} free, the folder and the host tier's cache file "
            f"need {format_bytes(need)} with the margin: pass --workdir on a larger disk"
        )
    if fstype in ("tmpfs", "ramfs") and not allow_tmpfs:
        raise SystemExit(
            f"{folder} is on {fstype} ({mount}): its files are in RAM, so the host tier's reads would not "
            "come from a disk. Pass --workdir on a disk, or --allow-tmpfs"
        )
    return disk


def drop_page_cache(files: list[Path]) -> str:
    """Write dirty pages back, then drop the page cache: the whole system's where permitted (root), else these
    files' clean pages (``posix_fadvise(DONTNEED)``, any user). Returns how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in files:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def storage_read_bytes() -> int | None:
    """Bytes this process (all its threads) read from storage, not from the page cache (/proc/self/io)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return None


def weight_files(folder: Path) -> list[Path]:
    return [f for f in folder.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".bin")]


# ---------------------------------------------------------------------------------------- saving


def child_save(args: argparse.Namespace, names: tuple[str, ...] = (*EXPERTS, "vae")) -> dict[str, Any]:
    """Build each component of ``names`` (on the GPU at full size: quick), save it, free it before the next one;
    then the scheduler and ``model_index.json`` (which names every component, saved or not)."""
    from diffusers import WanPipeline

    cfg = wan_config(args.size)
    init = "cuda" if torch.cuda.is_available() and args.size == "full" else "cpu"
    out: dict[str, Any] = {"save_s": {}, "bytes": {}}
    for name in names:
        module = make_component(name, cfg, init, args.seed)
        start = time.perf_counter()
        module.save_pretrained(args.folder / name, safe_serialization=True)
        out["save_s"][name] = round(time.perf_counter() - start, 3)
        out["bytes"][name] = sum(f.stat().st_size for f in (args.folder / name).rglob("*") if f.is_file())
        print(f"saved {name} ({format_bytes(out['bytes'][name])}) in {out['save_s'][name]:.1f} s", flush=True)
        del module
        gc.collect()
        if init == "cuda":
            torch.cuda.empty_cache()
    scheduler(cfg).save_pretrained(args.folder / "scheduler")
    meta = {name: make_component(name, cfg, "meta", 0) for name in (*EXPERTS, "vae")}
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, scheduler=scheduler(cfg), boundary_ratio=cfg["boundary_ratio"], **meta
    )
    pipe.save_config(args.folder)  # model_index.json
    start = time.perf_counter()
    os.sync()  # on disk before the runs read it (and before the page cache can be dropped)
    write_s = sum(out["save_s"].values()) + time.perf_counter() - start
    out["write_GBps"] = round(sum(out["bytes"].values()) / write_s / 1e9, 3)
    return out


# ---------------------------------------------------------------------------------------- generating


def random_embeddings(pipe: Any, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stand-ins for UMT5's prompt and negative-prompt embeddings (same in every process)."""
    model = pipe.transformer
    g = torch.Generator(device="cpu").manual_seed(seed + 1000)
    dtype = next(model.parameters()).dtype
    shape = (1, TEXT_TOKENS, model.config.text_dim)
    return torch.randn(*shape, generator=g).to(device, dtype), torch.randn(*shape, generator=g).to(device, dtype)


def switches(pipe: Any) -> list[dict[str, Any]]:
    """The host tier's switches so far (one per component brought in from disk), as its report gives them."""
    tier = pipe.flextensor_report()["host_tier"]
    return list(tier["switches"]) if tier else []


def switch_timelines(pipe: Any) -> list[dict[str, Any]]:
    """Per switch so far, its component and every unit taken: when it was read, asked for and taken, in seconds
    from the switch (`records.UnitArrival`): where the switch's wait went."""
    state = getattr(pipe, "_flextensor", None)
    tier = state.host_tier if state is not None else None
    if tier is None:
        return []
    return [{"component": s.component, "units": s.timeline()} for s in tier.switches]


def generate(pipe: Any, args: argparse.Namespace, steps: int, embeds: tuple, device: torch.device) -> dict[str, Any]:
    """One generation: per-step wall times (device synchronised at every step end), which expert ran each
    step, the steps that switched expert, and the host tier's switches during it; ``latents`` on the CPU. Every
    step's latents are hashed (where two runs first differ) between the step's timestamp and ``resumed``: that
    time is left out of the next step's ``step_s`` (it stays in ``generation_s``)."""
    ends: list[float] = []
    resumed: list[float] = []
    timesteps: list[float] = []
    step_hashes: list[str] = []

    def on_step(_pipe: Any, _i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        sync(device)
        ends.append(time.perf_counter())
        timesteps.append(float(t))
        latents = kwargs.get("latents")
        if latents is not None:
            step_hashes.append(
                hashlib.sha256(latents.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
            )
        resumed.append(time.perf_counter())
        return kwargs

    before = len(switches(pipe))
    timelines_before = len(switch_timelines(pipe))
    sync(device)
    start = time.perf_counter()
    try:
        latents = pipe(
            prompt_embeds=embeds[0],
            negative_prompt_embeds=embeds[1],
            num_frames=args.frames,
            height=args.height,
            width=args.width,
            num_inference_steps=steps,
            guidance_scale=args.guidance,
            generator=torch.Generator(device="cpu").manual_seed(args.seed),
            output_type="latent",
            callback_on_step_end=on_step,
        ).frames
    except Exception as exc:  # e.g. verify_loads' LoadCheckError at the end: the steps' hashes still tell
        exc.step_latents_sha256 = step_hashes  # type: ignore[attr-defined]
        raise
    sync(device)
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    experts = ["transformer" if t >= boundary else "transformer_2" for t in timesteps]
    return {
        "steps": steps,
        "generation_s": round(time.perf_counter() - start, 4),
        "step_s": [round(b - a, 4) for a, b in zip([start, *resumed[:-1]], ends, strict=True)],
        "experts": experts,
        "switch_steps": [i for i in range(len(experts)) if i == 0 or experts[i] != experts[i - 1]],
        "switches": switches(pipe)[before:],
        "switch_timelines": switch_timelines(pipe)[timelines_before:],
        "step_latents_sha256": step_hashes,
        "latents": latents.detach().cpu(),
    }


class ChildRun:
    """The all-pinned or the tiered run of one child process: its phases, host memory, storage reads and
    progress file (written after every phase, so that a run cut off keeps what it measured)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.role = args.child
        self.tiered = self.role == "tiered"
        self.start = time.perf_counter()
        self.sampler = HostMemorySampler(anon_shmem_bytes, args.sample_ms / 1e3).start()
        self.out: dict[str, Any] = {"role": self.role, "phases_s": {}, "storage_read_bytes": {}, "done": False}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.sampler.set_phase(name)
        io_before, start = storage_read_bytes(), time.perf_counter()
        print(f"{now(self.start)} {self.role}: {name}", flush=True)
        try:
            yield
        finally:
            self.out["phases_s"][name] = round(time.perf_counter() - start, 3)
            io_after = storage_read_bytes()
            self.out["storage_read_bytes"][name] = None if io_before is None else io_after - io_before
            self.save()

    def save(self) -> None:
        self.out["host_peak_by_phase"] = dict(self.sampler.peaks)
        write_json(self.args.progress, self.out, quiet=True)


def child_run(args: argparse.Namespace) -> None:
    """The all-pinned (``--child pinned``) or tiered (``--child tiered``) run; see the module docstring."""
    import diffusers
    from diffusers import WanPipeline

    from flextensor_diffusers.recipes.models import load_pipeline

    diffusers.utils.logging.set_verbosity_error()
    run = ChildRun(args)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    run.out.update(device=str(device), torch=torch.__version__, diffusers=diffusers.__version__)
    if run.tiered:
        run.out["page_cache_drop"] = drop_page_cache(weight_files(args.folder))
    with run.phase("load"):
        dtype = getattr(torch, wan_config(args.size)["dtype"])
        pipe = load_pipeline(args.folder, WanPipeline, dtype=dtype, text_encoder=None, tokenizer=None)
        pipe.set_progress_bar_config(disable=True)
    run.out["weights_bytes"] = sum(
        t.numel() * t.element_size() for name in (*EXPERTS, "vae") for t in getattr(pipe, name).state_dict().values()
    )
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.card) / total), device)
    watch = PeakWatch(device)  # from before enable: the GPU budget is a ceiling for the whole run
    with run.phase("enable"), host_copies_only() if args.size == "tiny" else contextlib.nullcontext():
        pipe.enable_flextensor_offload(
            budget=args.budget_bytes,
            device=device,
            host_budget=args.host_budget_bytes if run.tiered else None,
            cache_dir=args.cache_dir if run.tiered else None,
        )
    embeds = random_embeddings(pipe, args.seed, device)
    for gen, steps in (("warmup", args.warmup_steps), ("measured", args.steps)):
        if run.tiered:
            run.out[f"page_cache_drop_before_{gen}"] = drop_page_cache(weight_files(args.folder))
        with run.phase(gen):
            info = generate(pipe, args, steps, embeds, device)
            info["peak_allocated_bytes"] = watch.part()
            torch.save(info.pop("latents"), args.progress.parent / f"{run.role}_{gen}.pt")
            run.out[gen] = info
    report = pipe.flextensor_report()
    run.out["budget"] = watch.check(f"{run.role} run", report["budget_bytes"])
    run.out["tier_report"] = report["host_tier"]
    run.sampler.stop()
    run.out["done"] = True
    run.save()


# ---------------------------------------------------------------------------------------- the parent


def run_child(role: str, args: argparse.Namespace, deadline: float) -> tuple[dict[str, Any] | None, str | None]:
    """Run one child; its progress file (complete or not) and why it stopped early, if it did."""
    progress = args.workdir / "scratch" / f"{role}.json"
    progress.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", role, "--progress", str(progress), *child_argv(args)]
    timeout = deadline - time.perf_counter()
    if timeout < 20:
        return None, f"not run: {timeout:.0f} s left of --time-limit"
    error = None
    try:
        proc = subprocess.run(cmd, timeout=timeout, check=False)
        if proc.returncode != 0:
            error = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = "stopped at --time-limit"
    return (json.loads(progress.read_text()) if progress.exists() else None), error


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--size", args.size, "--workdir", str(args.workdir), "--seed", str(args.seed)]
    argv += ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
    argv += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--guidance", str(args.guidance)]
    argv += ["--budget", str(args.budget_bytes), "--host-budget", str(args.host_budget_bytes), "--card", args.card]
    return [*argv, "--sample-ms", str(args.sample_ms)]


@dataclass(frozen=True)
class StepRoles:
    """Which steps of a generation are steady and which come once per switch (`OVERHEAD_FORMULA`)."""

    steady: list[int]
    once_per_switch: list[int]
    rule: str


def step_roles(info: dict[str, Any]) -> StepRoles:
    """The steps that switch a component and end one's run come once per switch, the others are steady; with no
    steady step left that way, only the switching steps come once (and, with none left either, every step is
    steady)."""
    count = len(info["step_s"])
    switching = sorted(set(info["switch_steps"]))
    ending = {i - 1 for i in switching if i > 0} | ({count - 1} if count else set())
    boundary = sorted(set(switching) | ending)
    steady = [i for i in range(count) if i not in boundary]
    if steady:
        return StepRoles(steady, boundary, "switch and run-ending steps")
    steady = [i for i in range(count) if i not in switching]
    if steady:
        return StepRoles(steady, switching, "switch steps only")
    return StepRoles(list(range(count)), switching, "every step switches")


def steady_step_s(info: dict[str, Any]) -> float:
    """Median of the generation's steady steps (`step_roles`)."""
    return round(statistics.median([info["step_s"][i] for i in step_roles(info).steady]), 4)


def summarise_switches(result: dict[str, Any], pinned: dict[str, Any], tiered: dict[str, Any]) -> None:
    """Each switch of the measured generation: its disk read, the part a step paid, and the 40-step overhead."""
    p, t = pinned["measured"], tiered["measured"]
    result["all_pinned_step_s"], result["tiered_step_s"] = steady_step_s(p), steady_step_s(t)
    result["switch_steps"] = t["switch_steps"]
    result["switch_components"] = [t["experts"][i] for i in t["switch_steps"]]
    mine = [[s for s in t["switches"] if s["component"] == name] for name in result["switch_components"]]
    result["switch_s"] = [round(sum(s["read_s"] for s in reads), 4) for reads in mine]
    result["switch_wait_s"] = [round(sum(s["wait_s"] for s in reads), 4) for reads in mine]
    result["switch_prefetched"] = [any(s["prefetched"] for s in reads) for reads in mine]
    read_s, read_bytes = sum(s["read_s"] for s in t["switches"]), sum(s["nbytes"] for s in t["switches"])
    result["disk_read_GBps"] = round(read_bytes / read_s / 1e9, 3) if read_s else None
    io = tiered["storage_read_bytes"].get("measured")
    result["cold"] = None if io is None or not read_bytes else io >= 0.9 * read_bytes
    result["cold_evidence"] = {"storage_read_bytes_during_measured": io, "switch_read_bytes_measured": read_bytes}
    if len(p["step_s"]) != len(t["step_s"]):
        return
    roles = step_roles(t)
    exposed = [round(t["step_s"][i] - p["step_s"][i], 4) for i in roles.once_per_switch]
    base, step = result["all_pinned_step_s"], result["tiered_step_s"]
    result["switch_exposed_s"] = exposed
    result["step_roles"] = asdict(roles)
    result["overhead_40_steps_pct"] = round(100 * (STEPS_40 * (step - base) + sum(exposed)) / (STEPS_40 * base), 3)
    result["measured_generation_overhead_pct"] = round(100 * (t["generation_s"] / p["generation_s"] - 1), 3)


def summarise(result: dict[str, Any], runs: dict[str, dict[str, Any] | None], scratch: Path) -> None:
    """The issue's figures from the runs done so far."""
    pinned, tiered = runs.get("pinned"), runs.get("tiered")
    for role, run in runs.items():
        if run and "budget" in run:
            result[f"{role}_gpu_budget"] = run["budget"]
    if tiered:
        peaks = tiered.get("host_peak_by_phase", {})
        result["peak_host_bytes"] = max((v for k, v in peaks.items() if k in BUDGETED_PHASES), default=None)
        result["process_host_bytes_at_start"] = peaks.get("start")
        if result["peak_host_bytes"] is not None and result["config"]["size"] == "full":  # tiny: host_copies_only
            result["peak_host_within_budget"] = result["peak_host_bytes"] <= result["host_budget_bytes"]
        result["weights_bytes"] = tiered.get("weights_bytes")
        if tiered.get("tier_report"):
            result["switch_forecast"] = tiered["tier_report"]["forecasts"]
    if pinned and tiered and "measured" in pinned and "measured" in tiered:
        summarise_switches(result, pinned, tiered)
    equal = {}
    for gen in ("warmup", "measured"):
        a, b = scratch / f"pinned_{gen}.pt", scratch / f"tiered_{gen}.pt"
        if a.exists() and b.exists():
            equal[gen] = bool(torch.equal(torch.load(a).view(torch.uint8), torch.load(b).view(torch.uint8)))
    if equal:
        result["bitwise_equal_by_generation"] = equal
        result["bitwise_equal"] = len(equal) == 2 and all(equal.values())


def header(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": "host tier (issue 15): Wan2.2-T2V-A14B from a diffusers folder under a host budget",
        "model": f"Wan2.2-T2V-A14B architecture ({args.size}), random weights ({cfg['dtype']} experts, "
        f"{cfg['vae_dtype']} VAE)",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "output": "latents (no VAE decode)",
        "text_encoder": "not saved nor loaded: both generations get seeded random prompt_embeds and "
        "negative_prompt_embeds of UMT5-XXL's output shape (1, 512, text_dim) in the transformer's dtype",
        "budget_bytes": args.budget_bytes,
        "host_budget_bytes": args.host_budget_bytes,
        "card_cap_bytes": parse_bytes(args.card),
        "overhead_formula": OVERHEAD_FORMULA,
        "phases": [],
    }


def fresh_workdir(workdir: Path) -> None:
    """An empty work folder with a scratch folder; one holding files this script did not write is refused."""
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).exists():
        raise SystemExit(f"--workdir {workdir} holds files this script did not write: pass a new or empty folder")
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "scratch").mkdir(parents=True)
    (workdir / MARKER).touch()


def parent(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    deadline = start + args.time_limit
    cfg = wan_config(args.size)
    result = header(args, cfg)
    scratch = args.workdir / "scratch"

    def phase_done(name: str, t0: float, **extra: Any) -> None:
        result["phases"].append({"phase": name, "seconds": round(time.perf_counter() - t0, 2), **extra})
        write_json(args.out, result, quiet=True)
        print(f"{now(start)} done: {name} ({time.perf_counter() - t0:.1f} s)", flush=True)

    fresh_workdir(args.workdir)
    try:
        t0 = time.perf_counter()
        result["disk"] = check_disk(args.workdir, component_bytes(cfg), parse_bytes("2GiB"), args.allow_tmpfs)
        data, error = run_child("save", args, deadline)
        result["save"] = data
        if data is None or error:
            raise SystemExit(f"saving failed: {error or 'no result'}")
        phase_done("save", t0)
        runs: dict[str, dict[str, Any] | None] = {}
        for role in ("pinned", "tiered"):
            t0 = time.perf_counter()
            runs[role], error = run_child(role, args, deadline)
            result.setdefault("runs", {})[role] = runs[role]
            summarise(result, runs, scratch)
            phase_done(role, t0, **({"error": error} if error else {}))
    except SystemExit as exc:
        result["error"] = str(exc)
        write_json(args.out, result)
        raise
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    result.update({k: (runs.get("tiered") or {}).get(k) for k in ("device", "torch", "diffusers")})
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "config", "switch_forecast")}, indent=1))


# ---------------------------------------------------------------------------------------- command line


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the generations a tier benchmark runs (shared with tiers_bench.py)."""
    parser.add_argument("--frames", type=int, default=None, help="default 81 (full), 9 (tiny)")
    parser.add_argument("--height", type=int, default=None, help="default 480 (full), 32 (tiny)")
    parser.add_argument("--width", type=int, default=None, help="default 832 (full), 32 (tiny)")
    parser.add_argument("--steps", type=int, default=4, help="measured generation: 4 gives each expert 2 steps")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="warm-up generation (discovery, profiling); default as many as --steps, so that the measured "
        "generation's first switch follows a generation of its own length, as back-to-back generations do",
    )
    parser.add_argument("--guidance", type=float, default=5.0, help="CFG scale (> 1: a cond and an uncond pass)")
    parser.add_argument("--seed", type=int, default=0)


def resolve_generation_arguments(args: argparse.Namespace) -> None:
    """The generation's size when not given: the published one at full size, a small one with tiny weights."""
    tiny = args.size == "tiny"
    args.frames = args.frames or (9 if tiny else 81)
    args.height = args.height or (32 if tiny else 480)
    args.width = args.width or (32 if tiny else 832)
    # A shorter warm-up gives its last expert too few steps to hand its RAM over and read the next one ahead: after
    # 2 steps, call R's measured first switch waited 7.0 s; after 6 or 8, calls S and T's waited 0.004 s.
    args.warmup_steps = args.steps if args.warmup_steps is None else args.warmup_steps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (after every phase)")
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--workdir", type=Path, default=None, help="folder, cache; default <tmp>/host_tier_bench")
    add_generation_arguments(parser)
    parser.add_argument("--budget", default=None, help="GPU budget (default 8GiB; tiny: 250000)")
    parser.add_argument("--host-budget", default=None, help="default 32GiB; tiny: one expert + VAE + a quarter")
    parser.add_argument("--card", default="24GB", help="memory cap of the emulated card")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="host memory sampling interval")
    parser.add_argument("--allow-tmpfs", action="store_true", help="allow a work folder on tmpfs")
    parser.add_argument("--time-limit", type=float, default=500.0, help="seconds for the whole run; runs past it stop")
    parser.add_argument("--child", choices=("save", "pinned", "tiered"), help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tiny = args.size == "tiny"
    resolve_generation_arguments(args)
    args.workdir = args.workdir or Path(tempfile.gettempdir()) / f"host_tier_bench-{args.size}"
    args.folder, args.cache_dir = args.workdir / "pipeline", args.workdir / "cache"
    args.budget_bytes = parse_bytes(args.budget or (250_000 if tiny else "8GiB"))
    if args.host_budget is not None:
        args.host_budget_bytes = parse_bytes(args.host_budget)
    elif tiny:  # the tiny pipeline's host copies alone (see host_copies_only)
        sizes = component_bytes(wan_config("tiny"))
        args.host_budget_bytes = sizes["transformer"] + sizes["vae"] + sizes["transformer"] // 4 + 2**16
    else:
        args.host_budget_bytes = parse_bytes("32GiB")
    return args


def main() -> None:
    args = parse_args()
    if args.child == "save":
        write_json(args.progress, child_save(args), quiet=True)
        return
    if args.child in ("pinned", "tiered"):
        child_run(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown of tens of GiB of pinned host memory, one tensor at a time
    if args.size == "full" and not torch.cuda.is_available():
        raise SystemExit("--size full needs a CUDA GPU (use --size tiny to check the script on a CPU)")
    parent(args)


if __name__ == "__main__":
    main()
