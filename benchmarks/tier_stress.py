"""Stress the compressed host tier on the CPU: random timing perturbations around the disk reads, looking for a
generation whose latents are not bitwise equal to the reference.

The tiny Wan2.2 pipeline is offloaded with ``compression="lossless"`` and a host budget that holds one expert
(the smallest workable one, planned in the host copies' bytes as the tests do), so the experts take turns in RAM,
the other waiting on disk in its payload file and read back unit by unit while the model computes. Random sleeps
(seeded per generation) are put around the unit reads (reader threads), the payload reads, the gate, the
adoption of each unit, the spill and the decodes (main thread); the GIL switch interval and the number of reader
threads may be changed too. Every generation's latents, and every step's, are compared bitwise with the reference;
the payloads kept in RAM are checked against their CRCs after each generation.

    python benchmarks/tier_stress.py --experts identical-linked --generations 40 --seed 3 --read-sleep 0.02

Writes a JSON of the results under /tmp (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import device_copies as device_copies_mod
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.storage import codec as codec_mod
from flextensor_diffusers.storage import disk_reads, file_reads, host_budget
from flextensor_diffusers.storage import payload_cache as payload_cache_mod
from flextensor_diffusers.storage.compressed_copies import CompressedCopies
from flextensor_diffusers.storage.host_copies import HostCopies
from flextensor_diffusers.storage.host_tier import read_back as read_back_mod

EXPERTS = ("transformer", "transformer_2")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' tiny call
from tests.models import TINY_WAN_CALL  # noqa: E402

CALL = dict(TINY_WAN_CALL)  # the generation's arguments; --steps changes its step count

BUDGET = 340_000  # as tests/test_compressed_tier.py: the blocks stream compressed


# ----------------------------------------------------------------------------------------------- perturbations


class Jitter:
    """Random sleeps, seeded per generation (one RNG shared by all threads under a lock)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._lock = threading.Lock()
        self._rng = random.Random(args.seed)
        self.counts: dict[str, int] = {}

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._rng = random.Random(seed)

    def sleep(self, site: str, most: float, probability: float = 1.0) -> None:
        if most <= 0:
            return
        with self._lock:
            if self._rng.random() >= probability:
                return
            seconds = self._rng.uniform(0, most)
            self.counts[site] = self.counts.get(site, 0) + 1
        time.sleep(seconds)


