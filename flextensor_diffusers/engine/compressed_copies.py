"""The compressed copy of each unit worth it: made at set-up, page-locked, checked, released before dropped.

A unit kept compressed streams its *payload* (`codec`) and decodes it on the device into its slot, bit-exact;
the raw host copy stays the weights' truth (`host_copies`). Payloads come from the encoder or from the payload
cache (`payload_cache`), and none is used before it was shown to decode to the weights: on CUDA by decoding
it there once and comparing, on the CPU by comparing it with a fresh encoding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from .codec import CodecMismatch, EncodedUnit, Segment, check_decodes, encode_unit, worth_compressing
from .device_encoding import DeviceEncoder, EncodeJob
from .errors import FlexTensorError
from .host_memory import page_locked, unpin_in_place
from .payload_cache import PayloadCache
from .setup_threads import PACK_THREADS, on_threads
from .units import Unit


def segments_of(unit: Unit) -> list[Segment]:
    """The codec's view of a unit's flat buffer: where each tensor lies and its dtype."""
    return [Segment(p.offset, p.nbytes, p.dtype) for p in unit.tensors]


class CompressedCopies:
    """The payloads of a model's units by unit index (``encoded``), and the page-locking that goes with them.

    ``host_of(unit)`` gives a unit's final host bytes (`HostCopies.host_of`: it waits for units
    still arriving from disk).
    """

    def __init__(self, units: list[Unit], device: torch.device, host_of: Callable[[Unit], torch.Tensor]) -> None:
        self.units = units
        self.device = device
        self.cuda = device.type == "cuda"
        self._host_of = host_of
        self.encoded: dict[int, EncodedUnit] = {}
        self.pinned = False  # payloads are page-locked (asked at the last `make`)
        self._registered: list[torch.Tensor] = []  # payloads page-locked in place

    def make(self, pin: bool, cache: PayloadCache | None = None) -> None:
        """Keep a compressed copy of every unit that streams faster that way (see `codec`): loads then
        move the payload and decode it on the device, bit-exact. The raw host copy stays the truth.

        With a ``cache`` whose file holds this model's payloads, they are read back instead of encoded,
        and each is decoded and compared with the weights before it is kept: one mismatch refuses the
        file (`payload_cache`). Otherwise units are encoded (on the GPU where there is one: `_encode_all`)
        and the file is written. On a CUDA device the encoder decodes every new payload once there and
        compares it with the weights too (``verify``). Payloads are page-locked in place
        (``cudaHostRegister`` on their own mapping, which locks the pages where they are instead of copying them
        as ``pin_memory()`` does) and unregistered before they are dropped (`release`)."""
        self.release()
        self.pinned = pin
        if cache is None or not self._keep_cached(cache.read(PACK_THREADS), pin, cache):
            self._encode_all(pin, cache)
        if self.cuda:  # the checks' decode buffers go back to the device, not to the allocator's cache
            torch.cuda.empty_cache()

    def _encode_all(self, pin: bool, cache: PayloadCache | None) -> None:
        """Encode every unit worth it, keep the payloads (locked in place) and write ``cache``. On the CPU
        one unit per thread; on CUDA one after the other on the device (`DeviceEncoder`: each payload
        checked there, copies both ways overlapped with the coding, payloads locked as they arrive).

        A failure leaves no payload kept nor locked, and becomes a one-line error naming
        ``compression='none'``."""
        encoded_by_unit: dict[int, EncodedUnit] = {}
        locked: set[int] = set()
        try:
            if self.cuda:
                self._encode_on_device(pin, encoded_by_unit, locked)
            else:
                hosts = {unit.index: self._host_of(unit) for unit in self.units}  # the gate asked on this thread
                on_threads(lambda unit: self._encode_on_host(unit, hosts, encoded_by_unit), self.units, "compressing")
        except BaseException as exc:
            self._registered = [encoded_by_unit[index].payload for index in locked]
            self.release()
            error = self._encoder_error(exc)
            if error is exc:
                raise
            raise error from exc
        self._keep({index: encoded_by_unit[index] for index in sorted(encoded_by_unit)}, pin, frozenset(locked))
        if cache is not None:
            cache.write(self.encoded)

    @staticmethod
    def _encode_on_host(unit: Unit, hosts: dict[int, torch.Tensor], encoded_by_unit: dict[int, EncodedUnit]) -> None:
        encoded = encode_unit(hosts[unit.index], segments_of(unit))
        if worth_compressing(encoded):
            encoded_by_unit[unit.index] = encoded

    def _encode_on_device(self, pin: bool, encoded_by_unit: dict[int, EncodedUnit], locked: set[int]) -> None:
        """Units in order through `DeviceEncoder`; each unit's host bytes are asked for (the gate waits
        while it is packed) only when its turn comes."""
        jobs = [EncodeJob(unit.index, functools.partial(self._host_of, unit), segments_of(unit)) for unit in self.units]
        encoder = DeviceEncoder(self.device, lock=pin, keep=worth_compressing)
        desc = "compressing weights on the device"
        for done in tqdm(encoder.encode(jobs), total=len(jobs), desc=desc, disable=None, leave=False):
            encoded_by_unit[done.index] = done.encoded
            if done.locked:
                locked.add(done.index)

    def _encoder_error(self, exc: BaseException) -> BaseException:
        """What a failed encoding raises: a mismatch names the unit and tensor; a CUDA fault or an
        out-of-memory error its first line; both name compression='none'. Others pass through."""
        if isinstance(exc, CodecMismatch) and exc.unit is not None:
            unit = next(u for u in self.units if u.index == exc.unit)
            return self._mismatch_error(unit, unit.tensors[exc.segment].names[0])
        if isinstance(exc, RuntimeError) and not isinstance(exc, FlexTensorError):
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            room = "; or leave ~3 GiB of the device free at set-up (the encoder's most)"
            return FlexTensorError(
                f"compressing the weights on {self.device} failed ({first_line}): pass compression='none' "
                f"(--compression none) to stream them raw{room if isinstance(exc, torch.OutOfMemoryError) else ''}"
            )
        return exc

    def _keep_cached(self, cached: dict[int, EncodedUnit], pin: bool, cache: PayloadCache) -> bool:
        """Keep the payloads read from ``cache`` when every one decodes to its unit's weights; else keep none."""
        if not cached:
            return False
        by_index = {unit.index: unit for unit in self.units}
        if not set(cached) <= set(by_index):
            cache.refuse("it names units this model does not have")
            return False
        if any(list(encoded.segments) != segments_of(by_index[i]) for i, encoded in cached.items()):
            cache.refuse("its tensors lie elsewhere in the units (other alignment classes or strides)")
            return False
        self._keep(cached, pin)
        mismatches: dict[str, str] = {}

        def check(unit: Unit) -> None:
            mismatch = self._first_mismatch(unit, self.encoded[unit.index])
            if mismatch is not None:
                mismatches[unit.name] = mismatch

        units = [by_index[i] for i in sorted(cached)]
        if self.cuda:  # one decode at a time on the device
            for unit in units:
                check(unit)
        else:  # fresh encodings, one unit per thread as `_encode_all` encodes
            on_threads(check, units, "checking cached compressed weights")
        if mismatches:
            self.release()
            name = min(mismatches)
            cache.refuse(f"its copy of {name!r} does not decode to the weights ({mismatches[name]})")
            return False
        return True

    def _keep(self, encoded_by_unit: dict[int, EncodedUnit], pin: bool, locked: frozenset[int] = frozenset()) -> None:
        """Make each payload of ``encoded_by_unit`` its unit's compressed copy, page-locked when ``pin`` (those
        of ``locked`` already are, in place; the others arrive pageable: the host encoder and the cache read
        into new buffers), on `PACK_THREADS` threads: ``cudaHostRegister`` releases the GIL."""
        kept: dict[int, EncodedUnit] = {}

        def keep(index: int) -> None:
            encoded = encoded_by_unit[index]
            in_place = index in locked
            if pin and not in_place:
                payload, in_place = page_locked(encoded.payload)
                encoded = dataclasses.replace(encoded, payload=payload)
            if in_place:
                self._registered.append(encoded.payload)
            kept[index] = encoded

        if pin:
            on_threads(keep, list(encoded_by_unit), "page-locking compressed weights")
        else:
            for index in encoded_by_unit:
                keep(index)
        self.encoded.update((index, kept[index]) for index in encoded_by_unit)  # in the units' order

    @staticmethod
    def _mismatch_error(unit: Unit, tensor: str) -> FlexTensorError:
        return FlexTensorError(
            f"the compressed copy of {unit.name!r} does not decode to its weights ({tensor}): "
            "a codec fault on this device; pass compression='none' (--compression none)"
        )

    def _first_mismatch(self, unit: Unit, encoded: EncodedUnit) -> str | None:
        """Decode ``encoded`` on the device once and compare every tensor's bytes with the host copy; the
        name of the first tensor that differs, None when all are exact.

        A wrong payload would make every later load silently compute with wrong weights; this costs one
        copy of the unit and of its payload, one decode and one synchronisation at set-up (`check_decodes`,
        the encoder's own check). The CPU decoder is a reference, far slower than the encoder, so on the CPU the
        payload is compared with a fresh encoding of the weights instead (the encoder is deterministic): as
        exact, at encoding speed."""
        host = self._host_of(unit)
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

    def refresh(self, unit: Unit) -> None:
        """Encode ``unit`` again from its host bytes, which an edit changed; on the host, so that no device
        memory beyond the budget is taken mid-run. It stays uncompressed when that no longer pays."""
        old = self.encoded.pop(unit.index, None)
        if old is None:
            return
        if any(payload is old.payload for payload in self._registered):
            if self.cuda:  # a copy issued before may still read it
                torch.cuda.synchronize(self.device)
            unpin_in_place(old.payload)
            self._registered = [p for p in self._registered if p is not old.payload]
        encoded = encode_unit(self._host_of(unit), segments_of(unit))
        if worth_compressing(encoded):
            self._keep({unit.index: encoded}, self.pinned)

    def release(self) -> None:
        """Drop the compressed copies, unregistering those pinned in place (once no copy reads them)."""
        if self._registered and self.cuda:
            torch.cuda.synchronize(self.device)
        for payload in self._registered:
            unpin_in_place(payload)
        self._registered = []
        self.encoded = {}

    @property
    def payload_bytes(self) -> int:
        """Host bytes of all payloads."""
        return sum(e.payload.numel() for e in self.encoded.values())
