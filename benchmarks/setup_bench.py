"""Where set-up time goes: ways to bring weights into page-locked host memory, timed on one machine.

Set-up copies every unit's tensors into one flat host buffer and page-locks it (issue 15 asks for a
set-up at most 0.8x flextensor 0.5.0's). This times, for ``--units`` units of ``--mb`` MB each
(a Wan2.2-A14B block is ~703 MB), on ``--threads`` threads (one unit per task, as set-up does):

* ``empty+copy+register``: ``torch.empty`` (4 KiB pages, faulted on first touch by the copy), then
  ``cudaHostRegister`` in place (what set-up does today);
* ``hugepage+copy+register``: the package's own host buffer (`host_memory.host_buffer`: an anonymous
  mapping advised ``MADV_HUGEPAGE`` from 32 MiB on, so 2 MiB pages where the kernel gives them: 512x
  fewer faults and page-table entries to lock), then the same copy and register;
* ``hugepage+copy+register/unit``: the same buffer, copy and register, but each task does all three
  for its unit, so one thread's registration overlaps the others' copies (set-up today copies every
  unit, then registers every unit); its time is reported as ``copy_s`` (the three are not apart);
* ``register+copy``: ``cudaHostRegister`` on the fresh (untouched) buffer first, then the copy;
* ``pin_memory``: ``Tensor.pin_memory()`` per unit (torch's pinned allocator, then a copy).

Each variant prints and saves its copy / register / total seconds and GB/s, and the transparent huge
page settings of the machine. Each variant runs in a fresh process (a freed buffer that the next one
reused would skip its page faults), on sources it touched first (filled with a constant).

    python benchmarks/setup_bench.py --out $OUT/setup_h200.json
    python benchmarks/setup_bench.py --units 4 --mb 64      # any machine with CUDA (a CPU build skips register)
    python benchmarks/setup_bench.py --units 40 --threads 16 --variants hugepage+copy+register/unit
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.engine.host_memory import host_buffer, pin_in_place, unpin_in_place


@dataclass
class VariantTimes:
    name: str
    alloc_s: float
    copy_s: float
    register_s: float
    total_s: float
    gbps: float


def register(buffer: torch.Tensor) -> None:
    """`pin_in_place`, loud: a variant whose buffers stay pageable would time nothing worth comparing."""
    if not pin_in_place(buffer):
        raise RuntimeError("cudaHostRegister failed")


def on_threads(work: Callable[[int], None], count: int, threads: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(count)))
    return time.perf_counter() - start


def run_variant(name: str, sources: list[torch.Tensor], threads: int, can_register: bool) -> VariantTimes:
    n = len(sources)
    nbytes = sources[0].numel()
    buffers: list[torch.Tensor | None] = [None] * n
    alloc = copy = reg = 0.0
    if name == "pin_memory":
        copy = on_threads(lambda i: buffers.__setitem__(i, sources[i].pin_memory()), n, threads)
    elif name.endswith("/unit"):

        def one_unit(i: int) -> None:
            buffers[i] = host_buffer(nbytes)
            buffers[i].copy_(sources[i])
            if can_register:
                register(buffers[i])

        copy = on_threads(one_unit, n, threads)
        if can_register:
            for b in buffers:
                unpin_in_place(b)
    else:
        make = host_buffer if name.startswith("hugepage") else lambda b: torch.empty(b, dtype=torch.uint8)
        alloc = on_threads(lambda i: buffers.__setitem__(i, make(nbytes)), n, threads)
        if name == "register+copy" and can_register:
            reg = on_threads(lambda i: register(buffers[i]), n, threads)
        copy = on_threads(lambda i: buffers[i].copy_(sources[i]), n, threads)
        if name != "register+copy" and can_register:
            reg = on_threads(lambda i: register(buffers[i]), n, threads)
        if can_register:
            for b in buffers:
                unpin_in_place(b)
    total = alloc + copy + reg
    buffers.clear()
    return VariantTimes(
        name, round(alloc, 4), round(copy, 4), round(reg, 4), round(total, 4), round(n * nbytes / total / 1e9, 2)
    )


def thp_settings() -> dict[str, str]:
    out = {}
    for key in ("enabled", "defrag"):
        try:
            out[key] = Path(f"/sys/kernel/mm/transparent_hugepage/{key}").read_text().strip()
        except OSError:
            out[key] = "unknown"
    return out


VARIANTS = (
    "empty+copy+register",
    "hugepage+copy+register",
    "hugepage+copy+register/unit",
    "register+copy",
    "pin_memory",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--mb", type=float, default=703.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2, help="rounds over all variants (the best is kept)")
    parser.add_argument(
        "--intra-op-threads", type=int, default=0, help="torch.set_num_threads in each variant (0: torch's default)"
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="which to time")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    can_register = torch.cuda.is_available()
    nbytes = int(args.mb * 1e6) // 512 * 512
    if args.variant:
        if args.intra_op_threads:  # copy_ splits a large copy over torch's own threads, on top of ours
            torch.set_num_threads(args.intra_op_threads)
        sources = [torch.full((nbytes,), 7, dtype=torch.uint8) for _ in range(args.units)]
        print("RESULT " + json.dumps(asdict(run_variant(args.variant, sources, args.threads, can_register))))
        return
    shape = ["--units", str(args.units), "--mb", str(args.mb), "--threads", str(args.threads)]
    shape += ["--intra-op-threads", str(args.intra_op_threads)]
    best: dict[str, dict] = {}
    for _ in range(args.reps):
        for name in [v for v in args.variants if can_register or v != "pin_memory"]:
            proc = subprocess.run([sys.executable, __file__, *shape, "--variant", name], capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{name:>24}: failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            t = json.loads(line.removeprefix("RESULT "))
            print(
                f"{name:>24}: alloc {t['alloc_s']:6.3f} s  copy {t['copy_s']:6.3f} s  register {t['register_s']:6.3f} s"
                f"  total {t['total_s']:6.3f} s  {t['gbps']:6.2f} GB/s",
                flush=True,
            )
            if name not in best or t["total_s"] < best[name]["total_s"]:
                best[name] = t
    result = {
        "units": args.units,
        "unit_bytes": nbytes,
        "threads": args.threads,
        "intra_op_threads": args.intra_op_threads or torch.get_num_threads(),
        "registered": can_register,
        "transparent_hugepage": thp_settings(),
        "best_of_reps": list(best.values()),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["transparent_hugepage"]))


if __name__ == "__main__":
    main()