def install(jitter: Jitter, args: argparse.Namespace) -> None:
    """Wrap the seams and methods with random sleeps (class attributes: reaches every instance)."""
    a = args

    class Hooks(disk_reads.ReadHooks):
        def read(self, job: Any, position: int, read: Any) -> Any:  # reader threads
            jitter.sleep("hook.read.before", a.read_sleep)
            unit = read()
            jitter.sleep("hook.read.after", a.read_sleep, 0.5)
            return unit

        def changed(self, job: Any) -> None:
            jitter.sleep("hook.changed", a.thread_sleep, 0.3)

        def waiting(self, job: Any, position: int) -> None:  # main thread, before it waits for a unit
            jitter.sleep("hook.waiting", a.gate_sleep, 0.5)

    disk_reads.read_hooks = Hooks()

    def wrap(owner: Any, name: str, site: str, most: float, probability: float = 1.0, after: bool = False) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not after:
                jitter.sleep(site, most, probability)
            out = original(*args, **kwargs)
            if after:
                jitter.sleep(site, most, probability)
            return out

        setattr(owner, name, wrapped)

    # reader threads
    wrap(HostCopies, "read_unit", "HostCopies.read_unit", a.read_sleep, 0.5)
    wrap(CompressedCopies, "read_payload", "CompressedCopies.read_payload.after", a.thread_sleep, 0.5, after=True)
    wrap(payload_cache_mod.PayloadCache, "read_payload", "PayloadCache.read_payload", a.thread_sleep, 0.5)
    wrap(disk_reads.ReadJob, "_landed", "ReadJob._landed", a.thread_sleep, 0.3)
    wrap(disk_reads.ReadJob, "run", "ReadJob.run", a.thread_sleep, 0.5)
    # main thread
    wrap(disk_reads.FillGate, "__call__", "FillGate.__call__", a.gate_sleep, 0.3)
    wrap(read_back_mod.ReadBack, "_arrive", "ReadBack._arrive", a.gate_sleep, 0.3)
    wrap(HostCopies, "take_unit", "HostCopies.take_unit", a.gate_sleep, 0.3)
    wrap(CompressedCopies, "take", "CompressedCopies.take", a.gate_sleep, 0.3, after=True)
    wrap(HostCopies, "spill_payloads", "HostCopies.spill_payloads", a.gate_sleep, 1.0)
    wrap(disk_reads.ReadJob, "allow", "ReadJob.allow", a.gate_sleep, 0.3, after=True)
    wrap(disk_reads.ReadJob, "stop", "ReadJob.stop", a.gate_sleep, 0.3, after=True)
    if a.inject_fault > 0:  # positive control: a bit flipped in a payload after its CRC check
        checked_read = CompressedCopies.read_payload

        def corrupting(self: Any, index: int, pin: bool, *rest: Any) -> Any:
            payload, locked = checked_read(self, index, pin, *rest)
            with jitter._lock:
                flip = jitter._rng.random() < a.inject_fault
            if flip and payload.numel():
                payload[payload.numel() // 2] ^= 0x10
                jitter.counts["injected_faults"] = jitter.counts.get("injected_faults", 0) + 1
            return payload, locked

        CompressedCopies.read_payload = corrupting
    # the main thread's compute: a decode stands for a kernel that takes a while
    original_decode = codec_mod.decode_into

    def decode_into(*args: Any, **kwargs: Any) -> Any:
        jitter.sleep("decode_into", a.compute_sleep, 0.5)
        return original_decode(*args, **kwargs)

    device_copies_mod.decode_into = decode_into


class Chaos:
    """A background thread that, at random moments, drops the page cache of every file under ``roots``
    (payload files, weight files), runs the garbage collector, and spins in Python holding the GIL for a while."""

    def __init__(self, roots: list[Path], seed: int, most: float) -> None:
        self.roots = roots
        self.rng = random.Random(seed)
        self.most = most
        self.stopping = threading.Event()
        self.actions = 0
        self.thread = threading.Thread(target=self._run, name="tier-stress-chaos", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import gc
        import os

        while not self.stopping.wait(self.rng.uniform(0, self.most)):
            self.actions += 1
            choice = self.rng.random()
            if choice < 0.4:
                for root in self.roots:
                    for path in root.rglob("*"):
                        with contextlib.suppress(OSError):
                            if path.is_file():
                                fd = os.open(path, os.O_RDONLY)
                                try:
                                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                                finally:
                                    os.close(fd)
            elif choice < 0.7:
                gc.collect()
            else:
                end = time.perf_counter() + self.rng.uniform(0, self.most)
                while time.perf_counter() < end:  # holds the GIL between switch intervals
                    pass

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def install_tier_sleeps(jitter: Jitter, args: argparse.Namespace) -> None:
    """Random sleeps in the tier's own steps (main thread, under its lock): moving out, reading ahead."""
    from flextensor_diffusers.storage.host_tier import placement as placement_mod
    from flextensor_diffusers.storage.host_tier import read_ahead as read_ahead_mod

    for owner, name in (
        (placement_mod.Placement, "_move_out"),
        (read_ahead_mod.ReadAheads, "after"),
        (read_ahead_mod.ReadAheads, "_give_up"),
        (read_back_mod.ReadBack, "start"),
        (read_back_mod.ReadBack, "finish"),
        (disk_reads.Reader, "give_up"),
    ):
        original = getattr(owner, name)
        static = isinstance(owner.__dict__.get(name), staticmethod)

        def wrapped(*a: Any, _original: Any = original, _site: str = f"{owner.__name__}.{name}", **k: Any) -> Any:
            jitter.sleep(_site, args.gate_sleep, 0.5)
            out = _original(*a, **k)
            jitter.sleep(_site + ".after", args.gate_sleep, 0.5)
            return out

        setattr(owner, name, staticmethod(wrapped) if static else wrapped)


# ----------------------------------------------------------------------------------------------- pipelines


def widen(layers: int) -> None:
    """Both experts with ``layers`` blocks (more units to read back, more interleavings)."""
    from flextensor_diffusers.recipes import models

    real = models.load_config

    def config(model: str, size: str) -> dict:
        cfg = real(model, size)
        for name in EXPERTS:
            if name in cfg and layers:
                cfg[name]["num_layers"] = layers
        return cfg

    models.load_config = config


def save_folder(root: Path, experts: str) -> Path:
    """The tiny pipeline saved with ``save_pretrained`` (sharded as the tests do); ``identical-linked``:
    ``transformer_2`` a folder of symlinks to ``transformer``'s weight files (as tiers_bench's ``link_expert``)."""
    folder = root / "wan22"
    pipe = build_pipeline("wan22_t2v", "tiny")
    if experts != "distinct":
        pipe.transformer_2.load_state_dict(pipe.transformer.state_dict())
    pipe.save_pretrained(folder, max_shard_size="200KB")
    if experts == "identical-linked":
        source, target = folder / "transformer", folder / "transformer_2"
        shutil.rmtree(target)
        target.mkdir()
        for path in sorted(source.iterdir()):
            if path.name == "config.json":
                shutil.copy2(path, target / path.name)
            else:
                (target / path.name).symlink_to(Path("..") / "transformer" / path.name)
    return folder


def make_pipe(args: argparse.Namespace, folder: Path | None) -> Any:
    if folder is not None:
        from diffusers import WanPipeline

        extra = dict(text_encoder=None, tokenizer=None) if args.no_text_encoder else {}
        pipe = WanPipeline.from_pretrained(folder, **extra)
    else:
        pipe = build_pipeline("wan22_t2v", "tiny")
        if args.experts != "distinct":
            pipe.transformer_2.load_state_dict(pipe.transformer.state_dict())
        if args.no_text_encoder:
            pipe.register_modules(text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: Seeded stand-ins for the prompt embeddings when there is no text encoder (as the GPU bench does).
EMBEDS: dict[str, torch.Tensor] = {}


def generate(pipe: Any, steps: list[torch.Tensor] | None = None, num_steps: int | None = None) -> torch.Tensor:
    def on_step(p: Any, i: int, t: Any, kwargs: dict) -> dict:
        if steps is not None:
            steps.append(kwargs["latents"].clone())
        return kwargs

    call = dict(CALL)
    if EMBEDS:
        del call["prompt"], call["negative_prompt"]
        call.update(EMBEDS)
    if num_steps is not None:
        call["num_inference_steps"] = num_steps
    return pipe(
        **call,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=on_step,
    ).frames


def smallest_host_budget(pipe: Any, cache: Path, budget: int) -> int:
    """As tests/test_compressed_tier.py: the largest component's host copies next to the others' raw base."""
    pipe.enable_flextensor_offload(
        budget=budget, device="cpu", compression="lossless", host_budget="1GiB", cache_dir=cache
    )
    handles = ft.pipeline_offload(pipe).handles
    stored = {name: h.host.stored_bytes for name, h in handles.items()}
    raw = {name: h.host.where().ram_raw_bytes for name, h in handles.items()}
    pipe.disable_flextensor_offload()
    return max(stored[n] + sum(raw[o] for o in stored if o != n) for n in stored)


def payload_crcs(pipe: Any) -> dict[str, dict[int, int]]:
    """CRC-32 of every payload of each expert (those waiting on disk read through their file views)."""
    out = {}
    for name in EXPERTS:
        host = ft.pipeline_offload(pipe).handles[name].host
        out[name] = {i: zlib.crc32(memoryview(e.payload.numpy())) for i, e in host.compressed.encoded.items()}
    return out


def expert_of_steps(pipe: Any, count: int) -> list[str]:
    """Which expert runs each of ``count`` steps (Wan2.2's boundary: transformer at timesteps >= boundary)."""
    ratio = pipe.config.boundary_ratio
    pipe.scheduler.set_timesteps(count)
    if ratio is None:
        return ["transformer"] * len(pipe.scheduler.timesteps)
    boundary = ratio * pipe.scheduler.config.num_train_timesteps
    return ["transformer" if t >= boundary else "transformer_2" for t in pipe.scheduler.timesteps]


# ----------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    host_budget.process_own_bytes = lambda modules: 0  # as tests/models.py set_host_overhead(own=0, reserve=0)
    host_budget.HOST_RESERVE_BYTES = 0
    if args.read_threads:
        disk_reads.READ_THREADS = args.read_threads
    if args.piece_bytes:  # units of the tiny models read in many pieces, on every reader thread at once
        file_reads.MIN_PIECE_BYTES = file_reads.PIECE_ALIGN = args.piece_bytes
    widen(args.layers)
    CALL["num_inference_steps"] = args.steps
    work = Path(tempfile.mkdtemp(prefix="tier_stress_", dir="/tmp"))
    folder = save_folder(work, args.experts) if args.source == "folder" else None
    native = make_pipe(args, folder)
    if args.no_text_encoder:
        g = torch.Generator().manual_seed(1000 + args.seed)
        shape = (1, 512, native.transformer.config.text_dim)
        EMBEDS.update(
            prompt_embeds=torch.randn(*shape, generator=g), negative_prompt_embeds=torch.randn(*shape, generator=g)
        )
    step_counts = sorted({args.steps, *(args.alternate_steps or [])})
    references: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for count in step_counts:
        ref_steps: list[torch.Tensor] = []
        references[count] = (generate(native, ref_steps, count), ref_steps)
    step_experts = {count: expert_of_steps(native, count) for count in step_counts}
    del native

    pipe = make_pipe(args, folder)
    if args.experts != "distinct":
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                pipe.transformer.state_dict().values(), pipe.transformer_2.state_dict().values(), strict=True
            )
        )
        assert same, "the experts should be identical"
    cache = work / "cache"
    need = smallest_host_budget(pipe, cache, args.budget)
    pipe.enable_flextensor_offload(
        budget=args.budget, device="cpu", compression="lossless", host_budget="1GiB", cache_dir=cache
    )
    expert_stored = ft.pipeline_offload(pipe).handles["transformer"].host.stored_bytes
    pipe.disable_flextensor_offload()
    host_bytes = need + args.extra_host + int(args.extra_expert * expert_stored)

    def enable() -> Any:
        if args.fresh_cache:  # as the GPU bench: cache_dir emptied, so set-up encodes and writes the payload file
            payload_cache_mod.wait_for_all_writes()
            for path in cache.iterdir() if cache.exists() else []:
                path.unlink()
        pipe.enable_flextensor_offload(
            budget=args.budget,
            device="cpu",
            compression="lossless",
            host_budget=host_bytes,
            cache_dir=cache,
            verify_loads=args.verify_loads,  # every call's bytes compared with its weights (a fault raises)
        )
        state = ft.pipeline_offload(pipe)
        statuses.append({n: state.handles[n].payload_cache.describe() for n in EXPERTS})
        return state

    statuses: list[dict[str, str]] = []
    state = enable()
    enables = 1
    paths = {name: str(state.handles[name].payload_cache.path) for name in EXPERTS}
    crcs0 = payload_crcs(pipe)
    jitter = Jitter(args)
    install(jitter, args)
    if args.tier_sleeps:
        install_tier_sleeps(jitter, args)
    chaos = Chaos([work], args.seed, args.chaos) if args.chaos > 0 else None
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    results: list[dict[str, Any]] = []
    bad = 0
    started = time.perf_counter()
    for gen in range(args.generations):
        if time.perf_counter() - started > args.max_seconds:
            break
        gen_seed = args.seed * 100_003 + gen
        jitter.reseed(gen_seed)
        if args.reenable_every and gen and gen % args.reenable_every == 0:  # set-up again (a new process's)
            pipe.disable_flextensor_offload()
            state = enable()
            enables += 1
        steps: list[torch.Tensor] = []
        error = None
        count = step_counts[gen % len(step_counts)]
        reference, ref_steps = references[count]
        try:
            out = generate(pipe, steps, count)
        except Exception as exc:  # a read failure, say: recorded, the run goes on
            error = f"{type(exc).__name__}: {exc}"
            out = None
        equal = out is not None and torch.equal(out, reference)
        first_step = None
        if out is not None and not equal:
            first_step = next(
                (i for i, (s, r) in enumerate(zip(steps, ref_steps, strict=False)) if not torch.equal(s, r)), None
            )
        crcs = payload_crcs(pipe)
        crc_bad = {n: sorted(i for i in crcs0[n] if crcs[n].get(i) != crcs0[n][i]) for n in EXPERTS}
        tier = state.host_tier.report()
        row = {
            "generation": gen,
            "gen_seed": gen_seed,
            "steps": count,
            "bitwise": equal,
            "error": error,
            "first_differing_step": first_step,
            "expert_of_that_step": None if first_step is None else step_experts[count][first_step],
            "max_abs_diff": None if out is None or equal else float((out - reference).abs().max()),
            "payload_crc_mismatch": {n: v for n, v in crc_bad.items() if v},
            "on_disk": tier["on_disk"],
        }
        results.append(row)
        if not equal or error or row["payload_crc_mismatch"]:
            bad += 1
            print("NOT BITWISE" if not equal else "ANOMALY", json.dumps(row), flush=True)
        elif gen % 10 == 0:
            print(f"gen {gen}: bitwise ({time.perf_counter() - started:.1f} s)", flush=True)
    if chaos is not None:
        chaos.stop()
    tier = state.host_tier.report()
    plans = {n: str(h.plan and (sorted(h.plan.resident), h.plan.num_slots)) for n, h in state.handles.items()}
    pipe.disable_flextensor_offload()
    summary = {
        "args": vars(args),
        "payload_paths": paths,
        "shared_payload_file": paths["transformer"] == paths["transformer_2"],
        "step_experts": step_experts,
        "host_budget": host_bytes,
        "smallest_host_budget": need,
        "generations": len(results),
        "not_bitwise": [r for r in results if not r["bitwise"]],
        "anomalies": [r for r in results if r["error"] or r["payload_crc_mismatch"]],
        "reads_from_disk": len(tier["disk_reads_s"]),
        "switches_first": [(s["component"], s.get("read_ahead_bytes"), s.get("nbytes")) for s in tier["switches"][:6]],
        "plans": plans,
        "sleeps": jitter.counts,
        "enables": enables,
        "payload_statuses_first": statuses[:3],
        "chaos_actions": chaos.actions if chaos is not None else 0,
        "wall_s": round(time.perf_counter() - started, 1),
        "all_bitwise": bad == 0,
    }
    shutil.rmtree(work, ignore_errors=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--experts",
        choices=["distinct", "identical", "identical-linked"],
        default="distinct",
        help="identical: transformer's state dict copied into transformer_2; identical-linked: saved, then "
        "transformer_2's weight files symlinked to transformer's (implies --source folder)",
    )
    parser.add_argument("--source", choices=["memory", "folder"], default="memory")
    parser.add_argument("--read-sleep", type=float, default=0.01, help="most seconds slept around each unit read")
    parser.add_argument("--thread-sleep", type=float, default=0.005, help="other reader-thread sleeps")
    parser.add_argument("--gate-sleep", type=float, default=0.005, help="main-thread sleeps at the gate/adoption")
    parser.add_argument("--compute-sleep", type=float, default=0.002, help="main-thread sleep before a decode")
    parser.add_argument("--read-threads", type=int, default=0, help="disk_reads.READ_THREADS (0: as it is)")
    parser.add_argument(
        "--piece-bytes", type=int, default=0, help="file_reads' smallest piece and alignment (0: as they are)"
    )
    parser.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (0: as it is)")
    parser.add_argument("--extra-expert", type=float, default=0.0, help="host budget + this fraction of an expert")
    parser.add_argument("--no-text-encoder", action="store_true", help="random prompt embeddings (as the GPU bench)")
    parser.add_argument(
        "--alternate-steps", type=int, nargs="*", default=None, help="step counts alternated with --steps (warmup 2)"
    )
    parser.add_argument("--fresh-cache", action="store_true", help="empty cache_dir before each enable (encode anew)")
    parser.add_argument("--reenable-every", type=int, default=0, help="disable and enable again every K generations")
    parser.add_argument(
        "--inject-fault", type=float, default=0.0, help="positive control: flip a bit of a read payload (probability)"
    )
    parser.add_argument("--tier-sleeps", action="store_true", help="sleeps in the tier's own steps too")
    parser.add_argument(
        "--chaos", type=float, default=0.0, help="a thread dropping page caches, collecting, spinning (most s between)"
    )
    parser.add_argument("--layers", type=int, default=0, help="blocks per expert (0: the tiny config's 4)")
    parser.add_argument("--steps", type=int, default=4, help="inference steps")
    parser.add_argument("--budget", type=int, default=BUDGET, help="GPU budget (larger: resident units)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads (0: as it is)")
    parser.add_argument("--extra-host", type=int, default=0, help="bytes added to the smallest host budget")
    parser.add_argument("--max-seconds", type=float, default=420.0, help="stop starting generations after this")
    parser.add_argument("--verify-loads", action="store_true", help="enable with verify_loads=True")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.experts == "identical-linked":
        args.source = "folder"
    summary = run(args)
    out = args.out or Path(f"/tmp/tier_stress_{args.experts}_{args.source}_s{args.seed}.json")
    out.write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("not_bitwise", "anomalies")}, default=str))
    print(
        f"not bitwise: {len(summary['not_bitwise'])}/{summary['generations']}; anomalies: {len(summary['anomalies'])}"
    )
    print(f"written: {out}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
