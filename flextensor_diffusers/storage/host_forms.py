"""The forms a model's host bytes are stored in, one class each, behind the small interface `HostForm` that
`HostCopies`, packing and the host tier (`host_tier`) use: each form owns its bytes, the files it keeps for them,
and the answers the tier asks of it (what moves to disk, what stays in RAM meanwhile, what removal reads back).

* `RawInRam`: the raw bytes are the truth and sit in RAM, in a flat buffer per unit (compressed payloads may be
  kept beside them, see `compressed_copies`). They leave RAM as a whole (`RawInRam.spill`): into one cache file,
  or onto the weight files the model was loaded from, and come back unit by unit (`read_unit`, `take_unit`).
* `RawInSharedMemory`: raw in RAM, each unit's buffer a file shared with the other processes of the host
  (`shared_host`): packed and published by one process, attached to by the others; its files go at removal.
* `CompressedOnly` (``raw_copies="none"`` or ``"disk"``): the raw bytes of units kept compressed wait in a raw home
  for good (`raw_homes`: the weight files; else none at all, the payload being the host copy, or a cache file); RAM
  holds payloads, which leave for the payload file and come back unit by unit.

The form is chosen once: shared or not by `HostCopies`' constructor, compressed only by set-up as the storage plan
says (`HostCopies.keep_raw_in`). What moves where is the host tier's policy; a form only moves bytes and says where
they are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from ..engine.errors import FlexTensorError, OffloadStateError
from ..engine.units import Unit, unpin_unit
from .cache_files import drop_cached_pages_later, map_cache_file, write_cache_file
from .file_reads import SERIAL, PieceReader
from .host_bytes import Flat, HostBytes, InCacheFile, InPayloadsOnly, InRam, InWeightFiles
from .host_memory import host_buffer, page_locked, unpin_in_place
from .payloads_only import refuse_without_ram
from .raw_homes import RawHomes

if TYPE_CHECKING:
    from .host_copies import HostCopies, HostPlaces
    from .shared_host import SharedHostMemory

#: ``read(position, buffer, reader)``: fills one unit's new buffer (position 0: the base) straight from where its
#: stand-in's bytes live, e.g. large reads of a weight file instead of page faults through a mapping, in pieces
#: on ``reader``'s threads.
ReadInto = Callable[[int, torch.Tensor, PieceReader], None]


@dataclasses.dataclass(frozen=True)
class ReadUnit:
    """One unit's bytes read back from disk into a new RAM buffer (`HostForm.read_unit`), not adopted yet: its raw
    bytes, or (compressed only) its payload. ``nbytes``: what it brings into RAM."""

    index: int
    host: torch.Tensor
    nbytes: int
    pinned_in_place: bool  # locked in place (or lent by the locked pool): unlocked when dropped

    def drop(self) -> None:
        """Free it without adopting it (a read given up, or made stale by an edit)."""
        if self.pinned_in_place:
            unpin_in_place(self.host)


def copy_by_tensor(unit: Unit, stand_in: Flat, buffer: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy ``unit``'s bytes from a stand-in for its flat host buffer, which gives them only when sliced at each
    tensor's range (`PackedTensor.view_of`), into the flat ``buffer``, tensor by tensor."""
    for packed in unit.tensors:
        end = packed.offset + packed.nbytes
        buffer[packed.offset : end].copy_(stand_in[packed.offset : end], non_blocking=non_blocking)


def _copy_range(buffer: torch.Tensor, host: torch.Tensor, start: int, end: int) -> None:
    """One piece of a unit read from its stand-in: bytes ``[start, end)``."""
    buffer[start:end].copy_(host[start:end])


