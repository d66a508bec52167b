"""Page-locked host buffers handed on from one unit to the next, instead of locked and unlocked per unit.

A host tier moves weights in and out of RAM while the model computes: during an expert's last forward its
payloads leave RAM one by one (the hand-over) while the next expert's are read into the room, and after a switch
the rest are read while the new expert runs. Each buffer read was page-locked (``cudaHostRegister``, ~17 ms for
a 488 MB Wan2.2-A14B block on the H200) and each one let go unlocked (``cudaHostUnregister``, ~9 ms), on threads
beside the forwards. Those driver calls hold the thread that issues the forwards' work: on an H100, a side thread
locking and unlocking buffers made the main thread's GPU work 21x slower (3.4x in 32 MiB pieces), where copying
the same bytes between host buffers cost 6 % (``benchmarks/results/pin_contention_callO_h100.json``).

So a `LockedPool` keeps the buffers it is given back still locked (`give_back`) and lends them to the next reads
(`take`): once buffers are about, a read or a hand-over makes a driver call only when no idle buffer fits it (call P
on the H200: 184 reads served without one, 27 buffers locked). Its invariants:

* **The pool never grows by holding what it cannot use.** A read that no idle buffer fits gets a new one in the
  place of idle ones (the oldest, as many bytes as it takes), not beside them.
* **A buffer is lent to one owner at a time**, and only once its owner gave it back; an owner gives a buffer back
  only when no copy issued before still reads it (the same condition as for unlocking it).
* **A read fits a buffer** when the buffer holds it and is larger by at most a 64th (`fits`, `SLACK_FRACTION`):
  the blocks of a model are all about the same size, so a buffer made for one serves the next. New buffers for
  reads close to the largest the pool was told of (`expect`) get that size, so that any of those fits any of them.
* **The host budget holds.** What a lent buffer holds beyond its read's pages (``slack_bytes``) is counted by the
  owner of the budget, and comes only out of the room that owner says is left (`allow_slack`: a larger buffer is
  lent only while the budget has room for the difference; a read ahead leaves that room, `slack_for`); the
  buffers kept idle are only those the budget has room for (`trim`). The owner calls both at every change of
  what it counts.

Buffers lent out are known by address to `host_memory.unpin_in_place`, so that any owner that unlocks a payload
the usual way gives it back here instead (a read given up, a spill, an edit): nothing unlocks a lent buffer.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from . import host_memory
from .host_memory import HUGE_PAGE, HUGE_PAGE_MIN_BYTES, host_buffer, pin_in_place


def rounded(nbytes: int) -> int:
    """``nbytes`` up to whole pages, huge ones from `HUGE_PAGE_MIN_BYTES` on: what a buffer of that size takes in
    RAM anyway (`host_buffer`)."""
    page = HUGE_PAGE if nbytes >= HUGE_PAGE_MIN_BYTES else mmap.PAGESIZE
    return -(-nbytes // page) * page


#: A buffer lent may be larger than its read's pages by this fraction of the read, at most (`fits`).
SLACK_FRACTION = 1 / 64


def fits(capacity: int, nbytes: int) -> bool:
    """A buffer of ``capacity`` bytes may hold a read of ``nbytes``: it holds the read, and is larger than the read's
    pages by at most `SLACK_FRACTION` of the read."""
    return nbytes <= capacity <= rounded(nbytes) + int(nbytes * SLACK_FRACTION)


def slack_of(capacity: int, nbytes: int) -> int:
    """What a buffer of ``capacity`` holds beyond the pages of a read of ``nbytes`` (a buffer's own pages are counted
    as its bytes, here as everywhere the host budget counts)."""
    return max(capacity - rounded(nbytes), 0)


@dataclass
class LockedPoolCounts:
    """What the pool did: the reads served without a driver call (``reused``) against the buffers locked and
    unlocked, and the payloads adopted (`LockedPool.report` adds what it holds now)."""

    reused: int = 0
    locked: int = 0
    unlocked: int = 0
    adopted: int = 0


@dataclass(frozen=True, eq=False)  # compared by identity: the pool holds each once
class _Buffer:
    """A page-locked buffer of the pool: the whole of it (``whole``, ``capacity`` bytes, locked from its first
    byte) and how many bytes its current owner reads (``used``, 0 while idle)."""

    whole: torch.Tensor
    used: int

    @property
    def capacity(self) -> int:
        return self.whole.numel()

    @property
    def address(self) -> int:
        return self.whole.data_ptr()

    @property
    def slack(self) -> int:
        """What the buffer holds beyond the pages of the read it was lent for."""
        return slack_of(self.capacity, self.used) if self.used else 0


class LockedPool:
    """Page-locked host buffers lent for reads and taken back, by address; thread-safe (readers take on their
    threads, owners give back on theirs).

    ``lock`` and ``unlock`` page-lock a buffer in place and undo it (default: `host_memory.pin_in_place`, and
    unlocking its mapping); ``page_lock=False`` (no CUDA device, or ``pin_memory=False``) lends plain buffers, handed
    on all the same: a read then spares a new mapping and its page faults, and the CPU runs the same path as a GPU
    host."""

    def __init__(
        self,
        page_lock: bool = True,
        lock: Callable[[torch.Tensor], bool] | None = None,
        unlock: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self._lock_buffer = lock or (pin_in_place if page_lock else _stays_pageable)
        self._unlock_buffer = unlock or (_unlock_mapping if page_lock else _nothing_to_unlock)
        self._mutex = threading.Lock()
        self._lent: dict[int, _Buffer] = {}
        self._idle: list[_Buffer] = []  # oldest first
        self._largest = 0  # the largest read the pool was told to expect
        self._slack_room = 0  # what lent buffers may still hold beyond their reads' pages (`allow_slack`)
        self._closed = False
        self.counts = LockedPoolCounts()

    def expect(self, sizes: Iterable[int]) -> None:
        """Reads of these sizes will come (a model's payloads): new buffers for the largest ones are made as large
        as the largest, so that any of them fits any such buffer."""
        self._largest = max([self._largest, *sizes])

    def allow_slack(self, nbytes: int) -> None:
        """From now on, buffers lent may hold at most ``nbytes`` more beyond their reads' pages than they do now (the
        room the host budget leaves; 0 while the owner changes what it counts)."""
        with self._mutex:
            self._slack_room = max(nbytes, 0)

    def take(self, nbytes: int, lent: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, bool]:
        """A buffer for a read of ``nbytes``, as a tensor of exactly ``nbytes``: an idle one that fits, else a new
        one page-locked now. True when it is lent (its owner gives it back with `host_memory.unpin_in_place`); False
        when a new one could not be locked: the caller then owns an ordinary buffer, and the pool forgets it.
        ``lent`` is called under the pool's lock as the buffer is lent (or given as an ordinary one), so that what
        `idle_beyond` counts never sees the buffer both idle and taken, nor neither."""
        with self._mutex:
            usable = [b for b in self._idle if self._may_lend(b.capacity, nbytes)]
            best = min(usable, key=lambda b: b.capacity, default=None)
            if best is not None:
                self._idle.remove(best)
                self._slack_room -= slack_of(best.capacity, nbytes)
                self.counts.reused += 1
                lent()
                return self._lend(best.whole, nbytes), True
            capacity = self.new_capacity(nbytes)
            capacity = capacity if slack_of(capacity, nbytes) <= self._slack_room else rounded(nbytes)
            self._slack_room -= slack_of(capacity, nbytes)  # claimed now: another reader may take meanwhile
            unfit = self._idle_to_free(capacity)
        self._free_all(unfit)  # a new buffer takes their place, so the pool never holds more than it did
        whole = host_buffer(capacity)
        if not self._lock_buffer(whole):
            with self._mutex:
                self._slack_room += slack_of(capacity, nbytes)
                lent()
            return whole[:nbytes], False
        with self._mutex:
            self.counts.locked += 1
            lent()
            return self._lend(whole, nbytes), True

    def new_capacity(self, nbytes: int) -> int:
        """The size of a new buffer for a read of ``nbytes`` when the budget has room: the largest read expected when
        ``nbytes`` fits a buffer of that size, else the read's pages."""
        largest = rounded(self._largest)
        return largest if fits(largest, nbytes) else rounded(nbytes)

    def slack_for(self, sizes: Iterable[int]) -> int:
        """What new buffers for reads of ``sizes`` would hold beyond their pages: the room a reader leaves the pool
        when it reads them (`new_capacity`)."""
        return sum(slack_of(self.new_capacity(n), n) for n in sizes if n)

    def _idle_to_free(self, nbytes: int) -> list[_Buffer]:
        """Idle buffers, oldest first, of at least ``nbytes`` in all (all of them when they hold less), taken out of
        the idle ones to be freed; the caller holds the mutex."""
        taken: list[_Buffer] = []
        while self._idle and sum(b.capacity for b in taken) < nbytes:
            taken.append(self._idle.pop(0))
        return taken

    def _may_lend(self, capacity: int, nbytes: int) -> bool:
        """A buffer of ``capacity`` may be lent for a read of ``nbytes``: it `fits`, and the budget has room for what
        it holds beyond the read's pages."""
        return fits(capacity, nbytes) and slack_of(capacity, nbytes) <= self._slack_room

    def _lend(self, whole: torch.Tensor, nbytes: int) -> torch.Tensor:
        buffer = _Buffer(whole, nbytes)
        self._lent[buffer.address] = buffer
        host_memory.lent_by_pool[buffer.address] = self
        return whole[:nbytes]

    def lends(self, view: torch.Tensor) -> bool:
        """``view`` is a buffer the pool lent out."""
        with self._mutex:
            return view.data_ptr() in self._lent

    def give_back(self, view: torch.Tensor) -> None:
        """Take back a buffer the pool lent (no copy reads it any more): it stays locked, idle, for the next read."""
        with self._mutex:
            buffer = self._lent.pop(view.data_ptr())
            host_memory.lent_by_pool.pop(buffer.address, None)
            if not self._closed:
                self._idle.append(_Buffer(buffer.whole, 0))
                return
        self._free(buffer)

    def keep(self, payload: torch.Tensor) -> bool:
        """Keep ``payload``, page-locked and no longer read by its owner, as an idle buffer: one the pool lent is
        given back; one locked in place from its first byte to its last (`host_memory.pin_in_place`: a payload made
        at set-up) is adopted, at its size. False, nothing done, for any other (its owner unlocks it as before)."""
        if self.lends(payload):
            self.give_back(payload)
            return True
        if not host_memory.locked_in_place(payload):
            return False
        with self._mutex:
            if self._closed:
                return False
            self._idle.append(_Buffer(payload, 0))
            self.counts.adopted += 1
        return True

    def trim(self, keep_bytes: int) -> None:
        """Unlock and free idle buffers, oldest first, until those kept take at most ``keep_bytes``: the room the host
        budget leaves for them (see the module docstring)."""
        with self._mutex:
            freed = self._idle_to_free(self._idle_bytes() - keep_bytes)
        self._free_all(freed)

    def close(self) -> None:
        """Free every idle buffer; those lent are unlocked when their owners let them go, as any other buffer."""
        with self._mutex:
            self._closed = True
        self.trim(0)

    @property
    def slack_bytes(self) -> int:
        """RAM the lent buffers take beyond the pages of the reads they hold (counted by the budget's owner)."""
        with self._mutex:
            return self._slack_bytes()

    @property
    def idle_bytes(self) -> int:
        with self._mutex:
            return self._idle_bytes()

    def idle_beyond(self, claimed: Callable[[], int]) -> int:
        """The idle buffers' bytes beyond ``claimed()`` (what reads not yet lent a buffer will take), both read
        under the pool's lock, which `take`'s ``lent`` is told under: the two agree at every moment."""
        with self._mutex:
            return max(self._idle_bytes() - claimed(), 0)

    def report(self) -> dict[str, int]:
        """`LockedPoolCounts`, and what the pool holds now: buffers lent and idle, their bytes, and the lent ones'
        slack, as a plain dictionary."""
        with self._mutex:
            return {
                **asdict(self.counts),
                "lent": len(self._lent),
                "idle": len(self._idle),
                "lent_bytes": sum(b.capacity for b in self._lent.values()),
                "idle_bytes": self._idle_bytes(),
                "slack_bytes": self._slack_bytes(),
            }

    def _slack_bytes(self) -> int:
        return sum(b.slack for b in self._lent.values())

    def _idle_bytes(self) -> int:
        return sum(b.capacity for b in self._idle)

    def _free_all(self, buffers: list[_Buffer]) -> None:
        """Unlock and free ``buffers``, emptying the list: their pages go with their last views, so none may
        outlive this call here (a loop variable or the list kept them in RAM beside the new buffer `take` makes
        next: the likeliest cause of call S, H100, sampling 34.55 GB against a 34.36 GB host budget)."""
        while buffers:
            self._free(buffers.pop())

    def _free(self, buffer: _Buffer) -> None:
        self._unlock_buffer(buffer.whole)
        with self._mutex:
            self.counts.unlocked += 1


def _unlock_mapping(buffer: torch.Tensor) -> None:
    """Unlock a buffer of the pool now (its pages go with its last view)."""
    host_memory.unpin_in_place(buffer)


def _stays_pageable(buffer: torch.Tensor) -> bool:
    return True  # lent as it is


def _nothing_to_unlock(buffer: torch.Tensor) -> None:
    pass
