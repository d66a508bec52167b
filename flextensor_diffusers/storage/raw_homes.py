"""Compressed only (``raw_copies="disk"``): the raw bytes of units kept compressed wait outside RAM, in a `RawHome`.

Set-up hands each unit over as soon as its compressed copy is made (`RawHomes.settle`): its tensors then view a
stand-in in the home (views of the weight files a pipeline was loaded from, or a room in one cache file) and its
RAM buffer is freed, so RAM holds compressed copies, plus the raw bytes of the base and of units not worth
compressing. Every load of a homed unit decodes its compressed copy; its raw bytes are read only by edits,
``state_dict`` and removal. After an edit, units whose stand-in now holds their bytes in anonymous memory (written
copy-on-write pages of a file mapping) move within the home (`RawHomes.rehome_written`).

`HostCopies` owns the one `RawHomes` of a model compressed only; this module knows nothing of where the home is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from ..engine.binding import Binding
from ..engine.units import Unit, pin_unit, unpin_unit
from .host_bytes import AtRawHome, Flat


@dataclasses.dataclass(frozen=True)
class Moved:
    """A unit's raw bytes moved within its raw home (`RawHome.moved_if_written`): the new stand-in, and what to
    call once the unit's tensors point at it (the old place's memory goes back)."""

    stand_in: Flat
    release: Callable[[], None]


class RawHome(Protocol):
    """Where the raw bytes of units kept compressed wait outside RAM: the weight files a component was loaded from
    (the pipelines' `WeightFilesHome`), or one cache file (`cache_files.RawCacheFile`)."""

    #: The file or folder, for reports.
    where: Path

    def prepare(self, position: int, unit: Unit) -> None:
        """``unit`` was just packed (``unit.host`` holds its bytes), on a packing thread: work for `stand_in` that
        can run there, in parallel with other units' (comparing its bytes with a file's, say)."""
        ...

    def stand_in_as_loaded(self, position: int, unit: Unit) -> Flat | None:
        """Before ``unit`` is packed (its tensors still as loaded): a stand-in as `stand_in` gives, when the home holds
        its bytes where its tensors already view them (`mapped_weights`), read and written nothing; None: it is
        packed, and handed over by `stand_in`."""
        ...

    def stand_in(self, position: int, unit: Unit) -> Flat:
        """A stand-in for ``unit``'s flat host buffer (``unit.host``, in RAM now, holds its current bytes) that
        holds the same bytes outside RAM: a tensor, or an object that gives each tensor's bytes when sliced at
        its range, as `PackedTensor.view_of` slices."""
        ...

    def ram_bytes(self) -> int:
        """What its stand-ins keep in RAM (tensors the files lack)."""
        ...

    def moved_if_written(self, position: int, unit: Unit, raw: torch.Tensor) -> Moved | None:
        """After an edit: where ``unit``'s current bytes ``raw`` go when its stand-in now holds them in anonymous
        memory (written copy-on-write pages of a file mapping); None when it does not."""
        ...

    def close(self) -> None:
        """Offload is removed: delete what it wrote."""
        ...


class RawHomes:
    """Which positions (0: the base, ``i + 1``: unit ``i``) have their raw bytes in ``home``, and the verbs that put
    them there. ``raw_tensor(unit)``: a unit's current raw bytes as one flat tensor (gathered from a stand-in)."""

    def __init__(
        self, home: RawHome, positions: list[Unit], binding: Binding, raw_tensor: Callable[[Unit], torch.Tensor]
    ) -> None:
        self.home = home
        self._positions = positions
        self._binding = binding
        self._raw_tensor = raw_tensor
        self.homed: set[int] = set()

    @property
    def homed_bytes(self) -> int:
        """Raw bytes that wait in the home, outside RAM."""
        return sum(self._positions[p].nbytes for p in self.homed)

    def raw_ram_bytes(self, packed_bytes: int) -> int:
        """Host RAM the raw copies take, of ``packed_bytes`` in all: those not homed, and what the home's
        stand-ins keep in RAM."""
        return packed_bytes - self.homed_bytes + self.home.ram_bytes()

    def settle(self, index: int, kept: bool) -> None:
        """At set-up, as each unit is done with (`CompressedCopies.make`'s ``settled``): a unit kept compressed
        moves its raw bytes to the home and frees its RAM buffer; another stays in RAM."""
        position = index + 1
        unit = self._positions[position]
        if not kept or position in self.homed:
            return
        stand_in = self.home.stand_in(position, unit)
        self._binding.to_host(unit, stand_in)
        unpin_unit(unit)
        unit.stored = AtRawHome(stand_in)
        self.homed.add(position)

    def settle_as_loaded(self) -> set[int]:
        """Before packing: every unit whose bytes the home holds where its tensors already view them moves there
        without being packed, compared or read (`RawHome.stand_in_as_loaded`). The positions moved."""
        moved = set()
        for position, unit in enumerate(self._positions):
            stand_in = self.home.stand_in_as_loaded(position, unit) if unit.index >= 0 else None
            if stand_in is not None:
                self._binding.to_host(unit, stand_in)
                unit.stored = AtRawHome(stand_in)
                self.homed.add(position)
                moved.add(position)
        return moved

    def pin_the_rest(self) -> None:
        """Once set-up encoded everything: page-lock what stays in RAM raw (the base, units not worth
        compressing), which loads copy as they are."""
        for position, unit in enumerate(self._positions):
            buffer = unit.buffer if position not in self.homed else None
            if buffer is not None and not unit.pinned_in_place and not buffer.is_pinned():
                pin_unit(unit)

    def rehome_written(self, positions: list[int] | None = None) -> None:
        """After an edit: units whose raw bytes the edit wrote into copy-on-write pages of the weight files
        (anonymous memory the host budget does not see) move to the home's cache file, and those pages go back
        (`RawHome.moved_if_written`). ``positions``: the edited ones (default: all)."""
        for position in sorted(self.homed if positions is None else set(positions) & self.homed):
            unit = self._positions[position]
            moved = self.home.moved_if_written(position, unit, self._raw_tensor(unit))
            if moved is not None:  # tensors viewing the old stand-in follow; a device copy stays as it is
                self._binding.rehost(unit, moved.stand_in)
                unit.stored = AtRawHome(moved.stand_in)
                moved.release()

    def close(self) -> None:
        """Every unit restored from the home: it deletes what it wrote."""
        self.home.close()
        self.homed = set()
