"""Where the device encoder's "CUDA error: resource already mapped" comes from (issue 16, H200 only).

``encode_unit(..., device="cuda")`` failed on the H200 on Wan2.2-sized units at its first device allocation
(``benchmarks/results/codec_device_encode_failed_h200.log``). An allocation does not map anything, so the
error is most likely a CUDA runtime call's error left behind in the runtime's per-thread "last error" by an
earlier call that Python never checked. This script runs the encoder in fresh processes, one per variant
(input page-locked or not, payload page-locked or not, unit size, ``CUDA_LAUNCH_BLOCKING``), and reads the
runtime's last error (``cudaPeekAtLastError`` through the ``libcudart`` that torch loaded) before and after
every step of the encoder: the first step after which it is set is the culprit.

    python benchmarks/diag_device_encode.py --out $OUT/diag_device_encode_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    # name: (input, pin the payload, megabytes)
    "pageable_in_pageable_out": ("pageable", False, 700.0),
    "pageable_in_pinned_out": ("pageable", True, 700.0),
    "pin_memory_in_pinned_out": ("pin_memory", True, 700.0),
    "registered_in_pinned_out": ("registered", True, 700.0),
    "registered_in_pinned_out_small": ("registered", True, 8.0),
}


class Runtime:
    """The CUDA runtime(s) torch loaded, for their per-thread last error."""

    def __init__(self) -> None:
        paths = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libcudart" in os.path.basename(path) and path not in paths:
                    paths.append(path.removesuffix(" (deleted)"))
        self.libs = [ctypes.CDLL(p) for p in paths]
        for lib in self.libs:
            lib.cudaGetErrorName.restype = ctypes.c_char_p
        self.paths = paths

    def peek(self) -> list[str]:
        """Each runtime's last error, without clearing it ("" when none)."""
        out = []
        for lib in self.libs:
            code = lib.cudaPeekAtLastError()
            out.append("" if code == 0 else f"{code}:{lib.cudaGetErrorName(code).decode()}")
        return out


def run_variant(name: str, reps: int) -> dict:
    import torch

    from benchmarks.codec_bench import pack, wan_block_tensors
    from flextensor_diffusers.engine import codec
    from flextensor_diffusers.engine.host_memory import host_buffer, pin_in_place, unpin_in_place

    source, pin, mb = VARIANTS[name]
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    runtime = Runtime()
    events: list[dict] = []

    def note(step: str) -> None:
        errors = runtime.peek()
        if any(errors) and not any(e["errors"] == errors for e in events):
            events.append({"after": step, "errors": errors})

    def traced(fn_name: str) -> None:
        original = getattr(codec, fn_name)

        def wrapper(*args: object, **kwargs: object) -> object:
            note(f"before {fn_name}")
            result = original(*args, **kwargs)
            note(f"after {fn_name}")
            return result

        setattr(codec, fn_name, wrapper)

    for fn_name in ("_fetch", "_encode_slice", "_download", "_encode_class", "pin_in_place"):
        traced(fn_name)
    dim = 5120 if mb >= 700 else 512
    ffn = 13824 if dim == 5120 else 1408
    flat, segments = pack(wan_block_tensors(dim, ffn))
    note("pack")
    if source == "pin_memory":
        flat = flat.pin_memory()
    elif source == "registered":
        buffer = host_buffer(flat.numel())
        buffer.copy_(flat)
        flat = buffer
        registered = pin_in_place(flat)
        note(f"register input ({registered})")
    note("input ready")
    result: dict = {"variant": name, "mb": round(flat.numel() / 1e6, 1), "runtimes": runtime.paths}
    try:
        for rep in range(reps):
            encoded = codec.encode_unit(flat, segments, device="cuda", pin=pin)
            note(f"encode {rep} returned (payload pinned: {encoded.payload.is_pinned()})")
            out = torch.empty(encoded.raw_nbytes, dtype=torch.uint8, device="cuda")
            codec.decode_into(encoded, encoded.payload.to("cuda"), out)
            device_flat = flat.to("cuda")
            exact = all(
                torch.equal(out[s.offset : s.offset + s.nbytes], device_flat[s.offset : s.offset + s.nbytes])
                for s in segments
            )
            note(f"decode {rep} checked")
            if encoded.payload.is_pinned():
                unpin_in_place(encoded.payload)
                note(f"payload {rep} unregistered")
            result[f"rep{rep}_exact"] = exact
            del encoded, out, device_flat
        result["ok"] = True
    except Exception as exc:  # the point of the script: where and how it fails
        result["ok"] = False
        result["error"] = repr(exc)
        result["traceback"] = traceback.format_exc().splitlines()[-12:]
    result["last_error_events"] = events
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", help="run this one variant in this process (used by the driver)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=90)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.reps)), flush=True)
        return
    results = []
    # Every variant with launches made synchronous (an error surfaces at its own call), and the one codec_bench
    # ran when it failed (page-locked input and payload) also as it ran there.
    runs = [(name, "1") for name in VARIANTS] + [("pin_memory_in_pinned_out", "0")]
    for name, blocking in runs:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING=blocking)
        cmd = [sys.executable, __file__, "--variant", name, "--reps", str(args.reps)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"variant": name, "ok": False}
            result["returncode"] = proc.returncode
            result["stderr_tail"] = proc.stderr.splitlines()[-8:]
        except subprocess.TimeoutExpired:
            result = {"variant": name, "ok": False, "error": f"timed out after {args.timeout} s"}
        result["cuda_launch_blocking"] = blocking
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
