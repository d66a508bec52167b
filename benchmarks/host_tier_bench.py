"""Issue 15's GPU proof: Wan2.2-T2V-A14B (random bf16 weights) from a diffusers folder under a host budget.

Saves the full-size pipeline's ``transformer``, ``transformer_2``, ``vae`` and ``scheduler`` as a diffusers
folder (no text encoder: the generations get seeded random ``prompt_embeds`` / ``negative_prompt_embeds``
of UMT5-XXL's output shape, so the pipeline is loaded with ``text_encoder=None, tokenizer=None``), then
runs two child processes, each with a 24 GB card emulated (``set_per_process_memory_fraction``):

* all-pinned: ``from_pretrained`` + ``enable_flextensor_offload(budget="8GiB")``, every host copy in
  pinned RAM;
* tiered: page cache dropped (where the machine permits it), ``from_pretrained`` +
  ``enable_flextensor_offload(budget="8GiB", host_budget="32GiB")``: one expert's host copies wait on disk.

Each runs a warm-up generation (discovery and profiling, both experts) and a measured one (81 frames
832x480, CFG, ``--steps`` steps crossing the expert boundary), timing every step with
``callback_on_step_end`` after ``torch.cuda.synchronize``, sampling RssAnon + RssShmem every 50 ms.
The parent compares the latents bitwise and writes ``--out``: peak host memory, per-step time of both
runs, each switch's disk read and the part of it a step paid, disk bandwidth, whether the reads were
cold, and a 40-step overhead extrapolated from those (the formula is in the JSON).

Disk: the folder (two 28.6 GB experts and the VAE) takes ~54 GiB. A host tier that lets an expert wait
in the folder's own safetensors files needs no more than a cache file for the VAE (loaded in bf16, so
converted). One that writes a cache file per component it moves out (the tier as first built: both
experts over a run) needs ~54 GiB more, which a ~64 GiB disk does not have: a probe on the tiny
pipeline (full dtypes, CPU, seconds) tells which, and then ``--mode auto`` saves only the VAE and
scheduler and each child builds the experts in memory (same seeds, so the same weights; a digest checks
it) and passes them to ``from_pretrained``. What was saved is in the JSON; a disk that holds neither
plan is refused before anything is written.

    python benchmarks/host_tier_bench.py --out $OUT/host_tier_h200.json      # full size, on the GPU
    python benchmarks/host_tier_bench.py --size tiny --out /tmp/host_tier_tiny.json   # CPU, seconds

The JSON is written after every phase (and the children write theirs after every step of theirs),
so a run cut off by ``--time-limit`` or the caller keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine_bench as eb

from flextensor_diffusers.engine.config import parse_bytes

EXPERTS = ("transformer", "transformer_2")
#: Seed offsets of `models.build_wan22_t2v` (the text encoder's +2 is not built here).
SEED_OFFSET = {"transformer": 0, "transformer_2": 1, "vae": 3}
#: Marks a folder this script saved (reused by a later call with the same size, mode and seed).
MARKER = "host_tier_bench.json"
#: UMT5's output length for Wan (``max_sequence_length`` of the pipeline).
TEXT_TOKENS = 512
#: Steps of the extrapolated generation.
STEPS_40 = 40
OVERHEAD_FORMULA = (
    "overhead_40_steps_pct = 100 * (40 * (tiered_step_s - all_pinned_step_s) + sum(switch_exposed_s)) "
    "/ (40 * all_pinned_step_s), where tiered_step_s and all_pinned_step_s are medians of the measured "
    "generation's steps that switch no component, and switch_exposed_s[k] is the tiered minus the "
    "all-pinned duration of the k-th switching step of that generation (its first step, which brings "
    "the high-noise expert back, and its first low-noise step): a generation of any length switches "
    "twice, as the measured one (the warm-up generation before it wrote the cache files)"
)
TEXT_ENCODER_NOTE = (
    "not saved nor loaded (text_encoder=None, tokenizer=None): both generations get seeded random "
    "prompt_embeds and negative_prompt_embeds of UMT5-XXL's output shape (1, 512, text_dim) in the "
    "transformer's dtype"
)


def now(start: float) -> str:
    return f"[{time.perf_counter() - start:7.1f} s]"


def gib(n: float | None) -> str:
    from flextensor_diffusers.engine import format_bytes

    return "n/a" if n is None else format_bytes(n)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------- sizes, disk


def wan_config(size: str) -> dict[str, Any]:
    from flextensor_diffusers.recipes.models import load_config

    return load_config("wan22_t2v", size)


def dtypes(cfg: dict[str, Any]) -> tuple[torch.dtype, torch.dtype]:
    return getattr(torch, cfg["dtype"]), getattr(torch, cfg["vae_dtype"])


def make_component(name: str, cfg: dict[str, Any], init_device: str, seed: int) -> torch.nn.Module:
    """One component with `models.build_wan22_t2v`'s random init (made on ``init_device``, then on the
    CPU unless meta), in the dtype ``from_pretrained(torch_dtype=...)`` would give it."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from flextensor_diffusers.recipes.models import _random

    dtype, vae_dtype = dtypes(cfg)
    if name == "vae":
        return _random(lambda: AutoencoderKLWan(**cfg["vae"]), init_device, vae_dtype, seed + SEED_OFFSET[name])
    return _random(lambda: WanTransformer3DModel(**cfg[name]), init_device, dtype, seed + SEED_OFFSET[name])


def component_bytes(cfg: dict[str, Any]) -> dict[str, int]:
    """Weight bytes of each saved component, from a meta-device build (nothing allocated)."""
    sizes = {}
    for name in (*EXPERTS, "vae"):
        module = make_component(name, cfg, "meta", 0)
        tensors = [*module.parameters(), *module.buffers()]
        sizes[name] = sum(t.numel() * t.element_size() for t in tensors)
    return sizes


def scheduler(cfg: dict[str, Any]) -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**{k: v for k, v in cfg["scheduler"].items() if not k.startswith("_")})


