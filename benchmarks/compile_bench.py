"""Regional torch.compile with streaming: the engine benchmark's Wan2.2-A14B block stack.

For each workload: native eager, native with every block compiled (``block.compile(fullgraph=True)``,
what ``compile_repeated_blocks`` does), then the same compiled model offloaded (compiled before
enabling) at the smallest workable budget and at a middle one, each a run of its own (offload at that
budget, discovery, profiling, the plan's first forward, timed forwards). Reports the median forward
time, the lower bound max(compiled compute, streamed bytes / profiled bandwidth), the planner's
prediction against the measurement, recompiles after warm-up, peak allocated memory over the whole run
against the budget, and bitwise equality with the natively compiled output.

``--cudagraphs`` measures instead whether CUDA graphs would help natively: every block compiled with
``mode="reduce-overhead"`` (CUDA graphs per block) against the default mode, on the same stack.
Offloading refuses CUDA-graph modes; this measures what that refusal costs.

    python benchmarks/compile_bench.py --out benchmarks/results/compile_h200.json
    python benchmarks/compile_bench.py --cudagraphs --workloads 17f_480x272 --out compile_cudagraphs.json
    python benchmarks/compile_bench.py --blocks 4 --dim 256 --heads 4 --ffn 512 --small  # any device
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    WORKLOADS,
    StackShape,
    StreamedRun,
    build_stack,
    default_device,
    probe_budgets,
    result_header,
    stack_inputs,
    streamed_run,
    sync,
    time_forwards,
    write_json,
)
from torch import nn

#: Budgets run per workload: the smallest and the middle of the engine benchmark's three.
BUDGETS = ("smallest", "middle")


def compiled_forward_ms(model: nn.Module, x: tuple, reps: int, device: torch.device, mode: str) -> dict:
    """Compile every block with ``mode`` (after forgetting earlier compilations) and time the stack."""
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(fullgraph=True, mode=mode)
    start = time.perf_counter()
    for _ in range(3):  # compile, then CUDA-graph warm-up and recording for the modes that use them
        model(*x)
    sync(device)
    first_s = time.perf_counter() - start
    timed = time_forwards(model, x, reps, device)
    return {"ms": timed.ms, "out": timed.out.clone().cpu(), "first_calls_s": first_s}


def cudagraphs_row(model: nn.Module, shape: StackShape, workload: str, reps: int, device: torch.device) -> dict:
    """Native only: regional compilation with and without CUDA graphs for one workload."""
    x = stack_inputs(shape, workload, device)
    model(*x)
    eager_ms = time_forwards(model, x, reps, device).ms
    default = compiled_forward_ms(model, x, reps, device, "default")
    try:
        graphs = compiled_forward_ms(model, x, reps, device, "reduce-overhead")
    except RuntimeError as exc:  # measured on the H200: each block's graph overwrites its input
        return {"workload": workload, "error": str(exc).splitlines()[0]}
    for block in model.blocks:  # back to eager for the next workload's eager timing
        block._compiled_call_impl = None
    return {
        "workload": workload,
        "native_eager_s": round(eager_ms / 1e3, 5),
        "native_compiled_s": round(default["ms"] / 1e3, 5),
        "native_cudagraphs_s": round(graphs["ms"] / 1e3, 5),
        "cudagraphs_speedup_over_compiled": round(default["ms"] / graphs["ms"], 4),
        "compile_first_calls_s": round(default["first_calls_s"], 2),
        "cudagraphs_first_calls_s": round(graphs["first_calls_s"], 2),
        "cudagraphs_bitwise_equal_compiled": bool(torch.equal(default["out"], graphs["out"])),
    }


def measure_cudagraphs(args: argparse.Namespace, shape: StackShape, device: torch.device, result: dict) -> None:
    model = build_stack(shape, device)
    result["cudagraphs_native"] = []
    with torch.inference_mode():
        for workload in args.workloads:
            row = cudagraphs_row(model, shape, workload, args.reps, device)
            result["cudagraphs_native"].append(row)
            if "error" in row:
                print(f"{workload}: regional + CUDA graphs failed natively: {row['error']}", flush=True)
                break
            print(
                f"{workload}: eager {row['native_eager_s']:.5f} s, regional {row['native_compiled_s']:.5f} s, "
                f"regional+CUDA graphs {row['native_cudagraphs_s']:.5f} s "
                f"(x{row['cudagraphs_speedup_over_compiled']:.4f})",
                flush=True,
            )


def measure_natives(model: nn.Module, shape: StackShape, args: argparse.Namespace, device: torch.device) -> dict:
    """Eager, then regionally compiled (every block, compiled once for all workloads), per workload."""
    natives: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for workload in args.workloads:
            x = stack_inputs(shape, workload, device)
            model(*x)
            natives[workload] = {"eager_ms": time_forwards(model, x, args.reps, device).ms}
        for block in model.blocks:
            block.compile(fullgraph=True)
        for workload in args.workloads:
            x = stack_inputs(shape, workload, device)
            start = time.perf_counter()
            model(*x)
            sync(device)
            first_call_s = time.perf_counter() - start
            model(*x)
            timed = time_forwards(model, x, args.reps, device)
            native = natives[workload]
            native.update(compiled_ms=timed.ms, out=timed.out.cpu(), first_call_s=first_call_s)
            print(
                f"native {workload}: eager {native['eager_ms']:.1f} ms, regional compiled {timed.ms:.1f} ms "
                f"(x{native['eager_ms'] / timed.ms:.3f}); first call {first_call_s:.1f} s"
            )
    return natives


def run_record(run: StreamedRun, label: str, native: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of one budget's run (the budget's fields only when the engine refused it)."""
    record: dict[str, Any] = {"workload": run.workload, "mode": "regional", "budget": label, **run.budget}
    if run.error is not None:
        return {**record, "error": run.error}
    plan, timing = run.plan, run.timing
    lower = timing.lower_bound_ms(native["compiled_ms"])
    return {
        **record,
        "setup_s": round(run.setup_s, 3),
        "streamed_units": len(plan.streamed),
        "num_slots": plan.num_slots,
        "native_eager_s": round(native["eager_ms"] / 1e3, 5),
        "native_compiled_s": round(native["compiled_ms"] / 1e3, 5),
        "offload_compiled_s": round(timing.ms / 1e3, 5),
        "over_native_compiled": round(timing.ms / native["compiled_ms"], 4),
        "lower_bound_s": round(lower / 1e3, 5),
        "over_lower_bound": round(timing.ms / lower, 4),
        "planner_predicted_s": round(plan.predicted_ms / 1e3, 5),
        "predicted_over_measured": round(plan.predicted_ms / timing.ms, 4),
        "recompiles_after_warmup": run.recompiles_after_warmup,
        "steady_peak_allocated_bytes": timing.peak_allocated_bytes,
        "bitwise_equal_native_compiled": bool(torch.equal(timing.out.cpu(), native["out"])),
    }


