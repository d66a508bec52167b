"""Engine benchmark: a stack of Wan2.2-A14B-sized transformer blocks, native vs streamed.

40 diffusers ``WanTransformerBlock`` (dim 5120, 40 heads, ffn 13824, cross-attention over 512
text tokens; random bf16 weights, fp32 ``scale_shift_table`` and ``norm2`` as Wan keeps them) and
two workloads: 81 frames 832x480 with CFG batch 2 (32 760 tokens) and 17 frames 480x272 batch 1
(2 550 tokens). For each workload and each of 5 budgets, from "weights outside blocks + 2 slots +
activations" to "all resident", it reports native and offloaded forward time (median), the plan's
lower bound max(native compute, streamed bytes / measured bandwidth), peak allocated memory, bytes
streamed and bitwise equality with the native output.

    python benchmarks/engine_bench.py --out benchmarks/results/engine_h200.json
    python benchmarks/engine_bench.py --blocks 4 --dim 256 --heads 4 --ffn 512  # small, any device
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flextensor_diffusers as ft

WORKLOADS = {
    # name: (batch, latent frames, latent height, latent width) for a VAE of 4x temporal / 8x spatial
    "81f_832x480_cfg": (2, 21, 60, 104),
    "17f_480x272": (1, 5, 34, 60),
}


class BlockStack(nn.Module):
    """The repeated part of WanTransformer3DModel: blocks only, plus a small output projection."""

    def __init__(self, blocks: int, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        self.blocks = nn.ModuleList(
            [WanTransformerBlock(dim, ffn, heads, "rms_norm_across_heads", True, 1e-6) for _ in range(blocks)]
        )
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, 64)

    def forward(self, hidden, context, temb, rope):  # noqa: ANN001, ANN201
        for block in self.blocks:
            hidden = block(hidden, context, temb, rope)
        return self.proj_out(self.norm_out(hidden.float()).type_as(hidden))


def build(args: argparse.Namespace, device: torch.device) -> BlockStack:
    torch.manual_seed(0)
    with torch.device(device):
        model = BlockStack(args.blocks, args.dim, args.heads, args.ffn)
    model.to(torch.bfloat16)
    for block in model.blocks:  # Wan keeps these in fp32 (_keep_in_fp32_modules)
        block.scale_shift_table.data = block.scale_shift_table.data.float()
        block.norm2.float()
    return model.eval().requires_grad_(False)


def inputs(args: argparse.Namespace, workload: str, device: torch.device) -> tuple:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    batch, f, h, w = WORKLOADS[workload]
    if args.small:
        f, h, w = max(1, f // 4), max(2, h // 8), max(2, w // 8)
    g = torch.Generator(device="cpu").manual_seed(1)
    latent = torch.zeros(batch, 16, f, h, w, device=device)
    rope = WanRotaryPosEmbed(args.dim // args.heads, (1, 2, 2), 1024).to(device)(latent)
    tokens = f * (h // 2) * (w // 2)
    hidden = torch.randn(batch, tokens, args.dim, generator=g).to(device, torch.bfloat16)
    context = torch.randn(batch, 512, args.dim, generator=g).to(device, torch.bfloat16)
    temb = torch.randn(batch, 6, args.dim, generator=g).to(device, torch.float32)
    return hidden, context, temb, rope


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forwards(model: nn.Module, x: tuple, reps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    times = []
    out = None
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        out = model(*x)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out


@dataclass
class StreamedTiming:
    """Median offloaded forward of a plan already warm, what it streamed per forward, and its lower bound."""

    ms: float
    out: torch.Tensor
    stats: Any  # the handle's OffloadStats after timing
    streamed_bytes: float
    bandwidth: float  # profiled, bytes per ms

    def lower_bound_ms(self, compute_ms: float) -> float:
        """No schedule beats max(compute, streamed bytes / bandwidth)."""
        return max(compute_ms, self.streamed_bytes / self.bandwidth)


def time_streamed(handle: Any, model: nn.Module, x: tuple, reps: int, device: torch.device) -> StreamedTiming:
    """Time ``reps`` forwards of the handle's current plan from a fresh peak-memory counter."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    streamed_before = handle.stats().bytes_streamed
    ms, out = time_forwards(model, x, reps, device)
    stats = handle.stats()
    streamed = (stats.bytes_streamed - streamed_before) / reps
    return StreamedTiming(ms, out, stats, streamed, handle.profile.bandwidth_bytes_per_ms)


class RssSampler:
    """Peak resident set size of this process, sampled every 5 ms on a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_result(path: Path | None, result: dict) -> None:
    """Save a benchmark's JSON (when a path was given) and say where."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def pinned_bandwidth(device: torch.device) -> float:
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


def result_header(args: argparse.Namespace, device: torch.device) -> dict:
    """What every stack benchmark's JSON starts with (device, torch, arguments, pinned bandwidth); printed."""
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": vars(args) | {"out": str(args.out)},
        "bandwidth_GBps": round(pinned_bandwidth(device), 2),
        "runs": [],
    }
    print(f"device {result['device']}, torch {torch.__version__}, pinned H2D {result['bandwidth_GBps']} GB/s")
    return result


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """Size of the block stack; defaults are Wan2.2-A14B's."""
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--ffn", type=int, default=13824)
    parser.add_argument("--small", action="store_true", help="shrink the token counts (quick check)")


