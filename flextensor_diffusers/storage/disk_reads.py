"""Reading a component's host copies back from disk, unit by unit, while it already computes.

A component waiting on disk (`host_tier`) is read back by a `ReadJob` on the `Reader`'s thread: its units in
the order the component will need them (`read_order`: the base, the plan's resident units, then the profiled
call order; unit order before a profile exists), `UNITS_IN_FLIGHT` at once, each into its own (pinned)
buffer, never past the bytes the host budget allows it (a read ahead pauses there). Each unit is read in pieces
by all `READ_THREADS` threads (`storage.file_reads`), the first unit's pieces queued first: units arrive one
after the other, in order, at the disk's whole rate, rather than several at once at the end (the first one a
switch waits for then comes after one unit's read time, not after as many as were in flight). The engine asks
the gate given to `HostCopies.expect_arrivals` before it reads a unit's host bytes; `FillGate` is that gate
while units arrive: it blocks until the reader delivered the unit, then adopts the buffer on the main thread.
A read that fails is raised at the next gate as a one-line error (`read_error`).

Two module-level seams let tests make reads deterministic without touching what is read: `clock`, what read and
wait times are measured with (a fake one gives fixed figures whatever the machine's speed), and `read_hooks`, a
`ReadHooks` that every job calls around each unit read and whenever it changes (to hold, slow, fail or watch
reads with events instead of sleeps). Both are looked up at each use, so a replacement reaches jobs already queued.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.errors import FlexTensorError
from . import file_reads
from .file_reads import PieceReader
from .locked_pool import rounded

if TYPE_CHECKING:
    from ..engine import OffloadHandle
    from ..engine.units import Unit
    from .host_copies import HostCopies
    from .host_forms import ReadInto, ReadUnit

#: Threads that read the pieces of the units in flight: a disk serves several large reads in flight faster
#: than one.
READ_THREADS = max(2, min(8, os.cpu_count() or 1))
#: Units read at once (`file_reads.UNITS_IN_FLIGHT`; a test may make it one).
UNITS_IN_FLIGHT = file_reads.UNITS_IN_FLIGHT

#: What `ReadJob.read_s` and the host tier's switch waits are measured with (seconds). A seam: tests put a fake
#: clock here that only moves when their fake reads say so, so that those figures are fixed.
clock: Callable[[], float] = time.perf_counter


class ReadHooks:
    """Where a `ReadJob` lets an observer in: around each unit read, when the job changes, and when the main thread
    is about to wait for a unit. This default reads at once and tells no one; tests install another as `read_hooks`
    to hold a read until an event, make it fail, move a fake `clock`, or wake a waiter at the change it waits for.

    No hook is called under the job's lock (the host tier's may be held: a hook must not call into the tier)."""

    def read(self, job: ReadJob, position: int, read: Callable[[], ReadUnit]) -> ReadUnit:
        """Read unit ``position`` of ``job`` on one of the job's threads: ``read()`` does it and returns the unit.
        What this raises is the read's failure (raised at the next gate as `read_error`)."""
        return read()

    def changed(self, job: ReadJob) -> None:
        """``job`` changed: a unit was delivered (or freed, the job being stopped), it was allowed more bytes, it
        was stopped, or the reader left it."""

    def waiting(self, job: ReadJob, position: int) -> None:
        """The main thread is about to wait for ``position`` of ``job`` (`ReadJob.wait_for`); it may have arrived."""


#: The `ReadHooks` every read job calls (a seam for tests, see there).
read_hooks = ReadHooks()


def read_order(handle: OffloadHandle) -> list[int]:
    """The positions of ``handle``'s host copies that wait on disk (0: the base, ``i + 1``: unit ``i``;
    `HostCopies.waiting_positions`) in the order the engine reads them when it becomes active: the base, the
    plan's resident units (laid out at activation, by index), then the streamed units in the profiled call
    order, then any others."""
    waiting = set(handle.host.waiting_positions())
    order = [0]
    if handle.plan is not None:
        order += [i + 1 for i in sorted(handle.plan.resident)]
    if handle.profile is not None:
        order += [call.unit + 1 for call in handle.profile.calls]
    order += range(1, len(handle.units) + 1)
    return [p for p in dict.fromkeys(order) if p in waiting]


@dataclass(frozen=True)
class HowToRead:
    """How a component waiting on disk is read back."""

    read: ReadInto | None  # straight from the weight files (None: copy from its stand-ins)
    written: bool  # its weight-file views were written into: the files no longer hold its bytes


