"""Issue 48: the host RAM of a set-up that returns early (progressive packing) against one that packs first.

Each of ``--modes`` runs in a child process of its own (a fresh resident set): ``progressive``
(``progressive_packing=True``, the default) and ``packed_first`` (``progressive_packing=False``). A child builds the
Wan2.2 T2V pipeline with random weights (``--size``: ``full``, Wan2.2-T2V-A14B's published sizes, built on the GPU
and moved to the CPU as `recipes.models` builds them; ``small``, the tiny config widened to ~0.7 GB, for the CPU;
``tiny``), enables offload with ``--budget`` only (no host options; on CUDA the card is capped at ``--card`` with
``set_per_process_memory_fraction``), runs one generation (``--frames`` x ``--height`` x ``--width``,
``--steps``, CFG, the text encoder on the prompt, latents out: the VAE does not run) and waits until every unit
is packed (`OffloadHandle.wait_until_packed`).

Host memory, RssAnon + RssShmem of the child (anonymous and page-locked; a mapped file's pages not), is sampled every
``--sample-ms`` from before enable to the end. Per mode: ``weights_bytes`` (the offloaded components' parameters
and buffers), ``packed_bytes`` (their host copies: the weights plus each tensor's room in its buffer),
``largest_unit_bytes``, ``baseline_rss_bytes`` (after building, garbage collected and the C heap trimmed),
``peak_rss_bytes`` (peaks per phase in ``peak_rss_by_phase``), ``peak_over_baseline_bytes``,
``allowed_over_baseline_bytes`` (issue 48's bound: ``packed_bytes - weights_bytes`` plus the largest unit; on the
CPU the device copies, in RAM there, are added: ``budget_bytes``), ``excess_over_bound_bytes`` (what went beyond:
the fixed overhead), ``peak_over_end_bytes`` (the peak against the end, every unit packed: on the CPU, where the
device copies are in RAM, the cleaner view of what packing added while it went on), ``setup_s``
(the ``enable`` call), ``first_call_s`` (the generation, whose first forwards wait for the units they reach when
packing progressively), ``first_step_s`` (from the call's start to its first step's end, device synchronised),
``until_packed_s`` (from the call's end until every unit is packed) and ``progressive`` (whether each component did
pack progressively: a host tier turns it off). With ``--wait-before-call`` every unit is packed before the
generation (``until_packed_s`` from set-up's end), so packing needs no forward: on the CPU, where the device copies
are in RAM, ``packing_phases_peak_over_baseline_bytes`` (the enable and until_packed phases) is then free of them.
The parent writes ``--out`` (JSON) and prints a summary.

GPU (the lead's command, under 10 minutes on an H100 machine with 128 GiB of RAM)::

    python3 benchmarks/setup_ram_bench.py --size full --out $OUT/setup_ram_h100.json

CPU (``benchmarks/results/setup_ram_cpu.json``, and ``setup_ram_wait_cpu.json`` with ``--wait-before-call``)::

    python benchmarks/setup_ram_bench.py --size small --frames 9 --height 64 --width 64 --steps 2 \\
        --budget 150MB --out benchmarks/results/setup_ram_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import HostMemorySampler, anon_shmem_bytes, write_json

MODES = {"progressive": True, "packed_first": False}
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
#: ``small``: the tiny config's structure, widened so that units are tens of MB (RAM noise is not larger than
#: they are), ~0.7 GB in all.
SMALL = {
    "dtype": "bfloat16",
    "transformer": {"num_attention_heads": 8, "attention_head_dim": 128, "text_dim": 1024, "freq_dim": 256,
                    "ffn_dim": 4096, "num_layers": 8, "rope_max_seq_len": 1024},
    "text_encoder": {"vocab_size": 32128, "d_model": 1024, "d_kv": 64, "d_ff": 2816, "num_layers": 4,
                     "num_heads": 16, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128},
}  # fmt: skip


def small_config(real: Any) -> Any:
    """`recipes.models.load_config` giving the ``small`` sizes for Wan2.2's ``tiny`` config."""

    def load(model: str, size: str) -> dict[str, Any]:
        cfg = real(model, "tiny")
        cfg["dtype"] = SMALL["dtype"]
        for part in ("transformer", "transformer_2"):
            cfg[part].update(SMALL["transformer"])
        cfg["text_encoder"].update(SMALL["text_encoder"])
        return cfg

    return load


