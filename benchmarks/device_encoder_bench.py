"""Where set-up's device encoder (`engine.device_encoding.DeviceEncoder`) spends its time, unit by unit.

In ``peers_pipeline_17f_h200.json`` the 40-block Wan2.2 stack took 8.9 s to compress (~220 ms a block) where
``encode_profile_h200.json`` measured ~50 ms of device work a block. This runs ``--units`` Wan2.2 blocks
(one packed, page-locked block, encoded ``--units`` times) through `DeviceEncoder` and reports:

* ``device_only_ms``: ``encode_unit(..., payload_on_device=True)`` per unit, nothing brought back;
* ``pipeline_ms``: `DeviceEncoder.encode` per unit, and where its time went (``phases_ms``: the encoder's
  calls on the main thread; the host thread's copy out of staging and its page-locking), summed over units;
* ``beside_packing``: ``--beside-units`` copies of the block packed and locked on set-up's threads, alone,
  and with the encoder coding each as soon as it is packed, as set-up does (``pack_and_encode_s``), to set
  against packing alone plus ``--beside-units`` × ``pipeline_ms``.

At 41acb43 it also timed the host copy split over 8 threads: 83.6 ms a unit against 82.3 ms
(``device_encoder_h200.json``); that variant, a copy of `DeviceEncoder._empty`, is gone.

    python benchmarks/device_encoder_bench.py --out benchmarks/results/device_encoder_h200.json
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from codec_bench import locked_copy, pack, save, wan_block_tensors

from flextensor_diffusers.engine import device_encoding
from flextensor_diffusers.engine.codec import encode_unit, worth_compressing
from flextensor_diffusers.engine.device_encoding import DeviceEncoder, EncodeJob
from flextensor_diffusers.engine.host_memory import unpin_in_place
from flextensor_diffusers.engine.setup_threads import ThreadedWork


def timed_calls(spent: dict[str, float], owner: object, name: str, label: str) -> Callable[[], None]:
    """Wrap ``owner.name`` so that its wall time adds to ``spent[label]``; returns the undo."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def inner(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += (time.perf_counter() - start) * 1e3

    setattr(owner, name, inner)
    return lambda: setattr(owner, name, original)


def time_the_encoder(spent: dict[str, float]) -> list[Callable[[], None]]:
    """Time `DeviceEncoder`'s calls on the main thread and its host thread's whole task into ``spent``
    (ms, summed); returns the undos."""
    return [
        timed_calls(spent, DeviceEncoder, "_encode", "main: encode_unit"),
        timed_calls(spent, DeviceEncoder, "_upload", "main: upload next (waits while that unit is packed)"),
        timed_calls(spent, DeviceEncoder, "_bring_back", "main: staging copy (waits for a free buffer)"),
        timed_calls(spent, DeviceEncoder, "_empty", "host thread: whole"),
    ]


def run_pipeline(flat: torch.Tensor, segments: list, units: int) -> tuple[float, list[torch.Tensor]]:
    jobs = [EncodeJob(i, lambda: flat, segments) for i in range(units)]
    encoder = DeviceEncoder(torch.device("cuda"), lock=True, keep=worth_compressing)
    torch.cuda.synchronize()
    start = time.perf_counter()
    payloads = [done.encoded.payload for done in encoder.encode(jobs)]
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / units, payloads


def beside_packing(source: torch.Tensor, segments: list, units: int) -> dict[str, float]:
    """Set-up's shape: ``units`` copies of the block packed and locked on `PACK_THREADS` threads (one task
    per unit, from pageable sources as a model's parameters are), alone, and with `DeviceEncoder` coding each
    unit as soon as it is packed (what ``Runtime._set_up`` does with compression)."""
    sources = [source.clone() for _ in range(units)]
    packed: list[torch.Tensor | None] = [None] * units

    def pack_one(i: int) -> None:
        packed[i] = locked_copy(sources[i])

    def unpack() -> None:
        for i, buffer in enumerate(packed):
            if buffer is not None:
                unpin_in_place(buffer)
            packed[i] = None

    alone = ThreadedWork(pack_one, list(range(units)), "packing").finish()
    unpack()
    work = ThreadedWork(pack_one, list(range(units)), "packing")
    start = time.perf_counter()

    def packed_unit(i: int) -> torch.Tensor:
        work.wait_for(i)
        return packed[i]

    jobs = [EncodeJob(i, functools.partial(packed_unit, i), segments) for i in range(units)]
    encoder = DeviceEncoder(torch.device("cuda"), lock=True, keep=worth_compressing)
    payloads = [done.encoded.payload for done in encoder.encode(jobs)]
    torch.cuda.synchronize()
    both = time.perf_counter() - start
    packing = work.finish()
    for payload in payloads:
        unpin_in_place(payload)
    unpack()
    return {"units": units, "pack_alone_s": round(alone, 3), "pack_beside_encoder_s": round(packing, 3),
            "pack_and_encode_s": round(both, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=12)
    parser.add_argument("--beside-units", type=int, default=20, help="units packed beside the encoder (0: skip)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.zeros(1, device="cuda")
    source, segments = pack(wan_block_tensors(5120, 13824))
    flat = locked_copy(source)
    result: dict = {"command": " ".join(sys.argv), "torch": torch.__version__, "units": args.units}
    result["torch_threads"] = torch.get_num_threads()

    encode_unit(flat, segments, device="cuda", verify=True, payload_on_device=True)  # compiles the kernels
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.units):
        encode_unit(flat, segments, device="cuda", verify=True, payload_on_device=True)
    torch.cuda.synchronize()
    result["device_only_ms"] = round((time.perf_counter() - start) * 1e3 / args.units, 2)
    print(f"device only {result['device_only_ms']} ms/unit", flush=True)

    spent: dict[str, float] = defaultdict(float)
    undo = [
        *time_the_encoder(spent),
        timed_calls(spent, device_encoding, "host_buffer", "host_buffer (staging and payloads)"),
        timed_calls(spent, device_encoding, "pin_in_place", "host thread: lock"),
    ]
    ms, payloads = run_pipeline(flat, segments, args.units)
    for fn in undo:
        fn()
    result["pipeline_ms"] = round(ms, 2)
    result["phases_ms"] = {k: round(v, 1) for k, v in spent.items()}
    print(f"pipeline {result['pipeline_ms']} ms/unit: {result['phases_ms']}", flush=True)
    for p in payloads:
        unpin_in_place(p)
    del payloads
    if args.beside_units:
        result["beside_packing"] = beside_packing(source, segments, args.beside_units)
        print(f"beside packing: {result['beside_packing']}", flush=True)
    unpin_in_place(flat)
    save(result, args.out)


if __name__ == "__main__":
    main()
