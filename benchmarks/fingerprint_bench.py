"""What one ``verify_loads`` check costs on the device: the fingerprint of a unit the size of a Wan2.2-A14B block,
summed as before (32-bit words into an int64 sum, which PyTorch may convert first) and as now (64-bit words in
their own type, `engine.load_checks.fingerprint`): time per check and the memory it allocates.

Usage (on a GPU): python benchmarks/fingerprint_bench.py --unit-mib 700 --out benchmarks/results/fingerprint_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from flextensor_diffusers.engine.load_checks import ByteRun, fingerprint

Fingerprint = Callable[[torch.Tensor, list[ByteRun]], torch.Tensor]


def words_into_int64(flat: torch.Tensor, runs: list[ByteRun]) -> torch.Tensor:
    """The fingerprint as calls I and J computed it: 32-bit words summed into an int64."""
    return torch.stack([flat[r.start : r.stop].view(torch.int32).sum(dtype=torch.int64) for r in runs])


def measure(method: Fingerprint, flat: torch.Tensor, runs: list[ByteRun], repeats: int) -> dict[str, float]:
    """Milliseconds per check (CUDA events, after one warm-up) and the bytes it allocated beyond its input."""
    method(flat, runs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        method(flat, runs)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / repeats
    return {
        "ms_per_check": round(ms, 3),
        "GBps": round(flat.numel() / ms / 1e6, 1),
        "allocated_bytes": torch.cuda.max_memory_allocated() - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit-mib", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fingerprint_bench needs a CUDA device")
    flat = torch.randint(0, 256, (args.unit_mib << 20,), dtype=torch.uint8, device="cuda")
    runs = [ByteRun(0, flat.numel(), ((0, flat.numel()),))]
    result = {
        "device": torch.cuda.get_device_name(),
        "unit_bytes": flat.numel(),
        "words_into_int64": measure(words_into_int64, flat, runs, args.repeats),
        "int64_words": measure(fingerprint, flat, runs, args.repeats),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
