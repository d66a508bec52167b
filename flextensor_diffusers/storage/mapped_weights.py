"""Weights that are still the pages of their safetensors file, found without reading a byte of them.

``from_pretrained`` on a local folder gives tensors that view a private mapping of each weight file (safetensors
maps the whole file). Such a tensor's bytes *are* the file's as long as no page of it was written since: a write
(a fused LoRA, ``load_state_dict``) makes a private, anonymous copy of the page. So a unit whose every tensor views
the place its file holds it, with no page of it written (`/proc/self/pagemap`: present and not a file page, or
swapped out, which only anonymous pages of such a mapping are), can wait in its weight files with nothing packed,
compared or read (`raw_home.WeightFilesHome.stand_in_as_loaded`): its first reads are those of the model's first
forwards. The first enable under a host budget with compression then returns without reading the weights (issue 48).

Which file a mapping is of comes from `/proc/self/maps` for both the tensor's mapping and the raw home's own mapping
of the file, so that both are named the same way (the device and inode the kernel maps, on an overlay filesystem
too); anything not found there, or unreadable, answers "not the file's", and the unit is packed and compared instead.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine.units import PackedTensor, Unit
from .weight_files import SAFETENSORS_DTYPES, TensorEntry, TensorPlace

_PAGE = mmap.PAGESIZE
_PRESENT, _SWAPPED, _FILE_PAGE = np.uint64(1 << 63), np.uint64(1 << 62), np.uint64(1 << 61)


@dataclass(frozen=True)
class FileMapping:
    """One line of `/proc/self/maps` that maps a file: its addresses, the file offset at ``start``, and the file
    (``device`` as the kernel writes it, ``inode``)."""

    start: int
    end: int
    offset: int
    device: str
    inode: int

    def file_offset(self, address: int) -> int:
        return self.offset + address - self.start


class MappedFiles:
    """The process's file mappings, as `/proc/self/maps` lists them when this is made."""

    def __init__(self) -> None:
        self._mappings: list[FileMapping] = []
        self._starts: list[int] = []
        self._read()

    def _read(self) -> None:
        mappings = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if len(fields) >= 6 and fields[4] != "0":
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        mappings.append(FileMapping(start, end, int(fields[2], 16), fields[3], int(fields[4])))
        except (OSError, ValueError):
            mappings = []
        self._mappings = sorted(mappings, key=lambda m: m.start)
        self._starts = [m.start for m in self._mappings]

    def find(self, address: int) -> FileMapping | None:
        """The file mapping that held ``address`` when the lines were read; None when none did."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._mappings[i].end:
            return self._mappings[i]
        return None

    def holds_file_bytes(self, tensor: torch.Tensor, nbytes: int, home: torch.Tensor, start: int) -> bool:
        """Whether ``tensor``'s ``nbytes`` are, unwritten, the bytes at ``start`` of the file the raw home's
        mapping ``home`` maps whole (from its first byte). Both mappings must have been made before these lines
        were read, and be alive (so that no other mapping is at their addresses): ``tensor`` is one the model was
        loaded with, and the raw home maps every file before it reads them (`WeightFilesHome.stand_in_as_loaded`);
        an address may otherwise show a mapping unmapped since (a file the model was loaded from, whose tensors
        moved), or none."""
        address = tensor.data_ptr()
        mine, theirs = self.find(address), self.find(home.data_ptr())
        if theirs is not None and theirs.file_offset(home.data_ptr()) != 0:
            return False
        if mine is None or theirs is None or address + nbytes > mine.end:
            return False
        if (mine.device, mine.inode) != (theirs.device, theirs.inode):
            return False
        return mine.file_offset(address) == start and unwritten(address, nbytes)


def unwritten(address: int, nbytes: int) -> bool:
    """Whether no page of ``[address, address + nbytes)`` (of a private file mapping) was written (`any_written`)."""
    return not any_written([(address, nbytes)])


def any_written(ranges: list[tuple[int, int]]) -> bool:
    """Whether any page of the address ``ranges`` (of private file mappings) was written: present and no longer the
    file's page, or swapped out, which only a written page of such a mapping can be (`/proc/self/pagemap`'s flags,
    readable without privileges). True where that file cannot be read, so that a caller packs or moves the unit,
    which is always right."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            for address, nbytes in ranges:
                if nbytes <= 0:
                    continue
                first, last = address // _PAGE, (address + nbytes - 1) // _PAGE
                pagemap.seek(first * 8)
                flags = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
                if flags.size != last - first + 1:
                    return True
                written = ((flags & _PRESENT) != 0) & ((flags & _FILE_PAGE) == 0)
                if np.any(written | ((flags & _SWAPPED) != 0)):
                    return True
    except (OSError, ValueError):
        return True
    return False


def mapped_places(
    unit: Unit,
    entries: dict[str, TensorEntry],
    files: MappedFiles,
    mapping: Callable[[Path], torch.Tensor],
) -> list[TensorPlace] | None:
    """Where each tensor of ``unit`` (not packed) is in the files of ``entries``, when every one the files hold is
    those very bytes (`MappedFiles.holds_file_bytes`), laid out as the file holds it; tensors the files lack must be
    non-persistent buffers (kept in RAM by the stand-in). None otherwise. ``mapping(path)``: the raw home's mapping of
    that file."""
    if unit.stored is not None or unit.wrappers:
        return None
    places = []
    for packed in unit.tensors:
        tensor = packed.tensor.data
        if packed.inside or tensor.device.type != "cpu" or tensor.dtype != packed.dtype or not _plain(packed):
            return None
        keys = [rel if unit.index < 0 else f"{unit.name}.{rel}" for rel in packed.names]
        entry = next((entries[k] for k in keys if k in entries), None)
        if entry is None:
            if packed.persistent:
                return None
            places.append(TensorPlace(packed.offset, packed.nbytes, None))
            continue
        if SAFETENSORS_DTYPES.get(packed.dtype) != entry.dtype or entry.nbytes != packed.nbytes:
            return None
        if not files.holds_file_bytes(tensor, packed.nbytes, mapping(entry.file), entry.start):
            return None
        places.append(TensorPlace(packed.offset, packed.nbytes, entry))
    return places


def _plain(packed: PackedTensor) -> bool:
    """Contiguous in its flat buffer and as loaded, its span exactly its elements: a file's layout."""
    tensor = packed.tensor.data
    span = tensor.numel() * tensor.element_size()
    same = tuple(tensor.shape) == tuple(packed.shape) and tensor.is_contiguous()
    return same and _row_major(packed.shape, packed.stride) and span == packed.nbytes


def _row_major(shape: tuple[int, ...] | torch.Size, stride: tuple[int, ...]) -> bool:
    """Strides of a C-contiguous layout (dimensions of size 1 may have any stride)."""
    expected = 1
    for size, step in zip(reversed(tuple(shape)), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def kept_bytes(packed: PackedTensor) -> torch.Tensor:
    """A tensor the files lack (a non-persistent buffer) as bytes of its own in RAM, for a stand-in."""
    return packed.tensor.data.reshape(-1).view(torch.uint8).clone()