def stack_argv(args: argparse.Namespace) -> list[str]:
    """`add_stack_arguments` values back as command-line words, for child processes."""
    argv = ["--blocks", str(args.blocks), "--dim", str(args.dim), "--heads", str(args.heads), "--ffn", str(args.ffn)]
    return [*argv, "--small"] if args.small else argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_arguments(parser)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = result_header(args, device)

    # Native: everything on the device.
    model = build(args, device)
    natives = {}
    with torch.inference_mode():
        for workload in args.workloads:
            x = inputs(args, workload, device)
            model(*x)  # warm-up
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            native_ms, ref = time_forwards(model, x, args.reps, device)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            natives[workload] = {
                "ms": native_ms,
                "out": ref.cpu(),
                "peak": peak,
                "activation_peak": peak - base if device.type == "cuda" else 0,
            }
            print(f"native {workload}: {native_ms:.1f} ms, peak {peak / 2**30:.2f} GiB")
            del x, ref
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()

    with RssSampler() as rss:
        rss_before = psutil.Process().memory_info().rss
        start = time.perf_counter()
        handle = ft.offload(model, ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=10**15, device=device))
        setup_s = time.perf_counter() - start
    result["setup"] = {
        "setup_s": round(setup_s, 3),
        "model_bytes": weights,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": rss.peak,
        "peak_rss_over_model": round(rss.peak / weights, 3),
        "pinned_in_place": all(u.pinned_in_place for u in handle.units),
    }
    print(f"set-up {setup_s:.2f} s, peak RSS {rss.peak / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB of weights")
    unit_bytes = max(u.nbytes for u in handle.units)
    total_units = sum(u.nbytes for u in handle.units)

    with torch.inference_mode():
        for workload in args.workloads:
            x = inputs(args, workload, device)
            native = natives[workload]
            handle.set_budget(10**15)
            for _ in range(3):  # discovery (first workload only), profiling, first planned forward
                model(*x)
            assert handle.phase is ft.engine.Phase.STEADY, handle.phase
            act = handle.profile.activation_peak_bytes
            margin = int(act * (1 + handle.config.activation_margin))
            low = handle.resident_weight_bytes + 2 * unit_bytes + margin
            high = handle.resident_weight_bytes + total_units + margin
            budgets = [low + (high - low) * k // (args.budgets - 1) for k in range(args.budgets)]
            for budget in budgets:
                plan = handle.set_budget(budget)
                model(*x)  # first forward of the plan
                sync(device)
                timing = time_streamed(handle, model, x, args.reps, device)
                offload_ms, out, stats = timing.ms, timing.out, timing.stats
                lower = timing.lower_bound_ms(native["ms"])
                run = {
                    "workload": workload,
                    "budget_bytes": int(budget),
                    "streamed_units": len(plan.streamed),
                    "resident_units": len(plan.resident),
                    "num_slots": plan.num_slots,
                    "native_ms": round(native["ms"], 3),
                    "offload_ms": round(offload_ms, 3),
                    "overhead_pct": round(100 * (offload_ms / native["ms"] - 1), 2),
                    "lower_bound_ms": round(lower, 3),
                    "over_lower_bound": round(offload_ms / lower, 4),
                    "planner_predicted_ms": round(plan.predicted_ms, 3),
                    "planner_lower_bound_ms": round(plan.lower_bound_ms, 3),
                    "peak_allocated_bytes": int(stats.peak_allocated_bytes or 0),
                    "native_peak_allocated_bytes": int(native["peak"]),
                    "expected_peak_bytes": int(
                        handle.resident_weight_bytes
                        + sum(handle.units[u].nbytes for u in plan.resident)
                        + plan.num_slots * plan.slot_bytes
                        + native["activation_peak"]
                    ),
                    "bytes_streamed_per_forward": int(timing.streamed_bytes),
                    "bandwidth_GBps_profiled": round(timing.bandwidth / 1e6, 2),
                    "stall_ms_total": round(stats.stall_ms, 2),
                    "overlap_pct": None if stats.overlap_pct is None else round(stats.overlap_pct, 2),
                    "bitwise_equal": bool(torch.equal(out.cpu(), native["out"])),
                }
                run["peak_over_expected"] = round(run["peak_allocated_bytes"] / max(run["expected_peak_bytes"], 1), 4)
                result["runs"].append(run)
                print(
                    f"{workload:>16} budget {budget / 2**30:7.2f} GiB  streamed {run['streamed_units']:>2} "
                    f"slots {plan.num_slots}  native {native['ms']:8.1f}  offload {offload_ms:8.1f} ms "
                    f"({run['overhead_pct']:+.2f}%)  bound {lower:8.1f} (x{run['over_lower_bound']:.3f})  "
                    f"peak {run['peak_allocated_bytes'] / 2**30:6.2f} GiB (x{run['peak_over_expected']:.3f} "
                    f"of expected)  equal {run['bitwise_equal']}",
                    flush=True,
                )
            del x
    result["forwards"] = handle.counters
    start = time.perf_counter()
    handle.remove()
    result["remove_s"] = round(time.perf_counter() - start, 3)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
