"""`WeightFilesHome`: a component's own safetensors files as the place its raw bytes wait while RAM holds
compressed copies only (``raw_copies="none"`` or ``"disk"``; a host budget with compression chooses ``"none"``).

Set-up hands each unit over as soon as its compressed copy is made (`RawHomes.settle`): when the files hold
the unit's tensors byte for byte (`weight_files.match_unit`: same dtype and size; then every byte compared, on
the packing thread right after the unit is packed, since its compressed copy is made from the bytes in RAM and
its raw bytes would then be the file's), its tensors become views of private, copy-on-write mappings of those
files, and its RAM buffer is freed; nothing is written. A unit the files do not hold (converted at load, edited
since, a checkpoint elsewhere) goes to the *fallback* instead, unit by unit, so a component may wait partly in
each: with ``raw_copies="none"`` it keeps its payload only (`payloads_only.PayloadsOnlyHome`: nothing written),
with ``"disk"`` its raw bytes go to a cache file in ``cache_dir`` (`RawCacheFile`).

An edit made later through those views lands in private copy-on-write pages: anonymous memory, which the host
budget does not see. After every edit the home looks for such pages (`mapped_weights.any_written`: present and
no longer the file's, or swapped out) and moves each unit that has any to the fallback (`moved_if_written`), giving the
written pages back to the kernel once the unit's tensors point at their new place.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ..engine.units import Unit
from .cache_files import RawCacheFile, drop_cached_pages
from .host_bytes import DecodedPayload, Flat, InPayloadsOnly, InRam
from .mapped_weights import MappedFiles, any_written, kept_bytes, mapped_places
from .payloads_only import PayloadsOnlyHome
from .raw_homes import Moved, at_home
from .read_guard import NoRawBytes
from .weight_files import (
    FileStamp,
    NotSafetensors,
    ScatteredHost,
    TensorEntry,
    TensorPlace,
    changed_file,
    checkpoints,
    match_unit,
    read_entries,
    scattered_host,
    truncated_file,
    unit_difference,
)

logger = logging.getLogger(__name__)


class WeightFilesHome:
    """A `raw_homes.RawHome` over the checkpoints in ``folders`` (see the module docstring); ``fallback`` is
    the cache file for units they do not hold, created at the first such unit."""

    def __init__(self, component: str, folders: list[Path], fallback: RawCacheFile | PayloadsOnlyHome) -> None:
        self.component = component
        self.where = folders[0]
        self._checkpoints = [files for folder in folders for files in checkpoints(folder)]
        self._entries: list[dict[str, TensorEntry] | None] = [None] * len(self._checkpoints)
        self._fallback = fallback
        self._fallback_used = False
        self._maps: dict[Path, torch.Tensor] = {}
        self.stamps: dict[Path, FileStamp] = {}
        self._kept: dict[int, int] = {}  # per position: bytes its stand-in keeps in RAM (tensors the files lack)
        self._ranges: dict[int, list[tuple[int, int]]] = {}  # per position: its tensors' addresses in the mappings
        self._found: dict[int, tuple[list[TensorPlace] | None, str]] = {}  # per position: `prepare`'s answer
        self._lock = threading.Lock()  # `prepare` runs on packing threads
        self._files: MappedFiles | None = None  # the process's file mappings, read once all files are mapped

    def _entries_of(self, index: int) -> dict[str, TensorEntry]:
        with self._lock:
            entries = self._entries[index]
            if entries is None:
                entries = {}
                try:
                    for path in self._checkpoints[index]:
                        entries.update(read_entries(path))
                except (OSError, NotSafetensors) as exc:
                    logger.info("%s: %s cannot hold raw weights (%s)", self.component, self._checkpoints[index][0], exc)
                    entries = {}
                self._entries[index] = entries
            return entries

    def _mapping(self, path: Path) -> torch.Tensor:
        """A private mapping of the weight file ``path`` (one per file), stamped when first mapped."""
        with self._lock:
            if path not in self._maps:
                self.stamps[path] = FileStamp.take(path)
                size = self.stamps[path].size
                self._maps[path] = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            return self._maps[path]

    def prepare(self, position: int, unit: Unit) -> None:
        """Find ``unit``'s tensors in the first checkpoint that holds them all, every byte equal to the unit's
        in RAM (its compressed copy is made from those): on a packing thread, while its bytes are at hand."""
        fds: dict[Path, int] = {}
        found: tuple[list[TensorPlace] | None, str] = (None, "no safetensors checkpoint in its folder")
        try:
            for index in range(len(self._checkpoints)):
                places, reason = match_unit(unit, self._entries_of(index), fds)
                if places is not None:
                    reason = unit_difference(unit, places, self._mapping)
                    found = (places, "") if reason is None else (None, reason)
                    break
                found = (None, reason)
        except (OSError, NotSafetensors) as exc:
            found = (None, str(exc))
        finally:
            for fd in fds.values():
                os.close(fd)
        self._found[position] = found

    def stand_in_as_loaded(self, position: int, unit: Unit) -> Flat | None:
        """Before ``unit`` is packed: its tensors in its weight files, when every one they hold is already a view of
        those very bytes, none written since (`mapped_weights.mapped_places`): nothing is read, compared nor packed,
        and the tensors the files lack are copied into RAM. None otherwise (it is packed and compared)."""
        if self._files is None:  # every file mapped first: the mappings read next are those looked up
            for index in range(len(self._checkpoints)):
                for path in {entry.file for entry in self._entries_of(index).values()}:
                    self._mapping(path)
            self._files = MappedFiles()
        for index in range(len(self._checkpoints)):
            places = mapped_places(unit, self._entries_of(index), self._files, self._mapping)
            if places is None:
                continue
            by_key = {(p.offset, p.offset + p.nbytes): p for p in unit.tensors}
            views = {
                p.key: kept_bytes(by_key[p.key])
                if p.entry is None
                else self._maps[p.entry.file][p.entry.start : p.entry.start + p.nbytes]
                for p in places
            }
            self._kept[position] = sum(p.nbytes for p in places if p.entry is None)
            self._ranges[position] = [
                (self._maps[p.entry.file].data_ptr() + p.entry.start, p.nbytes) for p in places if p.entry
            ]
            return ScatteredHost(views, kept_bytes=self._kept[position])
        return None

    def forget(self, position: int) -> None:
        """The stand-in `stand_in_as_loaded` gave for ``position`` is not used: what it recorded goes."""
        self._kept.pop(position, None)
        self._ranges.pop(position, None)

    def stand_in(self, position: int, unit: Unit) -> Flat:
        """The unit's tensors in its weight files when `prepare` found them all there, byte for byte; else the
        fallback's stand-in (a room of the cache file, written there; or, payloads only, none)."""
        if position not in self._found:  # packed before this home was told (not on the set-up path)
            self.prepare(position, unit)
        places, reason = self._found.pop(position)
        if places is not None:
            for place in places:
                if place.entry is not None:
                    self._mapping(place.entry.file)
            buffer = unit.buffer
            assert buffer is not None, f"{unit.name} moves to its weight files from a flat buffer"
            stand_in = scattered_host(places, buffer, self._maps)
            self._kept[position] = stand_in.kept_bytes
            self._ranges[position] = [
                (self._maps[p.entry.file].data_ptr() + p.entry.start, p.nbytes) for p in places if p.entry
            ]
            return stand_in
        if not self._fallback_used:
            where = "as its payload only" if isinstance(self._fallback, PayloadsOnlyHome) else "in a cache file"
            logger.info("%s: %s waits %s (%s), not in its weight files", self.component, unit.name, where, reason)
            self._fallback_used = True
        return self._fallback.stand_in(position, unit)

    def stand_in_without_bytes(self, position: int, unit: Unit) -> NoRawBytes | None:
        """For a unit the files do not hold (edited since): the fallback's answer (payloads only: a `NoRawBytes`;
        a cache file keeps raw bytes: None)."""
        return self._fallback.stand_in_without_bytes(position, unit)

    def ram_bytes(self) -> int:
        return sum(self._kept.values()) + self._fallback.ram_bytes()

    def moved_if_written(self, position: int, unit: Unit, raw: Callable[[], torch.Tensor]) -> Moved | None:
        """After an edit: when ``unit``'s views into the files were written (copy-on-write pages), its current
        bytes (``raw()``) in the fallback (its room in the cache file, or payloads only: in RAM until its payload is
        made again from them), and what gives the written pages back once its tensors point there; None when
        nothing was written (or it waits in the fallback already)."""
        ranges = self._ranges.get(position)
        if ranges is None or not any_written(ranges):
            return None
        current = raw()
        stand_in = self._fallback.stand_in(position, dataclasses.replace(unit, stored=InRam(current)))
        del self._ranges[position]
        self._kept.pop(position, None)
        logger.info("%s: %s was edited; its raw bytes leave its weight files", self.component, unit.name)
        stored = at_home(stand_in)
        if isinstance(stored, InPayloadsOnly):  # its payload is made again from ``current`` before it closes
            stored = DecodedPayload(current, stored)
        return Moved(stored, lambda: give_back(ranges))

    def changed_file(self) -> Path | None:
        """The first weight file that changed since its units moved there (None: all as stamped)."""
        return changed_file(self.stamps.values())

    def truncated_file(self) -> Path | None:
        """A weight file now shorter than when it was stamped: its mapped views would fault (SIGBUS)."""
        return truncated_file(self.stamps.values())

    def close(self) -> None:
        """Offload removed (every unit restored from here): the fallback file goes, the files' pages that the
        restore read leave the page cache."""
        self._maps = {}
        self._fallback.close()
        for path in self.stamps:
            drop_cached_pages(path)


_PAGE = mmap.PAGESIZE


def give_back(ranges: list[tuple[int, int]]) -> None:
    """Drop the written pages of ``ranges`` (``MADV_DONTNEED``: a private mapping's page then reads the file's
    again), whole pages inside each range only: a page shared with a neighbouring tensor stays as it is."""
    libc = ctypes.CDLL(None, use_errno=True)
    for address, nbytes in ranges:
        start = -(-address // _PAGE) * _PAGE
        end = (address + nbytes) // _PAGE * _PAGE
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