class ReadJob:
    """The read of one spilled component's units into new RAM buffers, in the order it will need them,
    never past ``allowed`` bytes of that order (the budget's room for it: a read ahead pauses there
    until the component becomes active and the budget lets it go on).

    The reader thread (`run`), the unit threads (`_read_one`) and the main thread (`wait_for`, `allow`,
    `stop`) share it under one condition. ``how`` is decided on the reader thread as the read starts
    (whether the weight files still hold the bytes reads ``/proc/self/smaps``: no main-thread time).
    """

    def __init__(
        self, component: str, host_copies: HostCopies, order: list[int], plan: Callable[[], HowToRead], pin: bool
    ) -> None:
        self.component = component
        self.host_copies = host_copies
        self.order = order
        self.pin = pin
        self.hosts = host_copies.spilled_hosts()  # what reads copy from; what a given-up fill points back at
        self.nbytes = host_copies.arrival_bytes()  # per position: what its read brings into RAM
        self.ends = list(itertools.accumulate(self.nbytes[p] for p in order))  # bytes up to each unit, in order
        self.how: HowToRead | None = None
        self.allowed = 0  # main thread: bytes of the order the reader may read
        self.taken_bytes = 0  # main thread: of those, what the host copies adopted (counted there)
        self.running = False  # the reader thread began it
        self.submitted = 0  # reader thread: units of the order handed to a unit thread
        self.buffered: set[int] = set()  # positions whose read has its buffer (`unbuffered_bytes`)
        self.delivered: dict[int, ReadUnit] = {}
        self.delivered_at: dict[int, float] = {}  # when each position was delivered (`clock`)
        self.read_bytes = 0
        self.read_s = 0.0
        self.error: BaseException | None = None
        self.stopped = False
        self.finished = False  # the reader left it: every allowed unit read, or stopped, or failed
        self._plan = plan
        self._in_flight = 0
        self._busy_since: float | None = None
        self._cond = threading.Condition()

    @property
    def total_bytes(self) -> int:
        """What the whole read brings into RAM."""
        return self.ends[-1] if self.ends else 0

    def units_within(self, nbytes: int) -> int:
        """How many units of the order fit, whole, in ``nbytes``."""
        return bisect.bisect_right(self.ends, nbytes)

    @property
    def reserved_bytes(self) -> int:
        """Host RAM this job may hold, not yet counted by the host copies: its allowed units, less those taken."""
        count = self.units_within(self.allowed)
        return (self.ends[count - 1] if count else 0) - self.taken_bytes

    @property
    def unbuffered_bytes(self) -> int:
        """Of ``reserved_bytes``, those of units whose read has no buffer yet, in the whole pages their buffers will
        take. A read is told it has its buffer under the locked pool's lock as the pool lends it
        (`LockedPool.take`), so that `LockedPool.idle_beyond` sees each buffer idle or taken, never both or neither."""
        with self._cond:
            if self.stopped or self.finished or self.error is not None:
                return 0
            allowed = self.order[: self.units_within(self.allowed)]
            return self._pages_of([p for p in allowed if p not in self.buffered])

    def _pages_of(self, positions: list[int]) -> int:
        """The whole pages the buffers of ``positions`` take."""
        return sum(rounded(self.nbytes[p]) for p in positions)

    # ------------------------------------------------------------------------------------ main thread

    def allow(self, nbytes: int) -> None:
        with self._cond:
            self.allowed = nbytes
            self._cond.notify_all()
        read_hooks.changed(self)

    def allow_more(self, room: int) -> None:
        """Let the read go ``room`` bytes past the units it may read whole now (a read ahead topped up)."""
        count = self.units_within(self.allowed)
        self.allow((self.ends[count - 1] if count else 0) + max(room, 0))

    def stop(self) -> None:
        """Read no further unit (those in flight finish; what they read is freed)."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()
        read_hooks.changed(self)

    def wait_finished(self) -> None:
        """Wait until the reader left the job; one it has not begun is finished at once (and skipped)."""
        with self._cond:
            if not self.running:
                self.finished = True
            self._cond.wait_for(lambda: self.finished)

    def wait_for(self, position: int) -> ReadUnit | None:
        """Block until ``position`` is read and hand it over; None when the job stopped first. A failure
        of the read is raised here."""
        read_hooks.waiting(self, position)
        with self._cond:
            self._cond.wait_for(lambda: position in self.delivered or self.error is not None or self.finished)
            unit = self.delivered.pop(position, None)
            if unit is None and self.error is not None:
                raise self.error
            return unit

    def take_all(self) -> list[ReadUnit]:
        with self._cond:
            units = list(self.delivered.values())
            self.delivered.clear()
            return units

    # ------------------------------------------------------------------------------------ reader threads

    def run(self, pools: ReadPools) -> None:
        """On the reader thread: submit the units in order, at most `UNITS_IN_FLIGHT` at once and never past
        ``allowed``; the job is finished once the last one submitted is in."""
        with self._cond:
            if self.finished:  # given up before it began
                return
            self.running = True
        try:
            if not self.stopped:
                how = self._plan()
                with self._cond:
                    self.how = how
            for n, position in enumerate(self.order):
                with self._cond:
                    self._cond.wait_for(lambda n=n: self._may_submit(n))
                    if self.stopped or self.error is not None:
                        break
                    if self._in_flight == 0:
                        self._busy_since = clock()
                    self._in_flight += 1
                    self.submitted = n + 1
                try:
                    pools.units.submit(self._read_one, position, pools.pieces)
                except BaseException:
                    self._landed(None)
                    raise
        except BaseException as exc:
            with self._cond:
                self.error = self.error or exc
        finally:
            with self._cond:
                self._cond.wait_for(lambda: self._in_flight == 0)
                self.finished = True
                self._cond.notify_all()
            read_hooks.changed(self)

    def _may_submit(self, n: int) -> bool:
        if self.stopped or self.error is not None:
            return True
        return self.ends[n] <= self.allowed and self._in_flight < UNITS_IN_FLIGHT

    def _read_one(self, position: int, pieces: PieceReader) -> None:
        assert self.how is not None
        hosts = self.host_copies
        buffered = functools.partial(self._buffered, position)
        read = functools.partial(
            hosts.read_unit, position, self.hosts[position], self.pin, self.how.read, pieces, buffered
        )
        try:
            unit = read_hooks.read(self, position, read)
        except BaseException as exc:
            with self._cond:
                self.error = self.error or exc
            self._landed(None)
            return
        self._landed(unit)

    def _buffered(self, position: int) -> None:
        """The read of ``position`` has its buffer (told under the locked pool's lock, `unbuffered_bytes`)."""
        with self._cond:
            self.buffered.add(position)

    def _landed(self, unit: ReadUnit | None) -> None:
        """A unit read ended (``unit`` None: it failed): deliver it, or free it when the job was stopped."""
        drop = None
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0 and self._busy_since is not None:
                self.read_s += clock() - self._busy_since
                self._busy_since = None
            if unit is not None and (self.stopped or self.error is not None):
                drop = unit
            elif unit is not None:
                self.delivered[unit.index + 1] = unit
                self.delivered_at[unit.index + 1] = clock()
                self.read_bytes += unit.nbytes
            self._cond.notify_all()
        if drop is not None:
            self.host_copies.drop_read([drop])
        read_hooks.changed(self)


@dataclass(frozen=True)
class ReadPools:
    """The `Reader`'s threads: ``units`` read one unit each (`UNITS_IN_FLIGHT`), handing its pieces to
    ``pieces`` (`READ_THREADS`)."""

    units: ThreadPoolExecutor
    pieces: PieceReader

    @staticmethod
    def start() -> ReadPools:
        pieces = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="flextensor-read-piece")
        units = ThreadPoolExecutor(UNITS_IN_FLIGHT, thread_name_prefix="flextensor-read")
        return ReadPools(units, PieceReader(pieces, READ_THREADS))

    def shutdown(self) -> None:
        self.units.shutdown(wait=True)  # first: a unit in flight waits for its pieces
        assert self.pieces.pool is not None
        self.pieces.pool.shutdown(wait=True)


