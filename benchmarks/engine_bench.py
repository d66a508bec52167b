"""Engine benchmark: a stack of Wan2.2-A14B-sized transformer blocks, native vs streamed.

40 diffusers ``WanTransformerBlock`` (dim 5120, 40 heads, ffn 13824, cross-attention over 512
text tokens; random bf16 weights, fp32 ``scale_shift_table`` and ``norm2`` as Wan keeps them) and
two workloads: 81 frames 832x480 with CFG batch 2 (32 760 tokens) and 17 frames 480x272 batch 1
(2 550 tokens). A first offload without a limit profiles each workload; then each of ``--budgets``
budgets, from the smallest the engine accepts to "all resident", is a run of its own as a user makes
one: offload at that budget, discovery, profiling, the plan's first forward, ``--reps`` timed forwards.
Each run reports native and offloaded forward time (median), the plan's lower bound max(native compute,
streamed bytes / measured bandwidth), peak allocated memory over the whole run against the budget (and
over the timed forwards), bytes streamed and bitwise equality with the native output.

    python benchmarks/engine_bench.py --out benchmarks/results/engine_h200.json
    python benchmarks/engine_bench.py --blocks 4 --dim 256 --heads 4 --ffn 512 --small  # small, any device
"""

from __future__ import annotations

import argparse
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


def measure_native(model: nn.Module, shape: StackShape, workload: str, reps: int, device: torch.device) -> dict:
    """Median forward with every weight on the device, its output, its peak and the activations' part of it."""
    with torch.inference_mode():
        x = stack_inputs(shape, workload, device)
        model(*x)  # warm-up
        sync(device)
        base = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        timed = time_forwards(model, x, reps, device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    print(f"native {workload}: {timed.ms:.1f} ms, peak {peak / 2**30:.2f} GiB")
    return {"ms": timed.ms, "out": timed.out.cpu(), "peak": peak, "activation_peak": peak - base if peak else 0}


def run_record(run: StreamedRun, native: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of one budget's run (the budget's fields only when the engine refused it)."""
    record: dict[str, Any] = {"workload": run.workload, "setup_s": round(run.setup_s, 3), **run.budget}
    if run.error is not None:
        return {**record, "error": run.error}
    plan, timing = run.plan, run.timing
    lower = timing.lower_bound_ms(native["ms"])
    expected = run.planned_weight_bytes + native["activation_peak"]
    steady_peak = timing.peak_allocated_bytes  # None on the CPU
    return {
        **record,
        "streamed_units": len(plan.streamed),
        "resident_units": len(plan.resident),
        "num_slots": plan.num_slots,
        "native_ms": round(native["ms"], 3),
        "offload_ms": round(timing.ms, 3),
        "overhead_pct": round(100 * (timing.ms / native["ms"] - 1), 2),
        "lower_bound_ms": round(lower, 3),
        "over_lower_bound": round(timing.ms / lower, 4),
        "planner_predicted_ms": round(plan.predicted_ms, 3),
        "planner_lower_bound_ms": round(plan.lower_bound_ms, 3),
        "steady_peak_allocated_bytes": steady_peak,
        "native_peak_allocated_bytes": int(native["peak"]),
        "expected_peak_bytes": int(expected),
        "peak_over_expected": None if steady_peak is None else round(steady_peak / max(expected, 1), 4),
        "bytes_streamed_per_forward": int(timing.streamed_bytes),
        "bandwidth_GBps_profiled": round(timing.bandwidth / 1e6, 2),
        "stall_ms_total": round(timing.stats.stall_ms, 2),
        "overlap_pct": None if timing.stats.overlap_pct is None else round(timing.stats.overlap_pct, 2),
        "bitwise_equal": bool(torch.equal(timing.out.cpu(), native["out"])),
    }


def print_run(run: dict[str, Any]) -> None:
    budget = f"{run['workload']:>16} budget {run['budget_bytes'] / 2**30:7.2f} GiB"
    if "error" in run:
        print(f"{budget}  refused: {run['error']}", flush=True)
        return
    peak = (run["peak_allocated_bytes"] or 0) / 2**30
    steady = "n/a" if run["peak_over_expected"] is None else f"x{run['peak_over_expected']:.3f}"
    print(
        f"{budget}  streamed {run['streamed_units']:>2} slots {run['num_slots']}  native {run['native_ms']:8.1f}  "
        f"offload {run['offload_ms']:8.1f} ms ({run['overhead_pct']:+.2f}%)  bound {run['lower_bound_ms']:8.1f} "
        f"(x{run['over_lower_bound']:.3f})  peak {peak:6.2f} GiB, within budget {run['peak_within_budget']} "
        f"(steady {steady} of expected)  equal {run['bitwise_equal']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    StackShape.add_arguments(parser)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = StackShape.from_args(args)
    device = default_device()
    result = result_header(vars(args) | {"out": str(args.out)}, device)

    model = build_stack(shape, device)
    natives = {w: measure_native(model, shape, w, args.reps, device) for w in args.workloads}
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()

    probe = probe_budgets(model, shape, args.workloads, args.budgets, device)
    result["setup"] = probe.setup
    for workload in args.workloads:
        for budget in probe.budgets[workload]:
            run = run_record(streamed_run(model, shape, workload, budget, args.reps, device), natives[workload])
            result["runs"].append(run)
            print_run(run)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
