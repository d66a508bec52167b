"""Why is a compute-bound forward slower when copies overlap it? Three measurements, one process.

1. native forward of the short workload, alone and with a side stream copying pinned memory to
   the device the whole time (physical contention between copy engine and kernels);
2. the streamed forward at a budget where about a third of the blocks are streamed, with the CPU
   time spent inside the engine's hooks and copy issue (does the host block?);
3. whether the packed host buffers are seen as pinned by torch.

    python benchmarks/diag_overlap.py --out diag.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine_bench as eb

import flextensor_diffusers as ft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--out", type=Path)
    cli = parser.parse_args()
    args = argparse.Namespace(blocks=cli.blocks, dim=5120, heads=40, ffn=13824, small=False)
    device = torch.device("cuda")
    model = eb.build(args, device)
    x = eb.inputs(args, "17f_480x272", device)
    result: dict = {}
    with torch.inference_mode():
        for _ in range(2):
            model(*x)
        result["native_ms"], ref = eb.time_forwards(model, x, 5, device)
        host = torch.empty(702 * 2**20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty_like(host, device=device)
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            for _ in range(40):
                dev.copy_(host, non_blocking=True)
        result["native_with_side_copies_ms"], _ = eb.time_forwards(model, x, 3, device)
        side.synchronize()
        del dev, host
        model.to("cpu")
        torch.cuda.empty_cache()
        handle = ft.offload(model, ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=10**15))
        result["host_is_pinned"] = bool(handle.units[0].host.is_pinned())
        for _ in range(3):
            model(*x)
        unit = handle.units[0].nbytes
        act = handle.profile.activation_peak_bytes
        for streamed in (cli.blocks // 3, cli.blocks // 2):
            budget = handle.resident_weight_bytes + (cli.blocks - streamed + 2) * unit + int(act * 1.06)
            plan = handle.set_budget(budget)
            model(*x)
            spent = {"issue": 0.0, "before": 0.0, "after": 0.0}
            originals = {"issue": handle.schedule.issue}
            originals["before"] = handle._before_unit
            originals["after"] = handle._after_unit

            def wrap(name: str, fn: Any, spent: dict[str, float] = spent) -> Any:
                def inner(*a: Any) -> None:
                    t = time.perf_counter()
                    fn(*a)
                    spent[name] += time.perf_counter() - t

                return inner

            handle.schedule.issue = wrap("issue", originals["issue"])
            handle._before_unit = wrap("before", originals["before"])
            handle._after_unit = wrap("after", originals["after"])
            ms, out = eb.time_forwards(model, x, 3, device)
            handle.schedule.issue = originals["issue"]
            handle._before_unit, handle._after_unit = originals["before"], originals["after"]
            result[f"streamed_{len(plan.streamed)}"] = {
                "offload_ms": ms,
                "predicted_ms": plan.predicted_ms,
                "slots": plan.num_slots,
                "cpu_ms_per_forward": {k: v * 1e3 / 3 for k, v in spent.items()},
                "bitwise_equal": bool(torch.equal(out, ref)),
            }
            print(result, flush=True)
        handle.remove()
    if cli.out:
        cli.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
