"""The payloads of a model's units, which of them loads may decode, and the page-locks they hold.

Two owners, so that each payload is kept, proven and unlocked in one place:

* `PayloadLocks`: which payloads are page-locked in place, and what happens to a lock when its payload goes:
  unlocked once no copy reads it, or handed on still locked to the host tier's locked pool (`locked_pool`).
* `PayloadRecords`: each unit's payload by unit index, and which of those read from the payload file were not yet
  shown to decode to the weights (no planned load decodes those).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..engine.errors import FlexTensorError
from ..engine.units import Unit
from .codec import CodecMismatch, EncodedUnit, Segment, check_decodes, encode_unit, worth_compressing
from .host_memory import host_buffer, page_locked, unpin_in_place
from .locked_pool import LockedPool
from .setup_threads import on_threads


def segments_of(unit: Unit) -> list[Segment]:
    """The codec's view of a unit's flat buffer: where each tensor lies and its dtype."""
    return [Segment(p.offset, p.nbytes, p.dtype) for p in unit.tensors]


class PayloadLocks:
    """The payloads page-locked in place (``cudaHostRegister`` on their own mapping), each to be unlocked exactly
    once, and only when no copy issued before still reads it.

    ``pin``: payloads are to be page-locked (asked at the last set-up). Under a host tier, a payload that leaves RAM
    keeps its lock and goes to the tier's locked pool (`hand_buffers_on_to`), which lends it to the next read back
    (`buffer_for_read`): a component moved in and out makes no driver call per unit (see `locked_pool`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = False
        self._in_place: list[torch.Tensor] = []
        self._pool: LockedPool | None = None

    def hand_buffers_on_to(self, pool: LockedPool) -> None:
        """From now on, payload buffers let go stay locked in ``pool`` for the next reads, and reads back take their
        buffers from it (the host tier's pool, shared by the components it moves between RAM and disk)."""
        self._pool = pool

    def mark_locked(self, payload: torch.Tensor) -> None:
        """``payload``, kept, is page-locked in place (or lent by the pool): `unlock` undoes it when it goes."""
        self._in_place.append(payload)

    def lock(
        self, encoded_by_unit: dict[int, EncodedUnit], pin: bool, locked: frozenset[int]
    ) -> dict[int, EncodedUnit]:
        """Each payload of ``encoded_by_unit`` page-locked when ``pin`` (those of ``locked`` already are, in place;
        the others arrive pageable: the host encoder and the cache read into new buffers), on `PACK_THREADS`
        threads: ``cudaHostRegister`` releases the GIL. The payloads to keep, by unit index."""
        kept: dict[int, EncodedUnit] = {}

        def keep(index: int) -> None:
            encoded = encoded_by_unit[index]
            in_place = index in locked
            if pin and not in_place:
                payload, in_place = page_locked(encoded.payload)
                encoded = dataclasses.replace(encoded, payload=payload)
            if in_place:
                self._in_place.append(encoded.payload)
            kept[index] = encoded

        if pin:
            on_threads(keep, list(encoded_by_unit), "page-locking compressed weights")
        else:
            for index in encoded_by_unit:
                keep(index)
        return kept

    def unlock(self, payloads: list[torch.Tensor], copies_done: bool = False, hand_on: bool = True) -> None:
        """Unlock those of ``payloads`` that are locked in place, once no copy issued before reads them (the
        device is synchronised first unless the caller knows those copies are done, ``copies_done``; the others
        were page-locked as copies, or not at all: nothing to undo). With a pool (`hand_buffers_on_to`), they are
        kept there locked for the next reads instead, unless ``hand_on`` is False (something else may still read
        them)."""
        ids = {id(p) for p in payloads}
        locked = [p for p in self._in_place if id(p) in ids]
        if locked and self.cuda and not copies_done:
            torch.cuda.synchronize(self.device)
        pool = self._pool if hand_on else None
        for payload in locked:
            if pool is None or not pool.keep(payload):
                unpin_in_place(payload)
        self._in_place = [p for p in self._in_place if id(p) not in ids]

    def unlock_all(self) -> None:
        """`unlock` every payload locked in place."""
        self.unlock(list(self._in_place))

    def buffer_for_read(self, nbytes: int, buffered: Callable[[], None]) -> tuple[torch.Tensor, bool]:
        """A RAM buffer of ``nbytes`` to read a payload into: one the pool lends (True: its owner gives it back with
        ``unpin_in_place``), else a new pageable one; ``buffered`` is told once it is had (under the pool's lock:
        `LockedPool.take`)."""
        if self._pool is not None:
            return self._pool.take(nbytes, buffered)
        buffer = host_buffer(nbytes)
        buffered()
        return buffer, False


class PayloadRecords:
    """Each unit's payload (``encoded``, by unit index, in unit order), and which of them loads may decode.

    A payload encoded here from the weights is exact by its making (on CUDA the encoder decodes each one and
    compares). One read from the payload file is never trusted: it stays ``unproven`` (no planned load decodes it)
    until a first decoded load, an on-demand one, compared the result with the weights (`DeviceCopies.prove`); one
    that does not match shows the file stale, and every payload not proven yet is dropped (`drop_unproven`).

    ``host_of(unit)`` gives a unit's final host bytes (`HostCopies.raw_tensor`: it waits for units still arriving)."""

    def __init__(
        self, units: list[Unit], device: torch.device, host_of: Callable[[Unit], torch.Tensor], locks: PayloadLocks
    ) -> None:
        self.units = units
        self.device = device
        self.cuda = device.type == "cuda"
        self.host_of = host_of
        self.locks = locks
        self.encoded: dict[int, EncodedUnit] = {}
        #: Payloads kept from the payload file and not yet shown to decode to their unit's weights.
        self.unproven: set[int] = set()

    @property
    def proven(self) -> frozenset[int]:
        """The units whose compressed copies a load may decode: all kept but those not proven yet."""
        return frozenset(self.encoded) - frozenset(self.unproven)

    def prove(self, index: int) -> None:
        """Unit ``index``'s payload decoded to its weights at its first load: planned loads may decode it now."""
        self.unproven.discard(index)

    def drop_unproven(self) -> frozenset[int]:
        """Drop every payload not proven yet (unlocked once no copy reads it): a payload of the file did not decode
        to its weights, so none of the others is trusted either. The units dropped."""
        dropped = frozenset(self.unproven)
        self.locks.unlock([self.encoded[i].payload for i in dropped])
        for index in dropped:
            del self.encoded[index]
        self.unproven = set()
        return dropped

    def drop_all(self) -> None:
        """Drop every payload, unlocking those locked in place once no copy reads them."""
        self.locks.unlock_all()
        self.encoded = {}
        self.unproven = set()

    def keep(self, encoded_by_unit: dict[int, EncodedUnit], pin: bool, locked: frozenset[int] = frozenset()) -> None:
        """Make each payload of ``encoded_by_unit`` its unit's compressed copy, page-locked when ``pin``
        (`PayloadLocks.lock`; those of ``locked`` already are, in place)."""
        kept = self.locks.lock(encoded_by_unit, pin, locked)
        self.encoded.update((index, kept[index]) for index in encoded_by_unit)  # in the units' order

    def refresh(self, unit: Unit, hand_on: bool) -> None:
        """Encode ``unit`` again from its host bytes, which an edit changed; on the host, so that no device
        memory beyond the budget is taken mid-run. It stays uncompressed when that no longer pays. The old payload
        is unlocked once no copy issued before reads it; handed on to the pool only when ``hand_on`` (else the
        payload file's write under way still reads it)."""
        old = self.encoded.pop(unit.index, None)
        if old is None:
            return
        self.unproven.discard(unit.index)  # encoded again below, from the weights
        self.locks.unlock([old.payload], hand_on=hand_on)
        encoded = encode_unit(self.host_of(unit), segments_of(unit))
        if worth_compressing(encoded):
            self.keep({unit.index: encoded}, self.locks.pin)

    def first_mismatch(self, unit: Unit, encoded: EncodedUnit) -> str | None:
        """Decode ``encoded`` on the device once and compare every tensor's bytes with the host copy; the
        name of the first tensor that differs, None when all are exact.

        A wrong payload would make every later load silently compute with wrong weights; this costs one
        copy of the unit and of its payload, one decode and one synchronisation at set-up (`check_decodes`,
        the encoder's own check). The CPU decoder is a reference, far slower than the encoder, so on the CPU the
        payload is compared with a fresh encoding of the weights instead (the encoder is deterministic): as
        exact, at encoding speed."""
        host = self.host_of(unit)
        if not self.cuda:
            fresh = encode_unit(host, list(encoded.segments), chunk=encoded.chunk)
            same = dataclasses.replace(fresh, payload=encoded.payload) == encoded
            return None if same and torch.equal(fresh.payload, encoded.payload) else "its payload differs"
        on_device = dataclasses.replace(encoded, payload=encoded.payload.to(self.device, non_blocking=True))
        try:
            check_decodes(on_device, host.to(self.device, non_blocking=True))
        except CodecMismatch as exc:
            return unit.tensors[exc.segment].names[0]
        return None

    @staticmethod
    def mismatch_error(unit: Unit, tensor: str) -> FlexTensorError:
        """What a payload that does not decode to its weights at set-up raises: a codec fault on this device."""
        return FlexTensorError(
            f"the compressed copy of {unit.name!r} does not decode to its weights ({tensor}): "
            "a codec fault on this device; pass compression='none' (--compression none)"
        )

    @property
    def stored_bytes(self) -> int:
        """Bytes of all payloads, wherever they are: what they take in RAM when all are there."""
        return sum(e.payload.numel() for e in self.encoded.values())