class HostForm:
    """The interface every form gives (see the module docstring); ``host`` is the model's `HostCopies`."""

    def __init__(self, host: HostCopies) -> None:
        self._host = host

    #: Where the raw host copies wait while out of RAM as a whole (a cache file, or the weight files' folder).
    spilled_to: Path | None = None
    #: Compressed only: where raw bytes of units kept compressed wait.
    raw_homes: RawHomes | None = None
    #: The raw bytes of every unit are in RAM, or come back there from a spill: a unit kept compressed may load raw
    #: instead of decoding (`plan_residency`'s ``raw_fallback``). False: compressed only, they wait in a raw home.
    raw_in_ram: ClassVar[bool] = True
    #: What leaves RAM when the host tier moves the copies to disk: the payloads, for their payload file
    #: (`spill_payloads`); else the raw bytes as a whole (`spill`: to a cache file, or onto the weight files they
    #: were loaded from, which the tier looks for).
    moves_payloads: ClassVar[bool] = False
    #: The bytes were packed by another process: packing only points the tensors at them, and pins them in place
    #: or not at all (a private copy would defeat the sharing).
    attached: bool = False

    # ------------------------------------------------------------------------------------ set-up and removal

    def open(self, fingerprint: str, loose: int) -> None:
        """Before set-up packs the weights (``fingerprint``: their digest; ``loose``: tensors outside any unit's
        buffer, sharing storage): the files the form keeps them in are made or checked."""

    def buffer_for(self, unit: Unit) -> torch.Tensor | None:
        """The flat buffer packing puts ``unit``'s bytes in; None: a new one of its own in RAM (`pack_unit`)."""
        return None

    def unit_packed(self, position: int, unit: Unit) -> None:
        """``unit`` was just packed, on a packing thread, its bytes at hand in RAM."""

    def publish(self, fingerprint: str) -> None:
        """Set-up packed what it packs before returning: bytes kept for other processes are theirs to use now."""

    def restored(self) -> HostForm:
        """Every unit restored (removal): the files the form kept go; the form the host copies have from now on."""
        return self

    # ------------------------------------------------------------------------------------ what the host tier asks

    @property
    def ram_bytes_while_waiting(self) -> int:
        """RAM the host copies keep while they wait on disk, which another component must fit next to: compressed
        only, the raw bytes of the base and of units not kept compressed; raw bytes leave RAM as a whole."""
        return 0

    @property
    def restores_from_disk(self) -> bool:
        """Removal reads the raw bytes back from disk: they wait there now (a spill), or for good (a raw home)."""
        raise NotImplementedError

    @property
    def lets_go_payloads(self) -> bool:
        """Payloads may leave RAM one by one while the model is active (`let_go_payload`, a hand-over): compressed
        only, with the payload file holding every payload as it is."""
        return False

    @property
    def spill_is_current(self) -> bool:
        """Where the copies go when they leave RAM holds them as they are (no edit since)."""
        raise NotImplementedError

    @property
    def holds_movable_bytes(self) -> bool:
        """Host copies are in RAM that could move to disk."""
        raise NotImplementedError

    @property
    def waiting_on_disk(self) -> bool:
        """Bytes a load needs wait on disk."""
        raise NotImplementedError

    def waiting_positions(self) -> list[int]:
        """The positions a read back brings into RAM."""
        raise NotImplementedError

    def arrival_bytes(self) -> list[int]:
        """Per position, the bytes a read back of it brings into RAM (0 for one that does not wait)."""
        raise NotImplementedError

    @property
    def stored_bytes(self) -> int:
        """Host RAM the host copies take when all are in RAM."""
        raise NotImplementedError

    def where(self) -> HostPlaces:
        """Where the host copies are now, in bytes (`HostCopies.where`)."""
        raise NotImplementedError

    def raw_at_hand(self, unit: Unit) -> bool:
        """Whether ``unit``'s raw bytes are in a RAM buffer of its own (a raw load copies them at full speed)."""
        raise NotImplementedError

    def spilled_hosts(self) -> list[HostBytes | None]:
        """What each position's bytes are while spilled: what `read_unit` reads from and what `untake_units`
        points units back at (compressed only: None each, the payloads are read from the payload file). Taken
        with the model spilled and nothing taken yet."""
        raise NotImplementedError

    def read_unit(
        self,
        position: int,
        host: HostBytes | None,
        pin: bool,
        read: ReadInto | None,
        reader: PieceReader,
        buffered: Callable[[], None],
    ) -> ReadUnit:
        """One waiting unit's bytes in a new RAM buffer, for `take_unit`: from ``read(position, buffer,
        reader)`` when given, else copied from its spilled bytes ``host``; in pieces on ``reader``'s threads
        (`file_reads`: units then arrive in the order read). Page-locked when ``pin`` (in place where CUDA
        allows, else a pinned copy), so that taking it back does no heavy work. Changes nothing of the model:
        runs on any thread, while the model waits or computes.

        Compressed only, the unit's payload is read from the payload file instead (checked against its
        checksum). ``buffered`` is told once the new buffer is had (`CompressedCopies.read_payload`)."""
        raise NotImplementedError

    def take_unit(self, new: ReadUnit) -> None:
        """Adopt one unit's buffer that `read_unit` filled, on the main thread, while the model waits on disk
        (active or not): tensors that viewed the spilled bytes follow. No copy still reads them: every read of
        host bytes asks the reader's gate, which adopts first. The last unit taken ends the spill; a cache file
        is kept for the next one, its pages dropped from the page cache."""
        raise NotImplementedError

    def untake_units(self, hosts: list[HostBytes | None]) -> None:
        """Undo `take_unit` for every unit taken so far, pointing them back at their spilled bytes ``hosts``
        (`spilled_hosts`), which still hold them: a read back given up leaves the model on disk as before. The
        taken buffers are freed, so copies that may still read them finish first."""
        raise NotImplementedError

    def spill(self, path: Path, hosts: list[Flat] | None, held_bytes: int) -> None:
        """`HostCopies.spill`, every host copy final and none spilled: the raw bytes leave RAM as a whole."""
        raise NotImplementedError

    def spill_payloads(self) -> None:
        """`HostCopies.spill_payloads`, every host copy final: the payloads move to the payload file."""
        host = self._host
        if any(host.binding.on_device(unit) is not None for unit in host.positions):
            raise OffloadStateError("spill_payloads() needs an inactive model: release() it first")
        host.binding.sweep()  # an edit found now re-encodes before the payloads leave
        host.compressed.spill()

    def let_go_payload(self, unit: Unit) -> bool:
        """`HostCopies.let_go_payload`: only a form whose payloads move lets one go."""
        return False

    def edited(self, unit: Unit) -> None:
        """An edit reached ``unit``'s host copy."""

    def mark_spill_current(self) -> None:
        """Where the copies spill to holds their bytes now (the caller checked)."""

    def mark_spill_stale(self) -> None:
        """The host copies may change (an edit begins): the next spill writes them."""

    def edit_ended(self) -> None:
        """An edit of the weights ended (`Edits.editing`), every copy it changed final."""

    def decode_all(self, what: str) -> None:
        """Before ``what`` (an edit) writes the host copies: units kept as payloads only get their raw bytes decoded
        into RAM (refused first when the RAM available cannot hold them), until `close_decoded`."""

    def close_decoded(self, units: list[Unit] | None = None) -> None:
        """Units decoded into RAM for now (`decode_all`, a write-back; ``units``, None: all) go back to their payloads,
        made again since."""

    def before_restore(self, unit: Unit) -> None:
        """``unit`` is about to be restored (removal): payloads only, its raw bytes are decoded to be copied from."""

    def release_raw_for_edits(self) -> None:
        """Payloads only: units whose raw bytes an edit left in RAM while they had no payload (one made while the
        model was encoded between forwards) go back to their payload alone once it is kept and proven. Called at
        the end of each workload call."""


