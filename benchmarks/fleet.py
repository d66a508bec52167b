"""GPUs per request against concurrent replicas, on a fixed fleet: latency and clips per hour.

For a fleet of G GPUs and each g that divides G, G/g replicas run at the same time, each a recipe
process with ``--gpus g`` (context parallelism inside, weights streamed on every rank) on its own
``CUDA_VISIBLE_DEVICES`` slice. Latency is a replica's generation time (its profiling generation
excluded); fleet throughput is replicas x 3600 / median latency. Wan2.2-A14B-sized workload with
random weights, a few steps, by default. Each replica's peak allocated memory is set against its
budget (as its summary gives them: the measured generation only).

    python benchmarks/fleet.py --gpus 4 --out $OUT/fleet.json -- --random-weights full --steps 4 --budget 40GiB
    python benchmarks/fleet.py --gpus 1 -- --random-weights tiny --frames 9 --height 32 --width 32 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import GENERATION_ONLY, check_budget, write_json

RECIPE = "flextensor_diffusers.recipes.wan22_t2v"


def shapes(gpus: int) -> list[tuple[int, int]]:
    """(GPUs per request, replicas) for every way of splitting ``gpus`` evenly."""
    return [(g, gpus // g) for g in range(1, gpus + 1) if gpus % g == 0]


def run_shape(per_request: int, replicas: int, recipe_argv: list[str], scratch: Path) -> dict[str, Any]:
    """Start the replicas together, wait for all; their summaries' generation times."""
    procs = []
    for r in range(replicas):
        devices = ",".join(str(r * per_request + i) for i in range(per_request))
        summary = scratch / f"g{per_request}-r{r}.json"
        cmd = [sys.executable, "-m", RECIPE, *recipe_argv, "--gpus", str(per_request), "--json", str(summary)]
        cmd += ["--profiling-generation"]  # every step of the measured generation planned
        cmd += ["--output", str(scratch / f"g{per_request}-r{r}.mp4"), "--profile-dir", str(scratch / f"p{r}")]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices} if per_request * replicas > 1 else dict(os.environ)
        procs.append((summary, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    latencies, budgets, failures = [], [], []
    for r, (summary, proc) in enumerate(procs):
        out, _ = proc.communicate()
        if proc.returncode != 0 or not summary.exists():
            failures.append(out.decode(errors="replace").strip().splitlines()[-1:])
            continue
        info = json.loads(summary.read_text())
        latencies.append(info["generation_s"])
        label = f"{per_request} GPUs per request, replica {r}"
        budgets.append(check_budget(label, info["budget_bytes"], info["peak_allocated_bytes"], GENERATION_ONLY))
    run: dict[str, Any] = {"gpus_per_request": per_request, "replicas": replicas, "latencies_s": latencies}
    run["budget_per_replica"] = budgets
    if latencies:
        median = statistics.median(latencies)
        run.update(median_latency_s=round(median, 3), clips_per_hour=round(len(latencies) * 3600 / median, 2))
    if failures:
        run["failures"] = failures
    return run


def main() -> None:
    argv = sys.argv[1:]
    recipe_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, required=True, help="the fleet: GPUs of this host to use")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for per_request, replicas in shapes(args.gpus):
            run = run_shape(per_request, replicas, recipe_argv, Path(scratch))
            print(json.dumps(run), flush=True)
            runs.append(run)
    write_json(args.out, {"gpus": args.gpus, "recipe_arguments": recipe_argv, "runs": runs})


if __name__ == "__main__":
    main()
