"""`HostCopies`: the one owner of every unit's host bytes, the weights' truth, wherever they are.

Every parameter and buffer of a unit (and of the *base*, the weights outside units) lives in one flat host
buffer from set-up to removal; device memory only ever holds copies of it. A unit's host bytes are in one of
these places, and this object alone knows which:

* **RAM, raw**: a flat buffer of its own (page-locked for CUDA), packed at set-up (`start_packing`), or
  while the model already runs, each unit adopted when first asked for (`start_progressive_packing`; until
  then the gate below is set and the unit's tensors are still its own);
* **RAM, compressed** as well, when compression is on (`compressed`, a `CompressedCopies`): loads may move the
  payload and decode it on the device; the raw bytes stay the truth;
* **compressed only** (``raw_copies="none"`` or ``"disk"``, and always under a pipeline's host budget with
  compression): the raw bytes of each unit kept compressed leave RAM as soon as its payload is made, for a
  `RawHome` (the weight files it was loaded from; else, ``"none"``, nowhere: its payload is its only host copy,
  `payloads_only`; ``"disk"``: one cache file; `raw_homes.RawHomes`); RAM holds payloads, plus the raw bytes
  of the base and of units not worth compressing. Every load of such a unit decodes its payload. Its payloads
  can then wait on disk as well (`spill_payloads`: in the payload file), and come back unit by unit as below;
* **a cache file** (`spill`): a shared mapping of one file for all units, written once and kept, unwritten
  again, until an edit;
* **the weight files** the model was loaded from (`spill` with stand-ins): private copy-on-write views, so an
  edit made while a unit waits there lands in anonymous memory, never in the user's files;
* **arriving**: read back from disk unit by unit while the model already computes. Another thread reads each
  unit into a new buffer (`read_unit`); the main thread adopts it (`take_unit`); the last one taken ends the
  spill. Until then the reader's gate is open (`host_gates`), and every read of a unit's host bytes (a load,
  the copies made at activation, edits, ``state_dict``, spilling, removal) asks it first with `host_of`: the
  gate returns once the unit's final buffer is adopted. With no gate open a read costs one check.

Where a unit's bytes are is a typed record on the unit (`Unit.stored`, `host_bytes`); how they move between RAM
and disk is the form's (`host_forms`: raw in RAM, raw in memory shared between processes, or compressed only);
packing is `packing`'s.

Which components wait where is policy, and lives with the caller (the pipelines' host tier); this object only
moves bytes and says where they are.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ..engine.binding import Binding
from ..engine.errors import OffloadStateError
from ..engine.units import Unit, restore_unit
from .codec import EncodedUnit
from .compressed_copies import CompressedCopies
from .file_reads import SERIAL, PieceReader
from .host_bytes import Flat, HostBytes, InPayloadsOnly
from .host_forms import CompressedOnly, HostForm, RawInRam, RawInSharedMemory, ReadInto, ReadUnit, copy_by_tensor
from .host_gates import Gate, HostGates, OpenGate
from .host_memory import host_buffer
from .packing import Packing, PackingWindow, ProgressivePacking, start_packing
from .payloads_only import decoded
from .raw_homes import RawHome, RawHomes
from .shared_host import SharedHostMemory

logger = logging.getLogger(__name__)

__all__ = ["PACKING_WINDOW", "HostCopies", "HostPlaces", "PackingWindow", "ProgressivePacking", "ReadInto"]

#: Units packed ahead of the one the encoder asks for when raw bytes leave RAM as encoding goes (compressed
#: only): enough that packing keeps ahead of the encoder, few enough that RAM holds only a few raw units at a
#: time (a Wan2.2-A14B block is 0.7 GB).
PACKING_WINDOW = 3


@dataclasses.dataclass(frozen=True)
class HostPlaces:
    """Where one model's host copies are (`HostCopies.where`): the bytes in each place."""

    ram_raw_bytes: int
    ram_compressed_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | None = None  # the cache file or the weight files' folder they wait in
    arriving: bool = False  # being read back from disk while the model computes
    raw_disk_bytes: int = 0  # compressed only: the raw bytes that wait in a `RawHome`, outside RAM for good
    payloads_only_bytes: int = 0  # compressed only: the raw bytes of units whose payload is their only host copy

    @property
    def label(self) -> str:
        """A word for a report: "disk" while any copy a load needs waits there (arriving or not), else
        "ram compressed" when RAM holds compressed copies only, else "ram"."""
        if self.disk_bytes:
            return "disk"
        return "ram compressed" if self.raw_disk_bytes or self.payloads_only_bytes else "ram"


