"""Issue 25's GPU proof: host-memory tiers of Wan2.2-T2V-A14B (random bf16 weights) side by side, and set-up time.

**Pipeline.** The full pipeline (``transformer``, ``transformer_2``, ``vae``, no text encoder: seeded random
``prompt_embeds`` / ``negative_prompt_embeds`` of UMT5-XXL's output shape, as issue 15's bench had them) is saved
as a diffusers folder and loaded with ``WanPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None,
dtype=...)`` (``recipes.models.load_pipeline``, as issue 15's bench loaded it). Each configuration runs in a
child process of its own on an emulated card (``--card``, default 24 GB: ``set_per_process_memory_fraction``)
under ``budget="8GiB"``, with ``cache_dir`` in the work folder:

* ``ram_raw``: ``host_budget=None, compression="none"``: every host copy raw in RAM (the reference);
* ``host32_compressed``: ``host_budget="32GiB", compression="lossless"``;
* ``host24_compressed``: ``host_budget="24GiB", compression="lossless"``;
* ``defaults``: nothing but ``budget`` and ``cache_dir``;
* ``host32_raw`` (not run unless named in ``--configs``): ``host_budget="32GiB"`` alone (issue 15's tiered run);
* ``defaults_64gb`` (not run unless named): ``defaults`` as on a 64 GiB machine: the parent holds the rest of the
  machine's RAM, written, while the child runs (`ballast`); the default ``host_budget="auto"`` then finds the
  host copies do not fit and turns the host tier on (its budget: ``auto_host_budget_bytes``);
* ``ram_compressed``, ``host32_compressed_repeat`` and ``host32_compressed_unverified`` (not run unless named):
  compressed copies in RAM without a tier; ``host32_compressed`` again; and again with ``verify_loads=False``
  (a host tier with compression on a GPU verifies every load by default: every unit call compares its device
  bytes with its weights, `engine.load_checks`; this measures what that costs). ``--verify-loads`` adds
  ``verify_loads=True`` to every configuration run.

A child: page cache of the weight files dropped, ``from_pretrained``, ``enable_flextensor_offload`` (timed:
``setup_s``), a warm-up generation (``--warmup-steps``, default as many as ``--steps``: the measured generation's
first switch then follows a generation as long as itself) and a measured one (``--steps``; the page cache is dropped
again before it when the configuration has a host budget, so its reads from disk are cold), 81 frames 832x480
with CFG, same seed, latents out. Every step is timed with ``callback_on_step_end`` after a device
synchronisation; ``time_to_first_step_s`` runs from the start of enable to the end of the warm-up's first step.
Host memory (RssAnon + RssShmem: anonymous and page-locked) is sampled every 50 ms. A configuration that
fails (say ``host_budget`` with ``compression`` refused) records its ``error`` and the others go on.

Per configuration: ``host_budget_bytes``, ``peak_host_bytes`` (sampled, over load, enable and both
generations), ``stored_host_bytes`` (host copies in RAM, raw and compressed, from ``pipe.flextensor_report()``:
the largest of the components' ``host_ram_bytes`` summed after enable and after each generation, and of the
host tier's ``peak_host_ram_bytes``), ``weights_bytes`` (the loaded components' tensors), ``step_s`` (median
of the measured generation's steady steps: `step_roles`), ``switch_wait_s`` (the host tier's waits, per
switching step of the measured generation; empty without a host tier), ``overhead_40_steps_pct`` against
``ram_raw`` (`summarise_switches`: ``ram_raw`` in the all-pinned run's place),
``bitwise_equal`` (both generations' latents against ``ram_raw``'s), ``setup_s``, ``time_to_first_step_s``,
and the trimmed offload report (``report``).

**Set-up** (``setup``): the 40-block Wan2.2-A14B transformer stack of ``peers.py`` at ``17f_480x272``, each run in a
child process with ``peers.set_up``: ours raw (``raw_s``), FlexTensor 0.5.0 (``flextensor_s``; "not installed"
when it cannot be imported), ours ``compression="lossless", compression_cache=True`` (by default: on the GPU a
set-up that reads nothing of the payload file, and encodes between the raw forwards where there is none) with an
empty cache folder (``compressed_first_s``, which writes the payload file) and again with the file there
(``compressed_cached_s``), then with ``background_encoding=False`` and no file (``compressed_first_at_setup_s``:
every block encoded before set-up returns, the default before 2026-12-05's thirteenth session), and
``time_to_first_step_*_s``: wall time from the start
of set-up to the end of the first forward (synchronised), making its inputs included. Ours raw returns from set-up
while its units are still packed (progressive packing), so its ``setup_s`` is the call alone and its
``time_to_first_step_s`` counts the packing in full. ``raw_vs_flextensor`` and ``<run>_vs_raw``: set-ups over
another's (issue 25's targets: ≤ 0.8; from the file ≤ 1, first compressed ≤ 1.5). ``forward_s``: the forwards
after the first (raw: four; compressed: until planned loads decode, then one more), to compare the raw forwards of
a compressed set-up with raw's own. Each run's ``setup_thread_cpu_s``: the CPU time of the thread that called set-up,
during it (the rest of ``setup_s`` was waiting: on the disk, other threads, locks).

**Disk plan.** The GPU machine has ~64 GB of free disk and one expert is 28.6 GB: ``transformer`` is saved once,
``transformer_2`` is a folder with its own ``config.json`` whose weight files are symlinks to ``transformer``'s
(so both experts hold the same random weights: the compute is unchanged; the JSON's ``notes`` say so). The folder
takes ~29.2 GB; ``cache_dir`` (host tier and compressed payload cache files, up to ~20 GB) is emptied before and
after every configuration; the set-up runs' payload file (~20 GB) lives in the work folder and is deleted after
them. Free disk is checked before saving (folder + ``--cache-room`` + 2 GiB). The work folder is kept while a
chosen configuration is unfinished (a later call on the same machine reuses the saved folder), else deleted.

**On the GPU**, from the repository root, two calls of under 10 minutes each (every call writes ``--out`` after
every phase; ``--resume`` keeps an earlier file's finished configurations and set-up runs, ``--redo`` runs them
again; ``--time-limit`` stops starting phases past it, and stops a phase still running at it; the JSON's ``code``
is ``$CODE_COMMIT`` where set, else the checkout's git commit, else "unknown"; ``TIERS_BENCH_LOG=INFO`` puts the
package's log lines, timestamped, in the output: the host tier's moves and reads at each switch)::

    source benchmarks/device_setup.sh && python3 benchmarks/tiers_bench.py --no-setup \\
        --out $OUT/tiers_h200.json --time-limit 520
    # copy the returned tiers_h200.json to benchmarks/results/ (the working tree travels to the device), then
    source benchmarks/device_setup.sh && python3 benchmarks/tiers_bench.py --setup-only \\
        --resume benchmarks/results/tiers_h200.json --out $OUT/tiers_h200.json --time-limit 520

Expected at full size (from host_tier_h200.json and the peers runs): saving ~1 min, ``ram_raw`` and ``defaults``
~1.5 min each, each compressed configuration ~3 min (encoding, and reading the expert that waits on disk back
twice per generation), the set-up runs ~4 min: the four configurations may not all fit in one call. If the first
call stops before its last configuration (its row says ``not run`` or ``stopped at --time-limit``), run it again
with ``--resume benchmarks/results/tiers_h200.json`` (the saved folder is reused when the machine is still the
same, else saved again) before the ``--setup-only`` call; without ``--no-setup``/``--setup-only`` a call does
whatever is unfinished of both. No phase starts with less than ``--phase-min-s`` (and a configuration's expected
time) left. On this CPU, with a tiny pipeline and a 2-block stack (about a minute and a half)::

    python benchmarks/tiers_bench.py --size tiny --out /tmp/tiers_tiny.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    HostMemorySampler,
    PeakWatch,
    StackShape,
    anon_shmem_bytes,
    build_stack,
    default_device,
    device_name,
    forwards_until_compressed_steady,
    rss_bytes,
    stack_inputs,
    sync,
    write_json,
)

from flextensor_diffusers.engine import format_bytes, parse_bytes
from flextensor_diffusers.storage import payload_cache

# ------------------------------------------------------------------------------- shared with issue 15's bench
# (host_tier_bench.py until issue 46 merged it here: `git show 7df6cea:benchmarks/host_tier_bench.py`)

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


def fresh_workdir(workdir: Path) -> None:
    """An empty work folder with a scratch folder; one holding files this script did not write is refused."""
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).exists():
        raise SystemExit(f"--workdir {workdir} holds files this script did not write: pass a new or empty folder")
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "scratch").mkdir(parents=True)
    (workdir / MARKER).touch()


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


#: Keyword arguments of ``enable_flextensor_offload`` besides ``budget`` and ``cache_dir``, per configuration.
#: A ``host_budget`` here is the full-size one; `host_budget_of` maps it for the tiny pipeline.
CONFIGS: dict[str, dict[str, Any]] = {
    "ram_raw": {"host_budget": None, "compression": "none"},
    "host32_compressed": {"host_budget": "32GiB", "compression": "lossless"},
    "host24_compressed": {"host_budget": "24GiB", "compression": "lossless"},
    "defaults": {},
    "host32_raw": {"host_budget": "32GiB", "compression": "none"},
    "ram_compressed": {"host_budget": None, "compression": "lossless"},
    # host32_compressed again in the same call: one of its runs was not bitwise (results README, issue 25 fifth
    # session), so a reproduction runs it more than once against the same machine's reference
    "host32_compressed_repeat": {"host_budget": "32GiB", "compression": "lossless"},
    # host32_compressed verifies every load on a GPU (`engine.load_checks`: a wrong load fails the generation naming
    # the unit and how it was loaded); this is the same without, for what verifying costs
    "host32_compressed_unverified": {"host_budget": "32GiB", "compression": "lossless", "verify_loads": False},
    "defaults_64gb": {},
    # host32_compressed with the hand-over turned off (`WITHOUT_HAND_OVER`): what handing an expert's RAM over
    # during its last forward costs that forward, beside what it saves the switch after it
    "host32_compressed_no_hand_over": {"host_budget": "32GiB", "compression": "lossless"},
}
#: Configurations whose experts keep their RAM through their last forward: the benchmark clears the pipeline's
#: last-forward forecast after enable (``pipe._flextensor.last_forward``), so no forward is taken for the last.
WITHOUT_HAND_OVER = {"host32_compressed_no_hand_over"}
#: Configurations run as on a machine with less RAM: the parent holds the rest of the machine's RAM (touched
#: anonymous memory: `ballast`) while the child runs, so that the RAM available is what such a machine has left.
#: Full size only (the tiny pipeline runs as ``defaults``).
MACHINE_RAM = {"defaults_64gb": "64GiB"}
DEFAULT_CONFIGS = ("ram_raw", "host32_compressed", "host24_compressed", "defaults")
#: The configuration the others are compared with (latents, step time, overhead).
REFERENCE = "ram_raw"
#: Seconds a full-size configuration is expected to take (load, enable, both generations; from
#: host_tier_h200.json's runs, compression's encoding and the payload reads added): none starts with less left.
EXPECTED_S = {
    "ram_raw": 100,
    "defaults": 100,
    "host32_compressed": 240,
    "host24_compressed": 240,
    "host32_raw": 200,
    "defaults_64gb": 200,
    "ram_compressed": 150,
    "host32_compressed_repeat": 200,
    "host32_compressed_unverified": 200,
    "host32_compressed_no_hand_over": 200,
}
#: Set-up runs on the block stack, in order, and the `peers.set_up` method of each. The two compressed runs share
#: one cache folder, empty before the first: the first writes the payload file, the second reads it. The folder is
#: emptied again before the run with ``background_encoding=False``: it finds no file and encodes before returning.
SETUP_RUNS = {
    "raw": "flextensor_diffusers",
    "flextensor": "flextensor",
    "compressed_first": "flextensor_diffusers_lossless_cached",
    "compressed_cached": "flextensor_diffusers_lossless_cached",
    "compressed_first_at_setup": "flextensor_diffusers_lossless_at_setup",
}
SETUP_WORKLOAD = "17f_480x272"
#: The runs ``--setup-repeats`` runs again, in turns, right after the cached one: the targets compare these two,
#: and one run of each in a different state of the machine (page cache, write-back) was not enough to. A repeat
#: measures set-up and the first forward only (``--first-step-only``): the first run of each has shown the forwards
#: after it, and the repeats' time goes to more pairs (call Y: the first cached run took 67 s, its repeats 42–45 s).
REPEATED_SETUP_RUNS = ("raw", "compressed_cached")


def base_run(run: str) -> str:
    """The `SETUP_RUNS` name of a run, repeats (``raw#2``) included."""
    return run.split("#")[0]


def setup_runs(args: argparse.Namespace) -> list[str]:
    """The set-up runs in order: ``--setup-runs`` (default all of `SETUP_RUNS`), with ``--setup-repeats`` more of
    raw and compressed_cached in turns after the cached one."""
    chosen = [run for run in SETUP_RUNS if run in args.setup_runs]
    repeats = [f"{run}#{n}" for n in range(2, args.setup_repeats + 2) for run in REPEATED_SETUP_RUNS]
    if "compressed_cached" not in chosen:
        return chosen
    at = chosen.index("compressed_cached") + 1
    return chosen[:at] + repeats + chosen[at:]


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


#: The tiny stack (``peers.py``'s quick check).
TINY_STACK = StackShape(blocks=2, dim=256, heads=4, ffn=512, small=True)
#: What a resumed file must share with this run (else ``--redo``).
WORKLOAD_KEYS = ("size", "frames", "height", "width", "steps", "warmup_steps", "guidance", "seed", "card")
#: A reported value longer than this (as JSON) is trimmed in the JSON (dictionaries are trimmed key by key).
TRIM_CHARS = 4000


def now(start: float) -> str:
    return f"[{time.perf_counter() - start:7.1f} s]"


def needed_s(name: str, args: argparse.Namespace) -> float:
    """Seconds that must be left of ``--time-limit`` for configuration ``name`` to start."""
    return args.phase_min_s if args.size == "tiny" else max(args.phase_min_s, EXPECTED_S.get(name, 0))


def not_run(left: float) -> str:
    return f"not run: {max(left, 0):.0f} s left of --time-limit"


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def trim(value: Any, limit: int = TRIM_CHARS) -> Any:
    """``value`` with anything longer than ``limit`` characters of JSON shortened: dictionaries key by key,
    lists to their first 32 items, anything else to a note of its length."""
    text = json.dumps(value, default=str)
    if len(text) <= limit:
        return value
    if isinstance(value, dict):
        return {k: trim(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [trim(v, limit) for v in value[:32]] + ([f"... {len(value) - 32} more"] if len(value) > 32 else [])
    return f"<trimmed: {len(text)} characters>"


def code_commit() -> str:
    """$CODE_COMMIT, else this checkout's commit (``+dirty`` with uncommitted changes), else "unknown"."""
    if os.environ.get("CODE_COMMIT"):
        return os.environ["CODE_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
        return head + ("+dirty" if dirty.strip() else "")
    return "unknown"


# ---------------------------------------------------------------------------------------- configurations


def host_budget_of(name: str, args: argparse.Namespace) -> int | str | None:
    """The configuration's host budget as passed to enable: the full-size string, or for the tiny pipeline (whose
    host budget bounds its host copies alone: `host_copies_only`) "32GiB" as one expert + the VAE + a quarter of
    an expert (issue 15's tiny default) and "24GiB" as the VAE + one expert: at full size 24 GiB,
    less the process's own memory and the 1 GiB reserve, holds less than the VAE and one raw expert need in RAM
    (the other expert's base stays there too) but more than the VAE and one compressed expert; with the tiny
    pipeline's packing (bases, alignment) and its fp32 weights (which compress to about 0.86) that is what the
    VAE + one expert's parameter bytes + 64 KiB is (~480 KiB, between ~465 and ~503 KiB)."""
    budget = CONFIGS[name].get("host_budget")
    if budget is None or args.size == "full":
        return budget
    sizes = component_bytes(wan_config("tiny"))
    expert, vae = sizes["transformer"], sizes["vae"]
    fractions = {"32GiB": 1.25, "24GiB": 1.0}
    return vae + int(fractions[budget] * expert) + 2**16


def enable_options(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The configuration's keyword arguments of ``enable_flextensor_offload`` (budget and cache_dir added)."""
    options = dict(CONFIGS[name])
    if "host_budget" in options:
        options["host_budget"] = host_budget_of(name, args)
    if args.verify_loads:  # every unit call checks its device bytes (the report's load_checks say what was found)
        options["verify_loads"] = True
    return {"budget": args.budget_bytes, "cache_dir": str(args.cache_dir), **options}


# ---------------------------------------------------------------------------------------- saving


def link_expert(folder: Path) -> list[str]:
    """``transformer_2``: a folder with ``transformer``'s config and symlinks to its weight files."""
    source, target = folder / "transformer", folder / "transformer_2"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    links = []
    for path in sorted(source.iterdir()):
        if path.name == "config.json":
            shutil.copy2(path, target / path.name)
        else:
            (target / path.name).symlink_to(Path("..") / "transformer" / path.name)
            links.append(path.name)
    return links


def child_save_linked(args: argparse.Namespace) -> dict[str, Any]:
    """`child_save` for ``transformer`` and ``vae`` only, then ``transformer_2`` linked."""
    out = child_save(args, ("transformer", "vae"))
    out["transformer_2_links"] = link_expert(args.folder)
    out.update(complete=True, size=args.size, seed=args.seed)
    return out


def disk_probe(folder: Path, limit: int) -> dict[str, Any]:
    """Read rate of the weight files straight after dropping the page cache: up to ``limit`` bytes of
    ``transformer``'s files, 64 MiB at a time, on one thread."""
    files = sorted((folder / "transformer").glob("*.safetensors"))
    how = drop_page_cache(files)
    io_before, start, done = storage_read_bytes(), time.perf_counter(), 0
    buffer = bytearray(64 * 2**20)
    for path in files:
        with open(path, "rb", buffering=0) as file:
            while done < limit and (n := file.readinto(buffer)):
                done += n
        if done >= limit:
            break
    seconds = time.perf_counter() - start
    io_after = storage_read_bytes()
    return {
        "bytes": done,
        "seconds": round(seconds, 3),
        "GBps": round(done / seconds / 1e9, 3) if seconds > 0 else None,
        "page_cache_drop": how,
        "storage_read_bytes": None if io_before is None else io_after - io_before,
    }


# ---------------------------------------------------------------------------------------- a configuration


class StepClock:
    """The pipeline, with the end of every denoising step timestamped (``ends``) after ``generate``'s own
    ``callback_on_step_end`` (which synchronises the device); everything else is the pipeline's."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.ends: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __call__(self, *args: Any, callback_on_step_end: Any = None, **kwargs: Any) -> Any:
        def on_step(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            out = callback_on_step_end(pipe, i, t, tensors) if callback_on_step_end is not None else tensors
            self.ends.append(time.perf_counter())
            return out

        return self._pipe(*args, callback_on_step_end=on_step, **kwargs)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def host_copies(pipe: Any, cache_dir: Path) -> dict[str, Any]:
    """Where the host copies are now, from the offload report: RAM (raw, compressed), disk, and the process;
    and the bytes of the cache files in ``cache_dir``."""
    report = pipe.flextensor_report()
    components = report.get("components", {})
    places = [c.get("host_places") or {} for c in components.values()]
    tier = report.get("host_tier") or {}
    return {
        "host_ram_bytes": sum(c.get("host_ram_bytes") or 0 for c in components.values()),
        **{key: sum(p.get(key) or 0 for p in places) for key in PLACES},
        "process_host_bytes": report.get("process_host_bytes"),
        "tier_host_ram_bytes": tier.get("host_ram_bytes"),
        "cache_dir_bytes": folder_bytes(cache_dir),
    }


#: Where host copies are, as ``host_places`` of the offload report's components says (`HostPlaces`).
PLACES = ("ram_raw_bytes", "ram_compressed_bytes", "disk_bytes")


def latents_sha256(latents: torch.Tensor) -> str:
    return hashlib.sha256(latents.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def child_pipeline(args: argparse.Namespace) -> None:
    """One configuration (``--config``) in this process; see the module docstring. Errors are recorded."""
    import diffusers
    from diffusers import WanPipeline

    from flextensor_diffusers.recipes.models import load_pipeline

    diffusers.utils.logging.set_verbosity_error()
    if os.environ.get("TIERS_BENCH_LOG"):  # e.g. INFO: the host tier's moves and reads, timestamped, in the log
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(name)s: %(message)s", "%H:%M:%S"))
        package = logging.getLogger("flextensor_diffusers")
        package.addHandler(handler)
        package.setLevel(os.environ["TIERS_BENCH_LOG"])
    name = args.config
    run = ChildRun(args)  # phases, host memory sampler, storage reads, progress file
    run.role = name
    options = enable_options(name, args)
    tiered = options.get("host_budget") is not None or name in MACHINE_RAM  # "auto" may turn the tier on there
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    run.out.update(
        config=name,
        enable_kwargs=options,
        device=device_name(device),
        torch=torch.__version__,
        diffusers=diffusers.__version__,
        complete=False,
    )
    run.out["page_cache_drop_before_load"] = drop_page_cache(weight_files(args.folder))
    host = run.out["host_copies_by_phase"] = {}
    try:
        with run.phase("load"):
            dtype = getattr(torch, wan_config(args.size)["dtype"])
            pipe = load_pipeline(args.folder, WanPipeline, dtype=dtype, text_encoder=None, tokenizer=None)
            pipe.set_progress_bar_config(disable=True)
        run.out["weights_bytes"] = sum(
            t.numel() * t.element_size()
            for part in ("transformer", "transformer_2", "vae")
            for t in getattr(pipe, part).state_dict().values()
        )
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.card) / total), device)
        watch = PeakWatch(device)  # from before enable: the GPU budget is a ceiling for the whole run
        clock = StepClock(pipe)
        enable_start = time.perf_counter()
        with run.phase("enable"), host_copies_only() if args.size == "tiny" else contextlib.nullcontext():
            pipe.enable_flextensor_offload(**options)
        run.out["setup_s"] = round(time.perf_counter() - enable_start, 4)
        if name in WITHOUT_HAND_OVER:
            pipe._flextensor.last_forward = None
            run.out["hand_over"] = "off: the last-forward forecast cleared after enable"
        host["enable"] = host_copies(pipe, args.cache_dir)
        run.save()
        embeds = random_embeddings(pipe, args.seed, device)
        for gen, steps in (("warmup", args.warmup_steps), ("measured", args.steps)):
            if tiered and gen == "measured":  # cold reads for the measured switches
                run.out["page_cache_drop_before_measured"] = drop_page_cache(weight_files(args.folder))
            with run.phase(gen):
                clock.ends.clear()
                info = generate(clock, args, steps, embeds, device)
                if gen == "warmup" and clock.ends:
                    run.out["time_to_first_step_s"] = round(clock.ends[0] - enable_start, 4)
                info["peak_allocated_bytes"] = watch.part()
                latents = info.pop("latents")
                torch.save(latents, args.progress.parent / f"{name}_{gen}.pt")
                info["latents_sha256"] = latents_sha256(latents)
                info["latents_shape"], info["latents_dtype"] = list(latents.shape), str(latents.dtype)
                run.out[gen] = info
            host[gen] = host_copies(pipe, args.cache_dir)
        report = pipe.flextensor_report()
        run.out["budget"] = watch.check(f"{name} run", report.get("budget_bytes", args.budget_bytes))
        run.out["report"] = trim(report)
    except Exception as exc:  # recorded, and the parent goes on with the next configuration
        traceback.print_exc()
        run.out["error"] = error_text(exc)
        run.out["failed_phase"] = run.sampler.phase
        # the failed generation's steps (a wrong load found at its end by verify_loads: which step went wrong)
        run.out["failed_step_latents_sha256"] = getattr(exc, "step_latents_sha256", None)
    run.sampler.stop()
    run.out["complete"] = True
    run.save()


# ---------------------------------------------------------------------------------------- a set-up run


def compressed_steady(handle: Any, runner: Any, x: tuple, device: torch.device, start: float) -> dict[str, Any]:
    """After the first forward of a compressed set-up: forwards until one runs in steady state with planned loads
    that decode (`forwards_until_compressed_steady`, at most 60 s), and when that was, from the start of set-up."""

    times: list[float] = []

    def forward() -> None:
        times.append(timed_forward(runner, x, device))

    ran = forwards_until_compressed_steady(handle, forward, limit_s=60.0)
    steady_from = time.perf_counter() - start
    forward()  # one in steady state with planned loads that decode (or after the limit)
    return {
        "compressed_steady_from_s": round(steady_from, 4) if ran is not None else None,
        "forwards_until_compressed_steady": None if ran is None else 1 + ran,  # the first forward counted
        "payloads_unproven": len(handle.host.compressed.unproven),
        # the forwards after the first: raw ones while payloads arrive or are made (the first 40), the steady one last
        "forward_s": times if len(times) <= 41 else times[:40] + times[-1:],
        "forwards_after_the_first": len(times),
    }


def timed_forward(runner: Any, x: tuple, device: torch.device) -> float:
    """One forward of ``runner``, device synchronised: its wall time in seconds."""
    begin = time.perf_counter()
    with torch.inference_mode():
        runner(*x)
    sync(device)
    return round(time.perf_counter() - begin, 4)


def raw_forwards(runner: Any, x: tuple, device: torch.device, count: int = 4) -> list[float]:
    """``count`` more forwards after the first of a raw set-up, timed: what the forwards of a compressed set-up
    that streams raw meanwhile are compared with."""
    return [timed_forward(runner, x, device) for _ in range(count)]


def child_setup(args: argparse.Namespace) -> dict[str, Any]:
    """One set-up run (``--setup-run``) of the block stack: set-up, then the first forward; its record."""
    from peers import set_up

    device = default_device()
    shape = StackShape.from_args(args)
    method = SETUP_RUNS[args.setup_run]
    out: dict[str, Any] = {"run": args.setup_run, "method": method, "device": device_name(device), "complete": False}
    try:
        model = build_stack(shape, "cpu" if device.type == "cpu" else device).to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        watch = PeakWatch(device)
        with HostMemorySampler(rss_bytes, 0.005) as rss:
            start, start_cpu = time.perf_counter(), time.thread_time()
            keep = set_up(method, model, device, args.setup_budget_bytes, str(args.scratch))
            setup_done = time.perf_counter()
            setup_s, setup_cpu_s = setup_done - start, time.thread_time() - start_cpu
            runner = keep if method == "flextensor" else model
            with torch.inference_mode():
                x = stack_inputs(shape, SETUP_WORKLOAD, device)  # after set-up, as a pipeline makes its latents
                sync(device)
                forward_start = time.perf_counter()
                y = runner(*x)
                sync(device)
                first_done = time.perf_counter()
        out.update(
            setup_s=round(setup_s, 4),
            # the set-up's own thread's CPU time: what is left of setup_s is waiting (the disk, other threads, locks)
            setup_thread_cpu_s=round(setup_cpu_s, 4),
            first_forward_s=round(first_done - forward_start, 4),
            # wall time from the start of set-up: packing that goes on after set-up returned counts in full
            time_to_first_step_s=round(first_done - start, 4),
            peak_host_rss_bytes=rss.peak(),
            output_sha256=latents_sha256(y.detach().cpu()),
            **watch.check(f"set-up {args.setup_run}", args.setup_budget_bytes),
        )
        if args.first_step_only:
            out["first_step_only"] = True
        elif method != "flextensor" and keep.config.compression != "none":
            out.update(compressed_steady(keep, runner, x, device, start))
        elif method == "flextensor_diffusers":
            out["forward_s"] = raw_forwards(runner, x, device)
        if method != "flextensor":
            stats = keep.stats()
            out.update(setup_ms=stats.setup_ms, payload_cache=stats.payload_cache)
            # written in the background: the next run needs the whole file
            if keep.payload_cache is not None and not args.first_step_only:
                payload_cache.wait_for_all_writes()
                out["payload_written_s_after_setup"] = round(time.perf_counter() - setup_done, 3)
                out["payload_cache_final"] = keep.payload_cache.describe()
    except Exception as exc:
        traceback.print_exc()
        out["error"] = error_text(exc)
    out["complete"] = True
    return out


# ---------------------------------------------------------------------------------------- the parent


def run_child(
    argv: list[str], progress: Path, deadline: float, limit: float | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """Run this script with ``argv``; its progress file (complete or not) and why it stopped early, if it did."""
    progress.unlink(missing_ok=True)
    timeout = deadline - time.perf_counter()
    timeout = min(timeout, limit) if limit else timeout
    error = None
    try:
        proc = subprocess.run([sys.executable, __file__, *argv, "--progress", str(progress)], timeout=timeout)
        if proc.returncode != 0:
            error = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = "stopped at --time-limit" if not limit or timeout < limit else f"timed out after {limit:.0f} s"
    data = json.loads(progress.read_text()) if progress.exists() else None
    return data, error


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--size", args.size, "--workdir", str(args.workdir), "--seed", str(args.seed)]
    argv += ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
    argv += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--guidance", str(args.guidance)]
    argv += ["--budget", str(args.budget_bytes), "--card", args.card, "--sample-ms", str(args.sample_ms)]
    argv += ["--verify-loads"] if args.verify_loads else []
    return [*argv, "--setup-budget", str(args.setup_budget_bytes), *args.stack.argv()]


def entry_of(name: str, args: argparse.Namespace, data: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """A configuration's row from its child's progress file (the figures against ``ram_raw`` come later)."""
    data = data or {}
    host_budget = host_budget_of(name, args)
    entry: dict[str, Any] = {
        "config": name,
        "enable_kwargs": data.get("enable_kwargs") or enable_options(name, args),
        "host_budget_bytes": None if host_budget is None else parse_bytes(host_budget),
        "complete": bool(data.get("complete")) and error is None,
    }
    if data.get("error") or error:
        entry["error"] = data.get("error") or f"{error} ({last_phase(data)})"
    peaks = data.get("host_peak_by_phase", {})
    entry["peak_host_bytes"] = max((v for k, v in peaks.items() if k in BUDGETED_PHASES), default=None)
    host = data.get("host_copies_by_phase", {})
    report = data.get("report") or {}
    tier = report.get("host_tier") or {}
    stored = [h["host_ram_bytes"] for h in host.values()] + [tier.get("peak_host_ram_bytes") or 0]
    entry["stored_host_bytes"] = max(stored) if host else None
    entry["weights_bytes"] = data.get("weights_bytes")
    if entry["host_budget_bytes"] is not None and entry["stored_host_bytes"] is not None:
        entry["stored_within_host_budget"] = entry["stored_host_bytes"] <= entry["host_budget_bytes"]
        if args.size == "full":  # tiny: the host budget bounds the host copies alone (host_copies_only)
            entry["peak_host_within_budget"] = entry["peak_host_bytes"] <= entry["host_budget_bytes"]
    if entry["host_budget_bytes"] is None and tier.get("host_budget_bytes"):  # "auto" turned the tier on
        entry["auto_host_budget_bytes"] = tier["host_budget_bytes"]
        if entry["peak_host_bytes"] is not None:
            entry["peak_host_within_budget"] = entry["peak_host_bytes"] <= tier["host_budget_bytes"]
    measured = data.get("measured")
    entry["step_s"] = steady_step_s(measured) if measured else None
    entry["switch_wait_s"] = []
    entry["overhead_40_steps_pct"] = None
    entry["bitwise_equal"] = None
    entry["setup_s"] = data.get("setup_s")
    entry["time_to_first_step_s"] = data.get("time_to_first_step_s")
    entry["host_tier"] = bool(tier)
    entry["tier_peak_host_ram_bytes"] = tier.get("peak_host_ram_bytes")
    entry["stored_host_bytes_by_phase"] = host
    entry["host_peak_by_phase"] = peaks
    entry["phases_s"] = data.get("phases_s", {})
    entry["storage_read_bytes"] = data.get("storage_read_bytes", {})
    entry["gpu_budget"] = data.get("budget")
    for gen in ("warmup", "measured"):
        if gen in data:
            entry[gen] = data[gen]
    entry["report"] = report or None
    for key in ("device", "torch", "diffusers"):
        entry[key] = data.get(key)
    return entry


def last_phase(data: dict[str, Any]) -> str:
    """Where a child that did not finish got to, from its progress file."""
    phases = list(data.get("phases_s", {}))
    return f"after its phase {phases[-1]}" if phases else "before its first phase ended"


def compare(result: dict[str, Any], scratch: Path) -> None:
    """Every row against ``ram_raw``'s: latents (both generations), and the 40-step overhead with the switch
    figures of `summarise_switches` (``ram_raw`` as its all-pinned run)."""
    rows = {row["config"]: row for row in result["pipeline"]}
    ref = rows.get(REFERENCE)
    ref_ok = ref is not None and "measured" in ref and not ref.get("error")
    for row in result["pipeline"]:
        if "measured" not in row:
            continue
        terms: dict[str, Any] = {}
        summarise_switches(terms, ref if ref_ok else row, row)
        if row["host_tier"]:
            row["switch_wait_s"] = terms.get("switch_wait_s", [])
            for key in ("switch_s", "switch_prefetched", "disk_read_GBps", "cold", "cold_evidence"):
                row[f"tier_{key}" if key == "disk_read_GBps" else key] = terms.get(key)
        row["switch_steps"] = terms.get("switch_steps")
        if not ref_ok:
            continue
        for key in ("overhead_40_steps_pct", "switch_exposed_s", "measured_generation_overhead_pct"):
            row[key] = terms.get(key)
        row["reference_step_s"] = ref["step_s"]
        equal = {}
        for gen in ("warmup", "measured"):
            if gen in row and gen in ref:
                a, b = scratch / f"{REFERENCE}_{gen}.pt", scratch / f"{row['config']}_{gen}.pt"
                if a.exists() and b.exists():
                    equal[gen] = bool(torch.equal(torch.load(a).view(torch.uint8), torch.load(b).view(torch.uint8)))
                else:  # a row of an earlier call: its latents' hash
                    equal[gen] = row[gen]["latents_sha256"] == ref[gen]["latents_sha256"]
        row["bitwise_equal_by_generation"] = equal
        row["bitwise_equal"] = len(equal) == 2 and all(equal.values())


def header(args: argparse.Namespace) -> dict[str, Any]:
    cfg = wan_config(args.size)
    return {
        "benchmark": "host-memory tiers (issue 25): Wan2.2-T2V-A14B configurations of enable_flextensor_offload, "
        "and set-up time on the 40-block stack",
        "device": None,
        "code": code_commit(),
        "disk_read_GBps": None,
        "model": f"Wan2.2-T2V-A14B architecture ({args.size}), random weights ({cfg['dtype']} experts, "
        f"{cfg['vae_dtype']} VAE), latents out (no VAE decode)",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "stack"},
        "budget_bytes": args.budget_bytes,
        "card_cap_bytes": parse_bytes(args.card),
        "notes": [
            "transformer_2's weight files are symlinks to transformer's (disk: one 28.6 GB expert saved): both "
            "experts hold identical random weights; the compute and the bytes moved are those of two experts",
            "no text encoder: every generation gets seeded random prompt_embeds and negative_prompt_embeds of "
            "UMT5-XXL's output shape (1, 512, text_dim) in the transformer's dtype",
            "the page cache of the weight files is dropped before each configuration's load and, for a "
            "configuration with a host budget, before its measured generation (cold reads for its switches); "
            "as the two experts share their files, a switch may still find pages of the other expert's reads "
            "in the page cache (storage_read_bytes, per phase from /proc/self/io, says what came from the disk)",
            "peak_host_bytes: RssAnon + RssShmem of the configuration's process, sampled every "
            f"{args.sample_ms:g} ms over its phases {', '.join(BUDGETED_PHASES)}",
            "identical experts give identical payload-cache keys: with compression, both experts' host tier "
            "payload files in cache_dir have one name: the first expert writes it after encoding, the second reads "
            "it at set-up (decode-checked against its weights) and both wait in it (a write by either, after an "
            "edit, would go to a file of its own), so cache_dir holds one expert's payloads where distinct experts "
            "would hold two (stored_host_bytes_by_phase[...].cache_dir_bytes)",
            "stored_host_bytes: the largest of the components' host_ram_bytes summed (flextensor_report, after "
            "enable and after each generation) and the host tier's peak_host_ram_bytes",
            "overhead_40_steps_pct: issue 15's formula with ram_raw in the all-pinned run's place and the "
            "configuration in the tiered run's",
            "disk_read_GBps: one thread reading transformer's weight files after a page cache drop (disk_probe); "
            "tier_disk_read_GBps per configuration: the host tier's own reads",
            *(
                [
                    "tiny: the host budgets bound the host copies alone (host_copies_only); 32GiB "
                    "maps to VAE + 1.25 experts, 24GiB to VAE + 1 expert (+ 64 KiB; see host_budget_of)"
                ]
                if args.size == "tiny"
                else []
            ),
        ],
        "overhead_formula": OVERHEAD_FORMULA,
        "pipeline": [],
        "setup": {},
        "phases": [],
    }


def resumed(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Keep an earlier file's finished rows and set-up runs, refusing another workload. With ``--redo``, the rows
    this call runs (``--configs`` unless ``--setup-only``; the set-up runs unless ``--no-setup``) are dropped."""
    path = args.resume if args.resume is not None else (args.out if args.out.exists() else None)
    if path is None:
        return
    earlier = json.loads(Path(path).read_text())
    differ = [k for k in WORKLOAD_KEYS if earlier.get("config", {}).get(k) != result["config"][k]]
    if differ:
        raise SystemExit(f"{path} was measured with another {', '.join(differ)}: delete it, or pass another --out")
    redo = set(args.configs) if args.redo and not args.setup_only else set()
    result["resumed_from"] = str(path)
    result["pipeline"] = [r for r in earlier.get("pipeline", []) if r.get("complete") and r["config"] not in redo]
    runs = {k: v for k, v in earlier.get("setup", {}).get("runs", {}).items() if v.get("complete")}
    if runs and not (args.redo and not args.no_setup):
        result["setup"] = {"runs": runs}
    for key in ("device", "disk_read_GBps", "disk_probe", "disk", "save"):
        result[key] = result[key] if result.get(key) is not None else earlier.get(key)
    result["phases"] = [{**p, "resumed": True} for p in earlier.get("phases", [])]


def saved_folder(args: argparse.Namespace) -> dict[str, Any] | None:
    """The save record of a folder an earlier call left in the work folder, if complete and of this size."""
    record = args.workdir / "scratch" / "save.json"
    if not ((args.workdir / MARKER).exists() and record.exists() and (args.folder / "model_index.json").exists()):
        return None
    data = json.loads(record.read_text())
    return data if data.get("complete") and data.get("size") == args.size and data.get("seed") == args.seed else None


def empty(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)


def pipeline_phase(args: argparse.Namespace, result: dict[str, Any], deadline: float, phase_done: Any) -> None:
    """Save (or reuse) the folder, probe the disk, then each configuration not finished yet."""
    done = {row["config"] for row in result["pipeline"]}
    todo = [name for name in args.configs if name not in done]
    if not todo:
        return
    scratch = args.workdir / "scratch"
    t0 = time.perf_counter()
    earlier = saved_folder(args)
    if earlier is None:
        fresh_workdir(args.workdir)
        sizes = {**component_bytes(wan_config(args.size)), "transformer_2": 0}  # a link
        margin = parse_bytes("2GiB") + args.cache_room_bytes
        result["disk"] = check_disk(args.workdir, sizes, margin, args.allow_tmpfs)
        data, error = run_child(["--child", "save", *child_argv(args)], scratch / "save.json", deadline)
        result["save"] = data
        if data is None or error:
            raise SystemExit(f"saving failed: {error or 'no result'}")
        result["disk_probe"] = disk_probe(args.folder, args.probe_bytes)
        result["disk_read_GBps"] = result["disk_probe"]["GBps"]
        phase_done("save", t0)
    else:
        result.setdefault("save", earlier)
        phase_done("save", t0, reused=str(args.folder))
    for name in todo:
        t0 = time.perf_counter()
        left = deadline - time.perf_counter()
        if left < needed_s(name, args):
            row = {"config": name, "complete": False, "error": not_run(left)}
        else:
            empty(args.cache_dir)
            argv = ["--child", "pipeline", "--config", name, *child_argv(args)]
            with ballast(name, args) as held:
                data, error = run_child(argv, scratch / f"{name}.json", deadline)
            empty(args.cache_dir)
            row = entry_of(name, args, data, error)
            if name in MACHINE_RAM and args.size == "full":
                row["machine_ram_bytes"], row["ballast_bytes"] = parse_bytes(MACHINE_RAM[name]), held
            result["device"] = result.get("device") or row.get("device")
        result["pipeline"] = [r for r in result["pipeline"] if r["config"] != name] + [row]
        result["pipeline"].sort(key=lambda r: list(CONFIGS).index(r["config"]))
        compare(result, scratch)
        phase_done(name, t0, **({"error": row["error"]} if row.get("error") else {}))


@contextlib.contextmanager
def ballast(name: str, args: argparse.Namespace) -> Any:
    """For a configuration of `MACHINE_RAM` (full size), hold the machine's RAM beyond that size in this process
    while the child runs: an anonymous mapping with every page written, so that the kernel cannot reclaim it and
    the child finds the RAM available of the smaller machine. Yields the bytes held (0: none)."""
    if name not in MACHINE_RAM or args.size != "full":
        yield 0
        return
    import mmap

    import psutil

    nbytes = max(0, psutil.virtual_memory().total - parse_bytes(MACHINE_RAM[name]))
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        chunk = b"\1" * (64 << 20)
        for start in range(0, nbytes, len(chunk)):
            region[start : start + min(len(chunk), nbytes - start)] = chunk[: nbytes - start]
        available = psutil.virtual_memory().available
        print(f"ballast: holding {nbytes / 2**30:.1f} GiB; {available / 2**30:.1f} GiB available", flush=True)
        yield nbytes
    finally:
        region.close()


SETUP_KEYS = {
    "raw": ("raw_s", "time_to_first_step_raw_s"),
    "flextensor": ("flextensor_s", "time_to_first_step_flextensor_s"),
    "compressed_first": ("compressed_first_s", "time_to_first_step_compressed_first_s"),
    "compressed_cached": ("compressed_cached_s", "time_to_first_step_compressed_cached_s"),
    "compressed_first_at_setup": ("compressed_first_at_setup_s", "time_to_first_step_compressed_first_at_setup_s"),
}


def setup_summary(setup: dict[str, Any], args: argparse.Namespace) -> None:
    """The set-up block's figures from its runs; each run's error under ``errors``."""
    runs = setup.get("runs", {})
    errors = {run: record["error"] for run, record in runs.items() if record.get("error")}
    for base, (setup_key, first_key) in SETUP_KEYS.items():
        repeats = [record for run, record in runs.items() if base_run(run) == base and record.get("setup_s")]
        setup[setup_key] = median([record["setup_s"] for record in repeats])
        setup[first_key] = median([record["time_to_first_step_s"] for record in repeats])
        if len(repeats) > 1:  # each repeat's figure, in the order run
            setup[f"{setup_key}_runs"] = [record["setup_s"] for record in repeats]
            setup[f"{first_key}_runs"] = [record["time_to_first_step_s"] for record in repeats]
    setup["errors"] = errors
    setup.update(
        stack=vars(args.stack),
        workload=SETUP_WORKLOAD,
        budget_bytes=args.setup_budget_bytes,
        scope="setup_s: the set-up call (peers.set_up); time_to_first_step_s: wall time from the start of set-up "
        "to the end of the first forward (its inputs made in between), device synchronised; ours raw packs "
        "progressively (set-up returns while units are packed; the first forward waits for each it reaches); "
        "one fresh process per run, each after a sync and a page cache drop; with --setup-repeats, raw and "
        "compressed_cached ran again in turns (runs '<run>#<n>'), and each figure is the median of its runs",
    )
    ours, theirs = setup.get("raw_s"), setup.get("flextensor_s")
    setup["raw_vs_flextensor"] = round(ours / theirs, 3) if ours and theirs else None  # target <= 0.8
    for run in ("compressed_cached", "compressed_first", "compressed_first_at_setup"):  # targets <= 1, <= 1.5
        other = setup.get(f"{run}_s")
        setup[f"{run}_vs_raw"] = round(other / ours, 3) if ours and other else None
    setup["compressed_cached_vs_raw_pairs"] = cached_vs_raw_pairs(runs)


def cached_vs_raw_pairs(runs: dict[str, Any]) -> list[float]:
    """Each cached set-up over the raw one of its round (``compressed_cached#n`` / ``raw#n``; the first cached run
    over the first raw run): pairs run close together share the machine's state, which drifts over a call."""
    pairs = []
    for run, record in runs.items():
        if base_run(run) != "compressed_cached" or not record.get("setup_s"):
            continue
        raw = runs.get(run.replace("compressed_cached", "raw"), {}).get("setup_s")
        if raw:
            pairs.append(round(record["setup_s"] / raw, 3))
    return pairs


def setup_phase(args: argparse.Namespace, result: dict[str, Any], deadline: float, phase_done: Any) -> None:
    """The set-up runs not finished yet (both compressed runs when the cached one is to run: it needs the file
    the first one writes in this call)."""
    setup = result["setup"]
    runs = setup.setdefault("runs", {})
    todo = [run for run in setup_runs(args) if not runs.get(run, {}).get("complete")]
    if any(base_run(run) == "compressed_cached" for run in todo) and "compressed_first" not in todo:
        todo.insert(next(i for i, run in enumerate(todo) if base_run(run) == "compressed_cached"), "compressed_first")
    if not todo:
        setup_summary(setup, args)
        return
    if args.workdir.exists() and any(args.workdir.iterdir()) and not (args.workdir / MARKER).exists():
        raise SystemExit(f"--workdir {args.workdir} holds files this script did not write: pass a new or empty folder")
    (args.workdir / "scratch").mkdir(parents=True, exist_ok=True)
    (args.workdir / MARKER).touch()
    cache = args.workdir / "setup_cache"
    empty(cache)
    try:
        for run in todo:
            t0 = time.perf_counter()
            left = deadline - time.perf_counter()
            if run == "flextensor" and importlib.util.find_spec("flextensor") is None:
                runs[run] = {"run": run, "complete": False, "error": "not installed"}
            elif left < args.phase_min_s:
                runs[run] = {"run": run, "complete": False, "error": not_run(left)}
            else:
                if run == "compressed_first_at_setup":  # no payload file to find: it encodes before set-up returns
                    empty(cache)  # (the cached run is done with it; the disk holds one payload file at a time)
                # every run starts with no dirty pages to write back and an empty page cache (the first compressed
                # run writes ~20 GB: its write-back would otherwise fall in the next run's set-up)
                setup["page_cache_drop"] = drop_page_cache(sorted(cache.glob("*")))
                argv = ["--child", "setup", "--setup-run", base_run(run), "--scratch", str(cache), *child_argv(args)]
                argv += ["--first-step-only"] if run != base_run(run) else []
                data, error = run_child(
                    argv, args.workdir / "scratch" / f"setup_{run}.json", deadline, args.setup_timeout
                )
                runs[run] = data or {"run": run}
                if error:
                    runs[run].update(complete=False, error=runs[run].get("error") or error)
                result["device"] = result.get("device") or runs[run].get("device")
            setup_summary(setup, args)
            phase_done(f"setup {run}", t0, **({"error": runs[run]["error"]} if runs[run].get("error") else {}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def parent(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    deadline = start + args.time_limit
    result = header(args)
    resumed(args, result)

    def phase_done(name: str, t0: float, **extra: Any) -> None:
        result["phases"].append({"phase": name, "seconds": round(time.perf_counter() - t0, 2), **extra})
        write_json(args.out, result, quiet=True)
        print(f"{now(start)} done: {name} ({time.perf_counter() - t0:.1f} s)", flush=True)

    write_json(args.out, result, quiet=True)
    try:
        if not args.setup_only:
            pipeline_phase(args, result, deadline, phase_done)
        if not args.no_setup:
            setup_phase(args, result, deadline, phase_done)
    except SystemExit as exc:
        result["error"] = str(exc)
        write_json(args.out, result)
        raise
    finally:
        finished = {row["config"] for row in result["pipeline"] if row.get("complete")}
        if set(args.configs) <= finished and not args.keep_workdir:
            shutil.rmtree(args.workdir, ignore_errors=True)  # the folder (~29 GB at full size), cache and latents
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json(args.out, result)
    print(json.dumps(summary(result), indent=1))


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures: the shape of the JSON without the details."""
    keys = (
        "config",
        "host_budget_bytes",
        "peak_host_bytes",
        "stored_host_bytes",
        "weights_bytes",
        "step_s",
        "switch_wait_s",
        "overhead_40_steps_pct",
        "bitwise_equal",
        "setup_s",
        "time_to_first_step_s",
        "error",
    )
    setup = {k: v for k, v in result.get("setup", {}).items() if k not in ("runs", "stack", "scope")}
    return {
        **{k: result.get(k) for k in ("device", "code", "disk_read_GBps")},
        "pipeline": [{k: row.get(k) for k in keys if k in row} for row in result["pipeline"]],
        "setup": setup,
    }


# ---------------------------------------------------------------------------------------- command line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the JSON to write (after every phase); required")
    parser.add_argument(
        "--resume", type=Path, default=None, help="an earlier result whose finished rows to keep (default: --out)"
    )
    parser.add_argument(
        "--redo", action="store_true", help="run the chosen configurations and set-up runs again, keep the others"
    )
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma list of {', '.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)}). Host budgets: full "
        "size 32GiB and 24GiB; tiny (its host budget bounds the host copies alone, as issue 15's bench) 32GiB "
        "-> VAE + 1.25 experts, 24GiB -> VAE + 1 expert (parameter bytes; with the tiny packing, less than the VAE "
        "and one raw expert need in RAM, more than the VAE and one compressed expert, as 24 GiB is at full size "
        "once the process's own memory and the 1 GiB reserve are off), each + 64 KiB",
    )
    parser.add_argument("--no-setup", action="store_true", help="the pipeline configurations only")
    parser.add_argument("--setup-only", action="store_true", help="the set-up runs on the block stack only")
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--workdir", type=Path, default=None, help="folder, caches; default <tmp>/tiers_bench-SIZE")
    add_generation_arguments(parser)
    parser.add_argument(
        "--budget",
        default=None,
        help="GPU budget (default 8GiB; tiny: 360000, over the 320 KiB a compressed load of its blocks needs)",
    )
    parser.add_argument("--card", default="24GB", help="memory cap of the emulated card")
    parser.add_argument(
        "--verify-loads",
        action="store_true",
        help="enable with verify_loads=True: every unit call compares its device bytes with its weights, and a "
        "wrong load fails the generation (the report's load_checks count the comparisons)",
    )
    parser.add_argument(
        "--cache-room",
        default=None,
        help="disk kept free for cache_dir's files besides the folder (default 22GiB; tiny: 16MiB)",
    )
    parser.add_argument("--probe-bytes", default="4GiB", help="bytes of the cold disk read probe")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="host memory sampling interval")
    parser.add_argument("--allow-tmpfs", action="store_true", help="allow a work folder on tmpfs")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the work folder (the saved pipeline)")
    parser.add_argument(
        "--time-limit", type=float, default=520.0, help="seconds for the whole call; a phase running past it stops"
    )
    parser.add_argument(
        "--phase-min-s",
        type=float,
        default=None,
        help="start no phase with less time left (default 90, and for a full-size configuration its expected "
        "time: 100 s raw, 200 s with a host budget; tiny: 5)",
    )
    parser.add_argument(
        "--setup-budget",
        default=None,
        help="GPU budget of the set-up runs (default 2800000000, as peers.py's; tiny 1GiB)",
    )
    parser.add_argument("--setup-timeout", type=float, default=300.0, help="seconds per set-up run")
    parser.add_argument(
        "--setup-runs",
        type=lambda text: [run for run in text.split(",") if run],
        default=list(SETUP_RUNS),
        help=f"comma list of the set-up runs, of {', '.join(SETUP_RUNS)} (default: all)",
    )
    parser.add_argument(
        "--setup-repeats",
        type=int,
        default=0,
        help="run raw and compressed_cached this many more times, in turns; each figure is then the median",
    )
    StackShape.add_arguments(parser)  # the stack of the set-up runs (tiny: a 2-block stack unless given)
    parser.add_argument("--child", choices=("save", "pipeline", "setup"), help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--setup-run", choices=list(SETUP_RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tiny = args.size == "tiny"
    if args.out is None and args.child is None:
        parser.error("--out is required")
    if args.no_setup and args.setup_only:
        parser.error("--no-setup and --setup-only exclude each other")
    unknown_runs = [run for run in args.setup_runs if run not in SETUP_RUNS]
    if unknown_runs:
        parser.error(f"unknown --setup-runs {', '.join(unknown_runs)}; of {', '.join(SETUP_RUNS)}")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; one of {', '.join(CONFIGS)}")
    resolve_generation_arguments(args)
    args.workdir = args.workdir or Path(tempfile.gettempdir()) / f"tiers_bench-{args.size}"
    args.folder, args.cache_dir = args.workdir / "pipeline", args.workdir / "cache"
    args.budget_bytes = parse_bytes(args.budget or (360_000 if tiny else "8GiB"))
    args.cache_room_bytes = parse_bytes(args.cache_room or ("16MiB" if tiny else "22GiB"))
    args.probe_bytes = parse_bytes(args.probe_bytes)
    args.phase_min_s = args.phase_min_s if args.phase_min_s is not None else (5.0 if tiny else 90.0)
    args.setup_budget_bytes = parse_bytes(args.setup_budget or ("1GiB" if tiny else 2_800_000_000))
    args.stack = StackShape.from_args(args)
    if tiny and args.stack == StackShape():
        args.stack = TINY_STACK
    return args


def main() -> None:
    args = parse_args()
    if args.child and args.size == "tiny":
        torch.set_num_threads(1)  # 2 threads on a shared CPU make the tiny step times noise
    if args.child == "save":
        write_json(args.progress, child_save_linked(args), quiet=True)
        return
    if args.child == "setup":
        write_json(args.progress, child_setup(args), quiet=True)
        sys.stdout.flush()
        os._exit(0)  # no teardown of the pinned host copies, one tensor at a time
    if args.child == "pipeline":
        child_pipeline(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.size == "full" and not torch.cuda.is_available():
        raise SystemExit("--size full needs a CUDA GPU (use --size tiny to check the script on a CPU)")
    print(f"tiers_bench: {args.size}, configurations {', '.join(args.configs)}, out {args.out}", flush=True)
    parent(args)


if __name__ == "__main__":
    main()