class RawInRam(HostForm):
    """Raw bytes in RAM, the truth; they leave RAM as a whole (`spill`) and come back unit by unit."""

    def __init__(self, host: HostCopies) -> None:
        super().__init__(host)
        self.spilled_to: Path | None = None
        self._current = False  # where they spill to holds their bytes (no edit since)
        self._held_bytes: int | None = None  # while on stand-ins: what those keep in RAM
        self._taken: set[int] = set()  # positions already taken back into RAM during a spill

    @property
    def spill_is_current(self) -> bool:
        return self._current

    def edited(self, unit: Unit) -> None:
        self._current = False

    def mark_spill_current(self) -> None:
        self._current = True

    def mark_spill_stale(self) -> None:
        self._current = False

    @property
    def holds_movable_bytes(self) -> bool:
        return self.spilled_to is None

    @property
    def waiting_on_disk(self) -> bool:
        return self.spilled_to is not None

    @property
    def restores_from_disk(self) -> bool:
        return self.spilled_to is not None

    def waiting_positions(self) -> list[int]:
        return list(range(len(self._host.positions))) if self.spilled_to is not None else []

    def arrival_bytes(self) -> list[int]:
        return [u.nbytes for u in self._host.positions]

    @property
    def stored_bytes(self) -> int:
        return self._host.packed_bytes + self._host.compressed.stored_bytes

    def where(self) -> HostPlaces:
        from .host_copies import HostPlaces

        host = self._host
        payloads = host.compressed.payload_bytes
        if self.spilled_to is None:
            return HostPlaces(ram_raw_bytes=host.packed_bytes, ram_compressed_bytes=payloads)
        in_ram = (self._held_bytes or 0) + sum(host.positions[p].nbytes for p in self._taken)
        return HostPlaces(
            ram_raw_bytes=in_ram,
            ram_compressed_bytes=payloads,
            disk_bytes=max(host.packed_bytes - in_ram, 0),
            disk_path=str(self.spilled_to),
            arriving=host.gates.any_open,
        )

    def spill(self, path: Path, hosts: list[Flat] | None, held_bytes: int) -> None:
        """Move the host copies out of RAM (the model must be inactive: no tensor views a device copy): into
        the cache file ``path``, or, given ``hosts``, onto bytes that are already elsewhere, writing nothing
        (``path`` then names that place).

        ``hosts``: per position, a stand-in for the unit's flat host buffer that gives a tensor's bytes when
        sliced at the tensor's range, as `PackedTensor.view_of` slices (e.g. private mappings of the weight
        files the model was loaded from); ``held_bytes`` of them stay in RAM. The caller vouches that they hold
        the current bytes (`mark_spill_current`, and `spill_is_current` since).

        A cache file is written completely before any tensor points at it, so a full or unwritable disk
        raises with the copies still in RAM; writing is skipped when the file holds these bytes already
        (spilled before, no edit since). Every host copy is final here (`HostCopies.spill`)."""
        host = self._host
        if any(host.binding.on_device(unit) is not None for unit in host.positions):
            raise OffloadStateError("spill() needs an inactive model: release() it first")
        host.binding.sweep()  # an edit since the last spill means the file must be written again
        held: list[HostBytes]
        if hosts is None:
            if not (self._current and path.exists()):
                write_cache_file(path, host.positions, [host.host_of(u) for u in host.positions])
            held = [InCacheFile(view) for view in map_cache_file(path, host.positions)]
        else:
            held = [InWeightFiles(stand_in) for stand_in in hosts]
        if host.cuda:  # copies issued before release may still be reading the buffers about to be freed
            torch.cuda.synchronize(host.device)
        for unit, bytes_there in zip(host.positions, held, strict=True):
            host.binding.to_host(unit, bytes_there.flat)
            unpin_unit(unit)
            unit.stored = bytes_there
        self.spilled_to, self._taken, self._current = path, set(), True
        self._held_bytes = None if hosts is None else held_bytes

    def raw_at_hand(self, unit: Unit) -> bool:
        return self.spilled_to is None or unit.index + 1 in self._taken

    def spilled_hosts(self) -> list[HostBytes | None]:
        assert self.spilled_to is not None and not self._taken, "spilled_hosts() needs a spill with nothing taken"
        return [u.stored for u in self._host.positions]

    def read_unit(
        self,
        position: int,
        host: HostBytes | None,
        pin: bool,
        read: ReadInto | None = None,
        reader: PieceReader = SERIAL,
        buffered: Callable[[], None] = lambda: None,
    ) -> ReadUnit:
        unit = self._host.positions[position]
        buffer = host_buffer(unit.nbytes)
        buffered()
        if read is not None:
            read(position, buffer, reader)
        else:
            assert host is not None, f"{unit.name} has no spilled bytes to read"
            source = host.buffer
            if source is None:  # a stand-in is sliced per tensor only
                copy_by_tensor(unit, host.flat, buffer)
            else:  # a view of a cache file's mapping: its pages are read as the pieces fault them in
                step = reader.piece_bytes(unit.nbytes)
                ends = [(a, min(a + step, unit.nbytes)) for a in range(0, unit.nbytes, step)]
                reader.run([functools.partial(_copy_range, buffer, source, a, b) for a, b in ends])
        buffer, in_place = page_locked(buffer) if pin else (buffer, False)
        return ReadUnit(unit.index, buffer, unit.nbytes, in_place)

    def take_unit(self, new: ReadUnit) -> None:
        host = self._host
        position = new.index + 1
        unit = host.positions[position]
        assert self.spilled_to is not None and position not in self._taken, f"{unit.name} is not waiting to be taken"
        host.binding.rehost(unit, new.host)
        unit.stored, unit.pinned_in_place = InRam(new.host), new.pinned_in_place
        self._taken.add(position)
        if len(self._taken) == len(host.positions):
            if self._held_bytes is None:
                drop_cached_pages_later(self.spilled_to)
            self.spilled_to, self._held_bytes, self._taken = None, None, set()

    def untake_units(self, hosts: list[HostBytes | None]) -> None:
        if not self._taken:
            return
        host = self._host
        if host.cuda:
            torch.cuda.synchronize(host.device)
        for position in sorted(self._taken):
            unit, back = host.positions[position], hosts[position]
            assert back is not None
            host.binding.rehost(unit, back.flat)
            unpin_unit(unit)
            unit.stored = back
        self._taken = set()


