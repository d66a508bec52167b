"""What page-locking costs per unit-sized host buffer on this machine: ``cudaHostRegister`` of each buffer, then
``cudaHostUnregister``, then unmapping it (the steps a host tier's switch takes for each unit of the component
it moves out, and the reads of the one it brings in take for each unit they read).

Usage (on the GPU machine): ``python3 benchmarks/host_pin_bench.py --units 40 --unit-bytes 488220000 --out F``.
Prints and saves the per-buffer times in ms and their sums in s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flextensor_diffusers.engine.host_memory import host_buffer, pin_in_place, unpin_in_place


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=40)
    parser.add_argument("--unit-bytes", type=int, default=488_220_000)  # a Wan2.2-A14B block's payload
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.cuda.init()
    steps: dict[str, list[float]] = {"fill": [], "register": [], "unregister": [], "unmap": []}
    buffers = []
    for _ in range(args.units):
        start = time.perf_counter()
        buffer = host_buffer(args.unit_bytes)
        buffer.fill_(1)  # pages present, as after a read
        steps["fill"].append(time.perf_counter() - start)
        buffers.append(buffer)
    for buffer in buffers:
        start = time.perf_counter()
        assert pin_in_place(buffer)
        steps["register"].append(time.perf_counter() - start)
    for buffer in buffers:
        start = time.perf_counter()
        unpin_in_place(buffer)
        steps["unregister"].append(time.perf_counter() - start)
    while buffers:
        start = time.perf_counter()
        del buffers[-1]
        steps["unmap"].append(time.perf_counter() - start)
    result = {
        "device": torch.cuda.get_device_name(),
        "units": args.units,
        "unit_bytes": args.unit_bytes,
        "total_s": {k: round(sum(v), 4) for k, v in steps.items()},
        "per_unit_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in steps.items()},
    }
    print(json.dumps(result["total_s"]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
