"""Where every weight of an offloaded model lives, and the one object that moves it.

**The truth of a weight is its packed host buffer.** Every parameter and buffer of a unit (and of
the *base*, the weights outside units) is a view of one flat host buffer from set-up to removal.
Device memory only ever holds copies of those bytes:

* the base buffer and the resident units' buffers while the model is *active*;
* slots: a streamed unit's parameters are permanent views of its slot, whose bytes are those of
  whichever unit was loaded last (``slot_owner``).

So an edit that writes into device memory is lost at the next load or release. Edits therefore go
through `Residency.editing`: every tensor points at its host copy while the edit runs, tensors the
edit replaced are adopted into the host buffer, and device copies are made again afterwards.

A host copy may live on disk instead of in RAM (`spill` / `fill`, for a host-memory budget): the
flat buffers are then stand-ins over a mapping (a shared mapping of a cache file, or private views
of the weight files), so the truth is there, edits included, until it is read back into (pinned)
RAM. It is read back whole (`fill`) or unit by unit while the model already computes: another
thread reads each unit into a new buffer (`read_unit`) and the main thread adopts it (`take_unit`);
the last one taken ends the spill. Until then ``host_gate`` is set, and every read of a unit's host
bytes (a load's copy, the base and resident copies at activation, edits, ``state_dict``, spilling,
teardown) first calls it with the unit: the gate returns once the unit's final buffer is adopted.
Copies therefore never read a stand-in that is about to be replaced, and with nothing under way the
gate is None, one check per load.

Tensors of the model that are not packed (``loose``: they share storage with another tensor; and
``foreign``: added after set-up, e.g. LoRA adapters) follow the model with ``.to()`` on activate
and release, so they are always on the device the model computes on.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .binding import Binding
from .codec import EncodedUnit, decode_into
from .compressed_copies import CompressedCopies
from .errors import FlexTensorError, OffloadStateError
from .host_memory import host_buffer, page_locked
from .planner import CUDA_ALLOCATION_GRANULE, Plan, allocated
from .setup_threads import PACK_THREADS, ThreadedWork
from .shared_host import SharedHostMemory
from .units import (
    ALIGNMENT,
    Unit,
    UnitLayout,
    align,
    aligned_buffer,
    pack_unit,
    pin_unit,
    restore_unit,
    unpin_unit,
)

logger = logging.getLogger(__name__)

#: Cache files this process wrote (`Residency.spill`). Their owners delete them when offload is removed;
#: a process that exits without removing it deletes them here (their names carry its process id: no other
#: process uses them), so no run leaves weight copies behind in the cache folder.
_CACHE_FILES: set[Path] = set()


@atexit.register
def _delete_cache_files() -> None:
    for path in _CACHE_FILES:
        path.unlink(missing_ok=True)


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


class Packing:
    """Units being packed on threads (`Residency.start_packing`): the residency's host gate meanwhile."""

    def __init__(self, residency: Residency, work: ThreadedWork[Unit], positions: dict[int, int]) -> None:
        self._residency = residency
        self._work = work
        self._positions = positions

    def gate(self, unit: Unit) -> None:
        self._work.wait_for(self._positions[unit.index])

    def finish(self) -> float:
        """Wait for every unit, lift the gate, raise the first failure; seconds the packing took."""
        try:
            return self._work.finish()
        finally:
            if self._residency.host_gate == self.gate:  # bound methods compare by instance
                self._residency.host_gate = None


@dataclass
class SetupTimes:
    """Where set-up time went (ms): unit layout, copies into the flat buffers and their page-locking
    (`Residency.start_packing` does both per unit; with compression they overlap ``compress``), hooks."""

    layout: float = 0.0
    pack: float = 0.0
    hooks: float = 0.0
    compress: float | None = None  # only with compression

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in vars(self).items() if v is not None}


@dataclass
class DeviceCopies:
    """Device memory of an active model: the base buffer, resident unit buffers, slots."""

    base: torch.Tensor | None = None
    resident: dict[int, torch.Tensor] = field(default_factory=dict)
    slots: list[torch.Tensor] = field(default_factory=list)
    staging: list[torch.Tensor] = field(default_factory=list)  # per slot: a compressed load before decoding


