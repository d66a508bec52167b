"""`WaitingPayloads`: the payload file as the place a model's payloads wait while the host tier keeps it on disk.

Payloads leave RAM when the host tier moves their model to disk (`spill`): they become views of the payload file,
written once (in the background after encoding: `payload_cache.BackgroundWrite`) and unwritten again until an edit,
and come back unit by unit (`read_payload`, `take`) while the model computes, each checked against its checksum.
During a component's last forward before a switch they leave one by one as it is done with them (`let_go`).

A payload read back is of the file as it was when its read began. Reads run ahead of their take (the host tier reads
a component ahead while another computes), and an edit may come in between: it encodes the payloads again, and the
next spill writes the file again. A payload read before that write holds the old weights' bytes, and its checksum
matched the file then; so `take` adopts a payload only when no write of the file began or ended since its read
began, and reads any other one again. Tests: ``test_a_payload_read_back_before_an_edit_is_read_again_at_its_take``
(`tests/test_compression.py`) and ``test_an_edit_while_its_payloads_are_read_ahead_computes_with_the_edit_bitwise``
(`tests/test_compressed_tier.py`: the host tier's read ahead resumed after the edit, which is how a user meets it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import torch

from ..engine.errors import OffloadStateError
from .cache_files import drop_cached_pages_later
from .file_reads import SERIAL, PieceReader
from .host_memory import page_locked, unpin_in_place
from .payload_cache import BackgroundWrite, PayloadCache
from .payload_records import PayloadLocks, PayloadRecords

logger = logging.getLogger(__name__)


class WaitingPayloads:
    """The payload file (``file``, set at set-up), which payloads wait in it now (``waiting``: views of its mapping,
    by unit index, from `spill` or `let_go` to `take`), and whether it holds every payload as it is now.

    Invariants: a payload waits in the file only while the file holds it as it is (`file_current`); an edit makes it
    stale (`payload_changed`), and the next `spill` writes it again before any payload leaves RAM. A payload read
    back is taken only when the file was not written since its read began (see the module docstring)."""

    def __init__(self, records: PayloadRecords, locks: PayloadLocks) -> None:
        self._records = records
        self._locks = locks
        #: The file payloads wait in while their model is on disk (the payload cache): set at set-up.
        self.file: PayloadCache | None = None
        #: Units whose payloads wait in ``file`` now (views of its mapping), by index: `spill` to `take`.
        self.waiting: set[int] = set()
        self._holds = False  # ``file`` holds every payload as it is now (written or read, no edit since)
        self._writing: BackgroundWrite | None = None  # the file's write after encoding, until taken (`finish_write`)
        self._writes = 0  # the file's writes begun and ended so far (`_written`)
        self._writes_lock = threading.Lock()
        #: Each payload read back and not taken yet, by its buffer's address: ``_writes`` as its read began, and the
        #: ``pin`` it was read with. Written on reader threads, read on the model's.
        self._reads: dict[int, tuple[int, bool]] = {}

    @property
    def file_current(self) -> bool:
        """The payload file holds every payload as it is now (no edit re-encoded one since it was written); False
        while it is being written."""
        if self._writing is not None and not self._writing.running:
            self.finish_write()
        return self._writing is None and self.file is not None and self._holds and self.file.path.exists()

    def mark_holds_all(self) -> None:
        """Every payload kept now was read from ``file``: it holds them as they are."""
        self._holds = True

    def write_in_background(self, cache: PayloadCache) -> None:
        """Write every payload kept to ``cache``'s file on a thread of its own (for the next run, or a spill, which
        waits for it): set-up does not wait."""
        self._written()
        self._writing = BackgroundWrite(cache, self._records.encoded)

    def finish_write(self) -> None:
        """Wait for the payload file's write under way, if any, and take its outcome."""
        if self._writing is not None:
            self._holds = self._writing.held()
            self._writing = None
            self._written()

    def _written(self) -> None:
        """The file's bytes may change from now on, or just did: payloads read before are stale at their `take`."""
        with self._writes_lock:
            self._writes += 1
            self._reads = {}

    def payload_changed(self, index: int) -> bool:
        """An edit changes unit ``index``'s payload (in RAM from now on): the file no longer holds every payload as it
        is, and a write under way is of a stale set. Whether the old payload may be handed on to the locked pool:
        not while that write may still read it."""
        self.waiting.discard(index)
        self._holds = False
        if self._writing is not None:
            self._writing.stale = True
        return self._writing is None

    def forget(self, why: str, then: str) -> None:
        """The payload file cannot be used: refused (saying ``why``, and ``then`` what happens instead, in a
        warning) and deleted when no other live model uses it."""
        self._holds = False
        if self.file is not None:
            self.file.refuse(why, then=then)
            self.file.discard()

    def clear(self) -> None:
        """Every payload was dropped: none waits, and the file holds none of those to come."""
        self.waiting = set()
        self._holds = False

    @property
    def payload_bytes(self) -> int:
        """Host RAM of the payloads (those waiting in the file are not in RAM)."""
        return sum(e.payload.numel() for i, e in self._records.encoded.items() if i not in self.waiting)

    def spill(self) -> None:
        """Move every payload still in RAM out into the payload file: written first when it does not hold them
        (a full disk raises with the payloads still in RAM; those let go before are read back first, to be
        written), then each payload becomes a view of the file's mapping and its RAM is freed. The model must be
        inactive."""
        records = self._records
        if self.file is None:
            raise OffloadStateError("compressed copies can wait on disk only with a payload file (set-up sets it)")
        if len(self.waiting) == len(records.encoded):
            return
        self.finish_write()
        if not self.file_current:
            for index in sorted(self.waiting):  # let go from a file an edit made stale since: needed to write it
                self.take(index, *self.read_payload(index, self._locks.pin))
            self._written()
            try:
                self.file.own_for_writing()
                self._holds = self.file.write(records.encoded, strict=True)
            finally:
                self._written()
        views = self.file.map()
        self._locks.unlock_all()
        records.encoded = {i: dataclasses.replace(e, payload=views[i]) for i, e in records.encoded.items()}
        self.waiting = set(records.encoded)

    def let_go(self, index: int) -> None:
        """Unit ``index``'s payload, in RAM, goes back to the payload file, which holds it (`file_current`): it
        becomes a view of the file's mapping and its RAM is freed, while the model may be active (a component's
        RAM handed over during its last forward, see `storage.host_tier.hand_over`). The caller waited for
        every copy that read it; the next load of the unit has to take it back first (`read_payload`, `take`)."""
        assert self.file is not None and self.file_current and index not in self.waiting
        encoded = self._records.encoded
        self._locks.unlock([encoded[index].payload], copies_done=True)
        encoded[index] = dataclasses.replace(encoded[index], payload=self.file.map()[index])
        self.waiting = self.waiting | {index}  # a new set: readers on other threads iterate the old one

    def read_payload(
        self, index: int, pin: bool, reader: PieceReader = SERIAL, buffered: Callable[[], None] = lambda: None
    ) -> tuple[torch.Tensor, bool]:
        """Unit ``index``'s waiting payload in a RAM buffer (one the locked pool lends, page-locked as the pool's
        are; else a new one, page-locked when ``pin``: in place where CUDA allows, else a pinned copy; True when lent
        or locked in place: its owner gives it back with ``unpin_in_place``), read from the file in pieces on
        ``reader``'s threads and checked against its checksum; ``buffered`` is told once the buffer is had
        (`PayloadLocks.buffer_for_read`). Changes nothing here: runs on a reader thread while the model waits or
        computes. Which write of the file the bytes are of is noted for `take`."""
        began = self._writes  # before the records are read: a write that replaces them counts as begun
        assert self.file is not None
        buffer, lent = self._locks.buffer_for_read(self.file.records[index].payload_nbytes, buffered)
        try:
            self.file.read_payload(index, buffer, reader)
        except BaseException:
            if lent:
                unpin_in_place(buffer)  # back to the pool
            raise
        payload, locked = (buffer, lent) if lent or not pin else page_locked(buffer)
        self._reads[payload.data_ptr()] = (began, pin)
        return payload, locked

    def take(self, index: int, payload: torch.Tensor, locked: bool) -> None:
        """Adopt ``payload`` (from `read_payload`) as unit ``index``'s payload in RAM; the last one taken drops
        the file's pages from the page cache. One read before the file's last write began or ended is dropped and
        read again first, here (see the module docstring)."""
        read = self._reads.pop(payload.data_ptr(), None)
        if read is None or read[0] != self._writes:
            payload, locked = self._read_again(index, payload, locked, self._locks.pin if read is None else read[1])
        encoded = self._records.encoded
        encoded[index] = dataclasses.replace(encoded[index], payload=payload)
        if locked:
            self._locks.mark_locked(payload)
        self.waiting.discard(index)
        if not self.waiting and self.file is not None:
            drop_cached_pages_later(self.file.path)

    def _read_again(self, index: int, stale: torch.Tensor, locked: bool, pin: bool) -> tuple[torch.Tensor, bool]:
        """Unit ``index``'s payload read from the file as it is now, in place of ``stale``, read before an edit
        changed it (its buffer given back: to the locked pool when lent, unlocked when locked in place)."""
        assert self.file is not None
        logger.info("the payload of unit %d read back before an edit is read again from %s", index, self.file.path)
        if locked:
            unpin_in_place(stale)
        payload, locked = self.read_payload(index, pin)
        self._reads.pop(payload.data_ptr(), None)
        return payload, locked

    def untake(self, indices: list[int]) -> None:
        """Point the payloads of ``indices`` (taken back) at the file again, which still holds them: a read
        back given up leaves the model on disk as before."""
        if not indices:
            return
        assert self.file is not None
        views = self.file.map()
        encoded = self._records.encoded
        self._locks.unlock([encoded[i].payload for i in indices])
        for index in indices:
            encoded[index] = dataclasses.replace(encoded[index], payload=views[index])
            self.waiting.add(index)
