"""Unit codec benchmark: compression ratio, encode and decode throughput (issue 16).

Builds a unit laid out as ``engine/units.py`` lays one out (each tensor at a 512-byte aligned offset) from a
Wan2.2-A14B transformer block's tensors (dim 5120, ffn 13824: ~700 MB of BF16 with normal-random weights,
plus FP32 norms and modulation table as Wan keeps them), and, where found, from real trained weights cast to
BF16. For each it reports the ratio (payload bytes / flat bytes) and the host encode time (``encode_s``:
``encode_unit`` on the CPU's threads); on CUDA also the device encoder (``device_encode``: ``encode_unit(...,
device="cuda")`` timed end to end, host→device copies of the raw bytes and copies of the payload back to
host memory included, in GB/s of raw input, for page-locked or pageable input and payload, with the device
memory it allocated and its kernels' times), the decode throughput in GB/s of raw output (CUDA events, median
of many iterations, per kernel configuration, each checked bit-exact), the device-to-device copy rate for
reference, and pinned host→device copy times of the raw buffer and of the payload, so that the streamed rate
of a coded unit can be set against the raw one.

    python benchmarks/codec_bench.py --out benchmarks/results/codec_h200.json
    python benchmarks/codec_bench.py --device cpu --mb 8  # smoke test, any machine

Trained weights: ``--trained PATH`` (a ``.pth``/``.pt``/``.safetensors`` state dict; repeatable). Without it
the script looks for the shift-tolerant LPIPS AlexNet/VGG16 weights of the ``stlpips-pytorch`` wheel
(``pip download --no-deps stlpips-pytorch`` ships them; ``--trained-dir`` may point at an unpacked copy)
and torch hub's checkpoint cache. DFloat11 (``pip download dfloat11``: a 24 KB wheel, Huffman-coded BF16
exponents decoded by a CUDA PTX kernel through CuPy) is the published point of comparison; we do not use it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from bench_common import write_json

from flextensor_diffusers.storage.codec import (
    DEFAULT_CHUNK,
    EncodedUnit,
    Segment,
    decode_into,
    encode_unit,
    worth_compressing,
)
from flextensor_diffusers.storage.host_memory import host_buffer, pin_in_place, unpin_in_place

ALIGN = 512
CONFIGS = [(2048, 4), (1024, 4), (4096, 8), (2048, 8), (1024, 2)]  # (block, num_warps) tried on CUDA


def wan_block_tensors(dim: int, ffn: int, seed: int = 0) -> list[torch.Tensor]:
    """The tensors of a WanTransformerBlock: BF16 weights ~N(0, 0.02²), small biases, FP32 norms and table."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    tensors: list[torch.Tensor] = []
    for _attention in range(2):  # self- and cross-attention
        for _proj in range(4):  # q, k, v, out
            tensors += [normal(dim, dim), normal(dim, std=0.01)]
        tensors += [torch.ones(dim, dtype=torch.bfloat16), torch.ones(dim, dtype=torch.bfloat16)]  # norm_q, norm_k
    tensors += [normal(ffn, dim), normal(ffn, std=0.01), normal(dim, ffn), normal(dim, std=0.01)]
    tensors += [torch.ones(dim), torch.zeros(dim), normal(1, 6, dim, std=1 / math.sqrt(dim), dtype=torch.float32)]
    return tensors


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[Segment]]:
    segments, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        segments.append(Segment(offset, nbytes, t.dtype))
        offset = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
    flat = torch.zeros(max(offset, ALIGN), dtype=torch.uint8)
    for seg, t in zip(segments, tensors, strict=True):
        flat[seg.offset : seg.offset + seg.nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
    return flat, segments


def locked_copy(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` copied into a host buffer of the package's own and locked in place there, as set-up holds a
    unit; the caller unlocks it (`unpin_in_place`). Raises when CUDA cannot lock it: a benchmark of
    page-locked input must not time a pageable one."""
    locked = host_buffer(flat.numel())
    locked.copy_(flat)
    if not pin_in_place(locked):
        raise RuntimeError("cudaHostRegister of the unit buffer failed")
    return locked


def trained_files(explicit: list[str], trained_dir: str | None) -> Iterator[Path]:
    yield from (Path(p) for p in explicit)
    roots = [Path(trained_dir)] if trained_dir else []
    spec = importlib.util.find_spec("stlpips_pytorch")
    if spec and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    roots.append(Path(torch.hub.get_dir()) / "checkpoints")
    if not explicit:
        for root in roots:
            if root.is_dir():
                yield from sorted(p for ext in ("pth", "pt", "safetensors") for p in root.rglob(f"*.{ext}"))


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else {}


def code_widths(encoded: EncodedUnit) -> dict[str, int]:
    """How many chunks use each code width (b = 8: symbols stored as they are)."""
    rows = encoded.payload[: (encoded.n16 + encoded.n32) * 64].view(torch.int64).reshape(-1, 8)
    return {str(b): n for b, n in enumerate(torch.bincount(rows[:, 7], minlength=9).tolist()) if n}


def encode_report(name: str, flat: torch.Tensor, segments: list[Segment], chunk: int) -> tuple[EncodedUnit, dict]:
    start = time.perf_counter()
    encoded = encode_unit(flat, segments, chunk=chunk)
    encode_s = time.perf_counter() - start
    report = {
        "name": name,
        "raw_mb": flat.numel() / 1e6,
        "stored_mb": encoded.stored_nbytes / 1e6,
        "ratio": round(encoded.ratio, 4),
        "coded_fraction": round(encoded.coded_raw_nbytes / max(flat.numel(), 1), 4),
        "chunks_by_code_bits": code_widths(encoded),
        "encode_s": round(encode_s, 3),
        "encode_mb_s": round(flat.numel() / 1e6 / encode_s, 1),
        "worth_compressing": worth_compressing(encoded),
    }
    print(f"{name}: {report['raw_mb']:.1f} MB, ratio {encoded.ratio:.4f}, encode {encode_s:.2f} s", flush=True)
    return encoded, report


def unregister(payload: torch.Tensor) -> None:
    if payload.is_pinned():
        unpin_in_place(payload)


def kernel_times(fn: Callable[[], object], top: int = 15) -> list[dict]:
    """The CUDA kernels and copies ``fn()`` ran, by total device time (where the device encoder spends it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            rows.append({"name": event.key[:100], "device_ms": round(device_us / 1e3, 3), "calls": event.count})
    return sorted(rows, key=lambda r: -r["device_ms"])[:top]


def device_encode_report(
    flat: torch.Tensor, segments: list[Segment], chunk: int, device: torch.device, reps: int, host: EncodedUnit
) -> dict:
    """``encode_unit(..., device=device)`` end to end (copies both ways included), as ``CompressedCopies.make``
    calls it (unit buffer locked in place, pageable payload that set-up locks afterwards), with a pageable
    input, and with the payload locked in place by the encoder (``pin=True``), last: on the H200 that made
    device allocations fail with "resource already mapped" in some processes and not in others
    (``benchmarks/results/diag_device_encode_h200.json``, ``codec_device_encode_h200.log``), and once it
    fails every later CUDA allocation of the process does. Each variant: a warm-up call, then the median of
    ``reps`` calls; the first failure is recorded and ends the report. The kernel profile is of the set-up
    variant."""
    pinned_flat = locked_copy(flat)
    variants = {
        "pinned_in_pageable_out": (pinned_flat, False),
        "pageable_in_pageable_out": (flat, False),
        "pinned_in_pinned_out": (pinned_flat, True),
    }
    report: dict = {"raw_mb": flat.numel() / 1e6}
    for name, (src, pin) in variants.items():
        try:
            report[name] = encode_variant(src, flat, segments, chunk, device, reps, host, pin)
        except RuntimeError as exc:
            report[name] = f"failed: {exc!r}"
            print(f"  device encode {name} failed: {exc!r}", flush=True)
            break
        print(f"  device encode {name}: {report[name]}", flush=True)
        if name == "pinned_in_pageable_out":
            try:
                report["kernels"] = kernel_times(
                    lambda: encode_unit(pinned_flat, segments, chunk=chunk, device=device, verify=True)
                )
            except Exception as exc:  # the profile is a diagnostic: the timings stand without it
                report["kernels"] = f"profile failed: {exc!r}"
    unpin_in_place(pinned_flat)
    return report


def encode_variant(
    src: torch.Tensor,
    flat: torch.Tensor,
    segments: list[Segment],
    chunk: int,
    device: torch.device,
    reps: int,
    host: EncodedUnit,
    pin: bool,
) -> dict:
    """One variant of `device_encode_report`: seconds, device memory, and whether the payload decodes exactly."""
    times, peaks = [], []
    for rep in range(reps + 1):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        encoded = encode_unit(src, segments, chunk=chunk, device=device, pin=pin, verify=True)
        seconds = time.perf_counter() - start
        if rep:
            times.append(seconds)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        if rep < reps:
            unregister(encoded.payload)
    seconds = statistics.median(times)
    out = torch.zeros(encoded.raw_nbytes, dtype=torch.uint8, device=device)
    decode_into(encoded, encoded.payload.to(device), out)
    result = {
        "s": round(seconds, 4),
        "gbps": round(flat.numel() / seconds / 1e9, 2),
        "payload_pinned": encoded.payload.is_pinned(),
        "device_peak_mib": round(max(peaks) / 2**20, 1),
        "stored_vs_host": round(encoded.stored_nbytes / host.stored_nbytes - 1, 6),
        "exact": segments_equal(out, flat.to(device), segments),
    }
    unregister(encoded.payload)
    return result


def segments_equal(out: torch.Tensor, flat_dev: torch.Tensor, segments: list[Segment]) -> bool:
    return all(
        torch.equal(out[s.offset : s.offset + s.nbytes], flat_dev[s.offset : s.offset + s.nbytes]) for s in segments
    )


def cuda_time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs, each between two CUDA events."""
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def device_report(
    encoded: EncodedUnit, flat: torch.Tensor, segments: list[Segment], device: torch.device, iters: int
) -> dict:
    raw = encoded.raw_nbytes
    flat_dev = flat.to(device)
    payload = encoded.payload.to(device)
    out = torch.empty(raw, dtype=torch.uint8, device=device)
    report: dict = {}
    if device.type == "cpu":
        start = time.perf_counter()
        decode_into(encoded, payload, out)
        report["decode_cpu_s"] = round(time.perf_counter() - start, 3)
        report["exact"] = segments_equal(out, flat_dev, segments)
        return report

    copy_dst = torch.empty_like(flat_dev)
    report["d2d_copy_gbps"] = round(raw / cuda_time_ms(lambda: copy_dst.copy_(flat_dev), iters) / 1e6, 1)
    decode = {}
    for block, warps in CONFIGS:
        if encoded.chunk % block:
            continue
        out.fill_(0)
        decode_into(encoded, payload, out, block=block, num_warps=warps)  # compiles, then checks
        exact = segments_equal(out, flat_dev, segments)
        ms = cuda_time_ms(lambda b=block, w=warps: decode_into(encoded, payload, out, block=b, num_warps=w), iters)
        decode[f"block{block}_warps{warps}"] = {"ms": round(ms, 4), "gbps": round(raw / ms / 1e6, 1), "exact": exact}
    report["decode"] = decode
    best = max(decode.values(), key=lambda r: r["gbps"])
    report["decode_best_gbps"] = best["gbps"]
    report["exact"] = all(r["exact"] for r in decode.values())

    host_raw, host_payload = flat.pin_memory(), encoded.payload.pin_memory()
    raw_ms = cuda_time_ms(lambda: flat_dev.copy_(host_raw, non_blocking=True), max(3, iters // 4))
    coded_ms = cuda_time_ms(lambda: payload.copy_(host_payload, non_blocking=True), max(3, iters // 4))
    decode_ms = raw / best["gbps"] / 1e6
    report["h2d"] = {
        "raw_ms": round(raw_ms, 3),
        "raw_gbps": round(raw / raw_ms / 1e6, 1),
        "payload_ms": round(coded_ms, 3),
        # Streamed rate of raw bytes: copy then decode back to back, or overlapped across units (pipelined).
        "coded_serial_gbps": round(raw / (coded_ms + decode_ms) / 1e6, 1),
        "coded_pipelined_gbps": round(raw / max(coded_ms, decode_ms) / 1e6, 1),
    }
    print(f"  decode {best['gbps']} GB/s, h2d {report['h2d']}, exact {report['exact']}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mb", type=float, default=700.0, help="size of the random unit (700: a Wan2.2 block)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--encode-reps", type=int, default=5, help="timed device encodes per variant (CUDA)")
    parser.add_argument(
        "--device-encode", action=argparse.BooleanOptionalAction, default=True, help="time the device encoder (CUDA)"
    )
    parser.add_argument("--trained", action="append", default=[], help="a state dict file (repeatable)")
    parser.add_argument("--trained-dir", help="a folder to search for state dicts")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)

    # Params of a block ~ 8·dim² + 2·dim·ffn with ffn ≈ 2.7·dim; Wan2.2-A14B's own (5120, 13824) at ~700 MB.
    dim = max(128, round(math.sqrt(args.mb * 1e6 / 2 / 13.4) / 128) * 128)
    ffn = 13824 if dim == 5120 else round(2.7 * dim / 128) * 128
    units = [(f"wan_block_random_dim{dim}_ffn{ffn}", lambda: pack(wan_block_tensors(dim, ffn)))]
    for path in trained_files(args.trained, args.trained_dir):
        state = {k: v for k, v in load_state_dict(path).items() if torch.is_tensor(v) and v.is_floating_point()}
        if state:
            units.append(
                (f"trained_bf16:{path.name}", lambda s=state: pack([v.to(torch.bfloat16) for v in s.values()]))
            )
            units.append((f"trained_native:{path.name}", lambda s=state: pack(list(s.values()))))
    if len(units) == 1:
        print("no trained weights found: pass --trained PATH (see the module docstring)", flush=True)

    results = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "chunk": args.chunk,
        "units": [],
    }
    for name, build in units:
        flat, segments = build()
        encoded, report = encode_report(name, flat, segments, args.chunk)
        if device.type == "cuda":
            torch.zeros(1, device=device)  # the CUDA context exists before any host memory is registered
        report.update(device_report(encoded, flat, segments, device, args.iters))
        if device.type == "cuda" and args.device_encode:  # last: a failure there ends the process's CUDA use
            reps = args.encode_reps
            report["device_encode"] = device_encode_report(flat, segments, args.chunk, device, reps, encoded)
        results["units"].append(report)
        del flat, encoded
    print(json.dumps(results, indent=2))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
