"""How fast this machine's disk reads a large file, cold, by several methods: is the host tier's 1.76 GB/s
(``benchmarks/results/host_tier_05890d0_h200.json``: buffered ``preadv``, 8 threads) the disk's limit or the method's?

Issue 15's 40-step overhead is set by how long a switch waits for the next expert from disk, so the read
method matters as much as the plan. Each method reads the whole file once after the page cache is dropped
(``/proc/sys/vm/drop_caches``, root; else ``posix_fadvise(DONTNEED)`` on the file):

* ``buffered``: ``preadv`` through the page cache (what `disk_reads` does today), ``threads`` at once;
* ``direct``: ``O_DIRECT`` reads into page-aligned buffers, no page-cache copy, ``threads`` at once.

    python benchmarks/disk_bench.py --gb 8 --out $OUT/disk_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1 << 20


def drop_cache(path: Path) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def write_file(path: Path, nbytes: int) -> float:
    block = os.urandom(64 * MiB)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def read_file(path: Path, direct: bool, threads: int, chunk: int) -> float:
    """Read the whole file in ``chunk``-byte pieces, ``threads`` at once; each thread reuses one buffer."""
    size = path.stat().st_size
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs

    def read_range(worker: int) -> None:
        view = memoryview(buffers[worker])
        for offset in range(worker * chunk, size, threads * chunk):
            want = min(chunk, size - offset)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], offset + got)
                if n <= 0:
                    raise OSError(f"short read at {offset + got}")
                got += n

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read_range, range(threads)))
        return time.perf_counter() - start
    finally:
        os.close(fd)
        for b in buffers:
            b.close()


METHODS = [
    ("buffered", 8, 64),
    ("buffered", 16, 64),
    ("direct", 1, 64),
    ("direct", 4, 16),
    ("direct", 8, 16),
    ("direct", 16, 16),
    ("direct", 32, 8),
    ("direct", 8, 64),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=8.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    nbytes = int(args.gb * 1e9) // (64 * MiB) * (64 * MiB)
    path = args.dir / "disk_bench.bin"
    result: dict = {"command": " ".join(sys.argv), "bytes": nbytes, "runs": []}
    try:
        write_s = write_file(path, nbytes)
        result["write_GBps"] = round(nbytes / write_s / 1e9, 3)
        print(f"write {nbytes / 1e9:.1f} GB: {result['write_GBps']} GB/s", flush=True)
        for kind, threads, chunk_mib in METHODS:
            how = drop_cache(path)
            try:
                seconds = read_file(path, kind == "direct", threads, chunk_mib * MiB)
            except OSError as exc:
                result["runs"].append({"method": kind, "threads": threads, "error": str(exc)})
                print(f"{kind} x{threads}: {exc}", flush=True)
                continue
            run = {
                "method": kind,
                "threads": threads,
                "chunk_MiB": chunk_mib,
                "cache_drop": how,
                "seconds": round(seconds, 3),
                "GBps": round(nbytes / seconds / 1e9, 3),
            }
            result["runs"].append(run)
            print(f"{kind} x{threads} {chunk_mib} MiB: {run['GBps']} GB/s ({how})", flush=True)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
