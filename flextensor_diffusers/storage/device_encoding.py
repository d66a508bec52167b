"""Encoding a model's units on the GPU at set-up, with the copies both ways hidden behind the coding.

One unit's trip through the device encoder has four parts: the raw bytes over the link, coding and the
on-device check, and the payload back to host memory. Copied straight into a new pageable buffer, that last
part is the slowest of them: the driver stages the copy, and every page of the new buffer faults on first
touch. Through a page-locked staging buffer it is a transfer at the link's rate plus a host copy, and the
buffer, its pages then present, page-locks far faster than a fresh one.

`DeviceEncoder` runs the parts of successive units side by side: the next unit's raw bytes cross on a
copy stream while the current one is coded, and a host thread moves the previous payload from its staging
buffer into its own buffer and page-locks it there while the device codes the next. Even so, its calls take
longer than the device work alone, and longer still while units are being packed beside them; neither coding
after packing, a shorter thread switch interval nor fewer device synchronisations changed that, and what does
is not yet known. Measured times of each part and of the encoder: see benchmarks/results/README.md.

**Within the GPU budget.** Crossing the next unit while the current one is coded holds more units' bytes on the
device at once: on the H200 a 703 MB Wan2.2 block took the set-up to 3.23 GB, over a 2.8 GB budget. So the first
unit is encoded alone (its device memory all freed before the next one crosses), its peak tells what one unit at a
time needs, and the next units cross early only where that and three more units fit in ``budget_bytes``
(`_room_to_overlap`); otherwise one at a time, at the cost of uploads and copies back that do not overlap the
coding. The peak is read, never reset (the caller may be measuring its own). At set-up a need over the budget is
refused, naming the budget it takes and ``compression='none'``; after set-up (an edit, or encoding between
forwards) it only warns (``refuse=False``): refusing then would leave the edit half done, or stop a model that
runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..engine.config import format_bytes
from ..engine.errors import BudgetError
from .codec import CodecMismatch, EncodedUnit, Segment, encode_unit
from .host_memory import host_buffer, page_locked, pin_in_place, unpin_in_place

logger = logging.getLogger(__name__)

#: What the need measured on the first unit may miss on the later ones, as a share of it: a retry under exactly the
#: named budget overshot by 76 KB of 533 MB on the H200 (0.014 %).
ALLOCATION_SLACK = 0.005
#: Staging buffers the payloads come back through: one being filled by the device while the host empties the other.
STAGING_BUFFERS = 2


@dataclass(frozen=True)
class HostPayload:
    """A unit's encoding with its payload in a host buffer of its own; ``locked``: page-locked in place there
    (the owner unregisters it before dropping it)."""

    index: int
    encoded: EncodedUnit
    locked: bool


@dataclass
class _Staging:
    """A page-locked buffer a payload comes back into, and the host copy out of it still in flight.

    The buffer is the package's own host buffer, written once (so its pages are present) and then locked in
    place, which is far faster than ``pin_memory()``'s copy into new locked memory (see
    benchmarks/results/README.md). Every buffer the package locks is locked with its pages present; the encoder
    that locked fresh ones is the one that made later device allocations fail on the H200 (see `codec`)."""

    buffer: torch.Tensor
    locked: bool = False
    emptied: Future[HostPayload] | None = None

    def make_room(self, nbytes: int) -> None:
        if self.buffer.numel() >= nbytes:
            return
        self.release()
        self.buffer = host_buffer(nbytes + nbytes // 8)  # some room for a larger unit later
        self.buffer.fill_(0)
        self.buffer, self.locked = page_locked(self.buffer)

    def release(self) -> None:
        """Unlock the buffer (the device is done with it: the caller synchronised)."""
        if self.locked:
            unpin_in_place(self.buffer)
        self.buffer, self.locked = torch.empty(0, dtype=torch.uint8), False


@dataclass(frozen=True)
class EncodeJob:
    """A unit to encode: its index, how to get its raw host buffer (page-locked, so that it crosses
    asynchronously; asked for on the encoding thread when the unit's turn comes) and the codec's view of it."""

    index: int
    flat: Callable[[], torch.Tensor]
    segments: list[Segment]

    @property
    def nbytes(self) -> int:
        """The bytes of the unit's tensors: what the encoder codes."""
        return sum(segment.nbytes for segment in self.segments)


class DeviceEncoder:
    """Encodes units one after another on ``device``, each checked there (``verify``), and brings back to
    host memory the payloads that ``keep`` accepts, pageable or page-locked in place (``lock``).

    `encode` yields a `HostPayload` per kept unit, in order. An error of the encoder, or a check that fails
    (`CodecMismatch`, with ``unit`` set to the unit's index), is raised there once the work in flight has
    finished. The staging buffers go back to the system when it ends."""

    def __init__(
        self,
        device: torch.device,
        lock: bool,
        keep: Callable[[EncodedUnit], bool],
        budget_bytes: int | None = None,
        refuse: bool = True,
    ) -> None:
        self.device = device
        self.lock = lock
        self.keep = keep
        self.budget_bytes = budget_bytes  # the peak allocated memory it may reach (None: no bound)
        self.refuse = refuse  # a need over the budget raises (else it warns, and goes one unit at a time)
        #: Whether the next unit crosses while the current one is coded; decided after the first unit.
        self.overlapped = False
        self._copy_stream = torch.cuda.Stream(device)
        self._staging: list[_Staging] = []

    def encode(self, jobs: list[EncodeJob]) -> Iterator[HostPayload]:
        """Each kept unit's `HostPayload`, in the jobs' order, as soon as it is in host memory."""
        self._staging = [_Staging(torch.empty(0, dtype=torch.uint8)) for _ in range(STAGING_BUFFERS)]
        pending: list[Future[HostPayload]] = []
        brought = 0  # payloads sent back so far: they take the staging buffers in turn
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="payloads-back") as host_side:
                try:
                    self.overlapped = False
                    peak_before = torch.cuda.max_memory_allocated(self.device)
                    held_before = torch.cuda.memory_allocated(self.device)
                    upload = self._upload(jobs[0].flat()) if jobs else None
                    for position, job in enumerate(jobs):
                        if upload is None:  # one unit at a time: it crosses now
                            upload = self._upload(job.flat())
                        source, arrived = upload
                        compute = torch.cuda.current_stream(self.device)
                        compute.wait_event(arrived)
                        source.record_stream(compute)
                        following = jobs[position + 1] if position + 1 < len(jobs) else None
                        upload = self._upload(following.flat()) if following and self.overlapped else None
                        encoded = self._encode(job, source)
                        del source
                        if self.keep(encoded):
                            pending.append(self._bring_back(host_side, brought, job.index, encoded))
                            brought += 1
                        del encoded
                        if not self.overlapped:  # one unit at a time: all of its device memory goes first
                            while pending:
                                yield pending.pop(0).result()
                            compute.synchronize()
                        if position == 0:
                            self.overlapped = self._room_to_overlap(jobs, peak_before, held_before)
                        while pending and pending[0].done():
                            yield pending.pop(0).result()
                    while pending:
                        yield pending.pop(0).result()
                finally:  # not all yielded (an error, or the caller stopped): in-flight host copies end, and
                    for future in pending:  # the payloads they locked are unlocked before they are dropped
                        if not future.cancel() and future.exception() is None and future.result().locked:
                            unpin_in_place(future.result().encoded.payload)
        finally:
            torch.cuda.current_stream(self.device).synchronize()
            for staging in self._staging:
                staging.release()
            self._staging = []

    def _room_to_overlap(self, jobs: list[EncodeJob], peak_before: int, held_before: int) -> bool:
        """After the first unit, encoded alone: whether the next units may cross beside the coding within the
        budget. The first unit's peak, scaled to the largest unit (``held_before``, what the process held, does
        not scale), is what one unit at a time needs; crossing early can hold three more units (the next one's
        raw bytes, the current one's, freed once its coding ends, and its payload on its way back). A needed
        peak over the budget is refused, naming the budget it needs. A peak from before the encoder (the
        caller's) hides the first unit's: then one unit at a time, and nothing refused."""
        if self.budget_bytes is None:
            return True
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak <= peak_before:
            return False
        sizes = [job.nbytes for job in jobs]
        largest = max(sizes)
        need = held_before + -(-(peak - held_before) * largest // max(sizes[0], 1))
        need += int(need * ALLOCATION_SLACK)
        if need > self.budget_bytes and not self.refuse:
            logger.warning(
                "compressing the weights after set-up needs %s of device memory, over the budget of %s",
                format_bytes(need),
                format_bytes(self.budget_bytes),
            )
            return False
        if need > self.budget_bytes:
            raise BudgetError(
                f"compressing the weights on {self.device} needs {format_bytes(need)} of device memory at set-up, "
                f"over the budget of {format_bytes(self.budget_bytes)}: pass a budget of at least {need} bytes, or "
                "compression='none' (--compression none) to stream them raw",
                required_bytes=need,
            )
        return need + 3 * largest <= self.budget_bytes

    def _encode(self, job: EncodeJob, source: torch.Tensor) -> EncodedUnit:
        try:
            return encode_unit(source, job.segments, device=self.device, verify=True, payload_on_device=True)
        except CodecMismatch as exc:
            raise CodecMismatch(exc.segment, unit=job.index) from exc

    def _upload(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """``flat`` copied to the device on the copy stream (after the work queued so far), and its arrival."""
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            source = flat.to(self.device, non_blocking=True)
            return source, self._copy_stream.record_event()

    def _bring_back(
        self, host_side: ThreadPoolExecutor, position: int, index: int, encoded: EncodedUnit
    ) -> Future[HostPayload]:
        """Copy ``encoded``'s device payload into a staging buffer (once the host emptied it), and hand the
        rest to the host thread."""
        staging = self._staging[position % STAGING_BUFFERS]
        if staging.emptied is not None:
            staging.emptied.result()  # its previous payload is out (raises that unit's error, if any)
        nbytes = encoded.payload.numel()
        staging.make_room(nbytes)
        compute = torch.cuda.current_stream(self.device)
        staging.buffer[:nbytes].copy_(encoded.payload, non_blocking=True)
        copied = compute.record_event()
        staged = staging.buffer[:nbytes]
        staging.emptied = host_side.submit(self._empty, index, encoded, staged, copied.synchronize)
        return staging.emptied

    def _empty(self, index: int, encoded: EncodedUnit, staged: torch.Tensor, wait: Callable[[], None]) -> HostPayload:
        """On the host thread: the payload from ``staged`` into its own buffer, page-locked there if asked."""
        wait()
        payload = host_buffer(staged.numel())
        payload.copy_(staged)
        locked = self.lock and bool(payload.numel()) and pin_in_place(payload)
        return HostPayload(index, dataclasses.replace(encoded, payload=payload), locked)
