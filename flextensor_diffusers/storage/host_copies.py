"""`HostCopies`: the one owner of every unit's host bytes, the weights' truth, wherever they are.

Every parameter and buffer of a unit (and of the *base*, the weights outside units) lives in one flat host
buffer from set-up to removal; device memory only ever holds copies of it. A unit's host bytes are in one of
these places, and this object alone knows which:

* **RAM, raw**: a flat buffer of its own (page-locked for CUDA), packed at set-up (`start_packing`), or
  while the model already runs, each unit adopted when first asked for (`start_progressive_packing`; until
  then the gate below is set and the unit's tensors are still its own);
* **RAM, compressed** as well, when compression is on (`compressed`, a `CompressedCopies`): loads may move the
  payload and decode it on the device; the raw bytes stay the truth;
* **compressed only** (``raw_copies="disk"``, and always under a pipeline's host budget with compression): the
  raw bytes of each unit kept compressed leave RAM as soon as its payload is made, for a `RawHome` (the weight
  files it was loaded from, else one cache file; `raw_homes.RawHomes`); RAM holds payloads, plus the raw bytes
  of the base and of units not worth compressing. Every load of such a unit decodes its payload. Its payloads
  can then wait on disk as well (`spill_payloads`: in the payload file), and come back unit by unit as below;
* **a cache file** (`spill`): a shared mapping of one file for all units, written once and kept, unwritten
  again, until an edit;
* **the weight files** the model was loaded from (`spill` with stand-ins): private copy-on-write views, so an
  edit made while a unit waits there lands in anonymous memory, never in the user's files;
* **arriving**: read back from disk unit by unit while the model already computes. Another thread reads each
  unit into a new buffer (`read_unit`); the main thread adopts it (`take_unit`); the last one taken ends the
  spill. Until then ``host_gate`` is set, and every read of a unit's host bytes (a load, the copies made at
  activation, edits, ``state_dict``, spilling, removal) asks it first with `host_of`: the gate returns once
  the unit's final buffer is adopted. With nothing arriving the gate is None: one check per load.

Which components wait where is policy, and lives with the caller (the pipelines' host tier); this object only
moves bytes and says where they are.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..engine.binding import Binding
from ..engine.errors import FlexTensorError, OffloadStateError, first_line
from ..engine.units import Unit, copy_into, copy_tensor_into, pack_unit, pin_unit, restore_unit, unpin_unit
from . import packing_line
from .cache_files import drop_cached_pages_later, map_cache_file, write_cache_file
from .codec import EncodedUnit
from .compressed_copies import CompressedCopies
from .file_reads import SERIAL, PieceReader
from .host_memory import host_buffer, page_locked, pin_in_place, return_freed_heap
from .packing_line import PackingLine
from .raw_homes import RawHome, RawHomes
from .setup_threads import PACK_THREADS, ThreadedWork
from .shared_host import SharedHostMemory

logger = logging.getLogger(__name__)

#: ``read(position, buffer, reader)``: fills one unit's new buffer (position 0: the base) straight from where its
#: stand-in's bytes live, e.g. large reads of a weight file instead of page faults through a mapping, in pieces
#: on ``reader``'s threads.
ReadInto = Callable[[int, torch.Tensor, PieceReader], None]


#: Packing a unit of this many bytes gives the C heap's free pages back (`give_back_freed_originals`).
TRIM_AFTER_BYTES = 1 << 20

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

    @property
    def label(self) -> str:
        """A word for a report: "disk" while any copy a load needs waits there (arriving or not), else
        "ram compressed" when RAM holds compressed copies only, else "ram"."""
        if self.disk_bytes:
            return "disk"
        return "ram compressed" if self.raw_disk_bytes else "ram"


def give_back_freed_originals(unit: Unit) -> None:
    """``unit`` was just packed and its original tensors freed: give the C heap's free pages back now
    (`host_memory.return_freed_heap`), not at the heap's next trim, which may never come. Any original may have sat
    on the heap, whatever its size (a pipeline built in FP32 and cast, packed before set-up returned on the CPU:
    0.5 GB of its originals stayed resident, a 66 MB embedding among them)."""
    if unit.nbytes >= TRIM_AFTER_BYTES:
        return_freed_heap()


def copy_by_tensor(unit: Unit, stand_in: object, buffer: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy ``unit``'s bytes from a stand-in for its flat host buffer, which gives them only when sliced at each
    tensor's range (`PackedTensor.view_of`), into the flat ``buffer``, tensor by tensor."""
    for packed in unit.tensors:
        end = packed.offset + packed.nbytes
        buffer[packed.offset : end].copy_(stand_in[packed.offset : end], non_blocking=non_blocking)  # type: ignore[index]


