"""Touch most of the machine's free memory once, and say how fast first and second touches were.

Set-up writes every weight into new host buffers (and compression adds its payloads), while flextensor pins
the model's own tensors in place. On a freshly started virtual machine whose memory the host backs lazily
(the device tool's machines run a Firecracker kernel), the first write to each never-used page is slow, and
a set-up that needs new memory pays for it where one that needs none does not. On this repository's CPU
machine a first touch of 14 GB took 11.4 s and a second 0.77 s (``benchmarks/results/pretouch_cpu.json``),
and packing 4.2 GB of weights took 6.89 s on a process's first pass against 0.84 s on its next ones, and
3.35 s on the first pass right after this script had run (``benchmarks/results/first_touch_cpu.log``,
``benchmarks/first_touch_pack.py``): memory freed a while ago is slow again. Run this at the start of a
device call, before set-up figures are measured, to see whether that machine does the same (the report
says how much slower its first touch was) and to take part of that cost out of what follows.

    python benchmarks/pretouch_memory.py --out $OUT/pretouch_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

CHUNK = 1 << 30


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemAvailable in /proc/meminfo: pass --gb")


def touch_all(chunks: list[torch.Tensor], value: int, threads: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda c: c.fill_(value), chunks))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, help="GB to touch (default: 85%% of the available memory)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    nbytes = int(args.gb * 1e9) if args.gb else int(0.85 * available_bytes())
    chunks = [torch.empty(min(CHUNK, nbytes - at), dtype=torch.uint8) for at in range(0, nbytes, CHUNK)]
    first = touch_all(chunks, 1, args.threads)
    second = touch_all(chunks, 2, args.threads)
    result = {
        "command": " ".join(sys.argv),
        "bytes": nbytes,
        "threads": args.threads,
        "first_touch_s": round(first, 3),
        "second_touch_s": round(second, 3),
        "first_touch_gbps": round(nbytes / first / 1e9, 2),
        "second_touch_gbps": round(nbytes / second / 1e9, 2),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