def build(size: str, device: torch.device) -> Any:
    """The pipeline with random weights on the CPU (built on ``device``: the GPU makes full sizes quick)."""
    from flextensor_diffusers.recipes import models

    if size == "small":
        models.load_config = small_config(models.load_config)
    pipe = models.build_pipeline("wan22_t2v", "tiny" if size == "small" else size, init_device=device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tensors_bytes(pipe: Any) -> int:
    total = 0
    for name in COMPONENTS:
        module = getattr(pipe, name, None)
        if module is not None:
            total += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return total


def settled_rss() -> int:
    """RssAnon + RssShmem once garbage is collected and the C heap's free pages are given back."""
    from flextensor_diffusers.storage.host_memory import return_freed_heap

    gc.collect()
    return_freed_heap()
    return anon_shmem_bytes()


def generate(pipe: Any, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """One generation, latents out; the seconds it took and until its first step's end."""
    start = time.perf_counter()
    ends: list[float] = []

    def on_step(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())
        return tensors

    pipe(
        prompt="a cat walking on the beach at sunset",
        negative_prompt="blurry",
        num_frames=args.frames,
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        guidance_scale=4.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=on_step,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    return {"first_call_s": round(end - start, 3), "first_step_s": round(ends[0] - start, 3) if ends else None}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One mode in this process (see the module docstring)."""
    import diffusers

    import flextensor_diffusers as ft
    from flextensor_diffusers.reports.compare import cap_device_memory

    diffusers.utils.logging.set_verbosity_error()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out: dict[str, Any] = {"mode": args.child, "device": name, "torch": torch.__version__}
    built = time.perf_counter()
    pipe = build(args.size, device)
    out["build_s"] = round(time.perf_counter() - built, 1)
    cap_device_memory(device, args.card)
    out["weights_bytes"] = tensors_bytes(pipe)
    out["baseline_rss_bytes"] = settled_rss()
    with HostMemorySampler(anon_shmem_bytes, args.sample_ms / 1e3) as sampler:
        handles = set_up_and_run(pipe, args, device, sampler, out)
    out["packed_bytes"] = sum(h.host.packed_bytes for h in handles.values())
    out["largest_unit_bytes"] = max(u.nbytes for h in handles.values() for u in h.host.positions)
    out["budget_bytes"] = ft.pipeline_offload(pipe).budget_bytes
    out["peak_rss_by_phase"] = dict(sampler.peaks)
    out["end_rss_bytes"] = anon_shmem_bytes()
    out.update(memory_figures(out, sampler.peak(), device))
    return out


def set_up_and_run(
    pipe: Any, args: argparse.Namespace, device: torch.device, sampler: HostMemorySampler, out: dict[str, Any]
) -> dict[str, Any]:
    """Enable, generate and wait until every unit is packed (or wait first, ``--wait-before-call``), each a phase
    of ``sampler``; times into ``out``. The pipeline's handles."""
    import flextensor_diffusers as ft

    sampler.set_phase("enable")
    start = time.perf_counter()
    pipe.enable_flextensor_offload(budget=args.budget, device=device, progressive_packing=MODES[args.child])
    out["setup_s"] = round(time.perf_counter() - start, 3)
    handles = ft.pipeline_offload(pipe).handles
    out["progressive"] = {name: h.host._progressive is not None for name, h in handles.items()}
    phases = ["until_packed", "first_call"] if args.wait_before_call else ["first_call", "until_packed"]
    for phase in phases:
        sampler.set_phase(phase)
        if phase == "first_call":
            out.update(generate(pipe, args, device))
            continue
        waited = time.perf_counter()
        for handle in handles.values():
            handle.wait_until_packed()
        out["until_packed_s"] = round(time.perf_counter() - waited, 3)
    sampler.set_phase("end")
    return handles


def memory_figures(out: dict[str, Any], peak: int, device: torch.device) -> dict[str, Any]:
    """The peak against the baseline, issue 48's bound and the end (see the module docstring)."""
    baseline, end = out["baseline_rss_bytes"], out["end_rss_bytes"]
    allowed = out["packed_bytes"] - out["weights_bytes"] + out["largest_unit_bytes"]
    if device.type == "cpu":  # the device copies are in RAM too
        allowed += out["budget_bytes"]
    packing = max(out["peak_rss_by_phase"].get(p, 0) for p in ("enable", "until_packed"))
    return {
        "peak_rss_bytes": peak,
        "peak_over_baseline_bytes": peak - baseline,
        "allowed_over_baseline_bytes": allowed,
        "excess_over_bound_bytes": peak - baseline - allowed,
        "peak_over_end_bytes": peak - end,
        "packing_phases_peak_over_baseline_bytes": packing - baseline,
    }


def run_child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    result = Path(args.scratch) / f"setup_ram_{mode}.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, __file__, "--child", mode, "--result", str(result)]
    for key in ("size", "frames", "height", "width", "steps", "budget", "card", "sample_ms"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.wait_before_call:
        argv.append("--wait-before-call")
    started = time.perf_counter()
    proc = subprocess.run(argv, check=False)
    if proc.returncode != 0 or not result.exists():
        return {"mode": mode, "error": f"child exited with {proc.returncode}"}
    data = json.loads(result.read_text())
    data["child_s"] = round(time.perf_counter() - started, 1)
    return data


def summary(runs: list[dict[str, Any]]) -> None:
    gb = 1e9
    for run in runs:
        if "error" in run:
            print(f"{run['mode']}: {run['error']}")
            continue
        print(
            f"{run['mode']:>13}: weights {run['weights_bytes'] / gb:.2f} GB, largest unit "
            f"{run['largest_unit_bytes'] / gb:.3f} GB, peak over baseline "
            f"{run['peak_over_baseline_bytes'] / gb:.3f} GB (allowed {run['allowed_over_baseline_bytes'] / gb:.3f}; "
            f"over the end {run['peak_over_end_bytes'] / gb:.3f}; packing phases "
            f"{run['packing_phases_peak_over_baseline_bytes'] / gb:.3f}), set-up {run['setup_s']} s, first call "
            f"{run['first_call_s']} s (first step {run['first_step_s']} s), then packed in {run['until_packed_s']} s"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("small", "tiny", "full"), default="full")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", default="auto", help="the pipeline's GPU budget (default: auto)")
    parser.add_argument("--card", default="8GB", help="CUDA: the card's memory is capped at this")
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument(
        "--wait-before-call",
        action="store_true",
        help="wait until every unit is packed before the generation: packing then needs no forward, and on the CPU "
        "the enable and until_packed phases' peak is free of the device copies (in RAM there)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scratch", default="/tmp")
    parser.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        write_json(args.result, child(args), quiet=True)
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    result: dict[str, Any] = {
        "benchmark": "setup_ram_bench",
        "code": commit.stdout.strip(),
        "argv": sys.argv[1:],
        "runs": [],
    }
    for mode in args.modes:
        result["runs"].append(run_child(mode, args))
        write_json(args.out, result, quiet=True)
    summary(result["runs"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