def existing_ancestor(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def filesystem(path: Path) -> dict[str, Any]:
    """Free bytes, device id, mount point and type of the filesystem ``path`` is (or will be) on."""
    where = existing_ancestor(path)
    usage = shutil.disk_usage(where)
    mount, fstype = "?", "?"
    with contextlib.suppress(OSError):
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(where).startswith(parts[1]) and len(parts[1]) > len(best):
                best, mount, fstype = parts[1], parts[1], parts[2]
    return {
        "path": str(path),
        "free_bytes": usage.free,
        "total_bytes": usage.total,
        "st_dev": os.stat(where).st_dev,
        "mount": mount,
        "fstype": fstype,
    }


def dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def weight_files(*folders: Path) -> list[Path]:
    files: list[Path] = []
    for folder in folders:
        if folder.exists():
            files += [f for f in folder.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".bin")]
    return files


# ---------------------------------------------------------------------------------------- page cache

PROT_READ, MAP_SHARED = 1, 1


def cached_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache now (mmap + mincore); None where that cannot be asked."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            import numpy as np

            resident = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * page)


def cached_fraction(files: list[Path]) -> float | None:
    """Share of these files' bytes in the page cache; None without files or where mincore fails."""
    total = cached = 0
    for f in files:
        try:
            c = cached_bytes(f)
        except OSError:
            c = None
        if c is None:
            return None
        total += f.stat().st_size
        cached += c
    return round(cached / total, 4) if total else None