class HostCopies:
    """Where each unit's host bytes are, and the verbs that move them (see the module docstring).

    Units are numbered by *position*: 0 is the base, ``i + 1`` is unit ``i``. Re-pointing tensors from one
    host buffer to another goes through ``binding``, so that a unit computing on the device keeps its device
    copy and every edit found on the way reaches the truth first. How the bytes are kept and move between RAM and
    disk is ``form``'s (`host_forms`), chosen here: raw in RAM, or in ``shared`` memory, the processes of the host
    share; until set-up keeps raw bytes in a raw home (`keep_raw_in`).
    """

    def __init__(
        self, base: Unit, units: list[Unit], device: torch.device, binding: Binding, shared: SharedHostMemory | None
    ) -> None:
        self.base = base
        self.units = units
        self.device = device
        self.cuda = device.type == "cuda"
        self.binding = binding
        #: Units kept compressed as well (`CompressedCopies.make`; payloads pinned for CUDA).
        self.compressed = CompressedCopies(units, device, self.raw_tensor)
        #: What a read of a unit's host bytes asks first while some are not final (see the module docstring).
        self.gates = HostGates()
        #: How the host bytes are kept and moved: raw in RAM (shared or not), or compressed only (`keep_raw_in`).
        self.form: HostForm = RawInRam(self) if shared is None else RawInSharedMemory(self, shared)
        self._progressive: ProgressivePacking | None = None  # packing still under way after set-up
        #: Told of each unit's bytes as they are packed, on the thread that packed them (``verify_loads``
        #: fingerprints them while they are at hand: compressed only, they leave RAM soon after); None: nobody.
        self.on_packed: Callable[[Unit, torch.Tensor], None] | None = None

    @property
    def positions(self) -> list[Unit]:
        """The base, then the units: position ``p`` is unit ``p - 1``."""
        return [self.base, *self.units]

    # ------------------------------------------------------------------------------------ packing

    def start_packing(self, pin: bool, window: int | None = None, skip: frozenset[int] = frozenset()) -> Packing:
        """Start copying every unit and the base (but the positions in ``skip``) into the form's flat host buffers
        on threads (`packing.start_packing`)."""
        return start_packing(self, pin, window, skip)

    def start_progressive_packing(self, pin: bool, on_done: Callable[[float], None]) -> ProgressivePacking:
        """Start packing every unit and the base, each adopted as first asked for (`ProgressivePacking`): set-up
        does not wait for it. ``on_done`` is told the seconds it took once the last unit is adopted."""
        self._progressive = ProgressivePacking(self, pin, on_done)
        return self._progressive

    def packing_done(self, packing: ProgressivePacking) -> None:
        """``packing`` has no unit left to adopt (all adopted, or abandoned); it closed its gate."""
        if self._progressive is packing:
            self._progressive = None

    def offloaded(self, unit: Unit) -> bool:
        """Whether ``unit`` has a host copy, or is getting one (packed progressively); False once restored."""
        if unit.stored is not None:
            return True
        return self._progressive is not None and unit.index + 1 in self._progressive.pending

    # ------------------------------------------------------------------------------------ compressed only

    @property
    def raw_homes(self) -> RawHomes | None:
        """Compressed only: which units' raw bytes wait in the raw home."""
        return self.form.raw_homes

    @property
    def raw_home(self) -> RawHome | None:
        """Compressed only: where the raw bytes of units kept compressed wait."""
        return self.raw_homes.home if self.raw_homes is not None else None

    def keep_raw_in(self, home: RawHome) -> RawHomes:
        """Before set-up packs: the raw bytes of units kept compressed will wait in ``home`` (`RawHomes.settle` as
        each is encoded); the copies are compressed only from now on (`host_forms.CompressedOnly`)."""
        homes = RawHomes(home, self.positions, self.binding, self.raw_tensor, functools.partial(decoded, self))
        self.form = CompressedOnly(self, homes)
        return homes

    def raw_at_hand(self, unit: Unit) -> bool:
        """Whether ``unit``'s raw bytes are in a RAM buffer of its own (`HostForm.raw_at_hand`)."""
        return self.form.raw_at_hand(unit)

    def raw_tensor(self, unit: Unit) -> torch.Tensor:
        """``unit``'s current raw bytes as one flat tensor: its host buffer, or, when a stand-in holds them,
        gathered tensor by tensor into a new buffer (an edit of a unit compressed only re-encodes from it)."""
        host = self.readable(unit)
        if isinstance(host, torch.Tensor):
            return host
        flat = host_buffer(unit.nbytes)
        flat.zero_()  # the padding between tensors, as packing leaves it
        copy_by_tensor(unit, host, flat)
        return flat

    def copy_raw_into(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Enqueue a raw load of ``unit`` into the device ``buffer`` on the current stream: one copy of its host
        buffer, or, from a stand-in (a unit compressed only whose edited payload no longer fits its staging
        room), one copy per tensor."""
        host = self.readable(unit)
        if isinstance(host, torch.Tensor):
            buffer.copy_(host, non_blocking=True)
        else:
            copy_by_tensor(unit, host, buffer, non_blocking=True)

    def spill_payloads(self) -> None:
        """Compressed only: move the payloads out of RAM into the payload file (`CompressedCopies.spill`). The
        model must be inactive; units still arriving are waited for first."""
        self.gate_all()
        self.form.spill_payloads()

    def let_go_payload(self, unit: Unit) -> bool:
        """Compressed only: ``unit``'s payload leaves RAM for the payload file while the model is active, when
        the file holds it (`CompressedCopies.let_go`; the caller waited for the copies that read it); its next
        read asks the caller's gate, which takes it back (`read_unit`, `take_unit`). False when it stays (not
        compressed only or not compressed, not in RAM, or the file does not hold it)."""
        return self.form.let_go_payload(unit)

    @property
    def holds_movable_bytes(self) -> bool:
        """`HostForm.holds_movable_bytes` of the current form."""
        return self.form.holds_movable_bytes

    @property
    def waiting_on_disk(self) -> bool:
        """`HostForm.waiting_on_disk` of the current form."""
        return self.form.waiting_on_disk

    def waiting_positions(self) -> list[int]:
        """`HostForm.waiting_positions` of the current form."""
        return self.form.waiting_positions()

    def arrival_bytes(self) -> list[int]:
        """`HostForm.arrival_bytes` of the current form."""
        return self.form.arrival_bytes()

    @property
    def stored_bytes(self) -> int:
        """`HostForm.stored_bytes` of the current form."""
        return self.form.stored_bytes

    # ------------------------------------------------------------------------------------ reading host bytes

    def host_of(self, unit: Unit) -> Flat:
        """What ``unit``'s tensors view as its host copy once it holds the unit's final bytes (every open gate
        is asked first): its flat buffer, or a stand-in for it. A unit kept as payloads only is decoded into RAM
        first, to be written (`raw_homes.RawHomes.open`; its owner closes it again: `HostForm.close_decoded`)."""
        self.gates.ask(unit)
        if isinstance(unit.stored, InPayloadsOnly) and self.raw_homes is not None:
            self.raw_homes.open(unit)
        host = unit.host
        assert host is not None, f"{unit.name} has no host copy"
        return host

    def readable(self, unit: Unit) -> Flat:
        """``unit``'s host bytes to read, changing nothing: `host_of`'s, or, for a unit kept as payloads only, its
        bytes decoded into a new RAM buffer (`payloads_only.decoded`)."""
        return decoded(self, unit) if isinstance(unit.stored, InPayloadsOnly) else self.host_of(unit)

    def payload_of(self, unit: Unit) -> EncodedUnit:
        """``unit``'s compressed copy once its payload is final (every open gate is asked first: a payload may
        be arriving from the payload file)."""
        self.gates.ask(unit)
        return self.compressed.encoded[unit.index]

    def expect_arrivals(self, gate: Gate) -> OpenGate:
        """Units are about to arrive from disk (the caller reads them back and adopts each with `take_unit`):
        until the caller closes the `OpenGate` returned, every read of a unit's host bytes asks ``gate`` first,
        which returns once that unit's final buffer is adopted."""
        return self.gates.open(gate)

    @property
    def arriving(self) -> bool:
        """Some host bytes are not final yet (packed, or arriving from disk): reads ask a gate first."""
        return self.gates.any_open

    def where(self) -> HostPlaces:
        """Where the host copies are now, in bytes (`HostForm.where` of the current form)."""
        return self.form.where()

    def gate_all(self) -> None:
        """Every host copy final: units still packed adopted and locked, units still arriving waited for."""
        if self._progressive is not None:
            self._progressive.wait_all()
        if self.gates.any_open:
            for unit in self.positions:
                self.host_of(unit)

    @property
    def encoded(self) -> dict[int, EncodedUnit]:
        """The compressed copy of each unit kept compressed, by unit index."""
        return self.compressed.encoded

    def transfer_bytes(self, index: int) -> int:
        """What a load of unit ``index`` moves over the link: its payload, or its raw bytes when not compressed."""
        encoded = self.encoded.get(index)
        return encoded.payload.numel() if encoded is not None else self.units[index].nbytes

    @property
    def packed_bytes(self) -> int:
        """Bytes of all host copies (base and units), wherever they are."""
        return sum(u.nbytes for u in self.positions)

    @property
    def host_ram_bytes(self) -> int:
        """Host RAM the host copies take now, raw and compressed (`where`)."""
        places = self.where()
        return places.ram_raw_bytes + places.ram_compressed_bytes

    # ------------------------------------------------------------------------------------ edits

    def edited(self, unit: Unit) -> None:
        """An edit reached ``unit``'s host copy: where it spills to no longer holds its bytes, and its
        compressed copy is made again."""
        self.form.edited(unit)
        self.compressed.cancel_arrival("an edit of the weights")  # the payloads being read are of the old weights
        if unit.index >= 0 and unit.index in self.encoded:
            self.compressed.refresh(unit)

    def mark_spill_current(self) -> None:
        """Say that where the host copies spill to holds their bytes now (the caller checked: e.g. the weight
        files they were loaded from). An edit clears it: `spill_is_current` turns false."""
        self.form.mark_spill_current()

    def mark_spill_stale(self) -> None:
        """The host copies may change (an edit begins): the next spill writes them."""
        self.form.mark_spill_stale()

    @property
    def spill_is_current(self) -> bool:
        """`HostForm.spill_is_current` of the current form."""
        return self.form.spill_is_current

    # ------------------------------------------------------------------------------------ spilling

    @property
    def spilled_to(self) -> Path | None:
        """Where the raw host copies wait while they are out of RAM (a cache file, or the weight files' folder)."""
        return self.form.spilled_to

    def spill(self, path: Path, hosts: list[Flat] | None = None, held_bytes: int = 0) -> None:
        """Move the raw host copies out of RAM, into the cache file ``path`` or onto ``hosts`` (`RawInRam.spill`);
        units still arriving are waited for first."""
        self.gate_all()
        if self.spilled_to is not None:
            return
        self.form.spill(path, hosts, held_bytes)

    def spilled_hosts(self) -> list[HostBytes | None]:
        """`HostForm.spilled_hosts` of the current form."""
        return self.form.spilled_hosts()

    def read_unit(
        self,
        position: int,
        host: HostBytes | None,
        pin: bool,
        read: ReadInto | None = None,
        reader: PieceReader = SERIAL,
        buffered: Callable[[], None] = lambda: None,
    ) -> ReadUnit:
        """`HostForm.read_unit` of the current form."""
        return self.form.read_unit(position, host, pin, read, reader, buffered)

    def take_unit(self, new: ReadUnit) -> None:
        """`HostForm.take_unit` of the current form."""
        self.form.take_unit(new)

    def untake_units(self, hosts: list[HostBytes | None]) -> None:
        """`HostForm.untake_units` of the current form."""
        self.form.untake_units(hosts)

    @staticmethod
    def drop_read(read: list[ReadUnit]) -> None:
        """Free what `read_unit` read without adopting it (a read given up, or made stale by an edit)."""
        for unit in read:
            unit.drop()

    # ------------------------------------------------------------------------------------ removal

    def restore(self, on_restored: Callable[[Unit], None]) -> None:
        """Give every tensor its own storage again, bit-exact, on the device it came from (the model is
        inactive), telling ``on_restored`` of each unit done. Units go one by one, each all-or-nothing: if one
        fails (out of memory, say), those not restored yet stay packed and correct, and `restore` may be
        called again. Packing still under way is abandoned first: units not adopted keep their own tensors."""
        if self._progressive is not None:
            self._progressive.abandon()
        self.gate_all()
        with torch.no_grad(), torch.inference_mode(False):
            for unit in [*self.units, self.base]:
                if unit.stored is None:
                    continue
                try:
                    self.form.before_restore(unit)  # payloads only: decoded into RAM, to be copied from
                    restore_unit(unit)
                except Exception as exc:  # Ctrl-C goes on as it is: the user asked to stop, not a fault to explain
                    raise OffloadStateError(
                        f"could not restore {unit.name!r} ({exc}); the rest still streams on demand. "
                        "Free memory and call remove() again"
                    ) from exc
                on_restored(unit)
        self.compressed.release()
        self.form = self.form.restored()
