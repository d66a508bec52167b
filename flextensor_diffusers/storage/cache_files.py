"""Cache files of host copies: written whole or not at all, and never left behind by this process.

A component whose host copies leave RAM and whose bytes are nowhere else (weights built or edited in memory)
waits in one cache file: every unit at a 512-byte aligned offset, in position order (the base first). The file
is written to a temporary name and renamed once complete, so a full disk or a Ctrl-C leaves no half-written
file at its name; its name carries the process id, and the process deletes it when offload is removed, or at
exit. Every file here is made and opened again as `private_files` says (new, 0600, never through a link, in a
folder of this user's that `config.cache_folder` checked).

`RawCacheFile` is the other kind: the raw home of a model kept compressed only (``raw_copies="disk"``), written
unit by unit while set-up encodes, through a shared mapping. Each unit's room is reserved on disk
(``posix_fallocate``) before a byte is copied there, so a full disk is a clear error, never a fault on a page
the file system could not give.
"""

from __future__ import annotations

import atexit
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ..engine.errors import FlexTensorError
from ..engine.units import ALIGNMENT, Unit, align
from .private_files import create_new, fresh_file, map_descriptor, map_own_file, temporary_name

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
    """Write ``hosts`` (each unit's host bytes) to ``path`` at `file_offsets`, whole or not at all: to a new
    private file at a name of its own (`private_files.temporary_name`), renamed over ``path`` once complete."""
    offsets = file_offsets(units)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb", opener=create_new) as file:
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


class RawCacheFile:
    """The raw bytes of a model's units kept compressed, in one file at ``where`` (each unit at its
    `file_offsets` offset), written as set-up goes: a `raw_homes.RawHome`. The file is created sparse at
    once, new and private (`private_files.fresh_file`: whatever was at ``where`` is replaced, never followed),
    mapped through its descriptor, and each unit's room reserved when it arrives; it is deleted when offload
    is removed, or at exit."""

    def __init__(self, where: Path, units: list[Unit]) -> None:
        self.where = where
        self._offsets = file_offsets(units)
        self._mapped: torch.Tensor | None = None
        self._fd: int | None = None

    def _open(self) -> torch.Tensor:
        if self._mapped is None:
            try:
                self._fd = fresh_file(self.where)
                _WRITTEN.add(self.where)
                os.ftruncate(self._fd, max(self._offsets[-1], 1))
            except OSError as exc:
                raise self._error(exc) from exc
            self._mapped = map_descriptor(self._fd, max(self._offsets[-1], 1), shared=True)
        return self._mapped

    def _error(self, exc: OSError) -> FlexTensorError:
        return FlexTensorError(
            f"could not write the raw weights to {self.where} ({exc}): free space there or choose another cache_dir"
        )

    def prepare(self, position: int, unit: Unit) -> None:
        """Nothing to do ahead: `stand_in` writes the unit's bytes."""

    def stand_in_as_loaded(self, position: int, unit: Unit) -> None:
        """A cache file holds nothing before `stand_in` writes it: every unit is packed first."""
        return None

    def forget(self, position: int) -> None:
        """`stand_in_as_loaded` gave nothing to forget."""

    def stand_in(self, position: int, unit: Unit) -> torch.Tensor:
        """Copy ``unit``'s bytes (``unit.host``) into its room in the file; that room, as a tensor."""
        mapped = self._open()
        start = self._offsets[position]
        if unit.nbytes and hasattr(os, "posix_fallocate"):
            try:
                assert self._fd is not None
                os.posix_fallocate(self._fd, start, unit.nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot reserve: write on
                    raise self._error(exc) from exc
        room = mapped[start : start + unit.nbytes]
        host = unit.host
        assert isinstance(host, torch.Tensor), f"{unit.name} moves to the cache file from a flat buffer"
        room.copy_(host)
        return room

    def stand_in_without_bytes(self, position: int, unit: Unit) -> None:
        """The file keeps the raw bytes of every unit kept compressed: none waits as its payload only."""
        return None

    def ram_bytes(self) -> int:
        return 0

    def moved_if_written(self, position: int, unit: Unit, raw: Callable[[], torch.Tensor]) -> None:
        """Edits land in the file itself (a shared mapping): nothing moves."""
        return None

    def close(self) -> None:
        self._mapped = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.where.unlink(missing_ok=True)
        _WRITTEN.discard(self.where)


def map_cache_file(path: Path, units: list[Unit]) -> list[torch.Tensor]:
    """Each unit's bytes as a view of a shared mapping of the cache file at ``path``, opened without following a
    link and checked to be this user's regular file (`private_files.map_own_file`)."""
    offsets = file_offsets(units)
    try:
        mapped = map_own_file(path, max(offsets[-1], 1), shared=True)
    except OSError as exc:  # a link or another user's file at its name: never mapped
        raise FlexTensorError(f"cannot map the weight cache {path} ({exc}): choose another cache_dir") from exc
    return [mapped[offset : offset + unit.nbytes] for unit, offset in zip(units, offsets, strict=False)]


def drop_cached_pages_later(path: Path) -> None:
    """`drop_cached_pages` on a thread of its own: for a file of an expert's size it takes the caller most of a
    second (0.65 and 1.0 s in the two switches of the H200's measured generation, 2026-12-05), which a component
    that has just taken its last unit back must not wait for."""
    threading.Thread(target=drop_cached_pages, args=(path,), name="flextensor-drop-pages", daemon=True).start()


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
