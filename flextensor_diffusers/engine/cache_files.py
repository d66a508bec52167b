"""Cache files of host copies: written whole or not at all, and never left behind by this process.

A component whose host copies leave RAM and whose bytes are nowhere else (weights built or edited in memory)
waits in one cache file: every unit at a 512-byte aligned offset, in position order (the base first). The file
is written to a temporary name and renamed once complete, so a full disk or a Ctrl-C leaves no half-written
file at its name; its name carries the process id, and the process deletes it when offload is removed, or at
exit.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch

from .errors import FlexTensorError
from .units import ALIGNMENT, Unit, align

#: Cache files this process wrote. Their owners delete them when offload is removed; a process that exits
#: without removing it deletes them here (their names carry its process id: no other process uses them).
_WRITTEN: set[Path] = set()


@atexit.register
def _delete_written() -> None:
    for path in _WRITTEN:
        path.unlink(missing_ok=True)


def file_offsets(units: list[Unit]) -> list[int]:
    """Each unit's offset in a cache file, then the file's length."""
    offsets, offset = [], 0
    for unit in units:
        offsets.append(offset)
        offset = align(offset + unit.nbytes, ALIGNMENT)
    return [*offsets, offset]


def write_cache_file(path: Path, units: list[Unit], hosts: list[torch.Tensor]) -> None:
    """Write ``hosts`` (each unit's host bytes) to ``path`` at `file_offsets`, whole or not at all."""
    offsets = file_offsets(units)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "wb") as file:
            for host, offset in zip(hosts, offsets, strict=False):
                file.seek(offset)
                file.write(memoryview(host.numpy()))
            file.truncate(offsets[-1])
        tmp.replace(path)
        _WRITTEN.add(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FlexTensorError(
            f"could not write the weight cache {path} ({exc}): free space there or choose another cache_dir"
        ) from exc
    except BaseException:  # Ctrl-C while writing (seconds for an expert): no partial file stays behind
        tmp.unlink(missing_ok=True)
        raise


def map_cache_file(path: Path, units: list[Unit]) -> list[torch.Tensor]:
    """Each unit's bytes as a view of a shared mapping of the cache file at ``path``."""
    offsets = file_offsets(units)
    mapped = torch.from_file(str(path), shared=True, size=max(offsets[-1], 1), dtype=torch.uint8)
    return [mapped[offset : offset + unit.nbytes] for unit, offset in zip(units, offsets, strict=False)]


def drop_cached_pages(path: Path) -> None:
    """Ask the kernel to drop the file's cached pages: once read into RAM, a second copy in the page
    cache would only crowd out other memory (it is clean, so dropping it costs nothing)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
