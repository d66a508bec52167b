"""`SetUpPayloads`: making a model's payloads before set-up returns (or after an edit), read or encoded.

A unit kept compressed streams its *payload* (`codec`) and decodes it on the device into its slot, bit-exact;
the raw host copy stays the weights' truth. Payloads come from the payload cache (`payload_cache`) when its file
holds this model's, else from the encoder (on the device where there is one: `device_encoding`), and none is kept
before it was shown to decode to the weights: on CUDA by decoding it there once and comparing, on the CPU by
comparing it with a fresh encoding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..engine.errors import FlexTensorError, first_line
from ..engine.units import Unit
from .arrivals import PayloadArrival
from .codec import CodecMismatch, EncodedUnit, encode_unit, worth_compressing
from .device_encoding import DeviceEncoder, EncodeJob
from .payload_cache import CacheRecord, PayloadCache, UnusableCache, header_segments
from .payload_records import PayloadLocks, PayloadRecords, segments_of
from .setup_threads import on_threads
from .waiting_payloads import WaitingPayloads

#: ``settled(index, payload)``: unit ``index`` is done with at set-up (its payload, None when it is not worth
#: compressing), told in unit order; what `RawHomes.settle` uses to move raw bytes out of RAM as encoding goes (and,
#: payloads only, to hold the payload until the records keep it).
Settled = Callable[[int, EncodedUnit | None], None]


class SetUpPayloads:
    """Makes every unit's payload worth it at once (`make`), into ``records``; the payload file read or written
    is ``disk``'s.

    ``budget_bytes``: the peak allocated device memory the device encoder may reach (None: no bound); the handle
    sets its GPU budget."""

    def __init__(self, records: PayloadRecords, locks: PayloadLocks, disk: WaitingPayloads) -> None:
        self._records = records
        self._locks = locks
        self._disk = disk
        self.budget_bytes: int | None = None

    def make(
        self, pin: bool, cache: PayloadCache | None = None, settled: Settled | None = None, at_set_up: bool = True
    ) -> None:
        """Keep a compressed copy of every unit that streams faster that way (see `codec`), no payload kept before
        (`CompressedCopies.make` drops them first).

        With a ``cache`` whose file holds this model's payloads, they are read back instead of encoded,
        and each is decoded and compared with the weights before it is kept: one mismatch refuses the
        file (`payload_cache`). Otherwise units are encoded (on the GPU where there is one: `_encode_all`)
        and the file is written. On a CUDA device the encoder decodes every new payload once there and
        compares it with the weights too (``verify``). Payloads are page-locked in place
        (``cudaHostRegister`` on their own mapping, which locks the pages where they are instead of copying them
        as ``pin_memory()`` does) and unregistered before they are dropped.

        ``settled`` is told of every unit once it is done with, in unit order: as each is encoded on CUDA,
        after all of them on the CPU (`Settled`). At set-up a device encoder that needs more than ``budget_bytes``
        refuses it; after an edit (``at_set_up=False``) it encodes one unit at a time and only warns, since
        refusing then would leave the edit half done."""
        records = self._records
        told = _InOrder(settled, [unit.index for unit in records.units])
        if cache is not None and self._keep_cached(cache, pin, told):
            self._disk.mark_holds_all()
        else:
            self._encode_all(pin, cache, told, at_set_up)
        told.rest(records.encoded)
        if records.cuda:  # the checks' decode buffers go back to the device, not to the allocator's cache
            torch.cuda.empty_cache()

    def _encode_all(self, pin: bool, cache: PayloadCache | None, told: _InOrder, at_set_up: bool = True) -> None:
        """Encode every unit worth it, keep the payloads (locked in place) and write ``cache``. On the CPU
        one unit per thread; on CUDA one after the other on the device (`DeviceEncoder`: each payload
        checked there, copies both ways overlapped with the coding, payloads locked as they arrive).

        A failure leaves no payload kept nor locked, and becomes a one-line error naming
        ``compression='none'``."""
        records = self._records
        encoded_by_unit: dict[int, EncodedUnit] = {}
        locked: set[int] = set()
        try:
            if records.cuda:
                self._encode_on_device(pin, encoded_by_unit, locked, told, at_set_up)
            else:
                hosts = {unit.index: records.host_of(unit) for unit in records.units}  # the gate asked on this thread
                on_threads(lambda unit: _encode_on_host(unit, hosts, encoded_by_unit), records.units, "compressing")
        except BaseException as exc:
            for index in locked:
                self._locks.mark_locked(encoded_by_unit[index].payload)
            records.drop_all()
            error = self._encoder_error(exc)
            if error is exc:
                raise
            raise error from exc
        records.keep({index: encoded_by_unit[index] for index in sorted(encoded_by_unit)}, pin, frozenset(locked))
        if cache is not None:  # for the next run, or a spill (which waits for it): set-up does not wait
            self._disk.write_in_background(cache)

    def _encode_on_device(
        self, pin: bool, encoded_by_unit: dict[int, EncodedUnit], locked: set[int], told: _InOrder, at_set_up: bool
    ) -> None:
        """Units in order through `DeviceEncoder`; each unit's host bytes are asked for (the gate waits
        while it is packed) only when its turn comes, and each kept payload is kept at once, so that
        ``told`` may move the unit's raw bytes out of RAM."""
        jobs = self.encode_jobs()
        encoder = DeviceEncoder(
            self._records.device, lock=pin, keep=worth_compressing, budget_bytes=self.budget_bytes, refuse=at_set_up
        )
        desc = "compressing weights on the device"
        for done in tqdm(encoder.encode(jobs), total=len(jobs), desc=desc, disable=None, leave=False):
            encoded_by_unit[done.index] = done.encoded
            if done.locked:
                locked.add(done.index)
            told.upto(done.index, encoded_by_unit)

    def encode_jobs(self) -> list[EncodeJob]:
        """Every unit as the device encoder's job: its host bytes asked for (the gate waits while it is packed or
        arrives) only when its turn comes."""
        records = self._records
        return [EncodeJob(u.index, functools.partial(records.host_of, u), segments_of(u)) for u in records.units]

    def _encoder_error(self, exc: BaseException) -> BaseException:
        """What a failed encoding raises: a mismatch names the unit and tensor; a CUDA fault or an
        out-of-memory error its first line; both name compression='none'. Others pass through."""
        device = self._records.device
        if isinstance(exc, CodecMismatch) and exc.unit is not None:
            unit = next(u for u in self._records.units if u.index == exc.unit)
            return self._records.mismatch_error(unit, unit.tensors[exc.segment].names[0])
        if isinstance(exc, RuntimeError) and not isinstance(exc, FlexTensorError):
            room = "; or leave ~3 GiB of the device free at set-up (the encoder's most)"
            return FlexTensorError(
                f"compressing the weights on {device} failed ({first_line(exc)}): pass compression='none' "
                f"(--compression none) to stream them raw{room if isinstance(exc, torch.OutOfMemoryError) else ''}"
            )
        return exc

    def _keep_cached(self, cache: PayloadCache, pin: bool, told: _InOrder) -> bool:
        """Keep the payloads of ``cache``'s file when every one is intact and decodes to its unit's weights; else
        keep none (the file refused, saying why).

        Reading is pipelined: threads read the payloads ahead, in unit order, each checked against its CRC-32 and
        page-locked in place, while the main thread shows each one read to decode to its unit's weights. On CUDA
        that is one decode at a time on the device, in unit order, so ``told`` moves each unit's raw bytes out
        of RAM as it goes; on the CPU the thread that read a payload compares it with a fresh encoding. So the
        disk, the checksums and the device work at once instead of one after the other."""
        records = self.usable_records(cache)
        if not records:
            return False
        kept = self._records
        by_index = {unit.index: unit for unit in kept.units}
        check = None if kept.cuda else lambda index, encoded: kept.first_mismatch(by_index[index], encoded)
        arrival = PayloadArrival(cache, records, pin, check).begin()
        refused = None
        try:
            for index in tqdm(sorted(records), desc="reading compressed weights", disable=None, leave=False):
                fetched = arrival.wait_for(index)
                kept.encoded[index] = fetched.encoded
                if fetched.locked:
                    self._locks.mark_locked(fetched.encoded.payload)
                unit = by_index[index]
                mismatch = kept.first_mismatch(unit, fetched.encoded) if kept.cuda else fetched.mismatch
                if mismatch is not None:
                    raise UnusableCache(f"its copy of {unit.name!r} does not decode to the weights ({mismatch})")
                if kept.cuda:
                    told.upto(index, kept.encoded)
        except UnusableCache as exc:
            refused = str(exc)
        finally:  # payloads read ahead and not kept are dropped with their futures (unlocked as they go)
            arrival.abandon()
        if refused is not None:
            kept.drop_all()
            told.restart()
            cache.refuse(refused)
            return False
        cache.mark_read()
        return True

    def usable_records(self, cache: PayloadCache) -> dict[int, CacheRecord]:
        """``cache``'s records when its header matches this model (its units, laid out alike); else none, the file
        refused saying why."""
        records = cache.open()
        if not records:
            return {}
        by_index = {unit.index: unit for unit in self._records.units}
        if not set(records) <= set(by_index):
            cache.refuse("it names units this model does not have")
            return {}
        if any(list(map(tuple, r.segments)) != header_segments(by_index[i].tensors) for i, r in records.items()):
            cache.refuse("its tensors lie elsewhere in the units (other alignment classes or strides)")
            return {}
        return records


def _encode_on_host(unit: Unit, hosts: dict[int, torch.Tensor], encoded_by_unit: dict[int, EncodedUnit]) -> None:
    """One unit encoded on the host (on a set-up thread), kept when it pays."""
    encoded = encode_unit(hosts[unit.index], segments_of(unit))
    if worth_compressing(encoded):
        encoded_by_unit[unit.index] = encoded


class _InOrder:
    """Tells a `Settled` callback of units in order, each once (``upto`` a unit index; the ``rest`` at the end);
    ``restart`` after payloads were dropped (a refused cache) tells them again as they are encoded."""

    def __init__(self, settled: Settled | None, indices: list[int]) -> None:
        self._settled = settled
        self._indices = indices
        self._next = 0

    def upto(self, index: int, kept: dict[int, EncodedUnit]) -> None:
        if self._settled is None:
            return
        while self._next < len(self._indices) and self._indices[self._next] <= index:
            unit = self._indices[self._next]
            self._settled(unit, kept.get(unit))
            self._next += 1

    def rest(self, kept: dict[int, EncodedUnit]) -> None:
        if self._indices:
            self.upto(self._indices[-1], kept)

    def restart(self) -> None:
        self._next = 0
