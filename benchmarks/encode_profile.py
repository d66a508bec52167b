"""Where the device encoder's time goes, for one Wan2.2-A14B block (issue 16's set-up target).

``CompressedCopies`` encodes each unit with ``encode_unit(flat, ..., device="cuda", verify=True)`` from the
unit's page-locked raw buffer. This script times that call end to end, then splits it: each stage of the
coder with the device synchronised before and after (``stages_ms``, summed over the unit's slices), the
profiler's top operators by host time and by device time, and the host-side moves a payload can take
(device→host into a fresh pageable buffer, into a pre-faulted one, into a page-locked staging buffer from
torch's pinned allocator; a host copy from staging into a fresh buffer; ``cudaHostRegister`` of a fresh and of
a pre-faulted buffer). Every figure is for one unit; multiply by 40 for the block stack.

    python benchmarks/encode_profile.py --out benchmarks/results/encode_profile_h200.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from codec_bench import locked_copy, pack, save, wan_block_tensors

from flextensor_diffusers.engine import codec
from flextensor_diffusers.engine.host_memory import host_buffer, pin_in_place, unpin_in_place

STAGES = ("_fetch", "_split_words", "_choose_codes", "_pack_all", "check_decodes", "_download")


def timed(seconds: Callable[[], float], reps: int) -> float:
    return statistics.median(seconds() for _ in range(reps))


def wall(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def stage_times(flat: torch.Tensor, segments: list[codec.Segment]) -> dict[str, float]:
    """Milliseconds per coder stage over one encode, each stage between two device synchronisations."""
    spent: dict[str, float] = defaultdict(float)
    originals = {name: getattr(codec, name) for name in STAGES}

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: object, **kwargs: object) -> object:
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            torch.cuda.synchronize()
            spent[name] += (time.perf_counter() - start) * 1e3
            return result

        return inner

    for name, fn in originals.items():
        setattr(codec, name, wrap(name, fn))
    try:
        total = wall(lambda: codec.encode_unit(flat, segments, device="cuda", verify=True)) * 1e3
    finally:
        for name, fn in originals.items():
            setattr(codec, name, fn)
    spent["total_synchronised"] = total
    return {k: round(v, 2) for k, v in spent.items()}


def top_ops(fn: Callable[[], object], top: int = 20) -> dict[str, list[dict]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        rows.append(
            {
                "name": event.key[:90],
                "calls": event.count,
                "self_cpu_ms": round(event.self_cpu_time_total / 1e3, 2),
                "self_device_ms": round(device_us / 1e3, 2),
            }
        )
    return {
        "by_host": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top],
        "by_device": sorted(rows, key=lambda r: -r["self_device_ms"])[:top],
    }


def host_moves(nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of the ways a payload of ``nbytes`` can reach host memory, and of locking it there."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gbps = lambda s: round(nbytes / s / 1e9, 2)  # noqa: E731

    def d2h_fresh() -> float:
        dst = host_buffer(nbytes)
        return wall(lambda: dst.copy_(src))

    prefaulted = host_buffer(nbytes)
    prefaulted.fill_(0)

    def copy_fresh() -> float:
        dst = host_buffer(nbytes)
        return wall(lambda: dst.copy_(staging))

    def register(prefault: bool) -> float:
        buf = host_buffer(nbytes)
        if prefault:
            buf.fill_(0)
        start = time.perf_counter()
        ok = pin_in_place(buf)
        seconds = time.perf_counter() - start
        if ok:
            unpin_in_place(buf)
        return seconds

    return {
        "d2h_pageable_fresh_gbps": gbps(timed(d2h_fresh, reps)),
        "d2h_pageable_prefaulted_gbps": gbps(timed(lambda: wall(lambda: prefaulted.copy_(src)), reps)),
        "d2h_pinned_staging_gbps": gbps(timed(lambda: wall(lambda: staging.copy_(src, non_blocking=True)), reps)),
        "host_copy_staging_to_fresh_gbps": gbps(timed(copy_fresh, reps)),
        "host_copy_staging_to_prefaulted_gbps": gbps(timed(lambda: wall(lambda: prefaulted.copy_(staging)), reps)),
        "register_fresh_gbps": gbps(timed(lambda: register(False), reps)),
        "register_prefaulted_gbps": gbps(timed(lambda: register(True), reps)),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.zeros(1, device="cuda")
    flat, segments = pack(wan_block_tensors(5120, 13824))
    pinned = locked_copy(flat)
    encode = lambda: codec.encode_unit(pinned, segments, device="cuda", verify=True)  # noqa: E731
    encoded = encode()  # warm-up
    results: dict = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "raw_mb": round(flat.numel() / 1e6, 1),
        "stored_mb": round(encoded.stored_nbytes / 1e6, 1),
        "encode_s": round(timed(lambda: wall(encode), args.reps), 4),
    }
    results["encode_gbps"] = round(flat.numel() / results["encode_s"] / 1e9, 2)
    print(f"encode {results['encode_s']} s = {results['encode_gbps']} GB/s", flush=True)
    results["stages_ms"] = stage_times(pinned, segments)
    print(f"stages {results['stages_ms']}", flush=True)
    results["ops"] = top_ops(encode)
    results["host_moves"] = host_moves(encoded.stored_nbytes, args.reps)
    print(f"host moves {results['host_moves']}", flush=True)
    unpin_in_place(pinned)
    save(results, args.out)


if __name__ == "__main__":
    main()