class RawInSharedMemory(RawInRam):
    """Raw in RAM, each unit's flat buffer a file of ``shared`` (`shared_host.SharedHostMemory`) that every process
    of the host maps: the creating process packs the weights into those files and publishes them, the others
    attach, copying nothing. The form keeps the files: checked or made before packing, deleted at removal (the
    creator's; mappings stay valid in every process until it drops its tensors)."""

    def __init__(self, host: HostCopies, shared: SharedHostMemory) -> None:
        super().__init__(host)
        self.shared = shared
        self.attached = not shared.create

    def open(self, fingerprint: str, loose: int) -> None:
        if loose:
            raise FlexTensorError(
                f"shared host memory cannot hold tensors that share storage ({loose} here, "
                "e.g. weights tied outside one unit): offload without shared_host"
            )
        self.shared.open(fingerprint, {u.index: u.nbytes for u in self._host.positions})

    def buffer_for(self, unit: Unit) -> torch.Tensor:
        return self.shared.buffer(unit.index)

    def publish(self, fingerprint: str) -> None:
        if self.shared.create:
            self.shared.publish(fingerprint)

    def restored(self) -> HostForm:
        self.shared.unlink()
        return self


class CompressedOnly(HostForm):
    """Compressed only: raw bytes of units kept compressed wait in ``raw_homes`` for good; their payloads are the
    bytes that move, to the payload file and back unit by unit."""

    raw_in_ram = False
    moves_payloads = True

    def __init__(self, host: HostCopies, raw_homes: RawHomes) -> None:
        super().__init__(host)
        self.raw_homes = raw_homes
        self._payloads_taken: list[int] = []  # units whose payloads were taken back during a payload spill

    def unit_packed(self, position: int, unit: Unit) -> None:
        if unit.index >= 0:  # the base stays in RAM
            self.raw_homes.home.prepare(position, unit)

    def restored(self) -> HostForm:
        self.raw_homes.close()
        return RawInRam(self._host)

    @property
    def ram_bytes_while_waiting(self) -> int:
        return self.raw_homes.raw_ram_bytes(self._host.packed_bytes)

    @property
    def restores_from_disk(self) -> bool:
        return True

    @property
    def lets_go_payloads(self) -> bool:
        return self._host.compressed.file_current

    def spill(self, path: Path, hosts: list[Flat] | None, held_bytes: int) -> None:
        raise OffloadStateError("compressed only, the payloads move to disk: call spill_payloads()")

    def edit_ended(self) -> None:
        self.raw_homes.rehome_written()  # edited raw bytes leave the weight files' copy-on-write pages

    def decode_all(self, what: str) -> None:
        closed = [unit for unit in self._host.positions if isinstance(unit.stored, InPayloadsOnly)]
        refuse_without_ram(sum(unit.nbytes for unit in closed), what)
        for unit in closed:
            self._host.host_of(unit)  # decodes it (`RawHomes.open`)

    def close_decoded(self, units: list[Unit] | None = None) -> None:
        positions = None if units is None else [unit.index + 1 for unit in units]
        compressed = self._host.compressed
        self.raw_homes.close_opened(lambda index: index in compressed.encoded, positions, compressed.arriving)

    def before_restore(self, unit: Unit) -> None:
        if isinstance(unit.stored, InPayloadsOnly):
            self.raw_homes.open(unit)

    def release_raw_for_edits(self) -> None:
        proven = self._host.compressed.proven
        homes = self.raw_homes
        ready = sorted(p for p in homes.raw_for_edits if p - 1 in proven)
        if not ready:
            return
        host = self._host
        if host.cuda:  # a raw load issued before (a slot, a read ahead, a proof) may still read a buffer about to go
            torch.cuda.synchronize(host.device)
        homes.release_to_payloads(ready, lambda index: index in host.compressed.proven)

    @property
    def spill_is_current(self) -> bool:
        return self._host.compressed.file_current  # the payload file holds every payload as it is

    def edited(self, unit: Unit) -> None:
        self.raw_homes.rehome_written([unit.index + 1])

    @property
    def holds_movable_bytes(self) -> bool:
        compressed = self._host.compressed
        return len(compressed.waiting) < len(compressed.encoded)

    @property
    def waiting_on_disk(self) -> bool:
        return bool(self._host.compressed.waiting)

    def waiting_positions(self) -> list[int]:
        return sorted(index + 1 for index in self._host.compressed.waiting)

    def arrival_bytes(self) -> list[int]:
        compressed = self._host.compressed
        waiting = compressed.waiting
        return [
            compressed.encoded[p - 1].payload.numel() if p and p - 1 in waiting else 0
            for p in range(len(self._host.positions))
        ]

    @property
    def stored_bytes(self) -> int:
        host = self._host
        return self.raw_homes.raw_ram_bytes(host.packed_bytes) + host.compressed.stored_bytes

    def where(self) -> HostPlaces:
        from .host_copies import HostPlaces

        host = self._host
        compressed = host.compressed
        payloads = compressed.payload_bytes
        waiting = compressed.stored_bytes - payloads
        homes = self.raw_homes
        return HostPlaces(
            ram_raw_bytes=homes.raw_ram_bytes(host.packed_bytes),
            ram_compressed_bytes=payloads,
            disk_bytes=waiting,
            disk_path=str(compressed.file.path) if waiting and compressed.file else None,
            arriving=host.gates.any_open,
            raw_disk_bytes=homes.homed_bytes - homes.payloads_only_bytes,
            payloads_only_bytes=homes.payloads_only_bytes,
        )

    def raw_at_hand(self, unit: Unit) -> bool:
        return unit.index + 1 not in self.raw_homes.homed

    def spill_payloads(self) -> None:
        super().spill_payloads()
        self._payloads_taken = []

    def let_go_payload(self, unit: Unit) -> bool:
        compressed = self._host.compressed
        if unit.index not in compressed.encoded or unit.index in compressed.waiting:
            return False
        if not compressed.file_current:
            return False
        compressed.let_go(unit.index)
        return True

    def spilled_hosts(self) -> list[HostBytes | None]:
        return [None] * len(self._host.positions)  # payloads are read from the payload file

    def read_unit(
        self,
        position: int,
        host: HostBytes | None,
        pin: bool,
        read: ReadInto | None = None,
        reader: PieceReader = SERIAL,
        buffered: Callable[[], None] = lambda: None,
    ) -> ReadUnit:
        unit = self._host.positions[position]
        payload, locked = self._host.compressed.read_payload(unit.index, pin, reader, buffered)
        return ReadUnit(unit.index, payload, payload.numel(), locked)

    def take_unit(self, new: ReadUnit) -> None:
        compressed = self._host.compressed
        name = self._host.units[new.index].name
        assert new.index in compressed.waiting, f"{name}'s payload is not waiting to be taken"
        compressed.take(new.index, new.host, new.pinned_in_place)
        self._payloads_taken.append(new.index)

    def untake_units(self, hosts: list[HostBytes | None]) -> None:
        self._host.compressed.untake(self._payloads_taken)
        self._payloads_taken = []
