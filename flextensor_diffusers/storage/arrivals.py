"""Compressed copies that arrive after set-up, while the model already streams raw.

A set-up that does not wait for its payloads (`StoragePlan.may_read_payloads_later`, ``background_encoding``) leaves
them to an *arrival*, which `CompressedCopies` keeps once all are here (`CompressedCopies.adopt_arrival`), each
unproven until its first decoded load compares it with the weights:

- `PayloadArrival`: the payload file, read on threads once progressive packing is over;
- `EncodingBetweenForwards` (``background_encoding``, no file to read): the units encoded on the model's own
  thread after its forwards, on its device, each gap for about as long as the forward before it took.

Both answer ``done``, ``take`` (the payloads, and the first failure's line) and ``abandon``; ``in_file`` says
whether the payload file already holds what arrives.

Why between forwards, and not on host threads beside them as before: on the H200 (call L,
benchmarks/results/README.md) eight host threads encoding the 40-block Wan2.2 stack beside its raw forwards
slowed those from 0.5 s to about 2 s each for over a minute, and had not finished by then. A forward that streams
raw is bound by the copies from page-locked host memory, and the encoder's passes over the weights share the
memory bus and the CPU with them. Between forwards the encoder shares nothing with a forward, and it runs on the
device: 82 ms for a 703 MB block there on its own (fourth session), against about 5 s on one thread of a CPU
machine (0.15 GB/s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..engine.config import format_bytes
from ..engine.errors import BudgetError, first_line
from .codec import EncodedUnit, device_encoding_need, encode_unit, worth_compressing
from .device_encoding import ALLOCATION_SLACK, DeviceEncoder, EncodeJob
from .file_reads import UNITS_IN_FLIGHT, PieceReader
from .host_memory import page_locked
from .payload_cache import CacheRecord, PayloadCache
from .setup_threads import PACK_THREADS

#: The host memory the encoder works in beside the payloads it made, at most, in units of the largest unit it encodes
#: next: on CUDA the unit gathered from where its raw bytes wait (one; none when in RAM) and the two staging buffers
#: its payloads come back through (`device_encoding.STAGING_BUFFERS`, each an eighth larger than a payload, which
#: may be somewhat larger than its unit where coding does not pay); on the CPU the gathered unit and the host
#: encoder's slices and payload (`codec.device_encoding_need` at `codec.HOST_SLICE_BYTES`: under three units). What a
#: host tier makes room for before a gap (`EncodingBetweenForwards.room_needed`).
ENCODER_HOST_UNITS = 4


@dataclasses.dataclass(frozen=True)
class ArrivingPayload:
    """One payload that arrived after set-up: as an `EncodedUnit`, whether it is page-locked in place, and the first
    tensor a check found different (None: none, or not checked there)."""

    encoded: EncodedUnit
    locked: bool
    mismatch: str | None = None


class PayloadArrival:
    """The payloads of the payload file, read on threads in unit order (each in pieces: `file_reads`, so that they
    arrive in that order), each checked against its CRC-32, compared
    with its weights by ``check(index, encoded)`` when given (the first tensor that differs, None: none) and
    page-locked in place. A set-up that waits for them takes each in turn (`wait_for`: `SetUpPayloads._keep_cached`);
    one that does not (`CompressedCopies.start_arrival`) takes them all once ``done`` (`take`)."""

    #: The payloads come from the payload file (which then holds them).
    in_file = True

    def __init__(
        self,
        cache: PayloadCache,
        records: dict[int, CacheRecord] | Callable[[], dict[int, CacheRecord]],
        pin: bool,
        check: Callable[[int, EncodedUnit], str | None] | None = None,
    ) -> None:
        """``records``: the file's records, its header checked; or what checks it and returns them (empty: no usable
        file), called when the reads begin, so that a set-up that encodes between forwards where there is no usable
        file reads nothing of the file before it returns (`found_no_file` then says so)."""
        self._opener = records if callable(records) else None
        self._records: dict[int, CacheRecord] = {} if callable(records) else records
        self._cache, self._pin, self._check = cache, pin, check
        #: The header was checked as the reads began, and there is no usable file: nothing is read.
        self.found_no_file = False
        self._pieces = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="flextensor-arrive-piece")
        self._reader = PieceReader(self._pieces, PACK_THREADS)
        # each payload read in pieces by all threads, so few at once; but a check on the CPU (a fresh encoding)
        # is work for every thread
        in_flight = UNITS_IN_FLIGHT if check is None else PACK_THREADS
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="flextensor-arrive")
        self._futures: dict[int, Future[ArrivingPayload]] | None = None  # None: not begun
        # `begin` runs on the packing thread, `abandon` on the model's (an edit, removal): never both at once
        self._beginning = threading.Lock()

    @property
    def usable(self) -> bool:
        """The file's header was checked (at set-up, or as the reads began) and found usable: its payloads are
        read, or to be."""
        return bool(self._records)

    def begin(self) -> PayloadArrival:
        """Start the reads (no thread runs before: a set-up that does not wait for them begins them once the raw
        copies are packed, `CompressedCopies.begin_arrival`); a second call, or one after `abandon`, does nothing.
        A header left to check is checked first: no usable file reads nothing (`found_no_file`)."""
        with self._beginning:
            if self._futures is not None:
                return self
            if self._opener is not None:
                self._records = self._opener()
                if not self._records:
                    self.found_no_file = True  # set before the futures: ``done`` then implies it is known
                    self._shutdown(wait=False)
                    self._futures = {}
                    return self
                self._cache.mark_reading()
            self._futures = {index: self._pool.submit(self._read, index) for index in sorted(self._records)}
        return self

    def _read(self, index: int) -> ArrivingPayload:
        encoded = self._records[index].encoded(self._cache.read_checked(index, self._reader))
        mismatch = self._check(index, encoded) if self._check is not None else None
        payload, locked = page_locked(encoded.payload) if self._pin else (encoded.payload, False)
        return ArrivingPayload(dataclasses.replace(encoded, payload=payload), locked, mismatch)

    def wait_for(self, index: int) -> ArrivingPayload:
        """Unit ``index``'s payload once read (the reads begun); raises its read's failure (`UnusableCache`: a short
        or changed file)."""
        assert self._futures is not None, "the reads were not begun"
        return self._futures[index].result()

    @property
    def done(self) -> bool:
        """The reads were begun and all ended (read, or failed)."""
        return self._futures is not None and all(future.done() for future in self._futures.values())

    def take(self) -> tuple[dict[int, ArrivingPayload], str | None]:
        """The payloads read, and the first failure's line (None: none failed): a short or changed file
        (`UnusableCache`), or no memory; then the file is not used."""
        assert self._futures is not None, "the reads were not begun"
        payloads, failure = _results(self._futures)
        self._shutdown(wait=False)
        return payloads, failure

    def abandon(self) -> None:
        """Stop: reads not started are not made; those under way end and their buffers are dropped (unlocked)."""
        with self._beginning:
            self._shutdown(wait=True)
            self._futures = {}

    def _shutdown(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)  # first: a unit under way waits for its pieces
        self._pieces.shutdown(wait=wait)


def encoder_room(nbytes: int, held: int = 0) -> int:
    """The device memory encoding a unit of ``nbytes`` takes beside ``held`` bytes, the allocator's slack included
    (`codec.device_encoding_need`, which counts every byte as coded)."""
    need = held + device_encoding_need(nbytes)
    return need + int(need * ALLOCATION_SLACK)


def refuse_without_room(nbytes: int, held: int, budget_bytes: int | None, device: torch.device) -> None:
    """Raise `BudgetError` when encoding a unit of ``nbytes`` on ``device`` beside the ``held`` bytes the process
    holds there would go over the budget (`encoder_room`). The host encoder (a CPU ``device``) takes no device
    memory: nothing to refuse."""
    if budget_bytes is None or not nbytes or device.type != "cuda":
        return
    need = encoder_room(nbytes, held)
    if need > budget_bytes:
        raise BudgetError(
            f"background_encoding=True compresses the weights on {device} between forwards, which needs "
            f"{format_bytes(need)} of device memory there, over the budget of {format_bytes(budget_bytes)}"
            f": pass a budget of at least {need} bytes, or compression='none' (--compression none) to stream "
            "the weights raw",
            required_bytes=need,
        )


class EncodingBetweenForwards:
    """The payloads of ``jobs``' units made while the model streams raw, between its forwards (see the module
    docstring): after each forward the handle gives its device memory back and calls `encode_for` with the time
    that forward took, which encodes the next units in order until the next one, at the pace of those before it,
    would take longer than that (at least one a gap).

    On a CUDA ``device`` the units go through the `DeviceEncoder` (each checked there as it is made, page-locked in
    place when ``pin``) within ``budget_bytes``; on the CPU through the host encoder. Units not worth compressing
    get no payload. A failure (no room, no memory, a check that fails) ends the encoding: `take` reports it and the
    model streams raw."""

    #: The payloads are new: the payload file does not hold them yet.
    in_file = False

    def __init__(self, jobs: list[EncodeJob], device: torch.device, pin: bool, budget_bytes: int | None) -> None:
        self._jobs = jobs
        self._device = device
        self._pin = pin
        self._budget_bytes = budget_bytes
        self._nbytes = [job.nbytes for job in jobs]
        self._next = 0  # jobs[:_next] are encoded
        # one unit alone over the budget: refused at set-up, before anything is packed
        refuse_without_room(max(self._nbytes, default=0), 0, budget_bytes, device)
        self._made: dict[int, ArrivingPayload] = {}
        self._made_bytes = 0  # of ``_made`` until it is taken and kept: read on other threads (`made_bytes`)
        self._failure: str | None = None

    @property
    def done(self) -> bool:
        """Every unit encoded, or the encoding failed."""
        return self._failure is not None or self._next == len(self._jobs)

    @property
    def encoded_units(self) -> int:
        """How many units were encoded so far (kept or not worth it)."""
        return self._next

    @property
    def made_bytes(self) -> int:
        """Host RAM of the payloads made so far, until they are dropped or kept (`ArrivingPayloads.adopt` drops this
        arrival once they are): read by a host tier on other threads."""
        return self._made_bytes

    def room_needed(self) -> tuple[list[int], int]:
        """What encoding the units left takes in host RAM: per unit, in order, the most its payload keeps (its raw
        bytes: a payload kept is smaller, `codec.worth_compressing`), and the encoder's working memory beside them
        (`ENCODER_HOST_UNITS` of the largest unit left)."""
        left = self._nbytes[self._next :]
        return left, ENCODER_HOST_UNITS * max(left, default=0)

    def restart(self) -> None:
        """Drop the payloads made so far and begin again from the first unit at the next gap: an edit made them
        stale, or a host tier needed their room. A failure said before is forgotten."""
        self._made, self._made_bytes = {}, 0
        self._next = 0
        self._failure = None

    def encode_for(
        self, seconds: float, now: Callable[[], float] = time.perf_counter, limit: int | None = None
    ) -> None:
        """Encode the next units for about ``seconds`` (at least one) by the clock ``now`` (the handle's, which
        measured the forward), on the caller's thread; at most ``limit`` of them (None: no bound; 0: none), where a
        host tier made room for that many (`room_needed`). Interrupted (Ctrl-C), the unit under way is encoded again
        at the next call."""
        if self.done or limit == 0:
            return
        started = now()
        encode = self._on_device if self._device.type == "cuda" else self._on_host
        end = len(self._jobs) if limit is None else self._next + limit
        try:
            with contextlib.closing(encode(self._jobs[self._next : end])) as units:
                for count, (index, made) in enumerate(units, start=1):
                    if made is not None:
                        self._made[index] = made
                        self._made_bytes += made.encoded.payload.numel()
                    self._next += 1
                    elapsed = now() - started
                    if elapsed + elapsed / count > seconds:  # the next unit would end after the gap's time
                        break
        except Exception as exc:  # the model streams raw: `take` says why
            self._failure = first_line(exc)

    def _on_device(self, jobs: list[EncodeJob]) -> Iterator[tuple[int, ArrivingPayload | None]]:
        """Each of ``jobs``' units through the device encoder, in order, with its payload (None: not worth it);
        refused first when that would take the process over the budget. Closed early, the unit under way is
        dropped; the encoder's working memory goes back to the device either way (the next forward's slots are
        allocated anew, as after set-up)."""
        left = max(self._nbytes[self._next :], default=0)
        refuse_without_room(left, torch.cuda.memory_allocated(self._device), self._budget_bytes, self._device)
        encoder = DeviceEncoder(
            self._device, lock=self._pin, keep=lambda _encoded: True, budget_bytes=self._budget_bytes, refuse=False
        )
        try:
            for done in encoder.encode(jobs):
                made = ArrivingPayload(done.encoded, done.locked) if worth_compressing(done.encoded) else None
                yield done.index, made
        finally:
            torch.cuda.empty_cache()

    @staticmethod
    def _on_host(jobs: list[EncodeJob]) -> Iterator[tuple[int, ArrivingPayload | None]]:
        """Each of ``jobs``' units through the host encoder, in order, with its payload (None: not worth it); the
        model runs on the CPU: nothing to page-lock."""
        for job in jobs:
            encoded = encode_unit(job.flat(), job.segments)
            yield job.index, ArrivingPayload(encoded, locked=False) if worth_compressing(encoded) else None

    def take(self) -> tuple[dict[int, ArrivingPayload], str | None]:
        """The payloads made, and the failure's line (None: none failed)."""
        made, self._made = self._made, {}
        return made, self._failure

    def abandon(self) -> None:
        """Encode no more; the payloads made so far are dropped (those locked in place are unlocked as their
        mappings go: `host_memory.host_buffer`)."""
        self._made, self._made_bytes = {}, 0
        self._next = len(self._jobs)


def _results(futures: dict[int, Future[ArrivingPayload]]) -> tuple[dict[int, ArrivingPayload], str | None]:
    """Every future's payload by unit index, in index order, and the first failure's line (None: none failed)."""
    payloads: dict[int, ArrivingPayload] = {}
    failure = None
    for index, future in sorted(futures.items()):
        try:
            payloads[index] = future.result()
        except Exception as exc:
            failure = failure or first_line(exc)
    return payloads, failure
