"""What the benchmarks share: the Wan2.2-A14B block stack and its inputs, timing, peak device memory against
the budget, host memory sampling, and the JSON files they write.

Run a benchmark from the repository root with the package importable (``pip install -e .``, or
``PYTHONPATH=$PWD`` as ``benchmarks/device_setup.sh`` sets it): ``python benchmarks/x.py`` puts this folder
first on ``sys.path``, so ``import bench_common`` finds this module.

The budget is a ceiling (issue 24): every run that offloads under a GPU budget records ``budget_bytes``,
``peak_allocated_bytes`` and ``peak_within_budget`` through `PeakWatch.check`, which also prints a line for
a run that went over. A watch is started right before the run's offload set-up, so that its peak covers
set-up, profiling and the steady forwards. Its peaks are `flextensor_diffusers.engine.peaks` windows: the
profiling forwards reset torch's counter, and a peak read from torch's counter alone would miss everything
before the last of them (issue 46: LTX-2 trials under an 80 GB cap reported 24 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import flextensor_diffusers as ft

WORKLOADS = {
    # name: (batch, latent frames, latent height, latent width) for a VAE of 4x temporal / 8x spatial
    "81f_832x480_cfg": (2, 21, 60, 104),
    "17f_480x272": (1, 5, 34, 60),
}
#: What a `PeakWatch` started before the offload set-up covers.
WHOLE_RUN = "offload set-up, profiling and steady forwards"
#: What the peak of a run measured by `flextensor_diffusers.reports.compare` or a recipe's summary covers.
GENERATION_ONLY = (
    "the measured generation only (compare and the recipes measure from its start: set-up and the "
    "profiling generation are not covered)"
)
#: Budget for a handle that must not be limited (the probe that measures activations before budgets are set).
UNLIMITED = 10**15


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- the block stack


@dataclass(frozen=True)
class StackShape:
    """Size of the block stack (defaults: Wan2.2-A14B's) and whether the token counts are shrunk."""

    blocks: int = 40
    dim: int = 5120
    heads: int = 40
    ffn: int = 13824
    small: bool = False

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--blocks", type=int, default=StackShape.blocks)
        parser.add_argument("--dim", type=int, default=StackShape.dim)
        parser.add_argument("--heads", type=int, default=StackShape.heads)
        parser.add_argument("--ffn", type=int, default=StackShape.ffn)
        parser.add_argument("--small", action="store_true", help="shrink the token counts (quick check)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackShape:
        return cls(args.blocks, args.dim, args.heads, args.ffn, args.small)

    def argv(self) -> list[str]:
        """The same shape as command-line words, for child processes."""
        words = ["--blocks", str(self.blocks), "--dim", str(self.dim), "--heads", str(self.heads)]
        return [*words, "--ffn", str(self.ffn), *(["--small"] if self.small else [])]


class BlockStack(nn.Module):
    """The repeated part of WanTransformer3DModel: blocks only, plus a small output projection."""

    def __init__(self, shape: StackShape) -> None:
        super().__init__()
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        block = (shape.dim, shape.ffn, shape.heads, "rms_norm_across_heads", True, 1e-6)
        self.blocks = nn.ModuleList([WanTransformerBlock(*block) for _ in range(shape.blocks)])
        self.norm_out = nn.LayerNorm(shape.dim, elementwise_affine=False)
        self.proj_out = nn.Linear(shape.dim, 64)

    def forward(self, hidden, context, temb, rope):  # noqa: ANN001, ANN201
        for block in self.blocks:
            hidden = block(hidden, context, temb, rope)
        return self.proj_out(self.norm_out(hidden.float()).type_as(hidden))


def build_stack(shape: StackShape, device: torch.device | str) -> BlockStack:
    """Random bf16 weights (seed 0), with the fp32 ``scale_shift_table`` and ``norm2`` Wan keeps."""
    torch.manual_seed(0)
    with torch.device(device):
        model = BlockStack(shape)
    model.to(torch.bfloat16)
    for block in model.blocks:  # Wan keeps these in fp32 (_keep_in_fp32_modules)
        block.scale_shift_table.data = block.scale_shift_table.data.float()
        block.norm2.float()
    return model.eval().requires_grad_(False)


def stack_inputs(shape: StackShape, workload: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(hidden states, text context, time embedding, rotary embedding) of ``workload``, seeded."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    batch, f, h, w = WORKLOADS[workload]
    if shape.small:
        f, h, w = max(1, f // 4), max(2, h // 8), max(2, w // 8)
    g = torch.Generator(device="cpu").manual_seed(1)
    latent = torch.zeros(batch, 16, f, h, w, device=device)
    rope = WanRotaryPosEmbed(shape.dim // shape.heads, (1, 2, 2), 1024).to(device)(latent)
    tokens = f * (h // 2) * (w // 2)
    hidden = torch.randn(batch, tokens, shape.dim, generator=g).to(device, torch.bfloat16)
    context = torch.randn(batch, 512, shape.dim, generator=g).to(device, torch.bfloat16)
    temb = torch.randn(batch, 6, shape.dim, generator=g).to(device, torch.float32)
    return hidden, context, temb, rope


def stack_config(budget: int | str, device: torch.device) -> ft.OffloadConfig:
    """The stack streamed block by block."""
    return ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=budget, device=device)


# ---------------------------------------------------------------------------------------- timing


@dataclass
class Timed:
    """Median milliseconds of some forwards and the last one's output."""

    ms: float
    out: torch.Tensor


def time_forwards(model: Callable[..., torch.Tensor], x: tuple, reps: int, device: torch.device) -> Timed:
    """``reps`` forwards, each timed between device synchronisations."""
    times = []
    out = None
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        out = model(*x)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return Timed(statistics.median(times), out)


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (a rise after warm-up is a recompile)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------- the budget


@dataclass(frozen=True)
class BudgetCheck:
    """One run's peak allocated device memory against its budget. Unknown (None) on the CPU."""

    budget_bytes: int | None
    peak_allocated_bytes: int | None
    scope: str  # what the peak covers

    @property
    def peak_within_budget(self) -> bool | None:
        if self.budget_bytes is None or self.peak_allocated_bytes is None:
            return None
        return self.peak_allocated_bytes <= self.budget_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_within_budget": self.peak_within_budget,
            "peak_scope": self.scope,
        }


def check_budget(label: str, budget_bytes: int | None, peak_bytes: int | None, scope: str) -> dict[str, Any]:
    """The run's budget record; a run over its budget is said on a line of its own."""
    check = BudgetCheck(budget_bytes, peak_bytes, scope)
    if check.peak_within_budget is False:
        over = peak_bytes - budget_bytes
        print(
            f"OVER BUDGET: {label}: peak allocated {peak_bytes} B > budget {budget_bytes} B "
            f"(+{over} B, +{100 * over / budget_bytes:.2f} %) over {scope}",
            flush=True,
        )
    return check.as_dict()


class PeakWatch:
    """Peak allocated device memory from its creation on; None on the CPU.

    Create it right before a run's offload set-up. `part` reads the peak of the part that ended and starts
    the next (the steady forwards, say); `peak` stays the whole run's. Both are windows of
    `flextensor_diffusers.engine.peaks`, so the resets of torch's counter that the engine (profiling forwards),
    the recipes and compare make during the run hide nothing from them; a reset with torch's own
    ``reset_peak_memory_stats`` would, and nothing in a run may make one.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._whole: ft.engine.PeakWindow | None = None
        self._part: ft.engine.PeakWindow | None = None
        if self.cuda:
            sync(device)
            self._whole = ft.engine.open_window(device)
            self._part = self._whole

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> PeakWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to undo: a window only reads the engine's record."""

    def part(self) -> int | None:
        """The peak since the last part ended (or since creation); a new part starts."""
        if self._part is None:
            return None
        sync(self.device)
        peak = self._part.peak()
        self._part = ft.engine.open_window(self.device)
        return peak

    @property
    def peak(self) -> int | None:
        if self._whole is None:
            return None
        sync(self.device)
        return self._whole.peak()

    def check(self, label: str, budget_bytes: int | None, scope: str = WHOLE_RUN) -> dict[str, Any]:
        return check_budget(label, budget_bytes, self.peak, scope)


# ---------------------------------------------------------------------------------------- streamed runs


@dataclass
class StreamedTiming:
    """Median offloaded forward of a plan already warm, what it streamed per forward, and its lower bound."""

    ms: float
    out: torch.Tensor
    stats: Any  # the handle's OffloadStats after timing
    streamed_bytes: float
    bandwidth: float  # profiled, bytes per ms
    peak_allocated_bytes: int | None  # over the timed forwards alone

    def lower_bound_ms(self, compute_ms: float) -> float:
        """No schedule beats max(compute, streamed bytes / bandwidth)."""
        return max(compute_ms, self.streamed_bytes / self.bandwidth)


def time_streamed(
    handle: Any, model: nn.Module, x: tuple, reps: int, device: torch.device, watch: PeakWatch
) -> StreamedTiming:
    """Time ``reps`` forwards of the handle's current plan, as a part of ``watch`` of their own."""
    watch.part()
    streamed_before = handle.stats().bytes_streamed
    timed = time_forwards(model, x, reps, device)
    peak = watch.part()
    stats = handle.stats()
    streamed = (stats.bytes_streamed - streamed_before) / reps
    return StreamedTiming(timed.ms, timed.out, stats, streamed, handle.profile.bandwidth_bytes_per_ms, peak)


@dataclass
class StreamedRun:
    """One budget's run of the stack: offloaded at that budget, profiled, planned, timed, removed."""

    workload: str
    budget: dict[str, Any]  # `check_budget`'s record
    setup_s: float
    plan: Any = None  # the engine's Plan
    timing: StreamedTiming | None = None
    planned_weight_bytes: int = 0  # weights outside units + resident units + slots
    recompiles_after_warmup: int = 0
    error: str | None = None


def warm_up(handle: Any, model: nn.Module, x: tuple) -> None:
    """Discovery, profiling and the plan's first forward; the handle must then follow a plan."""
    for _ in range(3):
        model(*x)
    if handle.phase is not ft.engine.Phase.STEADY:
        raise RuntimeError(f"expected a plan after three forwards, the handle is in phase {handle.phase}")


def streamed_run(
    model: nn.Module, shape: StackShape, workload: str, budget: int, reps: int, device: torch.device
) -> StreamedRun:
    """Offload ``model`` at ``budget`` and run ``workload`` as a user would: set-up, discovery, profiling,
    the plan's first forward, then ``reps`` timed forwards. The inputs are made after set-up, as a
    pipeline makes its latents. A budget the engine refuses after profiling is the run's ``error``."""
    label = f"{workload} at {budget} B"
    watch = PeakWatch(device)
    start = time.perf_counter()
    handle = ft.offload(model, stack_config(budget, device))
    setup_s = time.perf_counter() - start
    try:
        with torch.inference_mode():
            x = stack_inputs(shape, workload, device)
            try:
                warm_up(handle, model, x)
            except ft.engine.BudgetError as exc:
                return StreamedRun(workload, watch.check(label, budget), setup_s, error=str(exc))
            sync(device)
            warm = dynamo_graphs()
            timing = time_streamed(handle, model, x, reps, device, watch)
            plan = handle.plan
            planned = handle.resident_weight_bytes + sum(handle.units[u].nbytes for u in plan.resident)
            planned += plan.num_slots * plan.slot_bytes
            return StreamedRun(
                workload,
                watch.check(label, budget),
                setup_s,
                plan,
                timing,
                planned,
                recompiles_after_warmup=dynamo_graphs() - warm,
            )
    finally:
        handle.remove()


@dataclass
class BudgetProbe:
    """Budgets from the smallest workable to all resident, per workload, and what the probe's set-up cost."""

    budgets: dict[str, list[int]]
    setup: dict[str, Any]


def probe_budgets(
    model: nn.Module, shape: StackShape, workloads: list[str], count: int, device: torch.device
) -> BudgetProbe:
    """Offload without a limit, profile each workload, and space ``count`` budgets from the smallest the
    engine accepts to every unit resident (both with the measured activations and their margin)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rss_before = psutil.Process().memory_info().rss
    with HostMemorySampler(rss_bytes, 0.005) as rss:
        start = time.perf_counter()
        handle = ft.offload(model, stack_config(UNLIMITED, device))
        setup_s = time.perf_counter() - start
    setup = {
        "setup_s": round(setup_s, 3),
        "model_bytes": weights,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": rss.peak(),
        "peak_rss_over_model": round(rss.peak() / weights, 3),
        "pinned_in_place": all(u.pinned_in_place for u in handle.units),
    }
    print(f"set-up {setup_s:.2f} s, peak RSS {rss.peak() / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB of weights")
    units = [u.nbytes for u in handle.units]
    budgets = {}
    with torch.inference_mode():
        for workload in workloads:
            handle.set_budget(UNLIMITED)
            warm_up(handle, model, stack_inputs(shape, workload, device))
            low = handle.smallest_budget()
            high = low - 2 * max(units) + sum(units)
            budgets[workload] = [low + (high - low) * k // max(count - 1, 1) for k in range(count)]
    start = time.perf_counter()
    handle.remove()
    setup["remove_s"] = round(time.perf_counter() - start, 3)
    return BudgetProbe(budgets, setup)


# ---------------------------------------------------------------------------------------- host memory


def rss_bytes() -> int:
    """This process's resident set."""
    return psutil.Process().memory_info().rss


def proc_status_bytes(*keys: str) -> int:
    """The sum of ``keys`` (``RssAnon``, ``RssShmem``, ``RssFile``...) of this process's /proc/self/status, bytes."""
    total = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in keys:
                total += int(rest.split()[0]) * 1024
    return total


def anon_shmem_bytes() -> int:
    """RssAnon + RssShmem of this process: its own memory, pinned buffers included, mapped files' pages not."""
    return proc_status_bytes("RssAnon", "RssShmem")


class HostMemorySampler:
    """Peak of ``read()`` per phase, sampled on a thread every ``interval_s`` and at each phase change."""

    def __init__(self, read: Callable[[], int], interval_s: float) -> None:
        self.read = read
        self.interval_s = interval_s
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        value = self.read()
        with self._lock:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def set_phase(self, phase: str) -> None:
        self.sample()  # the end of the phase before
        with self._lock:
            self.phase = phase
        self.sample()

    def peak(self) -> int:
        """The largest sample of every phase."""
        with self._lock:
            return max(self.peaks.values(), default=0)

    def start(self) -> HostMemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def __enter__(self) -> HostMemorySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------- results


def write_json(path: Path | None, data: dict[str, Any], quiet: bool = False) -> None:
    """Write ``data`` to ``path`` (when given) under a temporary name, then rename it: a reader, or a run cut
    off while writing, never leaves half a file."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
    if not quiet:
        print(f"wrote {path}", flush=True)


def provenance() -> dict[str, Any]:
    """What each row carries: the command that made it and the code's commit (CODE_COMMIT when set, since the
    device's copy of the tree may have a stale .git or none; else git's HEAD)."""
    commit = os.environ.get("CODE_COMMIT")
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, check=True).stdout.decode()
    return {"command": " ".join(["python3", *sys.argv]), "code_commit": commit.strip() if commit else None}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def pinned_bandwidth(device: torch.device) -> float:
    """Pinned host-to-device copy rate of 1 GiB, GB/s (0 on the CPU)."""
    if device.type != "cuda":
        return 0.0
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    sync(device)
    return 5 * host.numel() / (time.perf_counter() - start) / 1e9


def result_header(config: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What a stack benchmark's JSON starts with (device, torch, its arguments, pinned bandwidth); printed."""
    result: dict[str, Any] = {
        "device": device_name(device),
        "torch": torch.__version__,
        "config": config,
        "bandwidth_GBps": round(pinned_bandwidth(device), 2),
        "runs": [],
    }
    print(f"device {result['device']}, torch {torch.__version__}, pinned H2D {result['bandwidth_GBps']} GB/s")
    return result


def forwards_until_compressed_steady(handle: Any, forward: Callable[[], Any], limit_s: float = 120.0) -> int | None:
    """Run ``forward()`` until ``handle`` is in steady state with planned loads that decode: a compressed set-up
    profiles first, and one from the payload file that did not wait for it streams raw until its payloads arrived
    and were proven (`CompressedCopies.unproven`). The forwards run (0: it was already), or None when ``limit_s``
    seconds of forwards did not get there (e.g. a plan that loads every unit raw)."""
    from flextensor_diffusers.engine import Phase

    start, ran = time.perf_counter(), 0
    while True:
        if handle.phase is Phase.STEADY and handle.device_copies.decoding and not handle.host.compressed.arriving:
            return ran
        if time.perf_counter() - start > limit_s:
            return None
        forward()
        ran += 1
