"""Offloading methods side by side on the engine benchmark's block stack, one fresh process each.

Methods: native; accelerate's model-level hook (what diffusers' ``enable_model_cpu_offload`` uses);
diffusers leaf-level offload (what ``enable_sequential_cpu_offload`` gives, via accelerate);
diffusers group offloading (block level, one block per group, streams, with and without
``record_stream``, with ``low_cpu_mem_usage``); accelerate ``cpu_offload``; NVIDIA flextensor 0.5.0;
this package at given budgets, with raw and with losslessly compressed streaming (also with the raw copies
on disk, and with the payloads' cache file: name that method twice, the first run writes the file and the
second reads it back). For each: peak allocated GPU memory from set-up on, against the budget for the
methods that take one (and over the timed steps alone), median step time after warm-up, set-up time
(pinning included), peak host RSS, bitwise equality with native.

``--budgets smallest`` is the engine's own least budget for the workload: a probe set-up under
``"auto"`` profiles it and is removed, then the measured run is set up at that budget.

    python benchmarks/peers.py --out benchmarks/results/peers_h200.json --workload 81f_832x480_cfg
    python benchmarks/peers.py --blocks 2 --dim 256 --heads 4 --ffn 512 --small --methods native flextensor_diffusers

Each method runs in a child process (``--child METHOD``) so that allocator state, pinned memory
and hooks of one cannot affect the next; the parent collects one JSON line from each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    WORKLOADS,
    HostMemorySampler,
    PeakWatch,
    StackShape,
    build_stack,
    default_device,
    device_name,
    forwards_until_compressed_steady,
    rss_bytes,
    stack_inputs,
    sync,
    time_forwards,
    write_json,
)

METHODS = (
    "native",
    "model_cpu_offload",
    "sequential_cpu_offload",
    "group_offload",
    "group_offload_record_stream",
    "group_offload_low_cpu_mem",
    "accelerate_cpu_offload",
    "flextensor",
    "flextensor_diffusers",
    "flextensor_diffusers_lossless",
    "flextensor_diffusers_lossless_disk",
    "flextensor_diffusers_lossless_cached",
    "flextensor_diffusers_lossless_background",
    "flextensor_diffusers_lossless_at_setup",
)
OURS = (
    "flextensor_diffusers",
    "flextensor_diffusers_lossless",
    "flextensor_diffusers_lossless_disk",
    "flextensor_diffusers_lossless_cached",
    "flextensor_diffusers_lossless_background",
    "flextensor_diffusers_lossless_at_setup",
)
#: ``background_encoding`` by the method's last word: with no payload file to read, ``_background`` encodes between
#: the forwards while the model streams raw, ``_setup`` (``_at_setup``) before set-up returns, ``_cached`` as by
#: default (between forwards on CUDA where the encoder fits the budget: what users get); the others before set-up
#: returns, so that a few warm-up forwards reach the compressed plan whose steps they time.
BACKGROUND_ENCODING: dict[str, bool | None] = {"background": True, "setup": False, "cached": None}
#: A budget given as this word is the engine's own least budget for the workload, found by a probe set-up.
SMALLEST = "smallest"
REFERENCE = "native_output.pt"
# Forwards before timing: methods that profile get discovery + profiling + one steady forward.
PROFILING_FORWARDS = 1
WARMUP = {"flextensor": 2 + PROFILING_FORWARDS} | {method: 2 + PROFILING_FORWARDS for method in OURS}


def set_up(method: str, model: torch.nn.Module, device: torch.device, budget: int | str | None, scratch: str) -> Any:
    """Apply ``method`` to ``model`` (on the CPU); returns what must stay alive. ``scratch``: where ours
    may write cache files."""
    if method == "native":
        return model.to(device)
    if method == "model_cpu_offload":
        from accelerate import cpu_offload_with_hook

        return cpu_offload_with_hook(model, execution_device=device)
    if method in ("sequential_cpu_offload", "accelerate_cpu_offload"):
        from accelerate import cpu_offload

        # diffusers' enable_sequential_cpu_offload calls accelerate's cpu_offload per component with
        # offload_buffers when the module has buffers; on a bare stack both come to this call.
        return cpu_offload(model, execution_device=device, offload_buffers=method == "sequential_cpu_offload")
    if method.startswith("group_offload"):
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(
            model,
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
            record_stream=method == "group_offload_record_stream",
            low_cpu_mem_usage=method == "group_offload_low_cpu_mem",
        )
        return None
    if method == "flextensor":
        os.environ.setdefault("DISABLE_BEARTYPE", "1")
        import flextensor

        total = torch.cuda.get_device_properties(device).total_memory
        # flextensor profiles 10 forwards by default; one keeps the run short and is what ours does.
        config = flextensor.OffloadConfig(
            include_patterns=["blocks.*"],
            max_gpu_mem_fraction=min(1.0, budget / total) if budget else None,
            profiling_iters=PROFILING_FORWARDS,
        )
        return flextensor.offload(model, config=config)
    if method in OURS:
        import flextensor_diffusers as ft

        config = ft.OffloadConfig(
            include_patterns=["blocks.*"],
            gpu_budget=budget,
            device=device,
            compression="lossless" if "lossless" in method else "none",
            raw_copies="disk" if method.endswith("_disk") else "ram",
            # the payloads' file in ``scratch``: the first run writes it, a later one reads it back
            compression_cache=method.endswith(("_cached", "_background", "_at_setup")),
            cache_dir=scratch,
            background_encoding=BACKGROUND_ENCODING.get(method.rsplit("_", 1)[-1], False),
        )
        return ft.offload(model, config)
    raise SystemExit(f"unknown method {method!r}; one of {', '.join(METHODS)}")


def smallest_budget(
    method: str, model: torch.nn.Module, shape: StackShape, workload: str, device: torch.device, scratch: str
) -> int:
    """The least budget the engine accepts for ``workload``: a probe set-up under ``"auto"``, profiled, then
    removed (the model is back as it was), so that the measured run is set up, profiled and run under that
    budget from its start."""
    handle = set_up(method, model, device, "auto", scratch)
    with torch.inference_mode():
        x = stack_inputs(shape, workload, device)
        for _ in range(WARMUP[method]):
            model(*x)
    budget = handle.smallest_budget()
    handle.remove()
    return budget


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One method in this process: set-up, warm-up, timed steps; its row (see the module docstring)."""
    device = default_device()
    shape = StackShape.from_args(args)
    model = build_stack(shape, "cpu" if device.type == "cpu" else device).to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.budget == SMALLEST:
        budget = smallest_budget(args.child, model, shape, args.workload, device, args.scratch)
    else:
        budget = None if args.budget is None else parse_budget(args.budget)
    watch = PeakWatch(device)  # from set-up on: the budget is a ceiling for all of it
    with HostMemorySampler(rss_bytes, 0.005) as rss:
        start = time.perf_counter()
        keep = set_up(args.child, model, device, budget, args.scratch)
        setup_s = time.perf_counter() - start
    runner = keep if args.child == "flextensor" else model
    warmup = WARMUP.get(args.child, args.warmup)
    with torch.inference_mode(), HostMemorySampler(rss_bytes, 0.005) as rss_run:
        x = stack_inputs(shape, args.workload, device)  # after set-up, as a pipeline makes its latents
        start = time.perf_counter()
        for _ in range(warmup):  # discovery, profiling and the plan's first forward where there are
            runner(*x)
        if args.child in OURS and keep.config.compression != "none":  # until planned loads decode (timed: warm-up)
            warmup += forwards_until_compressed_steady(keep, lambda: runner(*x), limit_s=30.0) or 0
        sync(device)
        warmup_s = time.perf_counter() - start
        watch.part()
        timed = time_forwards(runner, x, args.reps, device)
        steady_peak = watch.part()
    out = timed.out.cpu()
    return {
        "method": label(args.child, budget),
        "budget_asked": args.budget,
        **watch.check(label(args.child, budget), budget),
        "steady_peak_allocated_bytes": steady_peak,
        "step_s": round(timed.ms / 1e3, 5),
        "setup_s": round(setup_s, 3),
        # Set-up work can be deferred into the first forwards (lazy pinning, discovery, profiling):
        # set-up plus what the warm-up forwards took beyond as many steady forwards counts both.
        "warmup_s": round(warmup_s, 3),
        "setup_overhead_s": round(setup_s + warmup_s - warmup * timed.ms / 1e3, 3),
        "peak_host_rss_bytes": max(rss.peak(), rss_run.peak()),
        "bitwise_equal": same_as_native(args.child, out, Path(args.scratch)),
        # where our set-up time goes (layout, pack, pin, hooks), to see what the set-up row is made of
        "setup_ms": keep.stats().setup_ms if args.child in OURS else None,
        **(transfer_figures(keep) if args.child in OURS else {}),
        # shows whether rows of different runs saw the same native output
        "output_sha256": hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
        "keep": type(keep).__name__,
    }


