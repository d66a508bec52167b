"""The compressed copy of each unit worth it: made at set-up, page-locked, checked, released before dropped.

A unit kept compressed streams its *payload* (`codec`) and decodes it on the device into its slot, bit-exact;
the raw host copy stays the weights' truth (`host_copies`), in RAM or, with ``raw_copies="disk"``, in a file.
Payloads come from the encoder or from the payload cache (`payload_cache`), and none is used before it was shown
to decode to the weights: on CUDA by decoding it there once and comparing, on the CPU by comparing it with a
fresh encoding.

Payloads leave RAM too when the host tier keeps their model on disk (`spill`): they become views of the payload
file, written once (in the background after encoding: `payload_cache.BackgroundWrite`) and unwritten again until
an edit, and come back unit by unit (`read_payload`, `take`) while the model computes, each checked against its
checksum.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..engine.errors import FlexTensorError, OffloadStateError, first_line
from ..engine.units import Unit
from .arrivals import EncodingBetweenForwards, PayloadArrival
from .cache_files import drop_cached_pages_later
from .codec import CodecMismatch, EncodedUnit, Segment, check_decodes, encode_unit, worth_compressing
from .device_encoding import DeviceEncoder, EncodeJob
from .file_reads import SERIAL, PieceReader
from .host_memory import host_buffer, page_locked, unpin_in_place
from .locked_pool import LockedPool
from .payload_cache import BackgroundWrite, CacheRecord, PayloadCache, UnusableCache, header_segments
from .setup_threads import on_threads

logger = logging.getLogger(__name__)

#: ``settled(index, kept)``: unit ``index`` is done with at set-up (its payload kept, or it is not worth
#: compressing), told in unit order; what `RawHomes.settle` uses to move raw bytes out of RAM as encoding goes.
Settled = Callable[[int, bool], None]


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
        #: The file payloads wait in while their model is on disk (the payload cache): set at set-up.
        self.file: PayloadCache | None = None
        #: Units whose payloads wait in ``file`` now (views of its mapping), by index: `spill` to `take`.
        self.waiting: set[int] = set()
        self._file_holds = False  # ``file`` holds every payload as it is now (written or read, no edit since)
        self._writing: BackgroundWrite | None = None  # the file's write after encoding, until taken (`_finish_write`)
        #: The peak allocated device memory the device encoder may reach at set-up (None: no bound); the handle
        #: sets its GPU budget.
        self.budget_bytes: int | None = None
        #: A set-up that did not wait for its payloads (`arrivals`): read from the payload file (`start_arrival`) or
        #: encoded between forwards (`start_encoding`) while the model streams raw.
        self._arrival: PayloadArrival | EncodingBetweenForwards | None = None
        #: Payloads kept from the payload file and not yet shown to decode to their unit's weights: no planned load
        #: decodes them until a first decoded load (an on-demand one) compared the result with the weights
        #: (`DeviceCopies.prove`).
        self.unproven: set[int] = set()
        #: Where payloads read back from ``file`` get their page-locked buffers, and where those let go are kept
        #: locked for the next reads (the host tier's: `locked_pool`); None: each is locked and unlocked itself.
        self.locked_pool: LockedPool | None = None

    def make(
        self, pin: bool, cache: PayloadCache | None = None, settled: Settled | None = None, at_set_up: bool = True
    ) -> None:
        """Keep a compressed copy of every unit that streams faster that way (see `codec`): loads then
        move the payload and decode it on the device, bit-exact. The raw host copy stays the truth.

        With a ``cache`` whose file holds this model's payloads, they are read back instead of encoded,
        and each is decoded and compared with the weights before it is kept: one mismatch refuses the
        file (`payload_cache`). Otherwise units are encoded (on the GPU where there is one: `_encode_all`)
        and the file is written. On a CUDA device the encoder decodes every new payload once there and
        compares it with the weights too (``verify``). Payloads are page-locked in place
        (``cudaHostRegister`` on their own mapping, which locks the pages where they are instead of copying them
        as ``pin_memory()`` does) and unregistered before they are dropped (`release`).

        ``settled`` is told of every unit once it is done with, in unit order: as each is encoded on CUDA,
        after all of them on the CPU (`Settled`). At set-up a device encoder that needs more than ``budget_bytes``
        refuses it; after an edit (``at_set_up=False``) it encodes one unit at a time and only warns, since
        refusing then would leave the edit half done."""
        self.release()
        self.pinned = pin
        told = _InOrder(settled, [unit.index for unit in self.units])
        if cache is not None and self._keep_cached(cache, pin, told):
            self._file_holds = True
        else:
            self._encode_all(pin, cache, told, at_set_up)
        told.rest(self.encoded)
        if self.cuda:  # the checks' decode buffers go back to the device, not to the allocator's cache
            torch.cuda.empty_cache()

    def _encode_all(self, pin: bool, cache: PayloadCache | None, told: _InOrder, at_set_up: bool = True) -> None:
        """Encode every unit worth it, keep the payloads (locked in place) and write ``cache``. On the CPU
        one unit per thread; on CUDA one after the other on the device (`DeviceEncoder`: each payload
        checked there, copies both ways overlapped with the coding, payloads locked as they arrive).

        A failure leaves no payload kept nor locked, and becomes a one-line error naming
        ``compression='none'``."""
        encoded_by_unit: dict[int, EncodedUnit] = {}
        locked: set[int] = set()
        try:
            if self.cuda:
                self._encode_on_device(pin, encoded_by_unit, locked, told, at_set_up)
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
        if cache is not None:  # for the next run, or a spill (which waits for it): set-up does not wait
            self._writing = BackgroundWrite(cache, self.encoded)

    @staticmethod
    def _encode_on_host(unit: Unit, hosts: dict[int, torch.Tensor], encoded_by_unit: dict[int, EncodedUnit]) -> None:
        encoded = encode_unit(hosts[unit.index], segments_of(unit))
        if worth_compressing(encoded):
            encoded_by_unit[unit.index] = encoded

    def _encode_on_device(
        self, pin: bool, encoded_by_unit: dict[int, EncodedUnit], locked: set[int], told: _InOrder, at_set_up: bool
    ) -> None:
        """Units in order through `DeviceEncoder`; each unit's host bytes are asked for (the gate waits
        while it is packed) only when its turn comes, and each kept payload is kept at once, so that
        ``told`` may move the unit's raw bytes out of RAM."""
        jobs = self._encode_jobs()
        encoder = DeviceEncoder(
            self.device, lock=pin, keep=worth_compressing, budget_bytes=self.budget_bytes, refuse=at_set_up
        )
        desc = "compressing weights on the device"
        for done in tqdm(encoder.encode(jobs), total=len(jobs), desc=desc, disable=None, leave=False):
            encoded_by_unit[done.index] = done.encoded
            if done.locked:
                locked.add(done.index)
            told.upto(done.index, encoded_by_unit)

    def _encode_jobs(self) -> list[EncodeJob]:
        """Every unit as the device encoder's job: its host bytes asked for (the gate waits while it is packed or
        arrives) only when its turn comes."""
        return [EncodeJob(unit.index, functools.partial(self._host_of, unit), segments_of(unit)) for unit in self.units]

    def _encoder_error(self, exc: BaseException) -> BaseException:
        """What a failed encoding raises: a mismatch names the unit and tensor; a CUDA fault or an
        out-of-memory error its first line; both name compression='none'. Others pass through."""
        if isinstance(exc, CodecMismatch) and exc.unit is not None:
            unit = next(u for u in self.units if u.index == exc.unit)
            return self._mismatch_error(unit, unit.tensors[exc.segment].names[0])
        if isinstance(exc, RuntimeError) and not isinstance(exc, FlexTensorError):
            room = "; or leave ~3 GiB of the device free at set-up (the encoder's most)"
            return FlexTensorError(
                f"compressing the weights on {self.device} failed ({first_line(exc)}): pass compression='none' "
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
        records = self._usable_records(cache)
        if not records:
            return False
        by_index = {unit.index: unit for unit in self.units}
        check = None if self.cuda else lambda index, encoded: self._first_mismatch(by_index[index], encoded)
        arrival = PayloadArrival(cache, records, pin, check).begin()
        refused = None
        try:
            for index in tqdm(sorted(records), desc="reading compressed weights", disable=None, leave=False):
                fetched = arrival.wait_for(index)
                self.encoded[index] = fetched.encoded
                if fetched.locked:
                    self._registered.append(fetched.encoded.payload)
                unit = by_index[index]
                mismatch = self._first_mismatch(unit, fetched.encoded) if self.cuda else fetched.mismatch
                if mismatch is not None:
                    raise UnusableCache(f"its copy of {unit.name!r} does not decode to the weights ({mismatch})")
                if self.cuda:
                    told.upto(index, self.encoded)
        except UnusableCache as exc:
            refused = str(exc)
        finally:  # payloads read ahead and not kept are dropped with their futures (unlocked as they go)
            arrival.abandon()
        if refused is not None:
            self.release()
            told.restart()
            cache.refuse(refused)
            return False
        cache.mark_read()
        return True

    def _usable_records(self, cache: PayloadCache) -> dict[int, CacheRecord]:
        """``cache``'s records when its header matches this model (its units, laid out alike); else none, the file
        refused saying why."""
        records = cache.open()
        if not records:
            return {}
        by_index = {unit.index: unit for unit in self.units}
        if not set(records) <= set(by_index):
            cache.refuse("it names units this model does not have")
            return {}
        if any(list(map(tuple, r.segments)) != header_segments(by_index[i].tensors) for i, r in records.items()):
            cache.refuse("its tensors lie elsewhere in the units (other alignment classes or strides)")
            return {}
        return records

    # ------------------------------------------------------------------------------------ arriving after set-up

    def start_arrival(self, cache: PayloadCache, pin: bool) -> bool:
        """Set-up from the payload file without waiting for it: its header is checked here, and its payloads are
        read on threads (`PayloadArrival`) from `begin_arrival` on, while the model already runs raw, and kept once
        all arrived (`adopt_arrival`), each to be proven at its first decoded load. False, nothing started, when
        the file is missing or refused."""
        self.release()
        records = self._usable_records(cache)
        if not records:
            return False
        self.file, self.pinned = cache, pin
        self._arrival = PayloadArrival(cache, records, pin)
        cache.mark_reading()
        return True

    def start_arrival_else_encoding(self, cache: PayloadCache, pin: bool) -> None:
        """As `start_arrival`, for a set-up that encodes between forwards where there is no usable file: nothing of
        the file is read here, not even its header (on the H100 a set-up that checked it took 1.14× raw's, call V).
        It is checked as the reads begin, and a missing or refused file turns into encoding between forwards at the
        next forward's start or end (`encode_if_no_file`)."""
        self.release()
        self.file, self.pinned = cache, pin
        self._arrival = PayloadArrival(cache, functools.partial(self._usable_records, cache), pin)
        cache.mark_opening()

    def begin_arrival(self) -> None:
        """Begin reading the payload file `start_arrival` checked (nothing when none is to be read, or already
        begun). Set-up calls it once the raw copies are all packed, so that the reads share neither the disk nor
        the memory bus nor the CPU with set-up and packing (begun with set-up, on the H200, call L: set-up 0.255 s
        against raw's 0.128 s, first step 4.14 s against 3.37 s)."""
        if isinstance(self._arrival, PayloadArrival):
            self._arrival.begin()

    def start_encoding(self, cache: PayloadCache | None, pin: bool) -> None:
        """Set-up without waiting for the encoder (``background_encoding``): the units are encoded between the
        model's forwards (`encode_between_forwards`) while it streams raw, on its device within ``budget_bytes``;
        the payloads are kept once all are made (`adopt_arrival`), each to be proven at its first decoded load,
        and then written to ``cache``'s file."""
        self.release()
        self.file, self.pinned = cache, pin
        self._arrival = EncodingBetweenForwards(self._encode_jobs(), self.device, pin, self.budget_bytes)
        if cache is not None:
            cache.mark_encoding()

    def encode_if_no_file(self) -> bool:
        """The payload file checked as its reads began (`start_arrival_else_encoding`) was missing or refused:
        encode between forwards instead (`start_encoding`), and say so. Called on the model's thread at each
        forward's start and end, and by `adopt_arrival`; nothing when the header is not checked yet, or was
        usable."""
        arrival = self._arrival
        if not (isinstance(arrival, PayloadArrival) and arrival.found_no_file):
            return False
        self.start_encoding(self.file, self.pinned)
        return True

    @property
    def encoding_between_forwards(self) -> bool:
        """Units are left to encode between the model's forwards (`start_encoding`)."""
        return isinstance(self._arrival, EncodingBetweenForwards) and not self._arrival.done

    def encode_between_forwards(self, seconds: float, now: Callable[[], float]) -> None:
        """After a forward, the model's device memory given back: encode the next units for about ``seconds`` by the
        clock ``now`` (`EncodingBetweenForwards.encode_for`)."""
        assert isinstance(self._arrival, EncodingBetweenForwards)
        self._arrival.encode_for(seconds, now)

    @property
    def arriving(self) -> bool:
        """Payloads are being read or made since set-up and not taken yet (`start_arrival`, `start_encoding`)."""
        return self._arrival is not None

    @property
    def arrived(self) -> bool:
        """The payloads read or made since set-up are all here (or one failed): `adopt_arrival` takes them."""
        return self._arrival is not None and self._arrival.done

    def adopt_arrival(self) -> bool:
        """Keep the payloads read or made since set-up (the model inactive), every one unproven; True when kept. A
        read that failed keeps none: the file is refused and deleted (the next set-up encodes again), the model
        streams raw; so does a failed encoding, with a warning. Payloads made here are then written to the file.
        A file found missing or refused as its reads began (after the caller's `encode_if_no_file`) keeps none:
        the units are encoded between forwards from now on."""
        if self.encode_if_no_file():
            return False
        arrival, self._arrival = self._arrival, None
        assert arrival is not None
        payloads, failure = arrival.take()
        if failure is not None:
            if arrival.in_file:
                self._forget_file(failure, then="this run streams raw, and the next set-up encodes again")
            else:
                logger.warning("compressing the weights while the model ran failed (%s): it streams them raw", failure)
            return False
        for index in sorted(payloads):
            self.encoded[index] = payloads[index].encoded
            if payloads[index].locked:
                self._registered.append(payloads[index].encoded.payload)
        self.unproven = set(payloads)
        if arrival.in_file:
            assert self.file is not None
            self._file_holds = True
            self.file.mark_read()
        elif self.file is not None:  # for the next run, or a spill (which waits for it)
            self._writing = BackgroundWrite(self.file, self.encoded)
        return True

    def cancel_arrival(self, why: str | None) -> None:
        """Stop reading the payload file, keeping none of its payloads: an edit made them stale (``why`` says so, in
        the file's status and a warning), or the copies are dropped (None)."""
        arrival, self._arrival = self._arrival, None
        if arrival is not None:
            usable = not isinstance(arrival, PayloadArrival) or arrival.usable
            arrival.abandon()
            if why is not None and not usable:  # the file not checked yet, or found missing or refused
                logger.warning("%s came before any payload was read or made: the model streams raw", why)
            elif why is not None and arrival.in_file and self.file is not None:
                self.file.refuse(f"{why} came while it was being read", then="the model streams raw")
            elif why is not None:
                logger.warning("%s came while the weights were being compressed: the model streams them raw", why)

    @property
    def proven(self) -> frozenset[int]:
        """The units whose compressed copies a load may decode: all kept but those not proven yet."""
        return frozenset(self.encoded) - frozenset(self.unproven)

    def prove(self, index: int) -> None:
        """Unit ``index``'s payload decoded to its weights at its first load: planned loads may decode it now."""
        self.unproven.discard(index)

    def disprove(self, unit: Unit) -> frozenset[int]:
        """``unit``'s payload from the file did not decode to its weights: the file is stale. Every payload not proven
        yet is dropped (once no copy reads it), and the file refused and deleted so that the next set-up encodes
        again; the units dropped."""
        dropped = frozenset(self.unproven)
        self._unregister([self.encoded[i].payload for i in dropped])
        for index in dropped:
            del self.encoded[index]
        self.unproven = set()
        self._forget_file(
            f"its copy of {unit.name!r} does not decode to the weights",
            then="the units not proven yet stream raw, and the next set-up encodes again",
        )
        return dropped

    def _forget_file(self, why: str, then: str) -> None:
        """The payload file cannot be used: refused (saying ``why``, and ``then`` what happens instead, in a
        warning) and deleted when no other live model uses it."""
        self._file_holds = False
        if self.file is not None:
            self.file.refuse(why, then=then)
            self.file.discard()

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
        self.unproven.discard(unit.index)  # encoded again below, from the weights
        self.waiting.discard(unit.index)  # its new payload is in RAM; the file's is stale
        self._file_holds = False
        if self._writing is not None:
            self._writing.stale = True
        # a copy issued before may still read it; the file's write under way too, so then it is not handed on
        self._unregister([old.payload], hand_on=self._writing is None)
        encoded = encode_unit(self._host_of(unit), segments_of(unit))
        if worth_compressing(encoded):
            self._keep({unit.index: encoded}, self.pinned)

    def release(self) -> None:
        """Drop the compressed copies, unregistering those pinned in place (once no copy reads them), after the
        payload file's write under way (it reads them)."""
        self._finish_write()
        self.cancel_arrival(None)
        self._unregister(self._registered)
        self.encoded = {}
        self.waiting = set()
        self.unproven = set()
        self._file_holds = False

    def _unregister(self, payloads: list[torch.Tensor], copies_done: bool = False, hand_on: bool = True) -> None:
        """Unlock those of ``payloads`` that are locked in place, once no copy issued before reads them (the
        device is synchronised first unless the caller knows those copies are done, ``copies_done``; the others
        were page-locked as copies, or not at all: nothing to undo). With a `locked_pool`, they are kept there
        locked for the next reads instead, unless ``hand_on`` is False (something else may still read them)."""
        ids = {id(p) for p in payloads}
        locked = [p for p in self._registered if id(p) in ids]
        if locked and self.cuda and not copies_done:
            torch.cuda.synchronize(self.device)
        pool = self.locked_pool if hand_on else None
        for payload in locked:
            if pool is None or not pool.keep(payload):
                unpin_in_place(payload)
        self._registered = [p for p in self._registered if id(p) not in ids]

    @property
    def payload_bytes(self) -> int:
        """Host RAM of the payloads (those waiting in the file are not in RAM)."""
        return sum(e.payload.numel() for i, e in self.encoded.items() if i not in self.waiting)

    @property
    def stored_bytes(self) -> int:
        """Bytes of all payloads, wherever they are: what they take in RAM when all are there."""
        return sum(e.payload.numel() for e in self.encoded.values())

    # ------------------------------------------------------------------------------------ waiting on disk

    @property
    def file_current(self) -> bool:
        """The payload file holds every payload as it is now (no edit re-encoded one since it was written); False
        while it is being written."""
        if self._writing is not None and not self._writing.running:
            self._finish_write()
        return self._writing is None and self.file is not None and self._file_holds and self.file.path.exists()

    def _finish_write(self) -> None:
        """Wait for the payload file's write under way, if any, and take its outcome."""
        if self._writing is not None:
            self._file_holds = self._writing.held()
            self._writing = None

    def spill(self) -> None:
        """Move every payload still in RAM out into the payload file: written first when it does not hold them
        (a full disk raises with the payloads still in RAM; those let go before are read back first, to be
        written), then each payload becomes a view of the file's mapping and its RAM is freed. The model must be
        inactive."""
        if self.file is None:
            raise OffloadStateError("compressed copies can wait on disk only with a payload file (set-up sets it)")
        if len(self.waiting) == len(self.encoded):
            return
        self._finish_write()
        if not self.file_current:
            for index in sorted(self.waiting):  # let go from a file an edit made stale since: needed to write it
                self.take(index, *self.read_payload(index, self.pinned))
            self.file.own_for_writing()
            self._file_holds = self.file.write(self.encoded, strict=True)
        views = self.file.map()
        self._unregister(list(self._registered))
        self.encoded = {i: dataclasses.replace(e, payload=views[i]) for i, e in self.encoded.items()}
        self.waiting = set(self.encoded)

    def let_go(self, index: int) -> None:
        """Unit ``index``'s payload, in RAM, goes back to the payload file, which holds it (`file_current`): it
        becomes a view of the file's mapping and its RAM is freed, while the model may be active (a component's
        RAM handed over during its last forward, see `storage.host_tier.hand_over`). The caller waited for
        every copy that read it; the next load of the unit has to take it back first (`read_payload`, `take`)."""
        assert self.file is not None and self.file_current and index not in self.waiting
        payload = self.encoded[index].payload
        self._unregister([payload], copies_done=True)
        self.encoded[index] = dataclasses.replace(self.encoded[index], payload=self.file.map()[index])
        self.waiting = self.waiting | {index}  # a new set: readers on other threads iterate the old one

    def read_payload(
        self, index: int, pin: bool, reader: PieceReader = SERIAL, buffered: Callable[[], None] = lambda: None
    ) -> tuple[torch.Tensor, bool]:
        """Unit ``index``'s waiting payload in a RAM buffer (one the `locked_pool` lends, page-locked as the pool's
        are; else a new one, page-locked when ``pin``: in place where CUDA allows, else a pinned copy; True when lent
        or locked in place: its owner gives it back with ``unpin_in_place``), read from
        the file in pieces on ``reader``'s threads and checked against its checksum; ``buffered`` is told once the
        buffer is had (under the pool's lock: `LockedPool.take`). Changes nothing here: runs on a reader thread while
        the model waits or computes."""
        assert self.file is not None
        nbytes = self.file.records[index].payload_nbytes
        pool = self.locked_pool
        if pool is not None:
            buffer, lent = pool.take(nbytes, buffered)
        else:
            buffer, lent = host_buffer(nbytes), False
            buffered()
        try:
            self.file.read_payload(index, buffer, reader)
        except BaseException:
            if lent:
                unpin_in_place(buffer)  # back to the pool
            raise
        return (buffer, lent) if lent or not pin else page_locked(buffer)

    def take(self, index: int, payload: torch.Tensor, locked: bool) -> None:
        """Adopt ``payload`` (from `read_payload`) as unit ``index``'s payload in RAM; the last one taken drops
        the file's pages from the page cache."""
        self.encoded[index] = dataclasses.replace(self.encoded[index], payload=payload)
        if locked:
            self._registered.append(payload)
        self.waiting.discard(index)
        if not self.waiting and self.file is not None:
            drop_cached_pages_later(self.file.path)

    def untake(self, indices: list[int]) -> None:
        """Point the payloads of ``indices`` (taken back) at the file again, which still holds them: a read
        back given up leaves the model on disk as before."""
        if not indices:
            return
        assert self.file is not None
        views = self.file.map()
        self._unregister([self.encoded[i].payload for i in indices])
        for index in indices:
            self.encoded[index] = dataclasses.replace(self.encoded[index], payload=views[index])
            self.waiting.add(index)


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
            self._settled(unit, unit in kept)
            self._next += 1

    def rest(self, kept: dict[int, EncodedUnit]) -> None:
        if self._indices:
            self.upto(self._indices[-1], kept)

    def restart(self) -> None:
        self._next = 0
