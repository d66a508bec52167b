"""`DeviceCopies`: the device memory of an active model, and the loads that fill it.

While a model is *active* the device holds copies of host bytes (`host_copies`): the base's, one per resident
unit, and the *slots* streamed units take turns in (with, per slot, a staging buffer where a compressed load
lands before it is decoded into the slot). ``slot_owner[s]`` is the unit whose bytes slot ``s`` holds or is
being loaded with; a slot is written only by `load_now` here or by the schedule's copy stream, which orders the
write after the slot's last reader. Which unit's tensors view which buffer is the `Binding`'s business: a
streamed unit views its slot from its call until the slot is handed on (`evict`).

Tensors of the model that are not packed (loose ones, which share storage with another tensor, and foreign ones,
added after set-up, e.g. LoRA adapters) follow the model with ``.to()`` on activate and release
(`unpacked.UnpackedTensors`), so they are always on the device the model computes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..storage.codec import EncodedUnit, decode_into
from ..storage.host_bytes import InPayloadsOnly
from ..storage.host_copies import HostCopies
from .binding import Binding
from .planner import CUDA_ALLOCATION_GRANULE, Plan, allocated
from .units import Unit, UnitLayout, aligned_buffer
from .unpacked import UnpackedTensors


@dataclass
class Buffers:
    """The device buffers of an active model."""

    base: torch.Tensor | None = None
    resident: dict[int, torch.Tensor] = field(default_factory=dict)
    slots: list[torch.Tensor] = field(default_factory=list)
    staging: list[torch.Tensor] = field(default_factory=list)  # per slot: a compressed load before decoding

    def nbytes(self) -> int:
        copies = [self.base, *self.resident.values(), *self.slots, *self.staging]
        return sum(c.numel() for c in copies if c is not None)


class DeviceCopies:
    """Device buffers by the plan (or one profiling slot before there is one), and every load into them."""

    def __init__(
        self, model: nn.Module, layout: UnitLayout, device: torch.device, host: HostCopies, binding: Binding
    ) -> None:
        self.model = model
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = host
        self.binding = binding
        self.units = layout.units
        self.base = layout.base
        #: The tensors that are not packed, moved with ``.to()``; the packed ones' identities, checked.
        self.unpacked = UnpackedTensors(model, layout.loose, host, device)
        #: (tensor, device it came from) for tensors moved with ``.to()`` instead of packed (the unpacked's own list).
        self.loose = self.unpacked.loose
        #: Packed tensors an edit inside ``editing()`` took out of the model (the unpacked's own set, `Edits`).
        self.dropped = self.unpacked.dropped
        self.active = False
        self.buffers = Buffers()
        self.slot_of: list[int | None] = [0] * len(self.units)
        self.slot_owner: list[int | None] = []
        self._dst: list[torch.Tensor | None] = [None] * len(self.units)  # a streamed unit's bytes in its slot
        self.loads = [0] * len(self.units)
        self.bytes_streamed = 0
        #: The encoded units whose loads move the payload and decode it: all of them before a plan exists
        #: (profiling measures their decodes), then the plan's choice (`Plan.compressed`).
        self.decoding: frozenset[int] = frozenset()
        #: Loads and fills made on the compute stream, outside the schedule's events: the schedule's streams wait
        #: for that stream once this moved past the count they last waited at (`SteadySchedule.issue`).
        self.compute_loads = 0

    @property
    def allocation_granule(self) -> int:
        return CUDA_ALLOCATION_GRANULE if self.cuda else 1  # what the device's allocator rounds every buffer up to

    @property
    def resident_weight_bytes(self) -> int:
        """Weights on the device whenever the model is active, whatever the plan: base and loose tensors, each
        as the allocator counts it."""
        granule = self.allocation_granule
        loose = sum(allocated(t.numel() * t.element_size(), granule) for t, _ in self.loose)
        return allocated(self.base.nbytes, granule) + loose

    @property
    def device_bytes(self) -> int:
        return self.buffers.nbytes()  # device memory held now: base, resident copies, slots, staging

    # ------------------------------------------------------------------------------------ activity

    def activate(self, plan: Plan | None) -> None:
        """Take device memory: the base, loose and foreign tensors, then resident units and slots."""
        if self.active:
            return
        self.unpacked.check_tensors_are_ours()
        self.binding.sweep()  # edits made while inactive reach the copies made below
        with torch.no_grad(), torch.inference_mode(False):
            buffer = aligned_buffer(self.base.nbytes, self.device)
            self.host.copy_raw_into(self.base, buffer)
            self.binding.to_device(self.base, buffer)
            self.buffers.base = buffer
            self.unpacked.to_device()
        self.active = True
        self.lay_out(plan)

    def release(self) -> None:
        """Give back all device memory; every tensor views its host copy until `activate`."""
        if not self.active:
            return
        self._drop_unit_buffers()
        if self.base.host is not None:
            self.binding.to_host(self.base)
        with torch.no_grad(), torch.inference_mode(False):
            self.unpacked.to_origin()
        self.buffers.base = None
        self.active = False

    # ------------------------------------------------------------------------------------ layout

    def _drop_unit_buffers(self) -> None:
        """Point the units at their host copies (edits made in device copies copied back first) and drop their
        slots and resident copies."""
        for unit in self.units:
            if unit.host is not None:  # during a failed set-up, not every unit is packed yet
                self.binding.to_host(unit)
        self.buffers.resident, self.buffers.slots, self.buffers.staging = {}, [], []
        self._dst = [None] * len(self.units)
        self.slot_owner = []

    def lay_out(self, plan: Plan | None) -> None:
        """Device buffers for the units: per the plan, or one shared profiling slot before a plan exists."""
        self._drop_unit_buffers()  # old device buffers go before new ones are taken
        if not self.units:
            return
        with torch.no_grad(), torch.inference_mode(False):
            if plan is None:
                self._lay_out_profiling()
            else:
                self._lay_out_plan(plan)
        self.slot_owner = [None] * len(self.buffers.slots)

    def _lay_out_profiling(self) -> None:
        packed = [u for u in self.units if self.host.offloaded(u)]  # remove() may have restored some
        slot = aligned_buffer(max((u.nbytes for u in packed), default=0), self.device)
        self.buffers.slots = [slot]
        self.slot_of = [0 if self.host.offloaded(u) else None for u in self.units]
        self.decoding = frozenset(self.host.encoded)
        self._allocate_staging(1)
        for unit in packed:
            self._dst[unit.index] = slot[: unit.nbytes]

    def _lay_out_plan(self, plan: Plan) -> None:
        self.buffers.slots = [aligned_buffer(plan.slot_bytes, self.device) for _ in range(plan.num_slots)]
        # a payload not proven yet is decoded only by an on-demand load, which proves it (`prove`)
        self.decoding = plan.compressed & self.host.compressed.proven
        self._allocate_staging(plan.num_slots)
        for index in sorted(plan.resident):
            unit = self.units[index]
            buffer = aligned_buffer(unit.nbytes, self.device)
            self._fill_resident(index, buffer)
            self.binding.to_device(unit, buffer)
            self.buffers.resident[index] = buffer
        for index, slot in enumerate(plan.slot_of):
            if slot is not None:
                self._dst[index] = self.buffers.slots[slot][: self.units[index].nbytes]
        self.slot_of = list(plan.slot_of)

    def _fill_resident(self, index: int, buffer: torch.Tensor) -> None:
        """A resident unit's device copy, on the current stream: decoded from its compressed copy through a staging
        buffer when its raw copy is not in a RAM buffer of its own (a stand-in in a file would be a pageable, possibly
        disk-bound copy), else copied from its host copy; with no raw copy at all (payloads only) and no staging buffer
        large enough (all resident), through a room of the payload's size for the while, before any activation. Later
        uses of the staging buffer are ordered after these decodes (the schedule's streams wait for this stream)."""
        encoded = self._decoded_fill(index)
        self.compute_loads += 1
        if encoded is None:
            return self.host.copy_raw_into(self.units[index], buffer)
        size, staging = encoded.payload.numel(), self.buffers.staging[0] if self.buffers.staging else buffer[:0]
        room = (staging if staging.numel() >= size else aligned_buffer(size, self.device))[:size]
        room.copy_(encoded.payload, non_blocking=True)
        decode_into(encoded, room, buffer)

    def _decoded_fill(self, index: int) -> EncodedUnit | None:
        """The compressed copy `_fill_resident` decodes unit ``index`` from, or None where it copies the raw bytes."""
        unit = self.units[index]
        room = self.buffers.staging[0].numel() if self.buffers.staging else 0
        if index in self.host.compressed.proven and not self.host.raw_at_hand(unit):
            encoded = self.host.payload_of(unit)
            if encoded.payload.numel() <= room or isinstance(unit.stored, InPayloadsOnly):
                return encoded
        return None

    def fill_bytes(self, index: int) -> int:
        """What `keep` moves over the link for unit ``index``: its compressed copy, or its raw bytes."""
        encoded = self._decoded_fill(index)
        return encoded.payload.numel() if encoded is not None else self.units[index].nbytes

    def keep(self, index: int) -> bool:
        """Give unit ``index``, streamed under this layout, a device copy of its own, filled now on the current
        stream and kept until the next layout: its later calls load nothing (an unplanned call of an entry
        method runs its units once per frame or tile, `phases.Unplanned.keeps`). True: it loaded, as `load_now`
        answers."""
        slot = self.slot_of[index]
        if slot is None:
            return False
        unit = self.units[index]
        if self.slot_owner and self.slot_owner[slot] == index:
            self.evict(slot)
            self.slot_owner[slot] = None
        with torch.no_grad(), torch.inference_mode(False):
            buffer = aligned_buffer(unit.nbytes, self.device)
            self._fill_resident(index, buffer)
            self.binding.to_device(unit, buffer)
        self.buffers.resident[index] = buffer
        self.slot_of[index], self._dst[index] = None, None
        self.loads[index] += 1
        self.bytes_streamed += unit.nbytes
        return True

    def _allocate_staging(self, num_slots: int) -> None:
        """Per slot, room for the largest payload a load decodes (none without such loads)."""
        size = max((self.host.encoded[i].payload.numel() for i in self.decoding), default=0)
        if size:
            self.buffers.staging = [aligned_buffer(size, self.device) for _ in range(num_slots)]

    # ------------------------------------------------------------------------------------ loading

    def bind_for_call(self, index: int) -> None:
        """Point a streamed unit that is about to be called at its slot (its load was issued: on demand, or by
        the schedule, whose event the compute stream waited for). An edit of its host copy since the load was
        issued makes the load stale: it is loaded again, now, on the compute stream."""
        slot = self.slot_of[index]
        if slot is None:  # resident: it views its resident copy already
            return
        unit, buffer = self.units[index], self.buffers.slots[slot]
        if self.binding.on_device(unit) is buffer:
            return
        self.binding.check(unit)  # an edit on the host since the load drops this slot's ownership
        self.load_now(index)
        self.binding.to_device(unit, buffer)

    def load_now(self, index: int, on_staged: Callable[[], None] | None = None) -> bool:
        """On-demand load on the compute stream (ordered after whatever last read the slot); True when it
        copied. ``on_staged`` runs between a compressed load's copy and its decode (the profiler's mark)."""
        slot = self.slot_of[index]
        if slot is None or self.slot_owner[slot] == index:
            return False
        self.compute_loads += 1  # the schedule's streams wait for this before their next load (see there)
        if self.stage(index, slot):
            if on_staged is not None:
                on_staged()
            self.decode_staged(index, slot)
            if index in self.host.compressed.unproven:
                self.prove(index, slot)
        self.note_load(slot, index)
        return True

    def prove(self, index: int, slot: int) -> None:
        """The first decoded load of a payload kept from the payload file without a check at set-up
        (`CompressedCopies.unproven`): compare the decoded bytes in the slot with the raw host copy, tensor by
        tensor, byte for byte (on a device through the slot's staging buffer, a piece at a time: no memory beyond
        the layout's), with one synchronisation. Equal: the payload is proven, and planned loads may decode it. Not
        equal: the file is stale; every unproven payload is dropped, the decodes that would use them stop, and this
        unit is loaded again raw, so this call computes with its weights."""
        unit, dst = self.units[index], self._dst[index]
        if not decoded_differs(unit, dst, self.host.raw_tensor(unit), self.buffers.staging[slot]):  # type: ignore[arg-type]
            self.host.compressed.prove(index)
            return
        self.decoding = self.decoding - self.host.compressed.disprove(unit)
        self.host.copy_raw_into(unit, dst)  # type: ignore[arg-type]

    def copy_in(self, index: int, slot: int) -> None:
        """Enqueue ``index``'s whole load into ``slot`` on the current stream (`stage`, then `decode_staged`)."""
        if self.stage(index, slot):
            self.decode_staged(index, slot)

    def stage(self, index: int, slot: int) -> bool:
        """Enqueue the copy part of a load on the current stream: the raw bytes into the slot, or the
        compressed payload into the slot's staging buffer. True when a decode must follow. The slot's previous
        occupant is pointed back at its host copy first."""
        self.evict(slot)
        if index not in self.decoding:
            self.host.copy_raw_into(self.units[index], self._dst[index])  # type: ignore[arg-type]
            return False
        encoded = self.host.payload_of(self.units[index])
        self.buffers.staging[slot][: encoded.payload.numel()].copy_(encoded.payload, non_blocking=True)
        return True

    def decode_staged(self, index: int, slot: int) -> None:
        """Enqueue the decode of ``index``'s staged payload into its slot on the current stream."""
        encoded = self.host.encoded[index]
        decode_into(encoded, self.buffers.staging[slot][: encoded.payload.numel()], self._dst[index])  # type: ignore[arg-type]

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
        if owner is not None and self.binding.on_device(self.units[owner]) is self.buffers.slots[slot]:
            self.binding.to_host(self.units[owner])

    def load_path(self, index: int) -> str:
        """How unit ``index``'s device bytes are loaded under the current layout, in words (for `LoadChecks`)."""
        slot = self.slot_of[index]
        if slot is None:
            decoded = index in self.host.compressed.proven and not self.host.raw_at_hand(self.units[index])
            return "resident, decoded at activation" if decoded else "resident, copied at activation"
        return f"slot {slot}, {'decoded' if index in self.decoding else 'copied raw'}"

    def note_load(self, slot: int, index: int) -> None:
        self.slot_owner[slot] = index
        self.loads[index] += 1
        self.bytes_streamed += self.units[index].nbytes

    # ------------------------------------------------------------------------------------ edits and removal

    def stale_copies_of(self, unit: Unit, on_device: bool) -> None:
        """``unit``'s host copy was edited: a slot loaded with it ahead of its call (an edit made on the host)
        loads it again, and a payload that outgrew its staging room loads raw until the next layout."""
        if unit.index < 0:
            return
        payload = self.host.encoded.get(unit.index)
        room = self.buffers.staging[0].numel() if self.buffers.staging else 0
        if unit.index in self.decoding and (payload is None or payload.payload.numel() > room):
            self.decoding = self.decoding - {unit.index}
        if not on_device:
            self.slot_owner = [None if owner == unit.index else owner for owner in self.slot_owner]

    def restored(self, unit: Unit) -> None:
        """``unit`` has its own storage again (`HostCopies.restore`): it loads nowhere any more."""
        if unit.index >= 0:
            self.slot_of[unit.index] = None


def decoded_differs(unit: Unit, decoded: torch.Tensor, raw: torch.Tensor, room: torch.Tensor) -> bool:
    """Whether ``decoded`` (``unit``'s bytes decoded into its slot) differs from ``raw`` (its raw host copy), tensor
    by tensor, byte for byte: each piece of the raw bytes copied through ``room`` (a staging buffer, so no memory
    beyond the layout's), compared on the device, with one synchronisation at the end."""
    differs = torch.zeros((), dtype=torch.bool, device=decoded.device)
    for packed in unit.tensors:
        end = packed.offset + packed.nbytes
        for start in range(packed.offset, end, room.numel()):
            stop = min(start + room.numel(), end)
            piece = room[: stop - start]
            piece.copy_(raw[start:stop], non_blocking=True)
            differs.logical_or_(torch.ne(piece, decoded[start:stop]).any())
    return bool(differs)