class PackingWindow:
    """Lets a unit be packed only within ``size`` positions of the furthest one asked for so far, so that
    packing cannot run far ahead of a consumer that frees each unit's RAM once done with it (compressed only).
    The consumer asks in order, and a position asked for is always within the window: no wait can deadlock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._asked = 0
        self._cond = threading.Condition()

    def ask(self, position: int) -> None:
        with self._cond:
            if position > self._asked:
                self._asked = position
                self._cond.notify_all()

    def wait_to_pack(self, position: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: position <= self._asked + self.size)

    def open_all(self) -> None:
        """Let every remaining unit be packed (the consumer is done, or failed)."""
        self.ask(1 << 62)


class Packing:
    """Units being packed on threads (`HostCopies.start_packing`): the host gate meanwhile."""

    def __init__(
        self, host: HostCopies, work: ThreadedWork[Unit], positions: dict[int, int], window: PackingWindow | None
    ) -> None:
        self._host = host
        self._work = work
        self._positions = positions
        self._window = window

    def gate(self, unit: Unit) -> None:
        position = self._positions[unit.index]
        if self._window is not None:
            self._window.ask(position)
        self._work.wait_for(position)

    def finish(self) -> float:
        """Wait for every unit, lift the gate, raise the first failure; seconds the packing took."""
        if self._window is not None:
            self._window.open_all()
        try:
            return self._work.finish()
        finally:
            if self._host.host_gate == self.gate:  # bound methods compare by instance
                self._host.host_gate = None


@dataclasses.dataclass(frozen=True)
class PackedCopy:
    """One unit's bytes copied by the packing line and not adopted yet (`ProgressivePacking`): its new flat
    buffer, and each tensor's edit count when its copy began."""

    buffer: torch.Tensor
    versions: tuple[int, ...]


