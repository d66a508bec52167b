"""Longest LTX-2 video whose denoising completes under a GPU memory cap, natively and offloaded.

LTX-2 frame counts are 8k+1 (its VAE compresses time 8x). Each trial runs in a fresh process, with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` and the cap set by
``torch.cuda.set_per_process_memory_fraction``, so that one out-of-memory cannot poison the next.

A trial is `LTX2ConditionPipeline` at full size (assets/ltx2/full.json: Gemma 3 12B, the
18.9B-parameter video+audio transformer, text connectors, video and audio VAEs; random bf16
weights), one denoising step without guidance (memory, not quality, is measured),
``output_type="latent"``: the VAE decode is not part of a trial.

- native: ``pipe.to(cuda)`` (every component resident, as a user would run it), one generation.
- offload: ``enable_flextensor_offload(budget=cap x 0.95)``; a 2-step generation (discovery,
  profiling), then the measured 1-step generation in the steady state, all under the cap.

The search: one uncapped native process measures peak memory at two short lengths; peak is
affine in the number of latent frames (attention is memory-efficient), which predicts each mode's
longest length under each cap. Trials then step from the prediction, by one latent frame (8 frames),
doubling the step while the outcome does not change, then bisecting, until a completed length and
the next one that does not complete are found. Only trials decide the answer. ``--max-frames``
bounds the lengths tried (attention time grows with the square of the length): a mode that
completes there is reported as "at least" that length.

    python benchmarks/max_length.py --out $OUT/ltx2_max_length_h200.json --caps 80GB 40GB
    python benchmarks/max_length.py --caps 40GB --resume benchmarks/results/ltx2_max_length_h200.json ...
    python benchmarks/max_length.py --size tiny --height 64 --width 64 --caps 1GB  # CPU check of the flow
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import WHOLE_RUN, PeakWatch, sync, write_json

BUDGET_OF_CAP = 0.95  # the offloaded run's budget: the cap, less room for the allocator's own rounding
ALLOC_CONF = "expandable_segments:True"


def frames_of(latent_frames: int) -> int:
    return 8 * (latent_frames - 1) + 1


def latent_frames_of(frames: int) -> int:
    return (frames - 1) // 8 + 1


def build(args: argparse.Namespace, device: torch.device) -> Any:
    from flextensor_diffusers.recipes.models import build_pipeline

    return build_pipeline("ltx2_condition", args.size, seed=0, init_device=device)


def generate(pipe: Any, args: argparse.Namespace, frames: int, steps: int) -> Any:
    """One generation without guidance (one transformer forward per step), latents out."""
    return pipe(
        prompt="a red fox running through a snowy forest, cinematic",
        height=args.height,
        width=args.width,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        max_sequence_length=args.text_tokens,
        output_type="latent",
        generator=torch.Generator(device="cpu").manual_seed(0),
    ).frames


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def trial(args: argparse.Namespace) -> dict[str, Any]:
    """One attempt at ``args.frames`` in ``args.child`` mode under ``args.cap``; never raises for OOM.

    The peak is watched from before set-up: ``peak_allocated_bytes`` covers set-up, the profiling
    generation and the measured one (against the budget, offloaded); ``generation_peak_allocated_bytes``
    the measured generation alone."""
    from flextensor_diffusers.engine import FlexTensorError
    from flextensor_diffusers.engine.config import resolve_device

    device = resolve_device(None)
    pipe = build(args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap / total), device)
    budget = None if args.child == "native" else int(args.cap * BUDGET_OF_CAP)
    result: dict[str, Any] = {"mode": args.child, "frames": args.frames, "cap_bytes": args.cap}
    watch = PeakWatch(device)
    stage = "set-up"
    started = time.perf_counter()
    try:
        if budget is None:
            pipe.to(device)
        else:
            pipe.enable_flextensor_offload(budget=budget, device=device, vae_tiling=False)
            stage = "profiling generation"
            generate(pipe, args, args.frames, 2)
        stage = "generation"
        result["peak_before_generation_bytes"] = watch.part()
        start = time.perf_counter()
        generate(pipe, args, args.frames, args.steps)
        sync(device)
        result.update(completed=True, generation_s=round(time.perf_counter() - start, 2))
        result["generation_peak_allocated_bytes"] = watch.part()
    except torch.OutOfMemoryError as exc:
        result.update(completed=False, failure=f"out of memory at {stage}: {str(exc).splitlines()[0][:160]}")
    except FlexTensorError as exc:  # e.g. the planner finds no plan under the budget
        result.update(completed=False, failure=f"{type(exc).__name__} at {stage}: {exc}")
    scope = WHOLE_RUN if budget is not None else "placement on the device and the generation (native)"
    result.update(watch.check(f"{args.child} {args.frames} frames under a {args.cap} B cap", budget, scope))
    result["trial_s"] = round(time.perf_counter() - started, 1)
    return result


def fit(args: argparse.Namespace) -> dict[str, Any]:
    """Uncapped native peaks at two lengths: resident bytes and activation bytes per latent frame."""
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    pipe = build(args, device).to(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    points = []
    for frames in args.fit_frames:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        generate(pipe, args, frames, 1)
        points.append((latent_frames_of(frames), peak(device) - resident))
    (l1, a1), (l2, a2) = points
    per_latent_frame = (a2 - a1) / (l2 - l1)
    blocks = pipe.transformer.transformer_blocks
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    transformer_bytes = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    return {
        "transformer_parameters": sum(p.numel() for p in pipe.transformer.parameters()),
        "resident_bytes": resident,
        "points": points,
        "activation_bytes_per_latent_frame": per_latent_frame,
        "activation_intercept_bytes": a1 - per_latent_frame * l1,
        "block_bytes": block_bytes,
        "transformer_outside_blocks_bytes": transformer_bytes - len(blocks) * block_bytes,
    }


def predict(model: dict[str, Any], mode: str, cap: int) -> int:
    """The longest length (8k+1) the affine model says fits, at least 9 frames."""
    if mode == "native":
        fixed, room = model["resident_bytes"], cap * 0.98
        scale = 1.0
    else:  # streamed: what stays outside the blocks, two block slots, the planner's activation margin
        fixed = model["transformer_outside_blocks_bytes"] + 2 * model["block_bytes"]
        room, scale = cap * BUDGET_OF_CAP, 1.05
    per, intercept = model["activation_bytes_per_latent_frame"], model["activation_intercept_bytes"]
    latent = int((room - fixed - scale * intercept) / (scale * per)) if per > 0 else 1
    return frames_of(max(2, latent))


def run_trial(args: argparse.Namespace, mode: str, frames: int, cap: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--frames", str(frames), "--cap", str(cap)]
    cmd += ["--size", args.size, "--height", str(args.height), "--width", str(args.width)]
    cmd += ["--steps", str(args.steps), "--text-tokens", str(args.text_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "frames": frames, "cap_bytes": cap, "completed": None, "failure": "timed out"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:  # a crash that is not an OOM: recorded, and it does not count as a result
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"mode": mode, "frames": frames, "cap_bytes": cap, "completed": None, "failure": " | ".join(tail)}
    return json.loads(line.removeprefix("RESULT "))


def search(args: argparse.Namespace, mode: str, cap: int, guess: int, trials: list, deadline: float, save: Any) -> dict:
    """Longest completing length: gallop from ``guess`` by latent frames, then bisect the bracket.

    Trials already in ``trials`` for this mode and cap (from ``--resume``) are outcomes known
    without running again. Returns ``max_frames`` (None when nothing completes, or the search was
    cut short before any trial completed) and ``bracket``: the longest completed and the shortest
    failed length found.
    """
    outcomes = {
        latent_frames_of(t["frames"]): t["completed"]
        for t in trials
        if t["mode"] == mode and t["cap_bytes"] == cap and t["completed"] is not None
    }
    limit = latent_frames_of(args.max_frames)

    def completes(latent: int) -> bool | None:
        if latent not in outcomes:
            if time.perf_counter() > deadline:
                return None
            t = run_trial(args, mode, frames_of(latent), cap)
            trials.append(t)
            save()  # after every trial, so that a cut-off run keeps them
            print(json.dumps(t), flush=True)
            if t["completed"] is None:
                return None
            outcomes[latent] = t["completed"]
        return outcomes[latent]

    def answer(good: int | None, bad: int | None, status: str) -> dict:
        frames = [frames_of(x) if x is not None else None for x in (good, bad)]
        return {"max_frames": frames[0], "bracket": frames, "status": status}

    start = min(latent_frames_of(guess), limit)
    first = completes(start)
    if first is None:
        return answer(None, None, "cut short")
    good, bad = (start, None) if first else (None, start)
    step = 1
    while good is None or bad is None:  # gallop until the outcome flips
        if good is None and bad == 2:
            return answer(None, bad, "the shortest length does not complete")
        if bad is None and good >= limit:
            return answer(good, None, f"completes at --max-frames {args.max_frames}")
        probe = min(good + step, limit) if bad is None else max(2, bad - step)
        ok = completes(probe)
        if ok is None:
            return answer(good, bad, "cut short")
        good, bad = (probe, bad) if ok else (good, probe)
        step *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        ok = completes(mid)
        if ok is None:
            return answer(good, bad, "cut short")
        good, bad = (mid, bad) if ok else (good, mid)
    return answer(good, bad, "found")


def run_fit(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "fit", "--size", args.size, "--height", str(args.height)]
    cmd += ["--width", str(args.width), "--text-tokens", str(args.text_tokens), "--fit-frames"]
    proc = subprocess.run([*cmd, *map(str, args.fit_frames)], capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the fit run failed:\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def resumed(path: Path, workload: dict[str, Any], device: str) -> dict[str, Any]:
    """The fit, the trials and the other caps' runs of an earlier run of this workload on this GPU.

    A search cut short by its deadline goes on from there instead of paying again for the fit and
    for lengths already tried; each carried trial is marked ``"resumed": true``. The modes searched
    now are searched again at their caps (from the carried trials); the rest is kept as it was.
    """
    earlier = json.loads(path.read_text())
    theirs = {k: v for k, v in earlier["workload"].items() if k != "transformer_parameters"}
    differ = sorted(k for k in {*theirs, *workload} if theirs.get(k) != workload.get(k))
    if differ or earlier["device"] != device:
        what = ", ".join(differ) + (" device" if earlier["device"] != device else "")
        raise SystemExit(f"{path} was measured on another workload or GPU ({what}); run without --resume")
    return {
        "fit": earlier["fit"],
        "trials": [{**t, "resumed": True} for t in earlier["trials"]],
        "runs": earlier["runs"],
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--height", type=int, default=704)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--steps", type=int, default=1, help="denoising steps of the measured generation")
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument("--caps", nargs="+", default=["80GB", "40GB"])
    parser.add_argument("--modes", nargs="+", default=["native", "offload"], choices=("native", "offload"))
    parser.add_argument("--fit-frames", nargs=2, type=int, default=[193, 385])
    parser.add_argument("--max-frames", type=int, default=2001, help="longest length tried")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per trial")
    parser.add_argument("--deadline", type=int, default=0, help="seconds for the whole search (0: none)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--resume", type=Path, help="an earlier result of the same workload: reuse its fit and trials")
    parser.add_argument("--child", choices=("native", "offload", "fit"), help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    return parser


def workload_of(args: argparse.Namespace) -> dict[str, Any]:
    """What every trial of this search runs (a resumed file must have measured the same)."""
    return {
        "pipeline": "LTX2ConditionPipeline",
        "size": args.size,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "guidance": "none (guidance_scale 1, no STG, no modality guidance)",
        "text_tokens": args.text_tokens,
        "vae_decode": "not run (output_type='latent')",
        "offload_budget": f"{BUDGET_OF_CAP} x cap",
        "alloc_conf": ALLOC_CONF,
    }


def search_caps(args: argparse.Namespace, result: dict[str, Any], caps: list[int], deadline: float) -> None:
    """Each cap's longest length per mode, into ``result["runs"]``; the file is written after every trial."""

    def save() -> None:
        write_json(args.out, result, quiet=True)

    for cap in caps:
        run = next((r for r in result["runs"] if r["cap_bytes"] == cap), None)
        if run is None:
            run = {"cap_bytes": cap, "height": args.height, "width": args.width}
            result["runs"].append(run)
        for mode in args.modes:
            guess = predict(result["fit"], mode, cap)
            run[f"{mode}_predicted_frames"] = guess
            found = search(args, mode, cap, guess, result["trials"], deadline, save)
            run[f"{mode}_max_frames"] = found["max_frames"]
            run[f"{mode}_search"] = found
            save()
        print(json.dumps(run), flush=True)


def main() -> None:
    args = parser().parse_args()
    if args.child == "fit":
        print("RESULT " + json.dumps(fit(args)), flush=True)
        return
    if args.child:
        print("RESULT " + json.dumps(trial(args)), flush=True)
        return

    from flextensor_diffusers.engine import parse_bytes

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF  # for every child process
    started = time.perf_counter()
    deadline = started + args.deadline if args.deadline else float("inf")
    workload = workload_of(args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    earlier = resumed(args.resume, workload, device) if args.resume else {"trials": [], "runs": []}
    model = earlier.get("fit") or run_fit(args)
    print("fit", json.dumps(model), flush=True)
    result: dict[str, Any] = {
        "workload": {**workload, "transformer_parameters": model["transformer_parameters"]},
        "device": device,
        "torch": torch.__version__,
        "fit": model,
        "resumed_from": str(args.resume) if args.resume else None,
        "runs": earlier["runs"],
        "trials": earlier["trials"],
    }
    search_caps(args, result, [parse_bytes(c) for c in args.caps], deadline)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
