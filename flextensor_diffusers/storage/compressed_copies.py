"""The compressed copy of each unit worth it: made at set-up, page-locked, checked, released before dropped.

A unit kept compressed streams its *payload* (`codec`) and decodes it on the device into its slot, bit-exact;
the raw host copy stays the weights' truth (`host_copies`), in RAM or, with ``raw_copies="disk"``, in a file.
Payloads come from the encoder or from the payload cache (`payload_cache`), and none is used before it was shown
to decode to the weights: on CUDA by decoding it there once and comparing, on the CPU by comparing it with a
fresh encoding.

`CompressedCopies` is the one face the engine and the host copies use; each thing it does is owned by one part:

* `payload_records.PayloadRecords`: the payloads by unit index, which loads may decode (proofs), edits re-encoding
  one; `payload_records.PayloadLocks`: which payloads are page-locked in place, and where a lock goes with its
  payload (unlocked, or handed on to the host tier's locked pool);
* `set_up_payloads.SetUpPayloads`: every payload made before set-up returns, read from the payload file or encoded;
* `arriving_payloads.ArrivingPayloads`: a set-up that did not wait for them, read or encoded while the model streams
  raw, and kept once all are here;
* `waiting_payloads.WaitingPayloads`: the payload file as where payloads wait while the host tier keeps their model
  on disk (`spill`, `let_go`), and their coming back unit by unit (`read_payload`, `take`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..engine.units import Unit
from .arrivals import EncodingBetweenForwards
from .arriving_payloads import ArrivingPayloads
from .codec import EncodedUnit
from .file_reads import SERIAL, PieceReader
from .host_memory import host_buffer
from .locked_pool import LockedPool
from .payload_cache import PayloadCache
from .payload_records import PayloadLocks, PayloadRecords, segments_of
from .set_up_payloads import Settled, SetUpPayloads
from .waiting_payloads import WaitingPayloads

__all__ = ["CompressedCopies", "Settled", "segments_of"]


class CompressedCopies:
    """The payloads of a model's units by unit index (``encoded``), where they are and how they got there.

    ``host_of(unit)`` gives a unit's final host bytes (`HostCopies.raw_tensor`: it waits for units still arriving
    from disk). Dropping the payloads (`release`) comes before making them again, whatever made them."""

    def __init__(self, units: list[Unit], device: torch.device, host_of: Callable[[Unit], torch.Tensor]) -> None:
        self.units = units
        self.device = device
        self.cuda = device.type == "cuda"
        self.locks = PayloadLocks(device)
        self.records = PayloadRecords(units, device, host_of, self.locks)
        self.disk = WaitingPayloads(self.records, self.locks)
        self.set_up = SetUpPayloads(self.records, self.locks, self.disk)
        self.arrivals = ArrivingPayloads(self.records, self.locks, self.disk, self.set_up)

    # ------------------------------------------------------------------------------------ what is kept

    @property
    def encoded(self) -> dict[int, EncodedUnit]:
        """Each unit's payload, by unit index (`PayloadRecords.encoded`)."""
        return self.records.encoded

    @property
    def unproven(self) -> set[int]:
        """Payloads kept from the payload file and not yet shown to decode to their unit's weights: no planned load
        decodes them until a first decoded load (an on-demand one) compared the result with the weights
        (`DeviceCopies.prove`)."""
        return self.records.unproven

    @property
    def proven(self) -> frozenset[int]:
        """The units whose compressed copies a load may decode: all kept but those not proven yet."""
        return self.records.proven

    @property
    def pinned(self) -> bool:
        """Payloads are page-locked (asked at the last set-up)."""
        return self.locks.pin

    @property
    def budget_bytes(self) -> int | None:
        """The peak allocated device memory the device encoder may reach (None: no bound); the handle sets its GPU
        budget before set-up."""
        return self.set_up.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, nbytes: int | None) -> None:
        self.set_up.budget_bytes = nbytes

    @property
    def file(self) -> PayloadCache | None:
        """The file payloads wait in while their model is on disk (the payload cache): set at set-up."""
        return self.disk.file

    @file.setter
    def file(self, cache: PayloadCache | None) -> None:
        self.disk.file = cache

    @property
    def waiting(self) -> set[int]:
        """Units whose payloads wait in the payload file now (`WaitingPayloads.waiting`)."""
        return self.disk.waiting

    @property
    def payload_bytes(self) -> int:
        """Host RAM of the payloads (those waiting in the file are not in RAM), those made between forwards and not
        kept yet included."""
        return self.disk.payload_bytes + self.arrivals.arriving_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of all payloads, wherever they are: what they take in RAM when all are there."""
        return self.records.stored_bytes

    def hand_buffers_on_to(self, pool: LockedPool) -> None:
        """Payload buffers let go stay locked in ``pool`` for the next reads, and reads back take theirs from it
        (`PayloadLocks.hand_buffers_on_to`: the host tier's pool)."""
        self.locks.hand_buffers_on_to(pool)

    # ------------------------------------------------------------------------------------ made at set-up

    def make(
        self, pin: bool, cache: PayloadCache | None = None, settled: Settled | None = None, at_set_up: bool = True
    ) -> None:
        """Drop the payloads, then keep a compressed copy of every unit that streams faster that way, read from
        ``cache``'s file or encoded (`SetUpPayloads.make`)."""
        self.release()
        self.locks.pin = pin
        self.set_up.make(pin, cache, settled, at_set_up)

    def release(self) -> None:
        """Drop the compressed copies, unregistering those pinned in place (once no copy reads them), after the
        payload file's write under way (it reads them)."""
        self.disk.finish_write()
        self.cancel_arrival(None)
        self.records.drop_all()
        self.disk.clear()

    # ------------------------------------------------------------------------------------ arriving after set-up

    def start_arrival(self, cache: PayloadCache, pin: bool) -> bool:
        """Set-up from the payload file without waiting for it: its header is checked here, and its payloads are
        read on threads from `begin_arrival` on, while the model already runs raw, and kept once all arrived
        (`adopt_arrival`), each to be proven at its first decoded load. False, nothing started, when the file is
        missing or refused."""
        self.release()
        return self.arrivals.start_reading(cache, pin)

    def start_arrival_else_encoding(self, cache: PayloadCache, pin: bool) -> None:
        """As `start_arrival`, for a set-up that encodes between forwards where there is no usable file: nothing of
        the file is read here (`ArrivingPayloads.start_reading_else_encoding`), and a missing or refused file turns
        into encoding between forwards at the next forward's start or end (`encode_if_no_file`)."""
        self.release()
        self.arrivals.start_reading_else_encoding(cache, pin)

    def begin_arrival(self) -> None:
        """Begin reading the payload file `start_arrival` checked (nothing when none is to be read, or already
        begun). Set-up calls it once the raw copies are all packed, so that the reads share neither the disk nor
        the memory bus nor the CPU with set-up and packing (begun with set-up, on the H200, call L: set-up 0.255 s
        against raw's 0.128 s, first step 4.14 s against 3.37 s)."""
        self.arrivals.begin()

    def start_encoding(self, cache: PayloadCache | None, pin: bool, restart_on_edit: bool = False) -> None:
        """Set-up without waiting for the encoder (``background_encoding``): the units are encoded between the
        model's forwards (`encode_between_forwards`) while it streams raw, on its device within ``budget_bytes``;
        the payloads are kept once all are made (`adopt_arrival`), each to be proven at its first decoded load,
        and then written to ``cache``'s file. ``restart_on_edit`` (the raw copies wait on disk, where raw loads are
        slow): an edit meanwhile begins the encoding again instead of leaving the model raw."""
        self.release()
        self.arrivals.start_encoding(cache, pin, restart_on_edit)

    def restart_encoding(self, why: str) -> bool:
        """Drop the payloads made between forwards so far, to be made again from the first unit at the next gap (a
        host tier needs their room); False when none are being made (`ArrivingPayloads.restart`)."""
        return self.arrivals.restart(why)

    def encoding_room_needed(self) -> tuple[list[int], int]:
        """What encoding the units left between forwards takes in host RAM
        (`arrivals.EncodingBetweenForwards.room_needed`)."""
        current = self.arrivals.current
        assert isinstance(current, EncodingBetweenForwards), "no encoding between forwards"
        return current.room_needed()

    def encode_if_no_file(self) -> bool:
        """The payload file checked as its reads began (`start_arrival_else_encoding`) was missing or refused:
        encode between forwards instead (`start_encoding`), and say so. Called on the model's thread at each
        forward's start and end, and by `adopt_arrival`; nothing when the header is not checked yet, or was
        usable."""
        if not self.arrivals.found_no_file:
            return False
        self.start_encoding(self.file, self.pinned)
        return True

    @property
    def encoding_between_forwards(self) -> bool:
        """Units are left to encode between the model's forwards (`start_encoding`)."""
        return self.arrivals.encoding_between_forwards

    def encode_between_forwards(self, seconds: float, now: Callable[[], float], limit: int | None = None) -> None:
        """After a forward, the model's device memory given back: encode the next units (at most ``limit``) for
        about ``seconds`` by the clock ``now`` (`ArrivingPayloads.encode_for`)."""
        self.arrivals.encode_for(seconds, now, limit)

    @property
    def arriving(self) -> bool:
        """Payloads are being read or made since set-up and not taken yet (`start_arrival`, `start_encoding`)."""
        return self.arrivals.current is not None

    @property
    def arrived(self) -> bool:
        """The payloads read or made since set-up are all here (or one failed): `adopt_arrival` takes them."""
        return self.arrivals.arrived

    def adopt_arrival(self, refusal: Callable[[int], str | None] | None = None) -> bool:
        """Keep the payloads read or made since set-up (the model inactive), every one unproven; True when kept
        (`ArrivingPayloads.adopt`, which asks ``refusal`` first). A file found missing or refused as its reads began
        (after the caller's `encode_if_no_file`) keeps none: the units are encoded between forwards from now on."""
        if self.encode_if_no_file():
            return False
        return self.arrivals.adopt(refusal)

    def cancel_arrival(self, why: str | None) -> None:
        """Stop reading or making payloads, keeping none: an edit made them stale (``why`` says so), or the copies
        are dropped (None) (`ArrivingPayloads.cancel`)."""
        self.arrivals.cancel(why)

    # ------------------------------------------------------------------------------------ proofs and edits

    def prove(self, index: int) -> None:
        """Unit ``index``'s payload decoded to its weights at its first load: planned loads may decode it now."""
        self.records.prove(index)

    def disprove(self, unit: Unit) -> frozenset[int]:
        """``unit``'s payload from the file did not decode to its weights: the file is stale. Every payload not proven
        yet is dropped (once no copy reads it), and the file refused and deleted so that the next set-up encodes
        again; the units dropped."""
        dropped = self.records.drop_unproven()
        self.disk.forget(
            f"its copy of {unit.name!r} does not decode to the weights",
            then="the units not proven yet stream raw, and the next set-up encodes again",
        )
        return dropped

    def refresh(self, unit: Unit) -> None:
        """Encode ``unit`` again from its host bytes, which an edit changed (`PayloadRecords.refresh`): its payload
        in the file is stale from now on (`WaitingPayloads.payload_changed`)."""
        if unit.index not in self.records.encoded:
            return
        hand_on = self.disk.payload_changed(unit.index)
        self.records.refresh(unit, hand_on)

    # ------------------------------------------------------------------------------------ waiting on disk

    @property
    def file_current(self) -> bool:
        """The payload file holds every payload as it is now (`WaitingPayloads.file_current`)."""
        return self.disk.file_current

    def spill(self) -> None:
        """Move every payload still in RAM out into the payload file (`WaitingPayloads.spill`)."""
        self.disk.spill()

    def let_go(self, index: int) -> None:
        """Unit ``index``'s payload goes back to the payload file while the model may be active
        (`WaitingPayloads.let_go`)."""
        self.disk.let_go(index)

    def read_payload(
        self, index: int, pin: bool, reader: PieceReader = SERIAL, buffered: Callable[[], None] = lambda: None
    ) -> tuple[torch.Tensor, bool]:
        """Unit ``index``'s waiting payload read into a RAM buffer on a reader thread
        (`WaitingPayloads.read_payload`)."""
        return self.disk.read_payload(index, pin, reader, buffered)

    def take(self, index: int, payload: torch.Tensor, locked: bool) -> None:
        """Adopt ``payload`` (from `read_payload`) as unit ``index``'s payload in RAM (`WaitingPayloads.take`)."""
        self.disk.take(index, payload, locked)

    def payload_to_decode(self, index: int) -> tuple[EncodedUnit, torch.Tensor] | None:
        """Unit ``index``'s payload and its bytes in RAM, for a decode on the host side (payloads only: its raw bytes
        for an edit, ``state_dict()``, removal): the payload kept, or, while it waits in the payload file, a copy read
        from the file and checked against its checksum, never the file's mapping unchecked. None: none is kept."""
        encoded = self.records.encoded.get(index)
        if encoded is None:
            return None
        if index not in self.disk.waiting:
            return encoded, encoded.payload
        assert self.disk.file is not None, "a payload waits in the payload file"
        copy = host_buffer(encoded.payload.numel())
        self.disk.file.read_payload(index, copy)
        return encoded, copy

    def untake(self, indices: list[int]) -> None:
        """Point the payloads of ``indices`` (taken back) at the file again (`WaitingPayloads.untake`)."""
        self.disk.untake(indices)