def print_run(run: dict[str, Any]) -> None:
    head = f"{run['workload']:>16} {run['budget']:>8} {run['budget_bytes'] / 2**30:6.2f} GiB"
    if "error" in run:
        print(f"{head}  refused: {run['error']}", flush=True)
        return
    print(
        f"{head}  streamed {run['streamed_units']:>2}  compiled native {run['native_compiled_s']:8.4f}  offload "
        f"{run['offload_compiled_s']:8.4f} s (x{run['over_native_compiled']:.4f})  bound x{run['over_lower_bound']:.3f}"
        f"  predicted x{run['predicted_over_measured']:.3f}  recompiles {run['recompiles_after_warmup']}  "
        f"within budget {run['peak_within_budget']}  equal {run['bitwise_equal_native_compiled']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    StackShape.add_arguments(parser)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cudagraphs", action="store_true", help="measure native CUDA graphs only (see above)")
    args = parser.parse_args()
    shape = StackShape.from_args(args)
    device = default_device()
    result = result_header(vars(args) | {"out": str(args.out)}, device)
    if args.cudagraphs:
        measure_cudagraphs(args, shape, device, result)
        write_json(args.out, result)
        return

    model = build_stack(shape, device)
    natives = measure_natives(model, shape, args, device)
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # The probe's discovery forward is the offloaded model's warm-up: it recompiles for the hooked blocks.
    probe = probe_budgets(model, shape, args.workloads, 3, device)
    for workload in args.workloads:
        for label, budget in zip(BUDGETS, probe.budgets[workload], strict=False):
            streamed = streamed_run(model, shape, workload, budget, args.reps, device)
            run = run_record(streamed, label, natives[workload])
            result["runs"].append(run)
            print_run(run)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
