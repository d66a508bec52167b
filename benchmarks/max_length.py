"""Longest LTX-2 video generated, decoded and written to an mp4 under a GPU memory cap, natively and offloaded.

LTX-2 frame counts are 8k+1 (its VAE compresses time 8x). A trial is the whole generation a user runs:
`LTX2ConditionPipeline` (``--size full``: assets/ltx2/full.json, Gemma 3 12B, the 18.9B-parameter
video+audio transformer, connectors, video and audio VAEs; random bf16 weights), ``--steps`` denoising
steps without guidance (memory, not quality, is measured; default: the outpainting recipe's steps for
the size, stated in the JSON), the VAE decode (``output_type="pt"``: the decoded video stays on the GPU,
diffusers' VAE tiling on unless ``--vae-tiling off``) and the mp4, written 32 frames at a time: each chunk
made uint8 and YUV 4:2:0 on the GPU (`media.video.uint8_chunks`, `Mp4Writer.write_tensor`, the same
bytes as the NumPy path) so that the video never sits on the host as float32 (at 2 000 frames of 1280x704
that would be 21.6 GB, twice over inside diffusers' ``output_type="np"``).

- native: ``pipe.to(cuda)`` (every component resident, as a user would run it).
- offload: ``enable_flextensor_offload(budget=cap x 0.95)`` (it streams the VAE too); before each
  trial a ``--profiling-steps`` latent-only generation (discovery, profiling) at the trial's length,
  all under the cap.

The cap: ``torch.cuda.set_per_process_memory_fraction``, with ``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True`` (set by this script before CUDA starts). The pipeline is built once, on the
host; each cap and mode places it (native: moved to the GPU; offload: offload enabled) and takes it back
after its search. The trials of a cap and mode run in this one process: an out-of-memory is caught, the
memory freed (the outputs dropped, ``gc``, ``torch.cuda.empty_cache``), and an offloaded pipeline's offload
is set up again before the next trial. Outcomes: ``completed``, ``gpu_oom`` (torch.OutOfMemoryError),
``host_oom`` (MemoryError, or the CPU allocator's failure), ``budget_refused`` (the planner's
`BudgetError`, before any allocation), ``error`` (anything else: not counted as an answer). A trial is
saved as ``"outcome": "running"`` before it starts: a process the kernel kills (host OOM) or a call cut
off leaves that in the file.

The search per cap and mode starts from a guess (``--start-frames``, ``--offload-start-frames`` for the
offloaded one; else the affine peak model of ``--fit-from FILE``'s ``fit``, or of an uncapped native fit at
``--fit-frames`` run here first), steps by ``--first-step-frames`` (default one latent frame, 8 frames),
doubling while the outcome does not change, then bisects, until the longest completing length and the next
one that does not complete are found. ``--max-frames`` bounds the lengths: a mode that completes there is
reported "at least" that length, ``first_failing_frames`` null. A search cut short by ``--deadline`` reports
the bracket it had; ``--resume`` goes on from it.

Quality: right after a cap's native search (its frames still in memory), one offloaded trial at the native
maximum compares its final latents and decoded frames with the native trial's (``runs[*].quality``).

Kept files (beside ``--out``): each cap's longest offloaded mp4 if under 16 MiB, else its first and last
frames as PNGs (the sha256 of the mp4 is in the JSON either way).

CPU check: there is no cap on the CPU (the fraction is not set; peaks are null). ``--simulate-oom-above N``
makes a trial longer than N frames raise torch.OutOfMemoryError at the end of its first denoising step,
so that the search, the recovery and the bracket are exercised; a cap below the smallest workable budget
gives ``budget_refused``. tests/test_max_length.py runs::

    python benchmarks/max_length.py --size tiny --height 64 --width 64 --caps 1GB --max-frames 25 \\
        --start-frames 9 --simulate-oom-above 17 --out /tmp/m.json

GPU (see benchmarks/results/README.md, "max_length.py schema")::

    python benchmarks/max_length.py --out $OUT/ltx2_max_length_decoded_h200.json --caps 80GB 40GB \\
        --steps 1 --fit-from benchmarks/results/ltx2_max_length_h200.json --deadline 480 --x264-preset ultrafast
    python benchmarks/max_length.py --resume benchmarks/results/ltx2_max_length_decoded_h200.json ...  # go on

A call ended during a trial (the device's time limit) leaves that trial ``running`` and the summaries of the
search it was in stale: ``--summarise FILE`` (no GPU) recomputes every summary from the recorded trials.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import numpy as np
import torch
from bench_common import HostMemorySampler, PeakWatch, rss_bytes, sync, write_json

BUDGET_OF_CAP = 0.95  # the offloaded run's budget: the cap, less room for the allocator's own rounding
ALLOC_CONF = "expandable_segments:True"
FPS = 24
#: What a trial's peaks cover.
TRIAL_SCOPE = (
    "the trial: offload set-up where it set up (a cap's first trial, or after a failure), profiling generation, "
    "generation with the VAE decode, mp4"
)
KEEP_MP4_BELOW = 16 * 2**20
OUTCOMES = ("completed", "gpu_oom", "host_oom", "budget_refused")
TEMPORAL_FACTOR = 8  # LTX-2's frames per latent frame: lengths are 8k+1


def frames_of(latent_frames: int) -> int:
    return TEMPORAL_FACTOR * (latent_frames - 1) + 1


def latent_frames_of(frames: int) -> int:
    return (frames - 1) // TEMPORAL_FACTOR + 1


def seconds_of(frames: int | None) -> float | None:
    return None if frames is None else round(frames / FPS, 3)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class SimulatedOOM:
    """On the CPU: a trial over ``limit`` frames runs out of "GPU memory" after its first step."""

    def __init__(self, limit: int | None, frames: int) -> None:
        self.fail = limit is not None and frames > limit

    def __call__(self, step: int) -> None:
        if self.fail:
            raise torch.OutOfMemoryError(f"simulated by --simulate-oom-above (step {step})")


class Bench:
    """The pipeline of this run, placed for one cap and mode at a time, and its trials."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from flextensor_diffusers.recipes.models import build_pipeline

        self.args, self.device = args, device
        init = device if args.size == "full" and device.type == "cuda" else "cpu"  # made on the GPU: quick
        self.pipe = build_pipeline("ltx2_condition", args.size, seed=0, init_device=init)  # then on the host
        self.placed: str | None = None  # "native" or "offload"
        self.cap: int | None = None
        self.videos = Path(args.video_dir or tempfile.mkdtemp(prefix="max_length_"))
        self.videos.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------------------------ placement

    def set_cap(self, cap: int | None) -> None:
        self.cap = cap
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), self.device)

    def place(self, mode: str) -> None:
        if self.placed == mode:
            return
        self.unplace()
        tiled = self.args.vae_tiling == "on"
        if mode == "native":
            self.placed = mode  # before the move: a move cut short is taken back by unplace
            self.pipe.to(self.device)
            self.pipe.vae.enable_tiling() if tiled else self.pipe.vae.disable_tiling()
        else:
            budget = int(self.cap * BUDGET_OF_CAP)
            self.pipe.enable_flextensor_offload(budget=budget, device=self.device, vae_tiling=tiled)
            self.placed = mode

    def unplace(self) -> None:
        if self.placed == "native":
            self.pipe.to("cpu")
        elif self.placed == "offload":
            self.pipe.disable_flextensor_offload()
        self.placed = None
        free_memory()

    # ------------------------------------------------------------------------------------ generations

    def call(self, frames: int, steps: int, output_type: str, on_step: Any = None) -> Any:
        """One generation without guidance (one transformer forward per step)."""
        captured: dict[str, torch.Tensor] = {}

        def callback(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if on_step is not None:
                on_step(step)
            if step == steps - 1:  # the final latents (packed tokens), for the quality comparison
                captured["latents"] = kwargs["latents"].detach().to("cpu", copy=True)
            return kwargs

        out = self.pipe(
            prompt="a red fox running through a snowy forest, cinematic",
            height=self.args.height,
            width=self.args.width,
            num_frames=frames,
            frame_rate=float(FPS),
            num_inference_steps=steps,
            guidance_scale=1.0,
            audio_guidance_scale=1.0,
            stg_scale=0.0,
            audio_stg_scale=0.0,
            modality_scale=1.0,
            audio_modality_scale=1.0,
            max_sequence_length=self.args.text_tokens,
            output_type=output_type,
            generator=torch.Generator(device="cpu").manual_seed(0),
            callback_on_step_end=callback,
            callback_on_step_end_tensor_inputs=["latents"],
        )
        return out, captured.get("latents")

    def trial(
        self, mode: str, frames: int, keep: bool = False, purpose: str = "search"
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One attempt at ``frames`` in ``mode`` under the current cap; never raises for running out of memory.

        Returns the JSON record and, for a completed trial, what stays in memory (``latents``, and the
        ``frames`` as uint8 when ``keep``; the ``first`` and ``last`` frames always)."""
        from flextensor_diffusers.engine import BudgetError
        from flextensor_diffusers.media.video import Mp4Writer, uint8_chunks

        args = self.args
        record: dict[str, Any] = {"mode": mode, "frames": frames, "video_s": seconds_of(frames), "cap_bytes": self.cap}
        if mode == "offload":
            record["budget_bytes"] = int(self.cap * BUDGET_OF_CAP)
        kept: dict[str, Any] = {}
        watch = PeakWatch(self.device)
        host = HostMemorySampler(rss_bytes, 0.05).start()
        stage, started, out = "set-up", time.perf_counter(), None
        path = self.videos / f"{mode}_{self.cap}_{frames}f_{purpose}.mp4"
        try:
            self.place(mode)
            if mode == "offload" and args.profiling_steps:
                stage = "profiling generation"
                start = time.perf_counter()
                self.call(frames, args.profiling_steps, "latent")
                sync(self.device)
                record["profiling_s"] = round(time.perf_counter() - start, 2)
            stage = "generation"
            start = time.perf_counter()
            out, latents = self.call(frames, args.steps, "pt", SimulatedOOM(args.simulate_oom_above, frames))
            sync(self.device)
            record["generation_s"] = round(time.perf_counter() - start, 2)  # steps, VAE decode, audio
            stage = "writing the mp4"
            start = time.perf_counter()
            video = out.frames[0]  # (F, 3, H, W) in [0, 1], on the GPU: it never comes to the host as float
            out = None
            stored = np.empty((len(video), *video.shape[2:], 3), np.uint8) if keep else None
            with Mp4Writer(path, fps=FPS, preset=args.x264_preset) as writer:
                for begin, pixels in uint8_chunks(video):
                    writer.write_tensor(pixels)
                    if stored is not None:
                        stored[begin : begin + len(pixels)] = pixels.cpu().numpy()
                    if begin == 0:
                        kept["first"] = pixels[0].cpu().numpy()
                kept["last"] = pixels[-1].cpu().numpy()
            del video, pixels
            record["write_s"] = round(time.perf_counter() - start, 2)
            record.update(outcome="completed", reason=None, codec=writer.codec)
            record.update(mp4_sha256=sha256_of(path), mp4_bytes=path.stat().st_size)
            kept.update(latents=latents, frames=stored, path=path)
        except torch.OutOfMemoryError as exc:
            record.update(outcome="gpu_oom", reason=f"at {stage}: {first_line(exc)}")
        except BudgetError as exc:  # the planner refused the budget before allocating (HostBudgetError too)
            record.update(outcome="budget_refused", reason=f"{type(exc).__name__} at {stage}: {first_line(exc)}")
        except MemoryError as exc:
            record.update(outcome="host_oom", reason=f"MemoryError at {stage}: {first_line(exc)}")
        except RuntimeError as exc:
            host_oom = "can't allocate memory" in str(exc) or "DefaultCPUAllocator" in str(exc)
            record.update(outcome="host_oom" if host_oom else "error", reason=f"at {stage}: {first_line(exc)}")
        except Exception as exc:
            record.update(outcome="error", reason=f"{type(exc).__name__} at {stage}: {first_line(exc)}")
        finally:
            out = None
            host.stop()
        if record["outcome"] != "completed":
            kept.clear()
            path.unlink(missing_ok=True)
            if self.placed == "offload" or stage == "set-up":
                self.unplace()  # an offload interrupted mid-generation is set up again for the next trial
            free_memory()
        record["seconds"] = round(time.perf_counter() - started, 2)
        record["peak_gpu_allocated_bytes"] = watch.peak
        if mode == "offload":  # the budget record (budget_bytes, peak_within_budget, ...), OVER BUDGET printed
            record.update(
                watch.check(f"offload {frames} frames under a {self.cap} B cap", record["budget_bytes"], TRIAL_SCOPE)
            )
        record["peak_host_rss_bytes"] = host.peak()
        return record, kept


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- the fit


def fit(bench: Bench, fit_frames: list[int]) -> dict[str, Any]:
    """Uncapped native peaks at two lengths (latents out): resident bytes and activation bytes per latent frame."""
    bench.set_cap(None)
    bench.place("native")
    device = bench.device
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    points = []
    for frames in fit_frames:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        bench.call(frames, 1, "latent")
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        points.append((latent_frames_of(frames), peak - resident))
    bench.unplace()
    (l1, a1), (l2, a2) = points
    per_latent_frame = (a2 - a1) / (l2 - l1)
    transformer = bench.pipe.transformer
    blocks = transformer.transformer_blocks
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    transformer_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
    return {
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "resident_bytes": resident,
        "points": points,
        "activation_bytes_per_latent_frame": per_latent_frame,
        "activation_intercept_bytes": a1 - per_latent_frame * l1,
        "block_bytes": block_bytes,
        "transformer_outside_blocks_bytes": transformer_bytes - len(blocks) * block_bytes,
        "scope": "latents out (no VAE decode): a starting guess for the search, not an answer",
    }


def predict(model: dict[str, Any] | None, mode: str, cap: int, start: int | None) -> int:
    """The length the search starts from: ``--start-frames``, else the longest (8k+1) the affine model fits."""
    if start is not None or model is None:
        return start or 9
    if mode == "native":
        fixed, room, scale = model["resident_bytes"], cap * 0.98, 1.0
    else:  # streamed: what stays outside the blocks, two block slots, the planner's activation margin
        fixed = model["transformer_outside_blocks_bytes"] + 2 * model["block_bytes"]
        room, scale = cap * BUDGET_OF_CAP, 1.05
    per, intercept = model["activation_bytes_per_latent_frame"], model["activation_intercept_bytes"]
    latent = int((room - fixed - scale * intercept) / (scale * per)) if per > 0 else 1
    return frames_of(max(2, latent))


# ---------------------------------------------------------------------------------------- the search


def search(bench: Bench, run: dict, mode: str, guess: int, deadline: float, save: Any, best: dict) -> dict:
    """Longest completing length: gallop from ``guess`` by latent frames, then bisect the bracket.

    Trials already in ``run["trials"]`` for this mode (from ``--resume``) are outcomes known without
    running again. ``best`` receives the longest completed trial's kept outputs (``best[mode]``).
    """
    args = bench.args
    trials = run["trials"]
    outcomes = {
        latent_frames_of(t["frames"]): t["outcome"] == "completed"
        for t in trials
        if t["mode"] == mode and t["outcome"] in OUTCOMES and t.get("purpose", "search") == "search"
    }
    limit = latent_frames_of(args.max_frames)

    def completes(latent: int) -> bool | None:
        if latent not in outcomes:
            if time.perf_counter() > deadline:
                return None
            frames = frames_of(latent)
            trials.append({"mode": mode, "frames": frames, "outcome": "running", "purpose": "search"})
            save()  # a process killed during the trial leaves "running" in the file
            record, kept = bench.trial(mode, frames, keep=mode == "native" and args.quality)
            trials[-1] = {**record, "purpose": "search"}
            save()
            print(json.dumps(trials[-1]), flush=True)
            if record["outcome"] not in OUTCOMES:
                return None
            if kept and frames > best.get(mode, {}).get("length", 0):
                if mode in best:
                    best[mode]["path"].unlink(missing_ok=True)  # only the longest mp4 of a mode stays on disk
                best[mode] = {**kept, "length": frames, "record": record}
            elif kept:
                kept["path"].unlink(missing_ok=True)
            outcomes[latent] = record["outcome"] == "completed"
        return outcomes[latent]

    def answer(good: int | None, bad: int | None, status: str) -> dict:
        return {
            "max_frames": frames_of(good) if good is not None else None,
            "first_failing_frames": frames_of(bad) if bad is not None else None,
            "status": status,
        }

    start = min(latent_frames_of(guess), limit)
    first = completes(start)
    if first is None:
        return answer(None, None, "cut short (deadline, an error, or a call ended during a trial)")
    good, bad = (start, None) if first else (None, start)
    step = max(1, args.first_step_frames // TEMPORAL_FACTOR)
    while good is None or bad is None:  # gallop until the outcome flips
        if good is None and bad == 1:
            return answer(None, bad, "the shortest length (1 frame) does not complete")
        if bad is None and good >= limit:
            return answer(good, None, f"at least {frames_of(good)} frames: completes at --max-frames")
        probe = min(good + step, limit) if bad is None else max(1, bad - step)
        ok = completes(probe)
        if ok is None:
            return answer(good, bad, "cut short (deadline, an error, or a call ended during a trial)")
        good, bad = (probe, bad) if ok else (good, probe)
        step *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        ok = completes(mid)
        if ok is None:
            return answer(good, bad, "cut short (deadline, an error, or a call ended during a trial)")
        good, bad = (mid, bad) if ok else (good, mid)
    return answer(good, bad, "found")


def compare(native: dict[str, Any], offload: dict[str, Any]) -> dict[str, Any]:
    """The offloaded outputs against the native ones at one length."""
    a, b = native["latents"], offload["latents"]
    fa, fb = native["frames"], offload["frames"]
    frames_diff = None
    if fa is not None and fb is not None and fa.shape == fb.shape:
        frames_diff = int(np.abs(fa.astype(np.int16) - fb.astype(np.int16)).max())
    return {
        "frames": native["length"],
        "latents_bitwise": bool(a is not None and b is not None and torch.equal(a, b)),
        "latents_max_abs_diff": None if a is None or b is None else float((a.float() - b.float()).abs().max()),
        "frames_bitwise": frames_diff == 0,
        "frames_max_abs_diff": frames_diff,
        "mp4_bitwise": native["record"]["mp4_sha256"] == offload["record"]["mp4_sha256"],
    }


def keep_files(bench: Bench, run: dict[str, Any], best: dict[str, Any], out_dir: Path) -> None:
    """The longest offloaded mp4 beside the JSON (under 16 MiB), else its first and last frames as PNGs."""
    from PIL import Image

    kept = best.get("offload")
    if not kept:  # none completed in this call: a resumed cap keeps the files of the call that made them
        run.setdefault("kept_files", [])
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"ltx2_offload_{run['cap_bytes']}_{kept['length']}f"
    path = kept["path"]
    if path.stat().st_size < KEEP_MP4_BELOW:
        names = [f"{stem}.mp4"]
        shutil.copyfile(path, out_dir / names[0])
    else:
        names = [f"{stem}_first.png", f"{stem}_last.png"]
        Image.fromarray(kept["first"]).save(out_dir / names[0])
        Image.fromarray(kept["last"]).save(out_dir / names[1])
    run["kept_files"] = names


def quality_trial(bench: Bench, run: dict[str, Any], native: dict[str, Any] | None, deadline: float) -> None:
    """One offloaded trial at the native maximum, compared with the native trial there (``run["quality"]``).

    It runs right after the native search, while the native frames are in memory (a resumed search has
    none: the earlier call's comparison stays)."""
    if native is None or not bench.args.quality or time.perf_counter() > deadline:
        run.setdefault("quality", None)
        return
    record, kept = bench.trial("offload", native["length"], keep=True, purpose="quality")
    run["trials"].append({**record, "purpose": "quality"})
    run["quality"] = compare(native, {**kept, "length": native["length"], "record": record}) if kept else None
    if kept:
        kept["path"].unlink(missing_ok=True)
    print("quality", json.dumps(run["quality"]), flush=True)


def longest_completed(run: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """The longest completed search trial of ``mode`` in this cap (this call's or a resumed one)."""
    done = [t for t in run["trials"] if t["mode"] == mode and t["outcome"] == "completed" and t["purpose"] == "search"]
    return max(done, key=lambda t: t["frames"], default=None)


def record_search(run: dict[str, Any], mode: str, found: dict[str, Any]) -> None:
    """A search's answer as the run's summary fields (the schema's ``<mode>_*`` and ``mp4_sha256``)."""
    run[f"{mode}_max_frames"] = found["max_frames"]
    run[f"{mode}_first_failing_frames"] = found["first_failing_frames"]
    run[f"{mode}_max_video_s"] = seconds_of(found["max_frames"])
    run[f"{mode}_status"] = found["status"]
    if mode == "offload":
        longest = longest_completed(run, "offload")
        run["mp4_sha256"] = longest["mp4_sha256"] if longest else None


def summarise(args: argparse.Namespace) -> dict[str, Any]:
    """``--summarise FILE``: each run's summary fields recomputed from its trials, on any machine.

    For a file whose GPU call was cut off during a trial (that trial stays ``"running"``): the search walks
    the recorded outcomes from the same start with the same steps and stops at the first length it has no
    outcome for, as it would have at the deadline. Trials are not touched."""
    result = json.loads(args.summarise.read_text())
    recorded_only = SimpleNamespace(args=args)  # the search never runs a trial after its deadline
    for run in result["runs"]:
        for mode in ("native", "offload"):
            if f"{mode}_predicted_frames" in run:
                guess = run[f"{mode}_predicted_frames"]
                record_search(run, mode, search(recorded_only, run, mode, guess, float("-inf"), lambda: None, {}))
    result["summarised_from_trials"] = True
    write_json(args.out or args.summarise, result)
    return result


def search_cap(bench: Bench, result: dict, cap: int, deadline: float, save: Any) -> None:
    args = bench.args
    run = next((r for r in result["runs"] if r["cap_bytes"] == cap), None)
    if run is None:
        run = {"cap_bytes": cap, "height": args.height, "width": args.width, "decoded": True, "trials": []}
        result["runs"].append(run)
    bench.set_cap(cap)
    best: dict[str, Any] = {}
    modes = [m for m in ("native", "offload") if m in args.modes]
    for mode in modes:  # native first: the quality trial, right after it, needs its frames
        start = args.offload_start_frames if mode == "offload" and args.offload_start_frames else args.start_frames
        guess = predict(result["fit"], mode, cap, start)
        run[f"{mode}_predicted_frames"] = guess
        record_search(run, mode, search(bench, run, mode, guess, deadline, save, best))
        if mode == "native" and "offload" in modes:
            quality_trial(bench, run, best.get("native"), deadline)
        save()
    bench.unplace()
    keep_files(bench, run, best, (args.out.parent if args.out else bench.videos))
    save()
    for kept in best.values():
        kept["path"].unlink(missing_ok=True)
    best.clear()
    print(json.dumps({k: v for k, v in run.items() if k != "trials"}), flush=True)


# ---------------------------------------------------------------------------------------- the command


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--height", type=int, default=704)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--steps", type=int, help="denoising steps of a trial (default: the recipe's for --size)")
    parser.add_argument("--profiling-steps", type=int, default=2, help="offloaded: latent-only steps before a trial")
    parser.add_argument("--text-tokens", type=int, help="prompt tokens (default: 1024; 32 with --size tiny)")
    parser.add_argument("--caps", nargs="+", default=["80GB", "40GB"])
    parser.add_argument("--modes", nargs="+", default=["native", "offload"], choices=("native", "offload"))
    parser.add_argument("--vae-tiling", choices=("on", "off"), default="on", help="diffusers' VAE tiling (both modes)")
    parser.add_argument("--x264-preset", default="medium", help="x264 preset of the mp4s (medium: the recipes')")
    parser.add_argument("--start-frames", type=int, help="first length tried in each search (default: predicted)")
    parser.add_argument("--offload-start-frames", type=int, help="first length of the offloaded searches")
    parser.add_argument(
        "--first-step-frames", type=int, default=8, help="the search's first step from its start (doubles after)"
    )
    parser.add_argument("--fit-from", type=Path, help="take the peak model (`fit`) from an earlier result")
    parser.add_argument("--fit-frames", nargs=2, type=int, default=[193, 385])
    parser.add_argument("--max-frames", type=int, default=2001, help="longest length tried")
    parser.add_argument("--no-quality", dest="quality", action="store_false", help="skip the native comparison")
    parser.add_argument(
        "--deadline",
        type=int,
        default=0,
        help="seconds from the script's start, the model's build included (about 85 s for full-size LTX-2 on a GPU "
        "machine), after which no trial starts (0: none)",
    )
    parser.add_argument("--simulate-oom-above", type=int, help="CPU check: trials longer than this run out of memory")
    parser.add_argument("--video-dir", type=Path, help="where each trial's mp4 is written (default: a temp folder)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarise", type=Path, help="recompute the summaries of a result from its trials; no GPU")
    parser.add_argument("--resume", type=Path, help="an earlier result of the same workload: reuse its fit and trials")
    return parser


def workload_of(args: argparse.Namespace) -> dict[str, Any]:
    """What every trial of this search runs (a resumed file must have measured the same)."""
    from flextensor_diffusers.media.video import WRITE_CHUNK_FRAMES

    return {
        "pipeline": "LTX2ConditionPipeline",
        "size": args.size,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "profiling_steps": args.profiling_steps,
        "guidance": "none (guidance_scale 1, no STG, no modality guidance)",
        "text_tokens": args.text_tokens,
        "vae_decode": f"output_type='pt' (decoded video kept on the device), VAE tiling {args.vae_tiling}",
        "mp4": f"written {WRITE_CHUNK_FRAMES} frames at a time (uint8 and YUV made on the device), {FPS} fps, "
        f"x264 preset {args.x264_preset}",
        "offload_budget": f"{BUDGET_OF_CAP} x cap",
        "alloc_conf": ALLOC_CONF,
        "simulated_oom_above_frames": args.simulate_oom_above,
    }


def resumed(path: Path, workload: dict[str, Any], device: str) -> dict[str, Any]:
    """The fit and the runs (with their trials) of an earlier run of this workload on this GPU; each
    carried trial is marked ``"resumed": true``, a carried ``"running"`` one (a process that ended during
    it) is kept and tried again."""
    earlier = json.loads(path.read_text())
    differ = sorted(k for k in {*earlier["workload"], *workload} if earlier["workload"].get(k) != workload.get(k))
    if differ or earlier["device"] != device:
        what = ", ".join(differ) + (" device" if earlier["device"] != device else "")
        raise SystemExit(f"{path} was measured on another workload or GPU ({what}); run without --resume")
    for run in earlier["runs"]:
        run["trials"] = [{**t, "resumed": True} for t in run["trials"]]
    return {"fit": earlier["fit"], "runs": earlier["runs"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.summarise:
        return summarise(args)
    from flextensor_diffusers.engine import parse_bytes
    from flextensor_diffusers.engine.config import resolve_device
    from flextensor_diffusers.recipes.ltx2_outpaint import DEFAULTS

    args.steps = args.steps or DEFAULTS[args.size].steps
    args.text_tokens = args.text_tokens or (32 if args.size == "tiny" else 1024)
    started = time.perf_counter()
    deadline = started + args.deadline if args.deadline else float("inf")
    device = resolve_device(None)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    workload = workload_of(args)
    earlier = resumed(args.resume, workload, device_name) if args.resume else {"fit": None, "runs": []}
    bench = Bench(args, device)
    model = earlier["fit"]
    if model is None and args.fit_from:
        model = json.loads(args.fit_from.read_text())["fit"]
    if model is None and args.start_frames is None:
        model = fit(bench, args.fit_frames)
    print("fit", json.dumps(model), flush=True)
    result: dict[str, Any] = {
        "workload": workload,
        "device": device_name,
        "torch": torch.__version__,
        "fit": model,
        "fit_from": str(args.fit_from) if args.fit_from else None,
        "resumed_from": str(args.resume) if args.resume else None,
        "fps": FPS,
        "runs": earlier["runs"],
    }

    def save() -> None:
        write_json(args.out, result, quiet=True)

    for cap in [parse_bytes(c) for c in args.caps]:
        search_cap(bench, result, cap, deadline, save)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