class ProgressivePacking:
    """Raw host copies packed while the model is already in use (`HostCopies.start_progressive_packing`): set-up
    returns at once, and the first forward waits only for the units it reaches, so packing overlaps the first
    forward instead of preceding it.

    The process's packing line (`packing_line.LINE`) copies each unit into a new flat buffer, one unit at a time
    for all models. A unit's tensors are re-pointed at its buffer on a thread that asks for its host bytes (the
    host gate, `gate`), so no tensor changes under code that reads it on another thread; the originals are freed
    then. A tensor edited in place while or after it was copied is found by its edit count and copied again at
    adoption. Until a unit is adopted its original tensors stay alive, so at most one unit (of the whole process)
    is held twice: the host peak is the weights plus the largest unit. Page-locking (``pin``) needs no original:
    each adopted buffer is locked in place on threads of this packing's own (`_lock`) while the line copies the
    next unit; until then loads read it pageable, which is as correct and slower. A buffer that cannot be locked
    stays pageable (`host_memory.pin_in_place` says so).

    The packing ends (`HostCopies.packing_done`, ``on_done`` told the seconds it took) at the first gate after
    every unit is adopted and locked; `wait_all` waits for that. A unit whose copy failed keeps its original
    tensors; asking for it raises a one-line error naming the fix.
    """

    def __init__(self, host: HostCopies, pin: bool, on_done: Callable[[float], None]) -> None:
        self._host = host
        self._line: PackingLine = packing_line.LINE  # looked up now: a test may give each of its models its own
        self._on_done = on_done  # told the seconds packing took once the last unit is adopted and locked
        self._started = time.perf_counter()
        self._last_packed = self._started
        #: Positions not adopted yet: their tensors are still the model's own.
        self.pending: set[int] = set(range(len(host.positions)))
        #: Positions whose copies failed, with what they raised.
        self.failed: dict[int, BaseException] = {}
        self._locker = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="flextensor-pin") if pin else None
        self._locks_left = 0  # buffers adopted and not locked yet (counted under ``_count``)
        self._count = threading.Lock()
        self._finished = False
        self._line.join(self, list(range(len(host.positions))))

    def copy(self, position: int) -> PackedCopy:
        """The unit at ``position`` copied into a new flat buffer (on the line's thread)."""
        unit = self._host.positions[position]
        versions = tuple(packed.tensor._version for packed in unit.tensors)
        buffer = host_buffer(unit.nbytes)
        with torch.no_grad():
            copy_into(unit, buffer)
        if self._host.on_packed is not None:
            self._host.on_packed(unit, buffer)
        self._last_packed = time.perf_counter()
        return PackedCopy(buffer, versions)

    def gate(self, unit: Unit) -> None:
        """The host gate while packing: return once ``unit`` is adopted; adopt the unit the line holds meanwhile
        (any model's: the line goes on only once it is), and end the packing once all is done."""
        position = unit.index + 1
        if position in self.pending:
            self._line.take(self, position)
        else:
            self._line.adopt_held()
        if not self.pending and self._locks_left == 0:
            self._finish()

    def wait_all(self) -> None:
        """Adopt every unit and wait for every lock, then end the packing; raise a unit's copy failure."""
        for position in sorted(self.pending):
            self._line.take(self, position)
        if self._locker is not None:
            self._locker.shutdown(wait=True)
        self._finish()

    def adopt(self, position: int, copy: PackedCopy) -> None:
        """Re-point the unit's tensors at ``copy`` (on the asking thread): its originals are freed, its buffer
        handed to be locked. Interrupted (Ctrl-C), the unit is either adopted or still pending."""
        locks = 1 if self._locker is not None else 0
        with self._count:  # counted before the unit leaves ``pending``: the packing cannot end before its lock
            self._locks_left += locks
        try:
            self._adopt(position, copy)
        except BaseException:
            with self._count:
                self._locks_left -= locks
            raise
        unit = self._host.positions[position]
        give_back_freed_originals(unit)
        if self._locker is not None:
            self._locker.submit(self._lock, unit, copy.buffer)

    def _adopt(self, position: int, copy: PackedCopy) -> None:
        unit = self._host.positions[position]
        recopied = False
        with torch.no_grad(), torch.inference_mode(False):
            for packed, version in zip(unit.tensors, copy.versions, strict=True):
                if packed.tensor._version != version:  # edited in place while or after it was copied
                    copy_tensor_into(packed, copy.buffer)
                    recopied = True
            unit.bind(copy.buffer)
        if recopied and self._host.on_packed is not None:
            self._host.on_packed(unit, copy.buffer)
        unit.host, unit.pinned_in_place = copy.buffer, False
        self.pending.discard(position)

    def _lock(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Page-lock an adopted buffer in place (on this packing's threads). The flag is read only once every
        lock is done (`wait_all`, `abandon`): whoever replaces or frees ``unit.host`` waits for them first."""
        try:
            unit.pinned_in_place = pin_in_place(buffer)
        finally:
            with self._count:
                self._locks_left -= 1
                self._last_packed = time.perf_counter()

    def failure(self, position: int) -> FlexTensorError:
        unit, cause = self._host.positions[position], first_line(self.failed[position])
        return FlexTensorError(
            f"packing {unit.name!r} into host memory failed ({cause}): free host memory (or pass a host_budget), "
            "then remove() the offload and offload again; the model's weights are unchanged"
        )

    def _finish(self) -> None:
        with self._count:
            if self._finished:
                return
            self._finished = True
        self._line.leave(self)
        if self._locker is not None:
            self._locker.shutdown(wait=False)
        self._host.packing_done(self)
        self._on_done(self._last_packed - self._started)

    def abandon(self) -> None:
        """Stop packing (removal): units not copied are not, one being copied is waited for, and every unit not
        adopted keeps its original tensors; the copy held for one is dropped. Locks under way are waited for."""
        self._line.leave(self)
        if self._locker is not None:
            self._locker.shutdown(wait=True)
        self.pending = set()
        self._host.packing_done(self)


class HostCopies:
    """Where each unit's host bytes are, and the verbs that move them (see the module docstring).

    Units are numbered by *position*: 0 is the base, ``i + 1`` is unit ``i``. Re-pointing tensors from one
    host buffer to another goes through ``binding``, so that a unit computing on the device keeps its device
    copy and every edit found on the way reaches the truth first.
    """

    def __init__(self, base: Unit, units: list[Unit], device: torch.device, binding: Binding) -> None:
        self.base = base
        self.units = units
        self.device = device
        self.cuda = device.type == "cuda"
        self.binding = binding
        #: Units kept compressed as well (`CompressedCopies.make`; payloads pinned for CUDA).
        self.compressed = CompressedCopies(units, device, self.raw_tensor)
        #: Called on the main thread with a unit before its host bytes are read while units arrive (see the
        #: module docstring); None when every host copy is final.
        self.host_gate: Callable[[Unit], None] | None = None
        #: Where the host copies wait while they are out of RAM (a cache file, or the weight files' folder).
        self.spilled_to: Path | None = None
        self._current = False  # where they spill to holds their bytes (no edit since)
        self._held_bytes: int | None = None  # while on stand-ins: what those keep in RAM
        self._taken: set[int] = set()  # positions already taken back into RAM during a spill
        #: Compressed only (see the module docstring): where raw bytes of units kept compressed wait (`keep_raw_in`).
        self.raw_homes: RawHomes | None = None
        self._payloads_taken: list[int] = []  # units whose payloads were taken back during a payload spill
        self._progressive: ProgressivePacking | None = None  # packing still under way after set-up
        #: Told of each unit's bytes as they are packed, on the thread that packed them (``verify_loads``
        #: fingerprints them while they are at hand: compressed only, they leave RAM soon after); None: nobody.
        self.on_packed: Callable[[Unit, torch.Tensor], None] | None = None

    @property
    def positions(self) -> list[Unit]:
        """The base, then the units: position ``p`` is unit ``p - 1``."""
        return [self.base, *self.units]

    # ------------------------------------------------------------------------------------ packing

    def start_packing(
        self, pin: bool, shared: SharedHostMemory | None, attaching: bool, window: int | None = None
    ) -> Packing:
        """Start copying every unit and the base into flat host buffers (or attaching them to shared ones),
        each page-locked by the task that packed it when ``pin``; set-up goes on meanwhile, and `host_of` waits
        for the unit it asks for (the device encoder codes the first blocks while the last are packed).

        One task per unit on a few threads: a copy into host memory is bound by one core's memory bandwidth,
        and the copies and ``cudaHostRegister`` release the GIL, so one thread's registration overlaps the
        others' copies. Host memory grows by at most one unit per thread. A failure is raised by
        `Packing.finish` once every task has ended: the caller restores whatever was packed. With ``window``, a
        unit is packed only within that many positions of the furthest one asked for (`PackingWindow`)."""
        gate = PackingWindow(window) if window is not None else None
        positions = {unit.index: position for position, unit in enumerate(self.positions)}

        def pack_one(unit: Unit) -> None:
            if gate is not None:
                gate.wait_to_pack(positions[unit.index])
            with torch.no_grad():
                pack_unit(unit, host=shared.buffer(unit.index) if shared is not None else None, filled=attaching)
            give_back_freed_originals(unit)
            if pin:
                pin_unit(unit, attached=attaching)
            if self.on_packed is not None:
                self.on_packed(unit, unit.host)  # type: ignore[arg-type]
            if self.raw_homes is not None and unit.index >= 0:  # while its bytes are at hand; the base stays in RAM
                self.raw_homes.home.prepare(positions[unit.index], unit)

        units = self.positions
        verb = "attaching to shared weights" if attaching else "packing weights"
        work = ThreadedWork(pack_one, units, f"{verb} and pinning them" if pin else verb)
        packing = Packing(self, work, positions, gate)
        self.host_gate = packing.gate
        return packing

    def start_progressive_packing(self, pin: bool, on_done: Callable[[float], None]) -> ProgressivePacking:
        """Start packing every unit and the base on threads, to be adopted as each is first asked for
        (`ProgressivePacking`): set-up does not wait for it. ``on_done`` is told the seconds it took once the
        last unit is adopted."""
        packing = ProgressivePacking(self, pin, on_done)
        self._progressive = packing
        self.host_gate = packing.gate
        return packing

    def packing_done(self, packing: ProgressivePacking) -> None:
        """``packing`` has no unit left to adopt (all adopted, or abandoned): reads no longer ask it."""
        if self._progressive is packing:
            self._progressive = None
        if self.host_gate == packing.gate:  # bound methods compare by instance
            self.host_gate = None

    def offloaded(self, unit: Unit) -> bool:
        """Whether ``unit`` has a host copy, or is getting one (packed progressively, not adopted yet); False
        once `restore` gave its tensors back."""
        if unit.host is not None:
            return True
        return self._progressive is not None and unit.index + 1 in self._progressive.pending

    # ------------------------------------------------------------------------------------ compressed only

    @property
    def compressed_only(self) -> bool:
        """Raw bytes of units kept compressed wait outside RAM (``raw_copies="disk"``; see the module docstring)."""
        return self.raw_homes is not None

    @property
    def raw_home(self) -> RawHome | None:
        """Compressed only: where the raw bytes of units kept compressed wait."""
        return self.raw_homes.home if self.raw_homes is not None else None

    def keep_raw_in(self, home: RawHome) -> RawHomes:
        """Before set-up packs: the raw bytes of units kept compressed will wait in ``home`` (`RawHomes.settle` as
        each is encoded)."""
        self.raw_homes = RawHomes(home, self.positions, self.binding, self.raw_tensor)
        return self.raw_homes

    def raw_at_hand(self, unit: Unit) -> bool:
        """Whether ``unit``'s raw bytes are in a RAM buffer of its own (a raw load copies them at full speed),
        not in a stand-in of the raw home or of a spill."""
        position = unit.index + 1
        if self.raw_homes is not None and position in self.raw_homes.homed:
            return False
        return self.spilled_to is None or position in self._taken

    def raw_tensor(self, unit: Unit) -> torch.Tensor:
        """``unit``'s current raw bytes as one flat tensor: its host buffer, or, when a stand-in holds them,
        gathered tensor by tensor into a new buffer (an edit of a unit compressed only re-encodes from it)."""
        host = self.host_of(unit)
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
        host = self.host_of(unit)
        if isinstance(host, torch.Tensor):
            buffer.copy_(host, non_blocking=True)
        else:
            copy_by_tensor(unit, host, buffer, non_blocking=True)

    def spill_payloads(self) -> None:
        """Compressed only: move the payloads out of RAM into the payload file (`CompressedCopies.spill`). The
        model must be inactive; units still arriving are waited for first."""
        self.gate_all()
        if any(self.binding.on_device(unit) is not None for unit in self.positions):
            raise OffloadStateError("spill_payloads() needs an inactive model: release() it first")
        self.binding.sweep()  # an edit found now re-encodes before the payloads leave
        self.compressed.spill()
        self._payloads_taken = []

    def let_go_payload(self, unit: Unit) -> bool:
        """Compressed only: ``unit``'s payload leaves RAM for the payload file while the model is active, when
        the file holds it (`CompressedCopies.let_go`; the caller waited for the copies that read it); its next
        read passes `host_gate` (the caller's), which takes it back (`read_unit`, `take_unit`). False when it stays
        (not compressed, not in RAM, or the file does not hold it)."""
        compressed = self.compressed
        if not self.compressed_only or unit.index not in compressed.encoded or unit.index in compressed.waiting:
            return False
        if not compressed.file_current:
            return False
        compressed.let_go(unit.index)
        return True

    @property
    def holds_movable_bytes(self) -> bool:
        """Host copies are in RAM that could move to disk: payloads not waiting yet (compressed only), else the
        raw copies, unless spilled."""
        if self.compressed_only:
            return len(self.compressed.waiting) < len(self.compressed.encoded)
        return self.spilled_to is None

    @property
    def waiting_on_disk(self) -> bool:
        """Whether bytes a load needs wait on disk: the payloads (compressed only), else the raw host copies."""
        if self.compressed_only:
            return bool(self.compressed.waiting)
        return self.spilled_to is not None

    def waiting_positions(self) -> list[int]:
        """The positions a read back brings into RAM: those whose payloads wait in the payload file
        (compressed only), else all of a spill's."""
        if self.compressed_only:
            return sorted(index + 1 for index in self.compressed.waiting)
        return list(range(len(self.positions))) if self.spilled_to is not None else []

    def arrival_bytes(self) -> list[int]:
        """Per position, the bytes a read back of it brings into RAM (0 for one that does not wait)."""
        if self.compressed_only:
            waiting = self.compressed.waiting
            return [
                self.encoded[p - 1].payload.numel() if p and p - 1 in waiting else 0 for p in range(len(self.positions))
            ]
        return [u.nbytes for u in self.positions]

    @property
    def stored_bytes(self) -> int:
        """Host RAM the host copies take when all are in RAM: raw and compressed copies, less the raw bytes
        that wait in the raw home for good (compressed only)."""
        raw = self.packed_bytes if self.raw_homes is None else self.raw_homes.raw_ram_bytes(self.packed_bytes)
        return raw + self.compressed.stored_bytes

    # ------------------------------------------------------------------------------------ reading host bytes

    def host_of(self, unit: Unit) -> torch.Tensor:
        """``unit.host`` once it holds the unit's final bytes (`host_gate` is asked first, when set)."""
        gate = self.host_gate
        if gate is not None:
            gate(unit)
        return unit.host  # type: ignore[return-value]

    def payload_of(self, unit: Unit) -> EncodedUnit:
        """``unit``'s compressed copy once its payload is final (`host_gate` is asked first, when set: a payload
        may be arriving from the payload file)."""
        gate = self.host_gate
        if gate is not None:
            gate(unit)
        return self.compressed.encoded[unit.index]

    def expect_arrivals(self, gate: Callable[[Unit], None]) -> None:
        """Units are about to arrive from disk (the caller reads them back and adopts each with `take_unit`):
        until `arrivals_done`, every read of a unit's host bytes asks ``gate`` first, which returns once that
        unit's final buffer is adopted."""
        self.host_gate = gate

    def arrivals_done(self, gate: Callable[[Unit], None]) -> None:
        """The arrivals ``gate`` was for are over (all taken, or given up): reads no longer ask it. A gate that
        was replaced meanwhile (set-up's packing, another read back) stays."""
        if self.host_gate is gate:
            self.host_gate = None

    def where(self) -> HostPlaces:
        """Where the host copies are now, in bytes: in RAM (all of them; while spilled, what stand-ins keep in
        RAM and the units already taken back), compressed in RAM, the rest on disk (and which file or folder),
        and whether units are arriving from disk."""
        payloads = self.compressed.payload_bytes
        if self.raw_homes is not None:
            waiting = self.compressed.stored_bytes - payloads
            return HostPlaces(
                ram_raw_bytes=self.raw_homes.raw_ram_bytes(self.packed_bytes),
                ram_compressed_bytes=payloads,
                disk_bytes=waiting,
                disk_path=str(self.compressed.file.path) if waiting and self.compressed.file else None,
                arriving=self.host_gate is not None,
                raw_disk_bytes=self.raw_homes.homed_bytes,
            )
        if self.spilled_to is None:
            return HostPlaces(ram_raw_bytes=self.packed_bytes, ram_compressed_bytes=payloads)
        in_ram = (self._held_bytes or 0) + sum(self.positions[p].nbytes for p in self._taken)
        return HostPlaces(
            ram_raw_bytes=in_ram,
            ram_compressed_bytes=payloads,
            disk_bytes=max(self.packed_bytes - in_ram, 0),
            disk_path=str(self.spilled_to),
            arriving=self.host_gate is not None,
        )

    def gate_all(self) -> None:
        """Every host copy final: units still packed are adopted and locked, units still arriving waited for,
        one by one."""
        if self._progressive is not None:
            self._progressive.wait_all()
        if self.host_gate is not None:
            for unit in self.positions:
                self.host_of(unit)

    @property
    def encoded(self) -> dict[int, EncodedUnit]:
        """The compressed copy of each unit kept compressed, by unit index."""
        return self.compressed.encoded

    def transfer_bytes(self, index: int) -> int:
        """What a load of unit ``index`` moves over the link when it loads compressed (its raw bytes when it is
        not kept compressed)."""
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
        self._current = False
        if self.raw_homes is not None:
            self.raw_homes.rehome_written([unit.index + 1])
        self.compressed.cancel_arrival("an edit of the weights")  # the payloads being read are of the old weights
        if unit.index >= 0 and unit.index in self.encoded:
            self.compressed.refresh(unit)

    def mark_spill_current(self) -> None:
        """Say that where the host copies spill to holds their bytes now (the caller checked: e.g. the weight
        files they were loaded from). An edit clears it: `spill_is_current` turns false."""
        self._current = True

    def mark_spill_stale(self) -> None:
        """The host copies may change (an edit begins): the next spill writes them."""
        self._current = False

    @property
    def spill_is_current(self) -> bool:
        """No edit since the last spill or `mark_spill_current`: where the copies spill to still holds them
        (compressed only: the payload file holds every payload as it is)."""
        if self.compressed_only:
            return self.compressed.file_current
        return self._current

    # ------------------------------------------------------------------------------------ spilling

    def spill(self, path: Path, hosts: list[object] | None = None, held_bytes: int = 0) -> None:
        """Move the host copies out of RAM (the model must be inactive: no tensor views a device copy): into
        the cache file ``path``, or, given ``hosts``, onto bytes that are already elsewhere, writing nothing
        (``path`` then names that place).

        ``hosts``: per position, a stand-in for the unit's flat host buffer that gives a tensor's bytes when
        sliced at the tensor's range, as `PackedTensor.view_of` slices (e.g. private mappings of the weight
        files the model was loaded from); ``held_bytes`` of them stay in RAM. The caller vouches that they hold
        the current bytes (`mark_spill_current`, and `spill_is_current` since).

        A cache file is written completely before any tensor points at it, so a full or unwritable disk
        raises with the copies still in RAM; writing is skipped when the file holds these bytes already
        (spilled before, no edit since). Units still arriving are waited for first."""
        self.gate_all()
        if self.spilled_to is not None:
            return
        if any(self.binding.on_device(unit) is not None for unit in self.positions):
            raise OffloadStateError("spill() needs an inactive model: release() it first")
        self.binding.sweep()  # an edit since the last spill means the file must be written again
        held = None if hosts is None else held_bytes
        if hosts is None:
            if not (self._current and path.exists()):
                write_cache_file(path, self.positions, [self.host_of(u) for u in self.positions])
            hosts = map_cache_file(path, self.positions)  # type: ignore[assignment]
        if self.cuda:  # copies issued before release may still be reading the buffers about to be freed
            torch.cuda.synchronize(self.device)
        for unit, host in zip(self.positions, hosts, strict=True):  # type: ignore[arg-type]
            self.binding.to_host(unit, host)  # type: ignore[arg-type]
            unpin_unit(unit)
            unit.host = host  # type: ignore[assignment]
        self.spilled_to, self._held_bytes, self._taken, self._current = path, held, set(), True

    def spilled_hosts(self) -> list[object]:
        """The stand-ins of a spill, per position: what `read_unit` reads from and what `untake_units` points
        units back at. Taken with the model spilled and nothing taken yet."""
        if self.compressed_only:  # payloads are read from the payload file; nothing to point back at
            return [None] * len(self.positions)
        assert self.spilled_to is not None and not self._taken, "spilled_hosts() needs a spill with nothing taken"
        return [u.host for u in self.positions]

    def read_unit(
        self,
        position: int,
        host: object,
        pin: bool,
        read: ReadInto | None = None,
        reader: PieceReader = SERIAL,
        buffered: Callable[[], None] = lambda: None,
    ) -> Unit:
        """One spilled unit's bytes in a new RAM buffer, as a copy of the unit for `take_unit`: from
        ``read(position, buffer, reader)`` when given, else copied from its stand-in ``host``; in pieces on
        ``reader``'s threads (`file_reads`: units then arrive in the order read). Page-locked when ``pin`` (in
        place where CUDA allows, else a pinned copy), so that taking it back does no heavy work. Changes nothing
        of the model: runs on any thread, while the model waits or computes.

        Compressed only, the unit's payload is read from the payload file instead (checked against its
        checksum): the copy returned holds it as ``host``, its size as ``nbytes``. ``buffered`` is told once the
        new buffer is had (`CompressedCopies.read_payload`)."""
        unit = self.positions[position]
        if self.compressed_only:
            payload, locked = self.compressed.read_payload(unit.index, pin, reader, buffered)
            return dataclasses.replace(unit, host=payload, nbytes=payload.numel(), pinned_in_place=locked)
        buffer = host_buffer(unit.nbytes)
        buffered()
        if read is not None:
            read(position, buffer, reader)
        elif not isinstance(host, torch.Tensor):  # a stand-in is sliced per tensor only
            copy_by_tensor(unit, host, buffer)
        else:  # a view of a cache file's mapping: its pages are read as the pieces fault them in
            step = reader.piece_bytes(unit.nbytes)
            ends = [(a, min(a + step, unit.nbytes)) for a in range(0, unit.nbytes, step)]
            reader.run([functools.partial(_copy_range, buffer, host, a, b) for a, b in ends])
        buffer, in_place = page_locked(buffer) if pin else (buffer, False)
        return dataclasses.replace(unit, host=buffer, pinned_in_place=in_place)

    def take_unit(self, new: Unit) -> None:
        """Adopt one unit's buffer that `read_unit` filled, on the main thread, while the model is spilled
        (active or not): ``unit.host`` becomes it, and tensors that viewed the stand-in follow. No copy still
        reads the stand-in: every read of host bytes passes `host_gate`, which adopts first. The last unit
        taken ends the spill; a cache file is kept for the next one, its pages dropped from the page cache."""
        position = new.index + 1
        unit = self.positions[position]
        if self.compressed_only:
            assert new.index in self.compressed.waiting, f"{unit.name}'s payload is not waiting to be taken"
            self.compressed.take(new.index, new.host, new.pinned_in_place)  # type: ignore[arg-type]
            self._payloads_taken.append(new.index)
            return
        assert self.spilled_to is not None and position not in self._taken, f"{unit.name} is not waiting to be taken"
        self.binding.rehost(unit, new.host)  # type: ignore[arg-type]
        unit.host, unit.pinned_in_place = new.host, new.pinned_in_place
        self._taken.add(position)
        if len(self._taken) == len(self.positions):
            if self._held_bytes is None:
                drop_cached_pages_later(self.spilled_to)
            self.spilled_to, self._held_bytes, self._taken = None, None, set()

    def untake_units(self, hosts: list[object]) -> None:
        """Undo `take_unit` for every unit taken so far in this spill, pointing them back at their stand-ins
        ``hosts`` (`spilled_hosts`), which still hold their bytes: a read back given up leaves the model spilled
        as before. The taken buffers are freed, so copies that may still read them finish first."""
        if self.compressed_only:
            self.compressed.untake(self._payloads_taken)
            self._payloads_taken = []
            return
        if not self._taken:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for position in sorted(self._taken):
            unit = self.positions[position]
            self.binding.rehost(unit, hosts[position])  # type: ignore[arg-type]
            unpin_unit(unit)
            unit.host = hosts[position]  # type: ignore[assignment]
        self._taken = set()

    @staticmethod
    def drop_read(read: list[Unit]) -> None:
        """Free what `read_unit` read without adopting it (a read given up, or made stale by an edit)."""
        for unit in read:
            unpin_unit(unit)

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
                if unit.host is None:
                    continue
                try:
                    restore_unit(unit)
                except Exception as exc:  # Ctrl-C goes on as it is: the user asked to stop, not a fault to explain
                    raise OffloadStateError(
                        f"could not restore {unit.name!r} ({exc}); the rest still streams on demand. "
                        "Free memory and call remove() again"
                    ) from exc
                on_restored(unit)
        self.compressed.release()
        if self.raw_homes is not None:
            self.raw_homes.close()
            self.raw_homes = None


def _copy_range(buffer: torch.Tensor, host: torch.Tensor, start: int, end: int) -> None:
    """One piece of a unit read from its stand-in: bytes ``[start, end)``."""
    buffer[start:end].copy_(host[start:end])