class Reader:
    """Runs read jobs one after the other (a component's read back, then the read ahead of the next) on one
    daemon thread, a read ahead paused for room must never keep the process from exiting; every job reads
    on the same `ReadPools`."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[ReadJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pools: ReadPools | None = None

    def start(self, job: ReadJob) -> None:
        if self._thread is None:
            self._pools = ReadPools.start()
            self._thread = threading.Thread(target=self._run, args=(self._pools,), name="flextensor-reader")
            self._thread.daemon = True
            self._thread.start()
        self._queue.put(job)

    def _run(self, pools: ReadPools) -> None:
        while (job := self._queue.get()) is not None:
            job.run(pools)

    @staticmethod
    def give_up(job: ReadJob) -> None:
        """Stop ``job`` between units, wait for the units in flight and free everything it read and no one took."""
        job.stop()
        job.wait_finished()
        job.host_copies.drop_read(job.take_all())

    def close(self) -> None:
        """Join the threads (every job was given up or finished first)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            assert self._pools is not None
            self._pools.shutdown()
            self._thread = self._pools = None


class FillGate:
    """The gate (`HostCopies.expect_arrivals`) while a component's units arrive: one list lookup for a unit
    already taken; for another, ``arrive(position)`` waits for the reader and adopts the unit's buffer."""

    def __init__(self, positions: int, waiting: list[int], arrive: Callable[[int], None]) -> None:
        self.pending = [False] * positions
        for position in waiting:
            self.pending[position] = True
        self.left = len(waiting)
        self._arrive = arrive

    def __call__(self, unit: Unit) -> None:
        if self.pending[unit.index + 1]:
            self._arrive(unit.index + 1)

    def took(self, position: int) -> None:
        self.pending[position] = False
        self.left -= 1


def read_error(component: str, exc: BaseException) -> FlexTensorError:
    """A failed read back as a one-line error naming the fix (errors of this package already name theirs)."""
    if isinstance(exc, FlexTensorError):
        return exc
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    return FlexTensorError(
        f"reading {component}'s weights back from disk failed ({reason}); it stays on disk and is read again when "
        "it next runs: fix the disk, cache_dir or model folder and run again, or disable_flextensor_offload()"
    )