class Residency:
    """Host buffers, device copies and the binding of every tensor to one of them.

    Invariants: a unit's tensors are views of exactly one flat buffer (host, its resident copy, or
    its slot); ``slot_owner[s]`` is the unit whose bytes slot ``s`` holds (None: unknown); a slot is
    written only by `load_now` here or by the schedule's copy stream, which orders the write after
    the slot's last reader.
    """

    def __init__(self, model: nn.Module, layout: UnitLayout, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cuda = device.type == "cuda"
        self.units: list[Unit] = layout.units
        self.base: Unit = layout.base
        #: (tensor, device it came from) for tensors moved with ``.to()`` instead of packed.
        self.loose: list[tuple[torch.Tensor, torch.device]] = [(t, t.device) for t in layout.loose]
        self._packed_ids = {id(p.tensor) for u in [self.base, *self.units] for p in u.tensors}
        self._packed_ids.update(id(t) for t, _ in self.loose)
        self.foreign: list[tuple[torch.Tensor, torch.device]] = []
        self.active = False
        self.copies = DeviceCopies()
        self.slot_of: list[int | None] = [0] * len(self.units)
        self.slot_owner: list[int | None] = [None]
        #: A streamed unit's bytes inside its slot (the destination of its loads).
        self.dst: list[torch.Tensor | None] = [None] * len(self.units)
        self.loads = [0] * len(self.units)
        self.bytes_streamed = 0
        #: Units kept compressed as well (`CompressedCopies.make`; payloads pinned for CUDA).
        self.compressed = CompressedCopies(self.units, device, self.host_of)
        #: The encoded units whose loads move the payload and decode it: all of them before a plan
        #: exists (profiling measures their decodes), then the plan's choice (`Plan.compressed`).
        self.decoding: frozenset[int] = frozenset()
        #: The cache file the host copies live in while spilled (None: in RAM).
        self.spilled_to: Path | None = None
        #: The file still holds the RAM copies' bytes (no edit since `fill`): spilling needs no write.
        self._file_current = False
        #: Called on the main thread with a unit before its host bytes are read, while units read back one
        #: by one are still arriving (see the module docstring); None when every host copy is final.
        self.host_gate: Callable[[Unit], None] | None = None
        #: Positions (0: the base, then 1 + unit index) already taken back into RAM during a spill.
        self._taken: set[int] = set()
        #: Where each unit's tensors point (their own device copy, or their host copy) and the edits made there.
        self.binding = Binding(self._positions(), device, self.host_of, self._edited)

    # ------------------------------------------------------------------------------------ set-up

    def start_packing(self, pin: bool, shared: SharedHostMemory | None, attaching: bool) -> Packing:
        """Start copying every unit and the base into flat host buffers (or attaching them to shared ones),
        each pinned right after its copy when ``pin``; set-up goes on meanwhile, and `host_of` waits for
        the unit it asks for (the device encoder codes the first blocks while the last are packed).

        One task per unit on `PACK_THREADS` threads (a copy into host memory is bound by one core's memory
        bandwidth; the copies and ``cudaHostRegister`` release the GIL). A unit is page-locked by the task
        that packed it, so one thread's registration overlaps the others' copies: on the H200, 28.1 GB in
        1.24 s this way against 1.78 s copying everything first (``setup_threads8_h200.json``,
        ``setup_threads16_h200.json``), though a model's set-up in ``peers.py`` packed the same bytes in
        2.84 s (``peers_setup_pack_pin_17f_h200.json``). Host memory grows by at most one unit per thread.
        A failure is raised by `Packing.finish` once every task has ended: the caller's teardown restores
        whatever was packed.
        """

        def pack_one(unit: Unit) -> None:
            with torch.no_grad():
                pack_unit(unit, host=shared.buffer(unit.index) if shared is not None else None, filled=attaching)
            if pin:
                pin_unit(unit, attached=attaching)

        units = [self.base, *self.units]
        verb = "attaching to shared weights" if attaching else "packing weights"
        work = ThreadedWork(pack_one, units, f"{verb} and pinning them" if pin else verb)
        packing = Packing(self, work, {unit.index: position for position, unit in enumerate(units)})
        self.host_gate = packing.gate
        return packing

    @property
    def resident_weight_bytes(self) -> int:
        """Weights on the device whenever the model is active, whatever the plan: base and loose, each as the
        allocator counts it (`planner.allocated`)."""
        granule = self.allocation_granule
        loose = sum(allocated(t.numel() * t.element_size(), granule) for t, _ in self.loose)
        return allocated(self.base.nbytes, granule) + loose

    @property
    def allocation_granule(self) -> int:
        """What the device's allocator rounds every buffer up to (and counts): 512 bytes on CUDA."""
        return CUDA_ALLOCATION_GRANULE if self.cuda else 1

    # ------------------------------------------------------------------------------------ activity

    def activate(self, plan: Plan | None) -> None:
        """Take device memory: the base, loose and foreign tensors, then resident units and slots."""
        if self.active:
            return
        self.check_tensors_are_ours()
        self.binding.sweep()  # edits made while inactive reach the copies made below
        with torch.no_grad(), torch.inference_mode(False):
            buffer = aligned_buffer(self.base.nbytes, self.device)
            buffer.copy_(self.host_of(self.base), non_blocking=True)
            self.binding.to_device(self.base, buffer)
            self.copies.base = buffer
            self.foreign = self._find_foreign()
            for t, _ in [*self.loose, *self.foreign]:
                t.data = t.data.to(self.device)
            self.active = True
            self.lay_out(plan)

    def release(self) -> None:
        """Give back all device memory; every tensor points at its host copy until `activate`."""
        if not self.active:
            return
        with torch.no_grad(), torch.inference_mode(False):
            self.unbind_units()
            if self.base.host is not None:
                self.binding.to_host(self.base)
            for t, origin in [*self.loose, *self.foreign]:
                t.data = t.data.to(origin)
        self.copies.base = None
        self.active = False

    def _find_foreign(self) -> list[tuple[torch.Tensor, torch.device]]:
        """Tensors added to the model after set-up (adapters), with the device they are on now."""
        found = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if id(t) not in self._packed_ids and id(t) not in found:
                found[id(t)] = (t, t.device if t.device != self.device else torch.device("cpu"))
        return list(found.values())

    def check_tensors_are_ours(self) -> None:
        """Refuse to go on when a packed tensor is no longer in the model: it was swapped for another
        object (in-place quantization, ``module.weight = nn.Parameter(...)``) outside `editing`, so
        its new value would never reach the device. Identity, not names: adapters re-wrap layers."""
        present = {id(t) for t in [*self.model.parameters(), *self.model.buffers()]}
        for unit in [self.base, *self.units]:
            if unit.host is None:
                continue
            for packed in unit.tensors:
                if id(packed.tensor) not in present:
                    name = f"{unit.name}.{packed.names[0]}" if unit.index >= 0 else packed.names[0]
                    raise OffloadStateError(
                        f"{name!r} was replaced by another tensor while offloaded, so its new value would "
                        "never reach the device: make such edits inside handle.editing() (pipelines: the "
                        "LoRA/state-dict methods do it for you), or disable offload, edit, and enable again"
                    )

    @property
    def device_bytes(self) -> int:
        """Device memory this residency holds now (base, resident copies, slots)."""
        copies = [self.copies.base, *self.copies.resident.values(), *self.copies.slots, *self.copies.staging]
        return sum(c.numel() for c in copies if c is not None)

    # ------------------------------------------------------------------------------------ layout

    def unbind_units(self) -> None:
        """Point the units at their host copies (edits made in device copies copied back first) and drop
        their slots and resident copies."""
        for unit in self.units:
            if unit.host is not None:  # during a failed set-up, not every unit is packed yet
                self.binding.to_host(unit)
        self.copies.resident, self.copies.slots, self.copies.staging = {}, [], []
        self.dst = [None] * len(self.units)
        self.slot_owner = []

    def lay_out(self, plan: Plan | None) -> None:
        """Device buffers for the units: per the plan, or one shared profiling slot before a plan exists."""
        self.unbind_units()  # old device buffers go before new ones are taken
        if not self.units:
            return
        with torch.no_grad(), torch.inference_mode(False):
            if plan is None:
                packed = [u for u in self.units if u.host is not None]  # remove() may have restored some
                slot = aligned_buffer(max((u.nbytes for u in packed), default=0), self.device)
                self.copies.slots = [slot]
                self.slot_of = [0 if u.host is not None else None for u in self.units]
                self.decoding = frozenset(self.encoded)
                self._allocate_staging(1)
                for unit in packed:
                    self.dst[unit.index] = slot[: unit.nbytes]
            else:
                self.copies.slots = [aligned_buffer(plan.slot_bytes, self.device) for _ in range(plan.num_slots)]
                self.decoding = plan.compressed & frozenset(self.encoded)
                self._allocate_staging(plan.num_slots)
                for index in sorted(plan.resident):
                    unit = self.units[index]
                    buffer = aligned_buffer(unit.nbytes, self.device)
                    self._fill_resident(index, buffer)
                    self.binding.to_device(unit, buffer)
                    self.copies.resident[index] = buffer
                for index, slot in enumerate(plan.slot_of):
                    if slot is not None:
                        self.dst[index] = self.copies.slots[slot][: self.units[index].nbytes]
                self.slot_of = list(plan.slot_of)
        self.slot_owner = [None] * len(self.copies.slots)

    def _fill_resident(self, index: int, buffer: torch.Tensor) -> None:
        """A resident unit's device copy, on the current stream: decoded from its compressed copy through
        a staging buffer when its raw copy waits on disk (reading the mapped file would be a pageable,
        possibly disk-bound copy), else copied from its host copy. Every later use of the staging
        buffer is ordered after these decodes (the schedule's streams wait for this stream on `follow`)."""
        encoded = self.encoded.get(index)
        room = self.copies.staging[0].numel() if self.copies.staging else 0
        if self.spilled_to is not None and encoded is not None and encoded.payload.numel() <= room:
            staging = self.copies.staging[0][: encoded.payload.numel()]
            staging.copy_(encoded.payload, non_blocking=True)
            decode_into(encoded, staging, buffer)
            return
        buffer.copy_(self.host_of(self.units[index]), non_blocking=True)

    def _allocate_staging(self, num_slots: int) -> None:
        """Per slot, room for the largest payload a load decodes (none without such loads)."""
        size = max((self.encoded[i].payload.numel() for i in self.decoding), default=0)
        if size:
            self.copies.staging = [aligned_buffer(size, self.device) for _ in range(num_slots)]

    # ------------------------------------------------------------------------------------ loading

    def bind_for_call(self, index: int) -> None:
        """Point a streamed unit that is about to be called at its slot (its load was issued: on demand, or
        by the schedule, whose event the compute stream waited for). An edit of its host copy since the load
        was issued makes the load stale: it is loaded again, now, on the compute stream."""
        slot = self.slot_of[index]
        if slot is None:  # resident: it views its resident copy already
            return
        unit, buffer = self.units[index], self.copies.slots[slot]
        if self.binding.on_device(unit) is buffer:
            return
        self.binding.check(unit)  # an edit on the host since the load drops this slot's ownership
        self.load_now(index)
        self.binding.to_device(unit, buffer)

    def load_now(self, index: int, on_staged: Callable[[], None] | None = None) -> bool:
        """On-demand load on the compute stream (ordered after whatever last read the slot).
        ``on_staged`` runs between a compressed load's copy and its decode (the profiler's mark)."""
        slot = self.slot_of[index]
        if slot is None or self.slot_owner[slot] == index:
            return False
        if self.stage(index, slot):
            if on_staged is not None:
                on_staged()
            self.decode_staged(index, slot)
        self.note_load(slot, index)
        return True

    def copy_in(self, index: int, slot: int) -> None:
        """Enqueue ``index``'s whole load into ``slot`` on the current stream (`stage`, then `decode_staged`)."""
        if self.stage(index, slot):
            self.decode_staged(index, slot)

    def stage(self, index: int, slot: int) -> bool:
        """Enqueue the copy part of a load on the current stream: the raw bytes into the slot, or the
        compressed payload into the slot's staging buffer. True when a decode must follow. The slot's
        previous occupant is pointed back at its host copy first (`Binding`)."""
        self.evict(slot)
        if index not in self.decoding:
            unit = self.units[index]
            if self.host_gate is not None:  # units still arriving from disk: its final bytes first
                self.host_gate(unit)
            self.dst[index].copy_(unit.host, non_blocking=True)  # type: ignore[union-attr,arg-type]
            return False
        encoded = self.encoded[index]
        self.copies.staging[slot][: encoded.payload.numel()].copy_(encoded.payload, non_blocking=True)
        return True

    def make_room_for(self, index: int) -> None:
        """`evict` the unit in ``index``'s slot, unless it is ``index`` itself."""
        slot = self.slot_of[index]
        if slot is not None and self.slot_owner and self.slot_owner[slot] != index:
            self.evict(slot)

    def evict(self, slot: int | None) -> None:
        """The unit whose tensors view ``slot`` views its host copy from now on (its edits copied back). Done
        before a load is timed or issued, so that the load's time is the copy's alone."""
        if slot is None or not self.slot_owner:
            return
        owner = self.slot_owner[slot]
        if owner is not None and self.binding.on_device(self.units[owner]) is self.copies.slots[slot]:
            self.binding.to_host(self.units[owner])

    def decode_staged(self, index: int, slot: int) -> None:
        """Enqueue the decode of ``index``'s staged payload into its slot on the current stream."""
        encoded = self.encoded[index]
        decode_into(encoded, self.copies.staging[slot][: encoded.payload.numel()], self.dst[index])  # type: ignore[arg-type]

    def transfer_bytes(self, index: int) -> int:
        """What a load of ``index`` moves over the link when it loads compressed (its raw bytes when it is
        not kept compressed); the plan decides which loads do (`decoding`)."""
        encoded = self.encoded.get(index)
        return encoded.payload.numel() if encoded is not None else self.units[index].nbytes

    # ------------------------------------------------------------------------------------ compression

    @property
    def encoded(self) -> dict[int, EncodedUnit]:
        """The compressed copy of each unit kept compressed, by unit index."""
        return self.compressed.encoded

    def note_load(self, slot: int, index: int) -> None:
        self.slot_owner[slot] = index
        self.loads[index] += 1
        self.bytes_streamed += self.units[index].nbytes

    # ------------------------------------------------------------------------------------ edits

    @contextmanager
    def editing(self) -> Iterator[None]:
        """Run an edit of the weights so that it lands in the host copies, the weights' truth.

        Every tensor points at its host copy during the edit (foreign tensors such as adapters come
        to the host too, so the edit computes on one device). Afterwards a tensor whose ``.data``
        the edit replaced is copied into its host buffer; one whose shape or dtype changed is put
        back as it was and the edit is refused. The caller activates the model again.
        """
        self.release()
        if self.cuda:  # no copy issued before may still be reading a host buffer the edit writes
            torch.cuda.synchronize(self.device)
        self.gate_all()  # the edit lands in the final host copies, not in stand-ins about to be replaced
        self._file_current = False  # the RAM copies may change: the next spill writes them
        foreign = self._find_foreign()
        with torch.no_grad(), torch.inference_mode(False):
            for t, _ in foreign:
                t.data = t.data.to("cpu") if t.device.type != "cpu" else t.data
        try:
            yield
        finally:
            with torch.no_grad(), torch.inference_mode(False):
                self._adopt_replaced()
            if self.encoded:  # the compressed copies must say what the edited host copies say
                self.compressed.make(self.compressed.pinned)
            self.binding.record()  # every copy was made again from the edited host copies

    def _edited(self, unit: Unit, on_device: bool) -> None:
        """An in-place edit of ``unit`` was found (`Binding`); its host copy holds it now (copied back when it
        was made in a device copy). What was copied from the host copy before is stale: the spill file, the
        compressed copy and, for an edit made on the host, a slot loaded with the unit ahead of its call."""
        self._file_current = False
        if unit.index < 0:
            return
        logger.info("%s was edited in place outside editing(); its copies follow", unit.name)
        if unit.index in self.encoded:
            self.compressed.refresh(unit)
            payload = self.encoded.get(unit.index)
            room = self.copies.staging[0].numel() if self.copies.staging else 0
            if unit.index in self.decoding and (payload is None or payload.payload.numel() > room):
                self.decoding = self.decoding - {unit.index}  # loads it raw until the next layout
        if not on_device:
            self.slot_owner = [None if owner == unit.index else owner for owner in self.slot_owner]

    def _adopt_replaced(self) -> None:
        refused: list[str] = []
        for unit in [self.base, *self.units]:
            if unit.host is None:
                continue
            for packed in unit.tensors:
                view = packed.view_of(unit.host)
                current = packed.tensor.data
                if current.data_ptr() == view.data_ptr():
                    continue
                if current.shape != packed.shape or current.dtype != packed.dtype:
                    refused.append(f"{unit.name}.{packed.names[0]}")
                    packed.tensor.data = view  # back as it was
                    continue
                view.copy_(current)
                packed.tensor.data = view
        if refused:
            raise FlexTensorError(
                f"an edit changed the shape or dtype of streamed weights ({', '.join(refused[:3])}); they were put "
                "back as they were. Disable offload, make the edit, and enable it again"
            )

    # ------------------------------------------------------------------------------------ host tier

    @property
    def packed_bytes(self) -> int:
        """Bytes of all host copies (base and units), wherever they live."""
        return sum(u.nbytes for u in [self.base, *self.units])

    @property
    def host_ram_bytes(self) -> int:
        """Host RAM the host copies take now (all of them; while spilled, what stand-ins keep in RAM and
        the units already taken back), and compressed copies."""
        payloads = self.compressed.payload_bytes
        if self.spilled_to is None:
            return payloads + self.packed_bytes
        taken = sum(self._positions()[p].nbytes for p in self._taken)
        return payloads + (self._held_bytes or 0) + taken

    def _positions(self) -> list[Unit]:
        """The base, then the units: position ``p`` is unit ``p - 1`` (how spills and reads number them)."""
        return [self.base, *self.units]

    # ------------------------------------------------------------------------------------ host gate

    def host_of(self, unit: Unit) -> torch.Tensor:
        """``unit.host`` once it holds the unit's final bytes (`host_gate` is asked first, when set)."""
        gate = self.host_gate
        if gate is not None:
            gate(unit)
        return unit.host  # type: ignore[return-value]

    def gate_all(self) -> None:
        """Every host copy final: a read back under way is waited for, unit by unit."""
        if self.host_gate is not None:
            for unit in self._positions():
                self.host_of(unit)

    # ------------------------------------------------------------------------------------ spill and fill

    def _file_offsets(self) -> list[int]:
        offsets, offset = [], 0
        for unit in [self.base, *self.units]:
            offsets.append(offset)
            offset = align(offset + unit.nbytes, ALIGNMENT)
        return [*offsets, offset]

    def spill(self, path: Path, hosts: list[object] | None = None, held_bytes: int = 0) -> None:
        """Move the host copies out of RAM (the model must be inactive): into the cache file ``path``, or,
        given ``hosts``, onto bytes that are already elsewhere, writing nothing (``path`` then names that place).

        ``hosts``: per unit (the base first), a stand-in for its flat host buffer that gives a tensor's
        bytes when sliced at the tensor's range, as `PackedTensor.view_of` slices (e.g. private mappings
        of the weight files the model was loaded from); ``held_bytes`` of them stay in RAM. The caller
        vouches that they hold the current bytes (`mark_spill_current`, and `spill_is_current` since).

        A cache file is all or nothing: it is written completely before any tensor points at it, so a
        full or unwritable disk raises with the copies still in RAM. Writing is skipped when the file
        already holds these bytes (spilled before, no edit since). A read back under way finishes first.
        """
        self.gate_all()
        if self.spilled_to is not None:
            return
        if self.active:
            raise OffloadStateError("spill() needs an inactive model: release() it first")
        self.binding.sweep()  # an edit since the last spill means the file must be written again
        units = [self.base, *self.units]
        held = None if hosts is None else held_bytes
        if hosts is None:
            offsets = self._file_offsets()
            if not (self._file_current and path.exists()):
                tmp = path.with_suffix(path.suffix + ".tmp")
                try:
                    with open(tmp, "wb") as file:
                        for unit, offset in zip(units, offsets, strict=False):
                            file.seek(offset)
                            file.write(memoryview(unit.host.numpy()))  # type: ignore[union-attr]
                        file.truncate(offsets[-1])
                    tmp.replace(path)
                    _CACHE_FILES.add(path)
                except OSError as exc:
                    tmp.unlink(missing_ok=True)
                    raise FlexTensorError(
                        f"could not write the weight cache {path} ({exc}): free space there or choose another cache_dir"
                    ) from exc
                except BaseException:  # Ctrl-C while writing (seconds for an expert): no partial file stays behind
                    tmp.unlink(missing_ok=True)
                    raise
            mapped = torch.from_file(str(path), shared=True, size=max(offsets[-1], 1), dtype=torch.uint8)
            hosts = [mapped[offset : offset + unit.nbytes] for unit, offset in zip(units, offsets, strict=False)]
        if self.cuda:  # copies issued before release may still be reading the buffers about to be freed
            torch.cuda.synchronize(self.device)
        with torch.no_grad(), torch.inference_mode(False):
            for unit, host in zip(units, hosts, strict=True):
                self.binding.to_host(unit, host)  # type: ignore[arg-type]
                unpin_unit(unit)
                unit.host = host  # type: ignore[assignment]
        self.spilled_to = path
        self._held_bytes = held
        self._taken = set()
        self._file_current = True

    def fill(self, pin: bool, read: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Read spilled host copies back into RAM (pinned when ``pin``); a cache file is kept for the next spill.

        ``read(position, buffer)`` fills one unit's new buffer (position 0: the base) straight from where
        the stand-ins' bytes live (large file reads instead of page faults through a mapping); the caller
        passes it only while `spill_is_current`, since an edit made while spilled lives in the stand-ins.
        """
        if self.spilled_to is None:
            return
        units = self.read_back(pin, read)
        assert units is not None
        self.take_back(units)

    #: While spilled onto stand-ins (`spill` with ``hosts``): the bytes they keep in RAM. None: in RAM, or
    #: spilled into a cache file.
    _held_bytes: int | None = None

    def spilled_hosts(self) -> list[object]:
        """The stand-ins of a spill, per position (the base first): what `read_unit` reads from and what
        `untake_units` points units back at. Taken with the model spilled and nothing taken yet."""
        assert self.spilled_to is not None and not self._taken, "spilled_hosts() needs a spill with nothing taken"
        return [u.host for u in self._positions()]

    def read_unit(
        self, position: int, host: object, pin: bool, read: Callable[[int, torch.Tensor], None] | None = None
    ) -> Unit:
        """One spilled unit's bytes (position 0: the base) in a new RAM buffer, as a copy of the unit for
        `take_unit`: from ``read(position, buffer)`` when given, else copied from its stand-in ``host``.
        Pinned when ``pin`` (in place where CUDA allows, else a pinned copy), so that taking it back does no
        heavy work. Changes nothing of the model: runs on any thread, while the model waits or computes."""
        unit = self._positions()[position]
        buffer = host_buffer(unit.nbytes)
        if read is not None:
            read(position, buffer)
        elif not isinstance(host, torch.Tensor):  # a stand-in is sliced per tensor only
            for packed in unit.tensors:
                end = packed.offset + packed.nbytes
                buffer[packed.offset : end].copy_(host[packed.offset : end])  # type: ignore[index]
        else:
            buffer.copy_(host)
        buffer, in_place = page_locked(buffer) if pin else (buffer, False)
        return dataclasses.replace(unit, host=buffer, pinned_in_place=in_place)

    def read_back(
        self,
        pin: bool,
        read: Callable[[int, torch.Tensor], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> list[Unit] | None:
        """Every spilled unit in a new RAM buffer (`read_unit`, one unit per thread) for `take_back`; when
        ``stop()`` turns true the read is given up: None, buffers freed. Every started unit finishes
        before a failure is raised."""
        hosts = self.spilled_hosts()

        def read_one(position: int) -> Unit | None:
            if stop is not None and stop():
                return None
            return self.read_unit(position, hosts[position], pin, read)

        quiet = True if stop is not None else None  # a background read shows no progress bar
        with (
            ThreadPoolExecutor(PACK_THREADS) as pool,
            tqdm(total=len(hosts), desc="reading weights from disk", disable=quiet, leave=False) as bar,
        ):
            futures = [pool.submit(read_one, position) for position in range(len(hosts))]
            for _done in as_completed(futures):
                bar.update()
        done: list[Unit] = []
        error: BaseException | None = None
        for future in futures:
            try:
                result = future.result()
            except BaseException as exc:
                error = error or exc
                continue
            if result is not None:
                done.append(result)
        if error is not None or len(done) < len(hosts):
            self.drop_read(done)
            if error is not None:
                raise error
            return None
        return done

    def take_unit(self, new: Unit) -> None:
        """Adopt one unit's buffer that `read_unit` filled, on the main thread, while the model is spilled
        (active or not): ``unit.host`` becomes it, and the unit's tensors follow when they pointed at the
        stand-in (an inactive model); a device copy stays bound. No copy still reads the stand-in: every
        read of host bytes passes `host_gate`, which adopts first; and a copy from a stand-in (pageable
        memory) returns only once CUDA has staged its source. The last unit taken ends the spill: a cache
        file is kept for the next one, its pages dropped from the page cache."""
        position = new.index + 1
        unit = self._positions()[position]
        assert self.spilled_to is not None and position not in self._taken, f"{unit.name} is not waiting to be taken"
        with torch.no_grad(), torch.inference_mode(False):
            self.binding.rehost(unit, new.host)  # type: ignore[arg-type]
        unit.host, unit.pinned_in_place = new.host, new.pinned_in_place
        self._taken.add(position)
        if len(self._taken) == len(self.units) + 1:
            if self._held_bytes is None:
                drop_cached_pages(self.spilled_to)
            self.spilled_to, self._held_bytes, self._taken = None, None, set()

    def take_back(self, read: list[Unit]) -> None:
        """Adopt every buffer `read_back` filled (`take_unit`): the spill ends."""
        for new in read:
            self.take_unit(new)

    def untake_units(self, hosts: list[object]) -> None:
        """Undo `take_unit` for every unit taken so far in this spill, pointing them back at their stand-ins
        ``hosts`` (`spilled_hosts`), which still hold their bytes (no edit runs before a read back ends): a
        read back given up leaves the model spilled as before. The taken buffers are freed, so copies that
        may still read them finish first."""
        if not self._taken:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        positions = self._positions()
        with torch.no_grad(), torch.inference_mode(False):
            for position in sorted(self._taken):
                unit = positions[position]
                self.binding.rehost(unit, hosts[position])  # type: ignore[arg-type]
                unpin_unit(unit)
                unit.host = hosts[position]  # type: ignore[assignment]
        self._taken = set()

    def drop_read(self, read: list[Unit]) -> None:
        """Free what `read_unit` read without adopting it (a read given up, or made stale by an edit)."""
        for unit in read:
            unpin_unit(unit)

    def mark_spill_current(self) -> None:
        """Say that where the host copies spill to holds their bytes now (the caller checked: e.g. the
        weight files they were loaded from). `editing` clears it: `spill_is_current` turns false."""
        self._file_current = True

    @property
    def spill_is_current(self) -> bool:
        """No edit since the last spill or `mark_spill_current`: where the copies spill to still holds their bytes."""
        return self._file_current

    # ------------------------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """Give every tensor its own storage again, bit-exact, on the device it came from.

        Used by a failed set-up and by removal alike. Units are restored one by one, each
        all-or-nothing; if one fails (out of memory, say), the units not yet restored stay packed
        and correct, and teardown may be called again.
        """
        if self.active:
            self.release()
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
                if unit.index >= 0:
                    self.slot_of[unit.index] = None
            for t, origin in self.loose:
                t.data = t.data.to(origin)
        self.compressed.release()