def same_as_native(method: str, out: torch.Tensor, scratch: Path) -> bool:
    """Bitwise equal to native's output, which the native child saved in ``scratch``."""
    reference = scratch / REFERENCE
    if method == "native":
        torch.save(out, reference)
    return bool(torch.equal(torch.load(reference).view(torch.uint8), out.view(torch.uint8)))


def transfer_figures(handle: Any) -> dict[str, Any]:
    """What our streamed run moved: weights, host bytes kept, bytes over the link per forward, and the
    link's profiled bandwidth (for the raw-bytes lower bound). The host bytes and a compressed load's bytes
    are read from the handle's host copies (`handle.host`, part of the engine's public face)."""
    stats = handle.stats()
    report = {k: v for k, v in vars(stats).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    profile = handle.profile
    return {
        "stats": report,
        "weights_bytes": sum(u.nbytes for u in handle.units) + handle.resident_weight_bytes,
        "stored_host_bytes": handle.host.host_ram_bytes,
        "payload_cache": stats.payload_cache,
        "bandwidth_bytes_per_ms": profile.bandwidth_bytes_per_ms if profile is not None else None,
        "streamed_units": len(handle.plan.streamed) if handle.plan is not None else None,
        "streamed_raw_bytes": sum(handle.units[i].nbytes for i in handle.plan.streamed) if handle.plan else None,
        # what the plan's loads move: the payload for a unit it decodes, the raw bytes for the others
        "streamed_transfer_bytes": (
            sum(
                handle.host.transfer_bytes(i) if i in handle.plan.compressed else handle.units[i].nbytes
                for i in handle.plan.streamed
            )
            if handle.plan
            else None
        ),
        "streamed_compressed_units": len(handle.plan.compressed) if handle.plan else None,
    }


def parse_budget(text: str | int | None) -> int | None:
    from flextensor_diffusers.engine import parse_bytes

    return None if text is None else parse_bytes(text)


def label(method: str, budget: int | str | None) -> str:
    return f"{method}@{budget}" if method in OURS else method


def label_of(row: dict[str, Any]) -> str:
    """A row's method label; rows that did not run carry the budget separately."""
    return label(row["method"], row.get("budget_bytes")) if "@" not in row["method"] else row["method"]


def earlier_rows(path: Path, result: dict[str, Any], running: set[str]) -> dict[str, dict[str, Any]]:
    """The rows of an earlier run (same workload, stack and GPU) by method label, marked resumed.

    Native runs again whenever anything runs: its output is the reference that ``bitwise_equal``
    compares with, and ``output_sha256`` shows it is the one the earlier rows saw.
    """
    if "native" not in running:
        raise SystemExit("--resume runs native again (its output is the reference): add native to --methods")
    earlier = json.loads(path.read_text())
    differ = [k for k in ("workload", "device", "blocks") if earlier.get(k) != result[k]]
    if differ:
        raise SystemExit(f"{path} was measured with another {', '.join(differ)}; run without --resume")
    return {label_of(r): {**r, "resumed": True} for r in earlier["runs"]}


def merge(paths: list[Path]) -> dict[str, Any]:
    """One table from several runs of the same workload: each method's latest measured row.

    Native's own step time differs between machines of the same kind, so every row keeps the
    native step time of the run that measured it (``native_step_s``, ``step_vs_native``) and the
    file it came from (``measured_in``); rows that no run measured keep their latest error.
    """
    rows: dict[str, dict[str, Any]] = {}
    merged: dict[str, Any] = {}
    for path in paths:
        run = json.loads(path.read_text())
        if merged and any(merged[k] != run[k] for k in ("workload", "device", "blocks")):
            raise SystemExit(f"{path} is another workload, stack or GPU than {paths[0]}")
        merged = {k: run[k] for k in ("workload", "device", "torch", "blocks")}
        measured = [r for r in run["runs"] if not r.get("resumed")]
        native = next((r for r in measured if r["method"] == "native" and "error" not in r), None)
        for r in measured:
            key = label_of(r)
            if "error" in r:
                if "error" in rows.get(key, r):  # a later error replaces an earlier one, not a measurement
                    rows[key] = r
                continue
            extra = {"measured_in": path.name}
            if native is not None:
                extra |= {"native_step_s": native["step_s"], "step_vs_native": r["step_s"] / native["step_s"] - 1}
            rows[key] = {**r, **extra}
    return {**merged, "merged_from": [p.name for p in paths], "runs": list(rows.values())}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    StackShape.add_arguments(parser)
    parser.add_argument("--workload", default="81f_832x480_cfg", choices=list(WORKLOADS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--budgets", nargs="+", default=["8.6GiB", "20GiB"], help=f"ours: bytes, or {SMALLEST!r} (the least)"
    )
    parser.add_argument("--flextensor-budget", default="8.6GiB", help="flextensor's budget, matched to ours")
    parser.add_argument("--warmup", type=int, default=2, help="for the methods that do not profile")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--scratch", default="/tmp/peers")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per method")
    parser.add_argument("--deadline", type=int, default=0, help="seconds for all; later methods are skipped")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--resume", type=Path, help="an earlier result: keep its rows for the methods not run now")
    parser.add_argument("--merge", nargs="+", type=Path, help="write one table from these results (oldest first)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--budget", help=argparse.SUPPRESS)
    return parser


def jobs_of(args: argparse.Namespace) -> list[tuple[str, int | str | None]]:
    """(method, budget) per child process, native first (its output is the reference)."""
    cached = [m for m in args.methods if m.endswith("_cached")]
    if SMALLEST in args.budgets and cached:
        raise SystemExit(
            f"--budgets {SMALLEST} sets up a probe first, which would write the payload cache that the first "
            f"{cached[0]} run is to write: give {cached[0]} a budget in bytes"
        )
    jobs: list[tuple[str, int | str | None]] = [("native", None)] if "native" in args.methods else []
    for method in args.methods:
        if method in OURS:
            jobs += [(method, b if b == SMALLEST else parse_budget(b)) for b in args.budgets]
        elif method == "flextensor":
            jobs.append((method, parse_budget(args.flextensor_budget)))
        elif method != "native":
            jobs.append((method, None))
    return jobs


def run_child(method: str, budget: int | str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One method in a fresh process; its row, or a row with the error that stopped it."""
    cmd = [sys.executable, __file__, "--child", method, "--workload", args.workload, "--scratch", args.scratch]
    cmd += [*StackShape.from_args(args).argv(), "--warmup", str(args.warmup), "--reps", str(args.reps)]
    cmd += ["--budget", str(budget)] if budget is not None else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"{method:>34}: timed out", flush=True)
        return {"method": method, "budget_bytes": budget, "error": f"timed out after {args.timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("OVER BUDGET"):
            print(line, flush=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        # The error line itself, not only torch's closing hint ("Compile with TORCH_USE_CUDA_DSA ...")
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:]) or "no output"
        print(f"{method:>34}: failed: {tail}", flush=True)
        return {"method": method, "budget_bytes": budget, "error": tail}
    run = json.loads(line.removeprefix("RESULT "))
    peak = "n/a" if run["peak_allocated_bytes"] is None else f"{run['peak_allocated_bytes'] / 2**30:6.2f} GiB"
    print(
        f"{run['method']:>34}: step {run['step_s']:.4f} s  peak {peak} (within budget {run['peak_within_budget']})  "
        f"set-up {run['setup_s']:7.2f} s  host RSS {run['peak_host_rss_bytes'] / 2**30:6.1f} GiB  "
        f"equal {run['bitwise_equal']}",
        flush=True,
    )
    return run


def main() -> None:
    args = parser().parse_args()
    if args.merge:
        write_json(args.out, merge(args.merge))
        return
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    jobs = jobs_of(args)
    result = {
        "workload": args.workload,
        "device": device_name(default_device()),
        "torch": torch.__version__,
        "blocks": args.blocks,
        "resumed_from": str(args.resume) if args.resume else None,
        "runs": [],
    }
    running = {label(m, b) for m, b in jobs}
    earlier = earlier_rows(args.resume, result, running) if args.resume else {}
    runs = result["runs"] = [r for key, r in earlier.items() if key not in running]
    started = time.perf_counter()
    for method, budget in jobs:
        write_json(args.out, result, quiet=True)  # before each method, so that a cut-off run keeps what it has
        if args.deadline and time.perf_counter() - started > args.deadline:
            skipped = {"method": method, "budget_bytes": budget, "error": f"not run: past --deadline {args.deadline} s"}
            runs.append(earlier.get(label(method, budget), skipped))  # an earlier measurement beats none
            continue
        runs.append(run_child(method, budget, args))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
