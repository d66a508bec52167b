"""When each unit of a component read back from a cold file arrives: one thread per unit with several units in
flight (the host tier's reads until this bench's commit), against every thread reading the pieces of the units
in flight in turn (`engine.file_reads`, `disk_reads.ReadPools`: the reads now).

A switch waits for the first unit it has not read ahead, then for each next one while the blocks before it
compute. So beside each unit's arrival time this prints when a consumer that computes ``--compute-ratio`` of a
unit's read time per unit (0.31: the H200's Wan2.2-A14B block, 80 ms of compute for a 488 MB payload read at
1.9 GB/s) would finish, and how long it would have waited.

Usage: ``python3 benchmarks/read_order_bench.py --units 16 --unit-mib 256 --repeats 3 --out F``. The file is
written once under ``--folder`` (deleted at the end), and its pages are dropped from the page cache before every
read (``POSIX_FADV_DONTNEED``; ``storage_read_bytes`` from /proc/self/io says what the disk served).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flextensor_diffusers.engine import file_reads
from flextensor_diffusers.engine.file_reads import FileSpan, PieceReader
from flextensor_diffusers.engine.host_memory import host_buffer
from flextensor_diffusers.pipelines import disk_reads


class EndedEarly(Exception):
    pass


def storage_read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_file(path: Path, units: int, unit_bytes: int) -> None:
    block = os.urandom(64 << 20)
    with path.open("wb") as f:
        for _ in range(units):
            left = unit_bytes
            while left:
                n = f.write(block[: min(left, len(block))])
                left -= n
        f.flush()
        os.fsync(f.fileno())


def one_unit(path: Path, index: int, unit_bytes: int, reader: PieceReader) -> None:
    """What a read back does per unit: a new buffer, its bytes read (``reader``'s way), then its checksum."""
    buffer = host_buffer(unit_bytes)
    reader.read([FileSpan(path, index * unit_bytes, memoryview(buffer.numpy()))], lambda p: EndedEarly(p))
    zlib.crc32(memoryview(buffer.numpy()))


def run(path: Path, units: int, unit_bytes: int, how: str, threads: int) -> dict:
    """Read every unit, ``how``: ``unit_per_thread`` (``threads`` units at once, each in one read) or ``pieces``
    (`disk_reads.UNITS_IN_FLIGHT` units at once, each in pieces on ``threads`` threads); every unit's arrival."""
    drop_cache(path)
    before = storage_read_bytes()
    arrivals: list[float] = [0.0] * units
    start = time.perf_counter()

    def timed(index: int, read: Callable[[], None]) -> None:
        read()
        arrivals[index] = time.perf_counter() - start

    if how == "unit_per_thread":
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: timed(i, lambda: one_unit(path, i, unit_bytes, file_reads.SERIAL)), range(units)))
    else:
        with (
            ThreadPoolExecutor(threads) as piece_pool,
            ThreadPoolExecutor(disk_reads.UNITS_IN_FLIGHT) as unit_pool,
        ):
            reader = PieceReader(piece_pool, threads)
            list(unit_pool.map(lambda i: timed(i, lambda: one_unit(path, i, unit_bytes, reader)), range(units)))
    total = max(arrivals)
    return {
        "how": how,
        "threads": threads,
        "arrival_s": [round(a, 4) for a in arrivals],
        "first_arrival_s": round(arrivals[0], 4),
        "all_arrived_s": round(total, 4),
        "GBps": round(units * unit_bytes / total / 1e9, 3),
        "storage_read_bytes": storage_read_bytes() - before,
    }


def consumer(arrivals: list[float], compute_s: float) -> dict:
    """A consumer that needs unit k after computing units 0..k-1, ``compute_s`` each, waiting for what has not
    arrived: when it ends, and how long it waited."""
    t = 0.0
    for arrival in arrivals:
        t = max(t, arrival) + compute_s
    return {"end_s": round(t, 4), "waited_s": round(t - compute_s * len(arrivals), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--unit-mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=disk_reads.READ_THREADS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compute-ratio", type=float, default=0.31)
    parser.add_argument("--folder", default=tempfile.gettempdir())
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    unit_bytes = args.unit_mib << 20
    path = Path(args.folder) / "read_order_bench.bin"
    write_file(path, args.units, unit_bytes)
    try:
        runs = []
        for _ in range(args.repeats):  # alternating, so that a drift of the disk touches both alike
            for how in ("unit_per_thread", "pieces"):
                result = run(path, args.units, unit_bytes, how, args.threads)
                unit_read_s = result["all_arrived_s"] / args.units
                result["consumer"] = consumer(result["arrival_s"], args.compute_ratio * unit_read_s)
                runs.append(result)
                print(
                    f"{how:16s} first {result['first_arrival_s']:.3f} s, all {result['all_arrived_s']:.3f} s "
                    f"({result['GBps']:.2f} GB/s, {result['storage_read_bytes'] / 1e9:.2f} GB from storage), "
                    f"consumer waited {result['consumer']['waited_s']:.3f} s"
                )
    finally:
        path.unlink(missing_ok=True)
    code = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {
        "command": "benchmarks/read_order_bench.py "
        + f"--units {args.units} --unit-mib {args.unit_mib} --threads {args.threads} --repeats {args.repeats}",
        "code": code,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "units": args.units,
        "unit_bytes": unit_bytes,
        "units_in_flight_pieces": disk_reads.UNITS_IN_FLIGHT,
        "compute_ratio": args.compute_ratio,
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
