"""Regional torch.compile with streaming: the engine benchmark's Wan2.2-A14B block stack.

For each workload: native eager, native with every block compiled (``block.compile(fullgraph=True)``,
what ``compile_repeated_blocks`` does), then the same compiled model offloaded (compiled before
enabling) at the smallest workable budget and at a middle one. Reports the median forward time,
the lower bound max(compiled compute, streamed bytes / profiled bandwidth), the planner's
prediction against the measurement, recompiles after warm-up, and bitwise equality with the
natively compiled output.

``--cudagraphs`` measures instead whether CUDA graphs would help natively: every block compiled with
``mode="reduce-overhead"`` (CUDA graphs per block) against the default mode, on the same stack.
Offloading refuses CUDA-graph modes; this measures what that refusal costs.

    python benchmarks/compile_bench.py --out benchmarks/results/compile_h200.json
    python benchmarks/compile_bench.py --cudagraphs --workloads 17f_480x272 --out compile_cudagraphs.json
    python benchmarks/compile_bench.py --blocks 4 --dim 256 --heads 4 --ffn 512 --small  # any device
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import (
    WORKLOADS,
    add_stack_arguments,
    build,
    inputs,
    result_header,
    sync,
    time_forwards,
    time_streamed,
    write_result,
)

import flextensor_diffusers as ft


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compiled_forward_ms(model: torch.nn.Module, x: tuple, reps: int, device: torch.device, mode: str) -> dict:
    """Compile every block with ``mode`` (after forgetting earlier compilations) and time the stack."""
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(fullgraph=True, mode=mode)
    start = time.perf_counter()
    for _ in range(3):  # compile, then CUDA-graph warm-up and recording for the modes that use them
        model(*x)
    sync(device)
    first_s = time.perf_counter() - start
    ms, out = time_forwards(model, x, reps, device)
    return {"ms": ms, "out": out.clone().cpu(), "first_calls_s": first_s}


def measure_cudagraphs(args: argparse.Namespace, device: torch.device, result: dict) -> None:
    """Native only: regional compilation with and without CUDA graphs, per workload."""
    model = build(args, device)
    result["cudagraphs_native"] = []
    with torch.inference_mode():
        for workload in args.workloads:
            x = inputs(args, workload, device)
            model(*x)
            eager_ms, _ = time_forwards(model, x, args.reps, device)
            default = compiled_forward_ms(model, x, args.reps, device, "default")
            try:
                graphs_ = compiled_forward_ms(model, x, args.reps, device, "reduce-overhead")
            except RuntimeError as exc:  # measured on the H200: each block's graph overwrites its input
                error = str(exc).splitlines()[0]
                result["cudagraphs_native"].append({"workload": workload, "error": error})
                print(f"{workload}: regional + CUDA graphs failed natively: {error}", flush=True)
                break
            row = {
                "workload": workload,
                "native_eager_s": round(eager_ms / 1e3, 5),
                "native_compiled_s": round(default["ms"] / 1e3, 5),
                "native_cudagraphs_s": round(graphs_["ms"] / 1e3, 5),
                "cudagraphs_speedup_over_compiled": round(default["ms"] / graphs_["ms"], 4),
                "compile_first_calls_s": round(default["first_calls_s"], 2),
                "cudagraphs_first_calls_s": round(graphs_["first_calls_s"], 2),
                "cudagraphs_bitwise_equal_compiled": bool(torch.equal(default["out"], graphs_["out"])),
            }
            result["cudagraphs_native"].append(row)
            print(
                f"{workload}: eager {eager_ms:.2f} ms, regional {default['ms']:.2f} ms, regional+CUDA graphs "
                f"{graphs_['ms']:.2f} ms (x{row['cudagraphs_speedup_over_compiled']:.4f})",
                flush=True,
            )
            for block in model.blocks:  # back to eager for the next workload's eager timing
                block._compiled_call_impl = None
            del x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_arguments(parser)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cudagraphs", action="store_true", help="measure native CUDA graphs only (see above)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = result_header(args, device)
    if args.cudagraphs:
        measure_cudagraphs(args, device, result)
        write_result(args.out, result)
        return

    model = build(args, device)
    natives = {}
    with torch.inference_mode():
        for workload in args.workloads:
            x = inputs(args, workload, device)
            model(*x)
            eager_ms, _ = time_forwards(model, x, args.reps, device)
            natives[workload] = {"eager_ms": eager_ms}
            del x
        for block in model.blocks:
            block.compile(fullgraph=True)
        for workload in args.workloads:
            x = inputs(args, workload, device)
            start = time.perf_counter()
            model(*x)
            sync(device)
            compile_s = time.perf_counter() - start
            model(*x)
            compiled_ms, ref = time_forwards(model, x, args.reps, device)
            natives[workload].update(compiled_ms=compiled_ms, out=ref.cpu(), first_call_s=compile_s)
            print(
                f"native {workload}: eager {natives[workload]['eager_ms']:.1f} ms, regional compiled "
                f"{compiled_ms:.1f} ms (x{natives[workload]['eager_ms'] / compiled_ms:.3f}); "
                f"first call {compile_s:.1f} s"
            )
            del x, ref
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()

    handle = ft.offload(model, ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=10**15, device=device))
    unit_bytes = max(u.nbytes for u in handle.units)
    total_units = sum(u.nbytes for u in handle.units)
    with torch.inference_mode():
        for workload in args.workloads:
            x = inputs(args, workload, device)
            native = natives[workload]
            handle.set_budget(10**15)
            for _ in range(3):  # discovery (warm-up: recompiles for the swapped block class), profiling, planned
                model(*x)
            act = handle.profile.activation_peak_bytes
            margin = int(act * (1 + handle.config.activation_margin))
            low = handle.resident_weight_bytes + 2 * unit_bytes + margin
            high = handle.resident_weight_bytes + total_units + margin
            for label, budget in (("smallest", low), ("middle", (low + high) // 2)):
                plan = handle.set_budget(budget)
                model(*x)
                sync(device)
                warm = graphs()
                timing = time_streamed(handle, model, x, args.reps, device)
                offload_ms, out, stats = timing.ms, timing.out, timing.stats
                lower = timing.lower_bound_ms(native["compiled_ms"])
                run = {
                    "workload": workload,
                    "mode": "regional",
                    "budget": label,
                    "budget_bytes": int(budget),
                    "streamed_units": len(plan.streamed),
                    "num_slots": plan.num_slots,
                    "native_eager_s": round(native["eager_ms"] / 1e3, 5),
                    "native_compiled_s": round(native["compiled_ms"] / 1e3, 5),
                    "offload_compiled_s": round(offload_ms / 1e3, 5),
                    "over_native_compiled": round(offload_ms / native["compiled_ms"], 4),
                    "lower_bound_s": round(lower / 1e3, 5),
                    "over_lower_bound": round(offload_ms / lower, 4),
                    "planner_predicted_s": round(plan.predicted_ms / 1e3, 5),
                    "predicted_over_measured": round(plan.predicted_ms / offload_ms, 4),
                    "recompiles_after_warmup": graphs() - warm,
                    "peak_allocated_bytes": int(stats.peak_allocated_bytes or 0),
                    "bitwise_equal_native_compiled": bool(torch.equal(out.cpu(), native["out"])),
                }
                result["runs"].append(run)
                print(
                    f"{workload:>16} {label:>8} {budget / 2**30:6.2f} GiB  streamed {run['streamed_units']:>2}  "
                    f"compiled native {native['compiled_ms']:8.1f}  offload {offload_ms:8.1f} ms "
                    f"(x{run['over_native_compiled']:.4f})  bound x{run['over_lower_bound']:.3f}  predicted "
                    f"x{run['predicted_over_measured']:.3f}  recompiles {run['recompiles_after_warmup']}  "
                    f"equal {run['bitwise_equal_native_compiled']}",
                    flush=True,
                )
            del x
    result["forwards"] = handle.counters
    handle.remove()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
