"""Compressed only (``raw_copies="none"`` or ``"disk"``): the raw bytes of units kept compressed leave RAM for good.

Set-up hands each unit over as soon as its compressed copy is made (`RawHomes.settle`): its tensors then view a
stand-in in the home (views of the weight files a pipeline was loaded from, a room in one cache file, or, payloads
only, a `read_guard.NoRawBytes` that holds nothing and refuses reads) and its RAM buffer is freed, so RAM holds
compressed copies, plus the raw bytes of the base and of units not worth compressing. Every load of a homed unit
decodes its compressed copy; its raw bytes are read only by edits, ``state_dict`` and removal. After an edit, units
whose stand-in now holds their bytes in anonymous memory (written copy-on-write pages of a file mapping) move within
the home (`RawHomes.rehome_written`).

A unit kept as payloads only has no raw bytes to read: whatever needs them has it decoded into RAM for the while
(`RawHomes.open`, a `DecodedPayload`), and once its payload says what those bytes say it goes back to its payload
alone (`RawHomes.close_opened`). Until set-up kept every payload (the device encoder keeps them all at the end), the
payload of a unit that lost its raw bytes is held here too (`held`): a set-up that fails or is interrupted after
that still restores it. An edit while the payloads are made between forwards leaves the units it wrote raw in RAM,
with no payload to go back to (`raw_for_edits`); once their new payloads are kept and proven (at their first decoded
load), the end of a workload call lets them go to their payloads alone (`release_to_payloads`), as set-up would have.

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
from .codec import EncodedUnit
from .host_bytes import AtRawHome, DecodedPayload, Flat, HostBytes, InPayloadsOnly, InRam
from .read_guard import NoRawBytes


@dataclasses.dataclass(frozen=True)
class Moved:
    """A unit's raw bytes moved within its raw home (`RawHome.moved_if_written`): where they are now (a room in the
    cache file; payloads only, decoded into RAM until its payload is made again from them), and what to call once the
    unit's tensors point there (the old place's memory goes back)."""

    stored: HostBytes
    release: Callable[[], None]


def at_home(stand_in: Flat) -> HostBytes:
    """The record of a unit whose raw bytes wait at ``stand_in`` in a raw home: none at all for a `NoRawBytes`."""
    return InPayloadsOnly(stand_in) if isinstance(stand_in, NoRawBytes) else AtRawHome(stand_in)


class RawHome(Protocol):
    """Where the raw bytes of units kept compressed wait outside RAM: the weight files a component was loaded from
    (the pipelines' `WeightFilesHome`), one cache file (`cache_files.RawCacheFile`), or nowhere
    (`payloads_only.PayloadsOnlyHome`)."""

    #: The file or folder, for reports (None: nowhere on disk).
    where: Path | None

    def prepare(self, position: int, unit: Unit) -> None:
        """``unit`` was just packed (``unit.host`` holds its bytes), on a packing thread: work for `stand_in` that
        can run there, in parallel with other units' (comparing its bytes with a file's, say)."""
        ...

    def stand_in_as_loaded(self, position: int, unit: Unit) -> Flat | None:
        """Before ``unit`` is packed (its tensors still as loaded): a stand-in as `stand_in` gives, when the home holds
        its bytes where its tensors already view them (`mapped_weights`), read and written nothing; None: it is
        packed, and handed over by `stand_in`."""
        ...

    def forget(self, position: int) -> None:
        """A stand-in `stand_in_as_loaded` gave for ``position`` will not be used (`RawHomes.settle_as_loaded`)."""
        ...

    def stand_in(self, position: int, unit: Unit) -> Flat:
        """A stand-in for ``unit``'s flat host buffer (``unit.host``, in RAM now, holds its current bytes) that
        holds the same bytes outside RAM: a tensor, or an object that gives each tensor's bytes when sliced at
        its range, as `PackedTensor.view_of` slices; a `NoRawBytes` where none are kept (its payload is its host
        copy)."""
        ...

    def stand_in_without_bytes(self, position: int, unit: Unit) -> NoRawBytes | None:
        """For ``unit``, whose raw bytes no file of the home holds (an edit wrote them into RAM): a `NoRawBytes`
        when the home keeps no raw bytes for such a unit, its payload being its only host copy (payloads only, its
        tensors able to refuse reads); None when it keeps them (a cache file), or the unit cannot go without."""
        ...

    def ram_bytes(self) -> int:
        """What its stand-ins keep in RAM (tensors the files lack)."""
        ...

    def moved_if_written(self, position: int, unit: Unit, raw: Callable[[], torch.Tensor]) -> Moved | None:
        """After an edit: where ``unit``'s current bytes (``raw()``, gathered when asked) go when its stand-in now
        holds them in anonymous memory (written copy-on-write pages of a file mapping); None when it does not."""
        ...

    def close(self) -> None:
        """Offload is removed: delete what it wrote."""
        ...


class RawHomes:
    """Which positions (0: the base, ``i + 1``: unit ``i``) have their raw bytes in ``home``, and the verbs that put
    them there. ``raw_tensor(unit)``: a unit's current raw bytes as one flat tensor (gathered from a stand-in);
    ``decoded(unit)``: those of a unit kept as payloads only, decoded into a new RAM buffer (`HostCopies.decoded`)."""

    def __init__(
        self,
        home: RawHome,
        positions: list[Unit],
        binding: Binding,
        raw_tensor: Callable[[Unit], torch.Tensor],
        decoded: Callable[[Unit], torch.Tensor],
    ) -> None:
        self.home = home
        self._positions = positions
        self._binding = binding
        self._raw_tensor = raw_tensor
        self._decoded = decoded
        self.homed: set[int] = set()
        #: Homed positions decoded into RAM for now (`open`), each a `DecodedPayload`.
        self.opened: set[int] = set()
        #: Until set-up is done (`set_up_done`): the payload of each unit that lost its raw bytes, by unit index.
        self.held: dict[int, EncodedUnit] = {}
        #: Positions whose raw bytes are in RAM only because an edit wrote them there while the payloads were being
        #: made between forwards (`close_opened`): `release_to_payloads` lets them go once a payload of theirs is
        #: proven.
        self.raw_for_edits: set[int] = set()

    @property
    def homed_bytes(self) -> int:
        """Raw bytes that wait in the home, outside RAM (or nowhere: payloads only)."""
        return sum(self._positions[p].nbytes for p in self.homed)

    @property
    def payloads_only_bytes(self) -> int:
        """Raw bytes of the units whose payload is their only host copy (decoded for now included)."""
        kinds = (InPayloadsOnly, DecodedPayload)
        return sum(self._positions[p].nbytes for p in self.homed if isinstance(self._positions[p].stored, kinds))

    def raw_ram_bytes(self, packed_bytes: int) -> int:
        """Host RAM the raw copies take, of ``packed_bytes`` in all: those not homed, what the home's stand-ins keep
        in RAM, and the units decoded for now."""
        opened = sum(self._positions[p].nbytes for p in self.opened)
        return packed_bytes - self.homed_bytes + self.home.ram_bytes() + opened

    def settle(self, index: int, payload: EncodedUnit | None) -> None:
        """At set-up, as each unit is done with (`CompressedCopies.make`'s ``settled``, with its payload, None when it
        is not worth compressing): a unit kept compressed moves its raw bytes to the home and frees its RAM buffer;
        another stays in RAM. A unit told again (its payloads made anew, after a payload file was refused) keeps its
        place; one decoded for now goes back to its payload, or stays in RAM when it has none any more."""
        position = index + 1
        unit = self._positions[position]
        if payload is not None and isinstance(unit.stored, (InPayloadsOnly, DecodedPayload)):
            self.held[index] = payload
        if position in self.opened:
            self.close_opened(lambda i: payload is not None, [position])
        if payload is None or position in self.homed:
            return
        self._move_home(position, unit)
        if isinstance(unit.stored, InPayloadsOnly):
            self.held[index] = payload  # its only copy now; the records may keep it only once all are made

    def _move_home(self, position: int, unit: Unit) -> None:
        """``unit``, in RAM, moves its raw bytes to the home (`RawHome.stand_in`: none at all, payloads only) and
        frees its RAM buffer."""
        stand_in = self.home.stand_in(position, unit)
        self._binding.to_host(unit, stand_in)
        unpin_unit(unit)
        unit.stored = at_home(stand_in)
        self.homed.add(position)

    def set_up_done(self) -> None:
        """Set-up kept every payload: the records hold them, nothing more is held here."""
        self.held = {}

    def settle_as_loaded(self, every_unit: bool = False) -> set[int] | None:
        """Before packing: every unit whose bytes the home holds where its tensors already view them moves there
        without being packed, compared or read (`RawHome.stand_in_as_loaded`). The positions moved. ``every_unit``
        (payloads only, to encode between forwards): all units or none; None, with nothing moved, when one is not
        held so (it would keep its payload as its only copy, so the model is encoded at set-up)."""
        found: dict[int, Flat] = {}
        for position, unit in enumerate(self._positions):
            stand_in = self.home.stand_in_as_loaded(position, unit) if unit.index >= 0 else None
            if stand_in is not None:
                found[position] = stand_in
            elif every_unit and unit.index >= 0:
                for taken in found:
                    self.home.forget(taken)
                return None
        for position, stand_in in found.items():
            unit = self._positions[position]
            self._binding.to_host(unit, stand_in)
            unit.stored = AtRawHome(stand_in)
            self.homed.add(position)
        return set(found)

    def home_raw(self, index: int) -> None:
        """Encoding between forwards: unit ``index``, just packed and not encoded yet, moves its raw bytes to the
        home (which must keep them: the weight files or a cache file, never payloads only) and frees its RAM
        buffer; the model streams them from there until its payload is kept."""
        position = index + 1
        unit = self._positions[position]
        if position in self.homed:
            return
        self._move_home(position, unit)
        assert isinstance(unit.stored, AtRawHome), f"{unit.name} has no payload to be its only copy yet"

    def pin_the_rest(self) -> None:
        """Once set-up encoded everything: page-lock what stays in RAM raw (the base, units not worth
        compressing), which loads copy as they are."""
        for position, unit in enumerate(self._positions):
            buffer = unit.buffer if position not in self.homed else None
            if buffer is not None and not unit.pinned_in_place and not buffer.is_pinned():
                pin_unit(unit)

    def open(self, unit: Unit) -> None:
        """A unit kept as payloads only gets its raw bytes decoded into a RAM buffer of its own, which its tensors
        view (unless they view a device copy, which holds the same bytes): for an edit, a write-back, removal. It
        stays so until `close_opened`."""
        closed = unit.stored
        assert isinstance(closed, InPayloadsOnly), f"{unit.name} has raw bytes to read"
        buffer = self._decoded(unit)
        self._binding.rehost(unit, buffer)
        unit.stored = DecodedPayload(buffer, closed)
        self.opened.add(unit.index + 1)

    def close_opened(
        self, has_payload: Callable[[int], bool], positions: list[int] | None = None, payloads_coming: bool = False
    ) -> None:
        """Units decoded for now (``positions``, default all) whose payload says what their bytes say now (made again
        after an edit, or never changed) go back to their payload alone: their tensors view their `NoRawBytes` again
        and the RAM buffer goes. One without a payload any more (unit index by ``has_payload``) keeps the buffer,
        raw in RAM: for good when an edit made it not worth compressing; until its payload is proven
        (`release_to_payloads`) when ``payloads_coming``, the payloads being made between forwards."""
        for position in sorted(self.opened if positions is None else set(positions) & self.opened):
            unit = self._positions[position]
            stored = unit.stored
            assert isinstance(stored, DecodedPayload)
            if has_payload(unit.index):
                self._binding.rehost(unit, stored.closed.flat)
                unit.stored = stored.closed
            else:
                unit.stored = InRam(stored.tensor)
                self.homed.discard(position)
                if payloads_coming:
                    self.raw_for_edits.add(position)
            self.opened.discard(position)

    def release_to_payloads(self, positions: list[int], ready: Callable[[int], bool]) -> None:
        """Units of ``positions`` kept raw in RAM for an edit (`raw_for_edits`) whose payload ``ready(unit index)``
        says is kept and proven go back to their payload alone, as set-up leaves a unit payloads only (`settle`):
        their tensors view a `NoRawBytes` (one that views a device copy keeps it, and gets the stand-in when it
        goes back to the host) and the RAM buffer goes. The caller made sure no copy issued before still reads
        those buffers. An edit found in one first (`Binding.check`) is handled before ``ready`` is asked: it may
        have left the unit without a payload. A unit the home cannot leave without raw bytes stays as it is."""
        released: set[int] = set()
        for position in positions:
            unit = self._positions[position]
            self._binding.check(unit)
            if position not in self.raw_for_edits or not isinstance(unit.stored, InRam) or not ready(unit.index):
                continue
            self.raw_for_edits.discard(position)
            stand_in = self.home.stand_in_without_bytes(position, unit)
            if stand_in is None:
                continue
            self._binding.rehost(unit, stand_in)
            unpin_unit(unit)
            unit.stored = InPayloadsOnly(stand_in)
            released.add(position)
        self.homed = self.homed | released  # a new set: a host tier counting RAM on another thread reads the old one

    def rehome_written(self, positions: list[int] | None = None) -> None:
        """After an edit: units whose raw bytes the edit wrote into copy-on-write pages of the weight files
        (anonymous memory the host budget does not see) move within the home (`RawHome.moved_if_written`: to its
        cache file, or, payloads only, into RAM until their payloads are made again), and those pages go back.
        ``positions``: the edited ones (default: all)."""
        for position in sorted(self.homed if positions is None else set(positions) & self.homed):
            unit = self._positions[position]
            moved = self.home.moved_if_written(position, unit, lambda unit=unit: self._raw_tensor(unit))
            if moved is not None:  # tensors viewing the old stand-in follow; a device copy stays as it is
                self._binding.rehost(unit, moved.stored.flat)
                unit.stored = moved.stored
                if isinstance(moved.stored, DecodedPayload):
                    self.opened.add(position)
                moved.release()

    def close(self) -> None:
        """Every unit restored from the home: it deletes what it wrote."""
        self.home.close()
        self.homed, self.opened, self.held, self.raw_for_edits = set(), set(), {}, set()
