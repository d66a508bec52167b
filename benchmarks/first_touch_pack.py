"""Pack model-like weights into new host buffers, several times in one process: is the first pass slow?

Builds ``--units`` units of ``--tensors`` BF16 tensors of 25 MiB each (random, as a model with random weights
is), then packs every unit into a new flat buffer on ``--threads`` threads, once per named variant, in
order: ``thp`` (`host_memory.host_buffer`, advised to use transparent huge pages) or ``empty``
(``torch.empty``, 4 KiB pages). A first pass far slower than the next ones, whatever the variant, means
the machine is slow to hand out memory no process has used yet (a lazily backed virtual machine), not
that one kind of buffer is slow. ``RssAnon`` and ``AnonHugePages`` (MiB) follow each pass.

    python benchmarks/first_touch_pack.py empty thp empty thp
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.engine.host_memory import host_buffer

TENSOR_BYTES = 25 << 20


def memory_mib() -> tuple[int, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(status["RssAnon"].split()[0]) // 1024, int(meminfo["AnonHugePages"].split()[0]) // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", choices=["thp", "empty"])
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    model = [
        [torch.randn(TENSOR_BYTES // 2).to(torch.bfloat16) for _ in range(args.tensors)] for _ in range(args.units)
    ]
    print(f"model built in {time.perf_counter() - start:.2f} s", flush=True)
    gb = args.units * args.tensors * TENSOR_BYTES / 1e9
    for variant in args.variants:
        make = host_buffer if variant == "thp" else (lambda n: torch.empty(n, dtype=torch.uint8))

        def pack(unit: list[torch.Tensor], make=make) -> torch.Tensor:  # noqa: ANN001 - the loop's buffer maker
            flat = make(sum(t.numel() * 2 for t in unit))
            offset = 0
            for t in unit:
                flat[offset : offset + t.numel() * 2].copy_(t.view(torch.uint8))
                offset += t.numel() * 2
            return flat

        start = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            packed = list(pool.map(pack, model))
        seconds = time.perf_counter() - start
        rss, huge = memory_mib()
        print(f"{variant:>5}: {seconds:.3f} s, {gb / seconds:.2f} GB/s, RssAnon {rss} MiB, AnonHugePages {huge} MiB")
        del packed


if __name__ == "__main__":
    main()