def drop_page_cache(files: list[Path], how: str) -> dict[str, Any]:
    """Write dirty pages back, then drop the page cache: the whole system's (root, ``/proc/sys/vm/
    drop_caches``), else these files' clean pages (``posix_fadvise(DONTNEED)``, any user)."""
    result: dict[str, Any] = {"method": None}
    if how == "none":
        return result
    start = time.perf_counter()
    os.sync()
    result["sync_s"] = round(time.perf_counter() - start, 3)
    if how in ("auto", "system"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            result["method"] = "drop_caches"
        except OSError as exc:
            result["drop_caches_error"] = f"{type(exc).__name__}: {exc}"
    if result["method"] is None and how in ("auto", "files", "system") and hasattr(os, "posix_fadvise"):
        for path in files:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        result["method"] = "fadvise"
    result["seconds"] = round(time.perf_counter() - start, 3)
    result["cached_fraction_after"] = cached_fraction(files)
    return result


# ---------------------------------------------------------------------------------------- host memory


def proc_status() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssShmem", "RssFile", "VmLck", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def storage_read_bytes() -> int | None:
    """Bytes this process (all its threads) had read from storage, not the page cache (/proc/self/io)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return None


def system_meminfo() -> dict[str, int]:
    info = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info


def system_used() -> int | None:
    """MemTotal - MemAvailable: memory the kernel cannot reclaim (all processes), page cache excluded."""
    info = system_meminfo()
    if "MemTotal" in info and "MemAvailable" in info:
        return info["MemTotal"] - info["MemAvailable"]
    return None


class HostSampler:
    """Peak host memory of this process per phase, sampled on a thread: RssAnon + RssShmem (pinned
    buffers are anonymous memory registered with cudaHostRegister), RssFile (mapped files), the
    system's unreclaimable memory, and the bytes of the cache folder's files."""

    KEYS = ("anon_shmem", "file", "system_used", "cache_dir")

    def __init__(self, interval_s: float, cache_dir: Path | None) -> None:
        self.interval_s = interval_s
        self.cache_dir = cache_dir
        self.phase = "start"
        self.peaks: dict[str, dict[str, int]] = {}
        self.system_base = system_used()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        status = proc_status()
        values = {
            "anon_shmem": status.get("RssAnon", 0) + status.get("RssShmem", 0),
            "file": status.get("RssFile", 0),
            "system_used": system_used() or 0,
            "cache_dir": 0,
        }
        if self.cache_dir is not None and self.cache_dir.exists():
            with contextlib.suppress(OSError):
                values["cache_dir"] = sum(e.stat().st_size for e in os.scandir(self.cache_dir) if e.is_file())
        with self._lock:
            peak = self.peaks.setdefault(self.phase, dict.fromkeys(self.KEYS, 0))
            for k, v in values.items():
                peak[k] = max(peak[k], v)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def set_phase(self, phase: str) -> None:
        self.sample()  # the end of the phase before
        with self._lock:
            self.phase = phase
        self.sample()

    def start(self) -> HostSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def peak(self, key: str, phases: list[str] | None = None) -> int:
        with self._lock:
            return max(
                (p[key] for name, p in self.peaks.items() if phases is None or name in phases),
                default=0,
            )

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"by_phase": {k: dict(v) for k, v in self.peaks.items()}, "system_used_base": self.system_base}


# ---------------------------------------------------------------------------------------- the probe


@contextlib.contextmanager
def host_copies_only() -> Iterator[None]:
    """Offload enabled in the block plans a host budget for the tiny pipeline's host copies alone: the
    process's own memory (~0.5 GB of Python and torch) and the tier's 1 GiB reserve, which a host budget
    holds besides the host copies, would dwarf its ~1 MB of weights (and refuse the tiny budgets)."""
    from unittest import mock

    from flextensor_diffusers.pipelines import host_budget

    with mock.patch.multiple(host_budget, HOST_RESERVE_BYTES=0, process_own_bytes=lambda modules: 0):
        yield


def probe_cache_writes(work: Path) -> dict[str, Any]:
    """Does the host tier write cache files for the experts of a pipeline loaded with ``from_pretrained``?
    The tiny pipeline on the CPU, in the full one's dtypes (bf16 experts, fp32 VAE loaded as bf16), saved
    and loaded as the full one will be, with one expert kept out of RAM."""
    from diffusers import WanPipeline

    from flextensor_diffusers.recipes.models import load_pipeline

    start = time.perf_counter()
    full = wan_config("full")
    cfg = {**wan_config("tiny"), "dtype": full["dtype"], "vae_dtype": full["vae_dtype"]}
    folder, cache = work / "probe" / "pipeline", work / "probe" / "cache"
    shutil.rmtree(work / "probe", ignore_errors=True)
    components = {name: make_component(name, cfg, "cpu", 0) for name in (*EXPERTS, "vae")}
    save_folder(folder, cfg, components)
    del components
    pipe = load_pipeline(folder, WanPipeline, dtype=dtypes(cfg)[0], text_encoder=None, tokenizer=None)
    expert = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    vae = sum(p.numel() * p.element_size() for p in pipe.vae.parameters())
    host_budget = expert + vae + expert // 4
    with host_copies_only():
        pipe.enable_flextensor_offload(budget=250_000, device="cpu", host_budget=host_budget, cache_dir=cache)
    peak = [dir_bytes(cache)]
    embeds = random_embeddings(pipe, 0, torch.device("cpu"))

    def on_step(_pipe: Any, _i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        peak.append(dir_bytes(cache))
        return kwargs

    pipe.set_progress_bar_config(disable=True)
    for _ in range(2):
        pipe(
            prompt_embeds=embeds[0],
            negative_prompt_embeds=embeds[1],
            num_frames=5,
            height=32,
            width=32,
            num_inference_steps=2,
            generator=torch.Generator(device="cpu").manual_seed(0),
            output_type="latent",
            callback_on_step_end=on_step,
        )
        peak.append(dir_bytes(cache))
    report = pipe.flextensor_report()["host_tier"] or {}
    pipe.disable_flextensor_offload()
    shutil.rmtree(work / "probe", ignore_errors=True)
    sources = {name: c.get("source") for name, c in (report.get("components") or {}).items()}
    if all(sources.get(name) for name in EXPERTS):  # the tier says where each component waits
        writes = any(sources[name] != "weights files" for name in EXPERTS)
    else:  # the tier as first built writes a file per component moved out (both experts over a run)
        writes = max(peak) >= expert // 2
    return {
        "cache_peak_bytes": max(peak),
        "expert_bytes": expert,
        "sources": sources,
        "writes_cache_files": writes,
        "cache_peak_over_expert": round(max(peak) / expert, 3),
        "tier_report_keys": sorted(report),
        "seconds": round(time.perf_counter() - start, 2),
    }


# ---------------------------------------------------------------------------------------- saving


def save_folder(folder: Path, cfg: dict[str, Any], components: dict[str, torch.nn.Module]) -> dict[str, Any]:
    """Save ``components`` (already built) with the scheduler and a model_index.json naming all of them."""
    from diffusers import WanPipeline

    folder.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for name, module in components.items():
        start = time.perf_counter()
        module.save_pretrained(folder / name, safe_serialization=True)
        seconds[name] = round(time.perf_counter() - start, 3)
    scheduler(cfg).save_pretrained(folder / "scheduler")
    meta = {name: make_component(name, cfg, "meta", 0) for name in (*EXPERTS, "vae")}
    index = WanPipeline(
        tokenizer=None, text_encoder=None, scheduler=scheduler(cfg), boundary_ratio=cfg["boundary_ratio"], **meta
    )
    index.save_config(folder)
    return seconds


def child_save(args: argparse.Namespace) -> dict[str, Any]:
    """Build each saved component on the GPU (quick), save it, free it before the next one."""
    start = time.perf_counter()
    cfg = wan_config(args.size)
    cuda = torch.cuda.is_available()
    init = "cuda" if cuda and args.size == "full" else "cpu"
    names = [*EXPERTS, "vae"] if args.mode == "folder" else ["vae"]
    out: dict[str, Any] = {"build_s": {}, "save_s": {}, "bytes": {}}
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        module = make_component(name, cfg, init, args.seed)
        out["build_s"][name] = round(time.perf_counter() - t0, 3)
        print(f"{now(start)} save child: built {name} on {init} in {out['build_s'][name]:.1f} s", flush=True)
        seconds = save_folder(folder, cfg, {name: module})
        out["save_s"].update(seconds)
        out["bytes"][name] = dir_bytes(folder / name)
        print(
            f"{now(start)} save child: saved {name} ({gib(out['bytes'][name])}) in {seconds[name]:.1f} s",
            flush=True,
        )
        del module
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    t0 = time.perf_counter()
    os.sync()  # on disk before the runs read it (and before the page cache can be dropped)
    out["sync_s"] = round(time.perf_counter() - t0, 3)
    written = sum(out["bytes"].values())
    write_s = sum(out["save_s"].values()) + out["sync_s"]
    out["write_GBps"] = round(written / write_s / 1e9, 3) if write_s else None
    out["saved"] = [*names, "scheduler", "model_index.json"]
    out["saved_bytes"] = dir_bytes(folder)
    out["seconds"] = round(time.perf_counter() - start, 2)
    write_json(folder / MARKER, {"size": args.size, "mode": args.mode, "seed": args.seed, **out})
    return out


# ---------------------------------------------------------------------------------------- generating


def random_embeddings(pipe: Any, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stand-ins for UMT5's prompt and negative-prompt embeddings (same in every process)."""
    model = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
    dim = model.config.text_dim
    g = torch.Generator(device="cpu").manual_seed(seed + 1000)
    dtype = next(model.parameters()).dtype
    pos = torch.randn(1, TEXT_TOKENS, dim, generator=g).to(device, dtype)
    neg = torch.randn(1, TEXT_TOKENS, dim, generator=g).to(device, dtype)
    return pos, neg


def tier_of(pipe: Any) -> Any:
    state = getattr(pipe, "_flextensor", None)
    return getattr(state, "host_tier", None) if state is not None else None


def tier_reads(tier: Any) -> list[dict[str, Any]]:
    """The tier's reads from disk as dicts: ``component``, ``seconds`` and whatever else a record carries
    (``(name, seconds)`` tuples as first built; dicts or dataclasses should the records grow)."""
    if tier is None:
        return []
    out = []
    for record in list(getattr(tier, "reads", None) or []):
        if isinstance(record, dict):
            item = dict(record)
        elif isinstance(record, (tuple, list)):
            item = {"component": record[0] if record else None}
            if len(record) > 1:
                item["seconds"] = record[1]
            item.update({f"field{i + 2}": extra for i, extra in enumerate(record[2:])})
        elif dataclasses.is_dataclass(record):
            item = dataclasses.asdict(record)
        elif hasattr(record, "__dict__"):
            item = {k: v for k, v in vars(record).items() if not k.startswith("_")}
        else:
            item = {"record": str(record)}
        item.setdefault("component", item.get("name"))
        if "seconds" not in item:
            item["seconds"] = next((item[k] for k in ("read_s", "s", "time_s", "duration_s") if k in item), None)
        if "wait_s" not in item and "wait" in item:
            item["wait_s"] = item["wait"]
        out.append({k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in item.items()})
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    pipe: Any, args: argparse.Namespace, steps: int, embeds: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[dict[str, Any], torch.Tensor]:
    """One generation; per-step wall times (device synchronised at every step end), which expert ran
    each step, the tier's reads from disk during it, attributed to the step they happened in."""
    tier = tier_of(pipe)
    ends: list[float] = []
    timesteps: list[float] = []
    reads_at: list[int] = []

    def on_step(_pipe: Any, _i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        sync(device)
        ends.append(time.perf_counter())
        timesteps.append(float(t))
        reads_at.append(len(tier_reads(tier)))
        return kwargs

    reads_before = len(tier_reads(tier))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    output = pipe(
        prompt_embeds=embeds[0],
        negative_prompt_embeds=embeds[1],
        num_frames=args.frames,
        height=args.height,
        width=args.width,
        num_inference_steps=steps,
        guidance_scale=args.guidance,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
        output_type="latent" if not args.decode else "np",
        callback_on_step_end=on_step,
    ).frames
    sync(device)
    end = time.perf_counter()
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    experts = ["transformer" if t >= boundary else "transformer_2" for t in timesteps]
    durations = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    switch_steps = [i for i in range(len(experts)) if i == 0 or experts[i] != experts[i - 1]]
    reads = tier_reads(tier)[reads_before:]
    step_of_read, first = [], reads_before
    for i, count in enumerate(reads_at):
        step_of_read += [i] * (count - first)
        first = count
    for k, read in enumerate(reads):
        read["step"] = step_of_read[k] if k < len(step_of_read) else None  # None: after the last step (decode)
    info = {
        "steps": steps,
        "generation_s": round(end - start, 4),
        "step_s": [round(d, 4) for d in durations],
        "after_last_step_s": round(end - ends[-1], 4) if ends else None,
        "timesteps": timesteps,
        "experts": experts,
        "switch_steps": switch_steps,
        "reads": reads,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    latents = output if isinstance(output, torch.Tensor) else torch.as_tensor(output)
    return info, latents.detach().cpu()


def weights_digest(pipe: Any) -> str:
    """A digest of a few tensors of each expert: equal in both runs means the same weights."""
    h = hashlib.sha256()
    for name in EXPERTS:
        model = getattr(pipe, name)
        params = dict(model.named_parameters())
        for key in ("proj_out.weight", "blocks.0.attn1.to_q.weight", "blocks.0.ffn.net.2.weight", "scale_shift_table"):
            t = params.get(key)
            if t is not None:
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def child_run(args: argparse.Namespace) -> dict[str, Any]:
    """The all-pinned (``--child pinned``) or tiered (``--child tiered``) run; progress written to
    ``--progress`` after every phase."""
    import diffusers
    from diffusers import WanPipeline

    from flextensor_diffusers.recipes.models import load_pipeline

    diffusers.utils.logging.set_verbosity_error()
    start = time.perf_counter()
    role = args.child
    tiered = role == "tiered"
    progress = Path(args.progress)
    scratch = progress.parent
    cfg = wan_config(args.size)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    folder, cache = Path(args.folder), Path(args.cache_dir)
    sampler = HostSampler(args.sample_ms / 1e3, cache if tiered else None).start()
    out: dict[str, Any] = {
        "role": role,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "pid": os.getpid(),
        "phases_s": {},
        "storage_read_bytes": {},  # per phase, from /proc/self/io: what came from the disk, not the page cache
        "done": False,
    }
    io_start: dict[str, int | None] = {}

    def phase(name: str) -> None:
        sampler.set_phase(name)
        io_start[name] = storage_read_bytes()
        out["host"] = sampler.as_dict()
        write_json(progress, out)
        print(f"{now(start)} {role}: {name}", flush=True)

    def finish_phase(name: str, t0: float) -> float:
        seconds = time.perf_counter() - t0
        out["phases_s"][name] = round(seconds, 3)
        end, begin = storage_read_bytes(), io_start.get(name)
        out["storage_read_bytes"][name] = end - begin if end is not None and begin is not None else None
        out["host"] = sampler.as_dict()
        write_json(progress, out)
        return seconds

    files = weight_files(folder)
    if tiered:
        out["drop_before_load"] = drop_page_cache(files, args.drop_caches)
    out["folder_cached_fraction_before_load"] = cached_fraction(files)

    passed: dict[str, Any] = {}
    if args.mode == "in-memory":
        phase("build")
        t0 = time.perf_counter()
        init = "cuda" if device.type == "cuda" and args.size == "full" else "cpu"
        passed = {name: make_component(name, cfg, init, args.seed) for name in EXPERTS}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        finish_phase("build", t0)

    phase("load")
    t0 = time.perf_counter()
    pipe = load_pipeline(folder, WanPipeline, dtype=dtypes(cfg)[0], text_encoder=None, tokenizer=None, **passed)
    del passed
    finish_phase("load", t0)
    out["folder_weight_bytes"] = sum(f.stat().st_size for f in files)
    out["weights_digest"] = weights_digest(pipe)
    pipe.set_progress_bar_config(disable=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.card) / total), device)
        out["card_cap_bytes"] = parse_bytes(args.card)

    phase("enable")
    t0 = time.perf_counter()
    with host_copies_only() if args.size == "tiny" else contextlib.nullcontext():
        pipe.enable_flextensor_offload(
            budget=args.budget_bytes,
            device=device,
            host_budget=args.host_budget_bytes if tiered else None,
            cache_dir=cache if tiered else None,
        )
    out["enable_s"] = round(finish_phase("enable", t0), 3)
    state = pipe._flextensor
    packed = {}
    for name, handle in state.handles.items():
        residency = getattr(handle, "residency", None)
        packed[name] = getattr(residency, "packed_bytes", None)
    out["packed_bytes"] = packed
    out["weights_bytes"] = sum(v for v in packed.values() if v) or None
    tier = tier_of(pipe)
    out["tier_after_enable"] = tier.report() if tier is not None else None
    embeds = random_embeddings(pipe, args.seed, device)

    for gen, steps in (("warmup", args.warmup_steps), ("measured", args.steps)):
        if tiered:
            out[f"drop_before_{gen}"] = drop_page_cache(weight_files(folder, cache), args.drop_caches)
            out[f"cached_fraction_before_{gen}"] = {
                "folder": cached_fraction(weight_files(folder)),
                "cache": cached_fraction([f for f in cache.glob("*") if f.is_file()]) if cache.exists() else None,
            }
        phase(gen)
        t0 = time.perf_counter()
        info, latents = generate(pipe, args, steps, embeds, device)
        torch.save(latents, scratch / f"{role}_{gen}.pt")
        info["latents_sha256"] = hashlib.sha256(latents.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        out[gen] = info
        finish_phase(gen, t0)
        print(
            f"{now(start)} {role}: {gen} {steps} steps in {info['generation_s']:.2f} s, steps "
            f"{', '.join(f'{s:.3f}' for s in info['step_s'])} s, experts {info['experts']}, "
            f"reads {[(r.get('component'), r.get('seconds')) for r in info['reads']]}",
            flush=True,
        )

    report = pipe.flextensor_report()
    out["tier_report"] = report.get("host_tier")
    out["components"] = {
        name: {k: c.get(k) for k in ("host", "streamed_units", "units", "stall_ms", "overlap_pct", "forwards")}
        for name, c in report.get("components", {}).items()
    }
    out["peak_allocated_bytes"] = report.get("peak_allocated_bytes")
    sampler.stop()
    out["host"] = sampler.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["done"] = True
    write_json(progress, out)
    return out


# ---------------------------------------------------------------------------------------- the parent


def plan_disk(args: argparse.Namespace, sizes: dict[str, int], probe: dict[str, Any], reuse: bool) -> dict[str, Any]:
    """Which folder to save, refused when the disk cannot hold it and the tier's cache files."""
    expert_sum = sizes["transformer"] + sizes["transformer_2"]
    overhead = 16 * 2**20  # configs, safetensors headers
    folder_need = {"folder": expert_sum + sizes["vae"] + overhead, "in-memory": sizes["vae"] + overhead}
    writes = bool(probe.get("writes_cache_files"))
    # Over a run the tier moves each expert out once at least (and the VAE at set-up): one file each. A tier
    # that waits in the folder's weight files still writes one for a component whose dtype from_pretrained
    # converted (the fp32 VAE, loaded in bf16).
    cache_need = expert_sum + sizes["vae"] if writes else sizes["vae"]
    folder_fs, cache_fs = filesystem(Path(args.folder)), filesystem(Path(args.cache_dir))
    same = folder_fs["st_dev"] == cache_fs["st_dev"]
    margin = parse_bytes(args.disk_margin)

    def fits(mode: str) -> bool:
        need_folder = 0 if reuse else folder_need[mode]
        if same:
            return need_folder + cache_need + margin <= folder_fs["free_bytes"]
        return need_folder + margin <= folder_fs["free_bytes"] and cache_need + margin <= cache_fs["free_bytes"]

    plan = {
        "folder_fs": folder_fs,
        "cache_fs": cache_fs,
        "same_filesystem": same,
        "component_bytes": sizes,
        "folder_bytes_needed": folder_need,
        "cache_bytes_needed": cache_need,
        "margin_bytes": margin,
        "tier_writes_cache_files": writes,
        "fits": {mode: fits(mode) for mode in folder_need},
    }
    if args.mode == "auto":
        mode = next((m for m in ("folder", "in-memory") if plan["fits"][m]), None)
    else:
        mode = args.mode if plan["fits"][args.mode] else None
    if mode is None:
        wanted = [args.mode] if args.mode != "auto" else list(folder_need)
        needs = ", ".join(f"{m}: {gib(0 if reuse else folder_need[m])} folder" for m in wanted)
        raise SystemExit(
            f"not enough disk: {folder_fs['mount']} has {gib(folder_fs['free_bytes'])} free"
            + ("" if same else f", {cache_fs['mount']} (cache) {gib(cache_fs['free_bytes'])}")
            + f"; needed ({needs}) + {gib(cache_need)} of the host tier's cache files + {gib(margin)} margin. "
            "Pass --folder / --cache-dir on a larger disk, or --mode in-memory"
        )
    for fs in {folder_fs["mount"]: folder_fs, cache_fs["mount"]: cache_fs}.values():
        if fs["fstype"] in ("tmpfs", "ramfs") and not args.allow_tmpfs:
            raise SystemExit(
                f"{fs['path']} is on {fs['fstype']} ({fs['mount']}): its files are in RAM, so the host tier's "
                "reads would not come from a disk. Pass --folder / --cache-dir on a disk, or --allow-tmpfs"
            )
    plan["mode"] = mode
    return plan


def run_child(
    role: str, args: argparse.Namespace, work: Path, deadline: float, start: float
) -> tuple[dict[str, Any] | None, str | None]:
    """Run one child; its progress file (complete or not) and why it stopped early, if it did."""
    progress = work / "scratch" / f"{role}.json"
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
        error = f"stopped at --time-limit ({time.perf_counter() - start:.0f} s)"
    data = json.loads(progress.read_text()) if progress.exists() else None
    if error:
        print(f"{now(start)} {role}: {error}", flush=True)
    return data, error


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--size", args.size, "--mode", args.mode, "--folder", str(args.folder), "--cache-dir", str(args.cache_dir)]
    argv += ["--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]
    argv += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--seed", str(args.seed)]
    argv += ["--budget", str(args.budget_bytes), "--host-budget", str(args.host_budget_bytes), "--card", args.card]
    argv += ["--guidance", str(args.guidance), "--drop-caches", args.drop_caches, "--sample-ms", str(args.sample_ms)]
    return [*argv, "--decode"] if args.decode else argv


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def steady_steps(info: dict[str, Any]) -> list[float]:
    """Durations of the steps that switch no component (all steps where every step switches)."""
    switches = set(info["switch_steps"])
    plain = [d for i, d in enumerate(info["step_s"]) if i not in switches]
    return plain or info["step_s"]


def summarise(result: dict[str, Any], pinned: dict[str, Any] | None, tiered: dict[str, Any] | None, work: Path) -> None:
    """The issue's figures from the two runs' measured generations."""
    p, t = (pinned or {}).get("measured"), (tiered or {}).get("measured")
    if tiered:
        sampler = tiered.get("host", {}).get("by_phase", {})
        phases = [*(("load",) if result["mode"] == "folder" else ()), "enable", "warmup", "measured"]
        if result["mode"] == "in-memory":  # the benchmark's own build holds both experts before enable
            phases = ["warmup", "measured"]
        result["peak_host_scope"] = (
            "RssAnon + RssShmem of the tiered process, sampled every "
            f"{result['config']['sample_ms']} ms, over its phases {', '.join(phases)}"
            + (
                " (in-memory mode: both experts are built in RAM before enable, so load and set-up peaks are the "
                "benchmark's, shown in peak_host_by_phase)"
                if result["mode"] == "in-memory"
                else ""
            )
        )
        result["peak_host_bytes"] = max((v.get("anon_shmem", 0) for k, v in sampler.items() if k in phases), default=0)
        base = sampler.get("start", {}).get("anon_shmem")
        if base is not None:  # the interpreter, torch and CUDA's own host memory before any weight
            result["process_host_bytes_at_start"] = base
            result["peak_host_over_start_bytes"] = result["peak_host_bytes"] - base
        result["peak_host_by_phase"] = sampler
        report = tiered.get("tier_report") or tiered.get("tier_after_enable") or {}
        result["tier_peak_host_ram_bytes"] = report.get("peak_host_ram_bytes")
        result["weights_bytes"] = tiered.get("weights_bytes")
        result["tiered_enable_s"] = tiered.get("enable_s")
        result["tiered_load_s"] = tiered.get("phases_s", {}).get("load")
        result["tiered_storage_read_bytes"] = tiered.get("storage_read_bytes")
        io, secs = tiered.get("storage_read_bytes") or {}, tiered.get("phases_s") or {}
        setup_read = sum(io.get(k) or 0 for k in ("load", "enable"))
        setup_s = sum(secs.get(k) or 0 for k in ("load", "enable"))
        if setup_read and setup_s:  # from_pretrained maps the files; packing reads them (cold when dropped)
            result["tiered_setup_disk_read_GBps"] = round(setup_read / setup_s / 1e9, 3)
        drops = {k: v for k, v in tiered.items() if k.startswith("drop_before_")}
        fractions = {k: v for k, v in tiered.items() if k.startswith("cached_fraction_before_")}
        result["page_cache"] = {"drops": drops, "cached_fractions": fractions}
        before = fractions.get("cached_fraction_before_measured") or {}
        cached = [v for v in before.values() if v is not None]
        dropped = (drops.get("drop_before_measured") or {}).get("method")
        # Cold: the measured generation's reads came from the disk. Best evidence: the bytes /proc/self/io says
        # the process read from storage during it, against the bytes the switches read; else the files' share
        # in the page cache when it began (mincore); else trust /proc/sys/vm/drop_caches.
        io_measured = (tiered.get("storage_read_bytes") or {}).get("measured")
        sizes = tiered.get("packed_bytes") or {}
        switch_bytes = sum(
            r.get("nbytes") or sizes.get(r.get("component")) or 0
            for r in ((tiered.get("measured") or {}).get("reads") or [])
        )
        if io_measured is not None and switch_bytes:
            result["cold_storage_fraction"] = round(io_measured / switch_bytes, 3)
        if io_measured and switch_bytes:
            result["cold"] = io_measured >= 0.9 * switch_bytes
        elif cached:
            result["cold"] = max(cached) <= 0.05
        elif dropped == "drop_caches":
            result["cold"] = True
        else:
            result["cold"] = None  # not known: nothing dropped the cache, or fadvise without a mincore check
        result["cold_method"] = dropped
        result["cold_evidence"] = {
            "page_cache_dropped_by": dropped,
            "cached_fraction_before_measured": before,
            "storage_read_bytes_during_measured": io_measured,
            "switch_read_bytes_measured": switch_bytes or None,
        }
    if pinned:
        result["pinned_enable_s"] = pinned.get("enable_s")
        result["pinned_load_s"] = pinned.get("phases_s", {}).get("load")
        result["all_pinned_peak_host_bytes"] = max(
            (v.get("anon_shmem", 0) for v in pinned.get("host", {}).get("by_phase", {}).values()), default=0
        )
        result.setdefault("weights_bytes", pinned.get("weights_bytes"))
    if pinned and tiered:
        result["weights_identical"] = pinned.get("weights_digest") == tiered.get("weights_digest")
    if p:
        result["all_pinned_step_s"] = round(median(steady_steps(p)), 4)
        result["all_pinned_steps_s"] = p["step_s"]
    if t:
        result["tiered_step_s"] = round(median(steady_steps(t)), 4)
        result["tiered_steps_s"] = t["step_s"]
        reads = t["reads"]
        result["switch_components"] = [t["experts"][i] for i in t["switch_steps"]]
        result["switch_steps"] = t["switch_steps"]
        # Each switch's disk read: the reads of the component it brings in during this generation.
        switch_s = []
        for i in t["switch_steps"]:
            name = t["experts"][i]
            secs = [r["seconds"] for r in reads if r.get("component") == name and r.get("seconds") is not None]
            if not secs:  # records without a component name: the reads made during that step
                secs = [r["seconds"] for r in reads if r.get("step") == i and r.get("seconds") is not None]
            switch_s.append(round(sum(secs), 4))
        result["switch_s"] = switch_s
        waits = [
            sum(r["wait_s"] for r in reads if r.get("component") == t["experts"][i] and r.get("wait_s") is not None)
            for i in t["switch_steps"]
        ]
        if any(r.get("wait_s") is not None for r in reads):
            result["switch_wait_s"] = [round(w, 4) for w in waits]  # as the tier reports the time a switch waited
            result["switch_hidden_by_tier_s"] = [
                round(max(0.0, r - w), 4) for r, w in zip(switch_s, waits, strict=True)
            ]
        if any("prefetched" in r for r in reads):
            result["switch_prefetched"] = [
                any(r.get("prefetched") for r in reads if r.get("component") == t["experts"][i])
                for i in t["switch_steps"]
            ]
        result["switch_reads"] = reads
        sizes = (tiered or {}).get("packed_bytes") or {}
        read_bytes = sum(r.get("nbytes") or sizes.get(r.get("component")) or 0 for r in reads if r.get("seconds"))
        read_s = sum(r["seconds"] for r in reads if r.get("seconds"))
        result["disk_read_bytes"] = read_bytes
        result["disk_read_GBps"] = round(read_bytes / read_s / 1e9, 3) if read_s and read_bytes else None
        extra = {k: v for k, v in ((tiered or {}).get("tier_report") or {}).items() if "switch" in k or "wait" in k}
        if extra:
            result["tier_switch_fields"] = extra  # whatever the tier reports about switches (read defensively)
        forecasts = ((tiered or {}).get("tier_report") or {}).get("forecasts")
        if forecasts:  # the tier's own forecast of each switch, to set against switch_exposed_s
            result["switch_forecast"] = forecasts
    if p and t and p["step_s"] and len(p["step_s"]) == len(t["step_s"]):
        exposed = [round(t["step_s"][i] - p["step_s"][i], 4) for i in t["switch_steps"]]
        result["switch_exposed_s"] = exposed
        result["switch_hidden_s"] = [
            round(max(0.0, s - e), 4) for s, e in zip(result["switch_s"], exposed, strict=True)
        ]
        base, step = result["all_pinned_step_s"], result["tiered_step_s"]
        result["overhead_40_steps_pct"] = round(100 * (STEPS_40 * (step - base) + sum(exposed)) / (STEPS_40 * base), 3)
        result["overhead_terms"] = {
            "per_step_pct": round(100 * (step - base) / base, 3),
            "switches_per_generation_s": round(sum(exposed), 4),
            "switches_pct_of_40_steps": round(100 * sum(exposed) / (STEPS_40 * base), 3),
        }
        result["measured_generation_overhead_pct"] = round(100 * (t["generation_s"] / p["generation_s"] - 1), 3)
        if "switch_wait_s" in result:  # the same extrapolation with the tier's own waits for the switches' cost
            result["overhead_40_steps_pct_from_tier_waits"] = round(
                100 * (STEPS_40 * (step - base) + sum(result["switch_wait_s"])) / (STEPS_40 * base), 3
            )
    equal = {}
    for gen in ("warmup", "measured"):
        a, b = work / "scratch" / f"pinned_{gen}.pt", work / "scratch" / f"tiered_{gen}.pt"
        if a.exists() and b.exists():
            x, y = torch.load(a), torch.load(b)
            equal[gen] = bool(
                x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            )
    if equal:
        result["bitwise_equal_by_generation"] = equal
        result["bitwise_equal"] = all(equal.values()) and len(equal) == 2
    host = result.get("peak_host_bytes")
    if host is not None:
        result.setdefault("targets", {})["host_within_budget"] = host <= result["host_budget_bytes"]
    if result.get("overhead_40_steps_pct") is not None:
        result.setdefault("targets", {})["overhead_40_steps_le_3pct"] = result["overhead_40_steps_pct"] <= 3
    if result.get("setup_s") is not None and result.get("flextensor_setup_s"):
        result.setdefault("targets", {})["setup_le_0.8x_flextensor"] = (
            result["setup_s"] <= 0.8 * result["flextensor_setup_s"]
        )


def peers_setup(path: Path | None) -> tuple[float | None, float | None, str | None]:
    """(ours, flextensor's) block-stack set-up seconds from a peers.py result, when one is given."""
    if path is None:
        return None, None, None
    runs = json.loads(path.read_text()).get("runs", [])
    ours = [
        r["setup_s"] for r in runs if str(r.get("method", "")).startswith("flextensor_diffusers") and "setup_s" in r
    ]
    theirs = [r["setup_s"] for r in runs if r.get("method") == "flextensor" and "setup_s" in r]
    return (min(ours) if ours else None), (theirs[0] if theirs else None), str(path)


def parent(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    deadline = start + args.time_limit
    cfg = wan_config(args.size)
    work = Path(args.workdir)
    result: dict[str, Any] = {
        "benchmark": "host tier (issue 15): Wan2.2-T2V-A14B from a diffusers folder under a host budget",
        "model": f"Wan2.2-T2V-A14B architecture ({args.size}), random weights ({cfg['dtype']} experts, "
        f"{cfg['vae_dtype']} VAE)",
        "size": args.size,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "frames": args.frames,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "cfg": args.guidance > 1,
        "output": "images (VAE decoded)" if args.decode else "latents (no VAE decode)",
        "budget_bytes": args.budget_bytes,
        "host_budget_bytes": args.host_budget_bytes,
        "card_cap_bytes": parse_bytes(args.card),
        "text_encoder": TEXT_ENCODER_NOTE,
        "peak_host_bytes": None,
        "weights_bytes": None,
        "all_pinned_step_s": None,
        "tiered_step_s": None,
        "switch_s": [],
        "disk_read_GBps": None,
        "cold": None,
        "overhead_40_steps_pct": None,
        "overhead_formula": OVERHEAD_FORMULA,
        "bitwise_equal": None,
        "setup_s": None,
        "flextensor_setup_s": None,
        "phases": [],
    }
    ours, theirs, source = peers_setup(args.peers_json)
    result["setup_s"], result["flextensor_setup_s"] = ours, theirs
    result["setup_source"] = source or "not given: set-up figures come from a separate peers.py run (--peers-json)"
    if ours is not None and theirs:
        result["setup_vs_flextensor"] = round(ours / theirs, 3)

    def phase_done(name: str, t0: float, **extra: Any) -> None:
        result["phases"].append(
            {"phase": name, "start_s": round(t0 - start, 2), "seconds": round(time.perf_counter() - t0, 2), **extra}
        )
        eb.write_result(args.out, result)
        print(f"{now(start)} done: {name} ({time.perf_counter() - t0:.1f} s)", flush=True)

    result["machine"] = {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": (system_meminfo().get("MemTotal")),
        "mem_available_bytes": (system_meminfo().get("MemAvailable")),
    }
    created_folder = False
    try:
        # --- plan: sizes, the probe, the disk
        t0 = time.perf_counter()
        print(f"{now(start)} phase: plan (sizes, does the host tier write cache files?, free disk)", flush=True)
        sizes = component_bytes(cfg)
        work.mkdir(parents=True, exist_ok=True)
        result["probe"] = probe_cache_writes(work)
        marker = Path(args.folder) / MARKER
        reuse = False
        if marker.exists():  # saved by an earlier call with --keep-folder
            saved = json.loads(marker.read_text())
            reuse = all(saved.get(k) == v for k, v in (("size", args.size), ("seed", args.seed)))
            reuse = reuse and (args.mode == "auto" or saved.get("mode") == args.mode)
            if reuse and args.mode == "auto":
                args.mode = saved["mode"]
            if not reuse:
                shutil.rmtree(args.folder)
        elif Path(args.folder).exists() and any(Path(args.folder).iterdir()):
            raise SystemExit(f"--folder {args.folder} exists and was not saved by this script: choose another")
        plan = plan_disk(args, sizes, result["probe"], reuse)
        args.mode = plan["mode"]
        result["mode"] = args.mode
        result["disk_plan"] = plan
        result["free_disk_bytes"] = plan["folder_fs"]["free_bytes"]
        print(
            f"{now(start)} mode {args.mode}: experts {gib(sizes['transformer'])} each, VAE {gib(sizes['vae'])}; "
            f"{plan['folder_fs']['mount']} ({plan['folder_fs']['fstype']}) has {gib(plan['folder_fs']['free_bytes'])} "
            f"free; tier writes cache files: {plan['tier_writes_cache_files']}",
            flush=True,
        )
        phase_done("plan", t0)

        # --- save
        t0 = time.perf_counter()
        if reuse:
            saved = json.loads(marker.read_text())
            result["save"] = {**saved, "reused": True}
        else:
            print(f"{now(start)} phase: save ({args.mode})", flush=True)
            created_folder = True
            data, error = run_child("save", args, work, deadline, start)
            if data is None or error:
                result["save_error"] = error or "no result"
                raise SystemExit(f"saving failed: {result['save_error']}")
            result["save"] = data
        result["saved"] = result["save"].get("saved")
        result["saved_bytes"] = result["save"].get("saved_bytes")
        result["folder"] = str(args.folder)
        if args.mode == "in-memory":
            result["experts_source"] = (
                "built in memory in each run (random init with the same seeds, on the GPU at full size, then moved to "
                "the CPU) and passed to from_pretrained: the disk cannot hold the folder's experts and the host tier's "
                "cache files"
            )
        phase_done("save", t0)

        # --- the two runs
        runs: dict[str, dict[str, Any] | None] = {}
        for role in ("pinned", "tiered"):
            t0 = time.perf_counter()
            print(f"{now(start)} phase: {role} run", flush=True)
            data, error = run_child(role, args, work, deadline, start)
            runs[role] = data
            result.setdefault("runs", {})[role] = data
            if error:
                result.setdefault("errors", {})[role] = error
            summarise(result, runs.get("pinned"), runs.get("tiered"), work)
            phase_done(role, t0, **({"error": error} if error else {}))
            if role == "pinned" and args.cache_dir.exists():
                shutil.rmtree(args.cache_dir, ignore_errors=True)
        for key in ("device", "torch", "diffusers"):
            result[key] = next((r[key] for r in runs.values() if r and key in r), None)
    except SystemExit as exc:
        result["error"] = str(exc)
        raise
    finally:
        t0 = time.perf_counter()
        shutil.rmtree(args.cache_dir, ignore_errors=True)
        shutil.rmtree(work / "scratch", ignore_errors=True)
        if not args.keep_folder and (created_folder or (Path(args.folder) / MARKER).exists()):
            shutil.rmtree(args.folder, ignore_errors=True)
            result["folder_deleted"] = True
        phase_done("cleanup", t0)
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k not in ("runs", "disk_plan", "config", "switch_reads", "peak_host_by_phase", "page_cache")
            },
            indent=1,
        )
    )


# ---------------------------------------------------------------------------------------- command line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (after every phase)")
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--workdir", type=Path, default=None, help="default: <tmp>/host_tier_bench-<size>")
    parser.add_argument("--folder", type=Path, default=None, help="where to save the pipeline (default: workdir)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the host tier's cache folder (default: workdir)")
    parser.add_argument("--keep-folder", action="store_true", help="keep the saved folder (a later call reuses it)")
    parser.add_argument(
        "--mode",
        default="auto",
        choices=("auto", "folder", "in-memory"),
        help="folder: save the experts too; in-memory: save the VAE, build the experts in each run; auto: "
        "folder when the disk holds it and the tier's cache files",
    )
    parser.add_argument("--frames", type=int, default=None, help="default 81 (full), 9 (tiny)")
    parser.add_argument("--height", type=int, default=None, help="default 480 (full), 32 (tiny)")
    parser.add_argument("--width", type=int, default=None, help="default 832 (full), 32 (tiny)")
    parser.add_argument("--steps", type=int, default=4, help="measured generation: 4 gives each expert 2 steps")
    parser.add_argument("--warmup-steps", type=int, default=2, help="warm-up generation (discovery, profiling)")
    parser.add_argument("--guidance", type=float, default=5.0, help="CFG scale (> 1: a cond and an uncond pass)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default=None, help="GPU budget (default 8GiB; tiny: 250000)")
    parser.add_argument(
        "--host-budget",
        default=None,
        help="default 32GiB; tiny: one expert + VAE + a quarter, for the host copies alone (host_copies_only)",
    )
    parser.add_argument("--card", default="24GB", help="memory cap of the emulated card")
    parser.add_argument("--decode", action="store_true", help="decode with the VAE (default: latents only)")
    parser.add_argument("--drop-caches", default="auto", choices=("auto", "system", "files", "none"))
    parser.add_argument("--sample-ms", type=float, default=50.0, help="host memory sampling interval")
    parser.add_argument("--disk-margin", default="2GiB", help="free space left on the disk")
    parser.add_argument("--allow-tmpfs", action="store_true", help="allow a folder or cache on tmpfs")
    parser.add_argument("--time-limit", type=float, default=500.0, help="seconds for the whole run; runs past it stop")
    parser.add_argument("--peers-json", type=Path, default=None, help="a peers.py result: fills setup_s fields")
    parser.add_argument("--child", choices=("save", "pinned", "tiered"), help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args()

    tiny = args.size == "tiny"
    args.frames = args.frames or (9 if tiny else 81)
    args.height = args.height or (32 if tiny else 480)
    args.width = args.width or (32 if tiny else 832)
    args.workdir = args.workdir or Path(tempfile.gettempdir()) / f"host_tier_bench-{args.size}"
    args.folder = args.folder or args.workdir / "pipeline"
    args.cache_dir = args.cache_dir or args.workdir / "cache"
    args.budget_bytes = parse_bytes(args.budget or (250_000 if tiny else "8GiB"))
    if args.host_budget is not None:
        args.host_budget_bytes = parse_bytes(args.host_budget)
    elif tiny:
        sizes = component_bytes(wan_config("tiny"))
        args.host_budget_bytes = sizes["transformer"] + sizes["vae"] + sizes["transformer"] // 4 + 2**16
    else:
        args.host_budget_bytes = parse_bytes("32GiB")

    if args.child == "save":
        write_json(Path(args.progress), child_save(args))
        return
    if args.child in ("pinned", "tiered"):
        child_run(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown of tens of GiB of pinned host memory, one tensor at a time
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("--size full needs a CUDA GPU (use --size tiny to check the script on a CPU)")
    parent(args)


if __name__ == "__main__":
    main()
