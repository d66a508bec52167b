"""Reading ahead: the components expected after the active one are read while it computes.

While a component runs, the ones expected after it (`ComponentOrder`: the order seen last time, else the
pipeline's declared ``model_cpu_offload_seq``, wrapping around to the next generation) that wait on disk are
read on the reader's thread, in that order, as far as the budget allows next to the active one (others, neither
active nor expected before, may move out): all of the first one when it fits, else its first units, then the
read pauses; what room is left goes to the next ones (past a small VAE that a latents generation does not even
run, to the next generation's first expert). When one becomes active, the one before moves out (free for
components that wait in their weight files) and its read goes on from where it paused (`read_back`). A wrong
guess is stopped between units and its buffers freed; an edit of the component since the read began makes its
bytes stale: they are dropped and it is read again.

The reader runs jobs one after the other, so the read aheads are kept in the order expected: one paused for
room must never hold up a read queued behind it that is needed sooner.
"""

from __future__ import annotations

import logging

from ...engine import format_bytes
from ...engine.errors import FlexTensorError
from ..disk_reads import Reader, ReadJob
from ..locked_pool import LockedPool
from .jobs import read_job
from .order import ComponentOrder
from .placement import Placement
from .records import ReadRecords

logger = logging.getLogger(__name__)


class ReadAheads:
    """The read aheads under way, by component, in the order expected (the order the reader runs them), kept in
    ``reads`` (`ReadRecords.ahead`), where the placement counts what they reserve."""

    def __init__(
        self,
        placement: Placement,
        reads: ReadRecords,
        reader: Reader,
        order: ComponentOrder,
        pin: bool,
        pool: LockedPool,
    ) -> None:
        self._placement = placement
        self._reader = reader
        self._order = order
        self._pin = pin
        self._pool = pool
        self._jobs: dict[str, ReadJob] = reads.ahead

    def take(self, name: str) -> ReadJob | None:
        """``name`` becomes active: its read ahead (if any), which becomes its read back."""
        return self._jobs.pop(name, None)

    def give_up_all(self) -> None:
        for name in list(self._jobs):
            self._give_up(name)

    def give_up_before(self, name: str) -> None:
        """``name`` becomes active: the read aheads queued before its own were wrong guesses (and one paused
        for room would hold the reader up); all are when it has none (its read is queued after them)."""
        for other in list(self._jobs):
            if other == name:
                return
            self._give_up(other)

    def _give_up(self, name: str) -> None:
        self._reader.give_up(self._jobs.pop(name))
        logger.debug("host tier: the read ahead of %s was given up", name)

    def top_up(self, active: str) -> None:
        """RAM was freed while ``active`` runs (`hand_over`): the read aheads expected go on into it, in order, as
        `after` lets them (none moves out here: this runs on the hand-over's thread)."""
        wanted = self.readable_after(active)
        if list(self._jobs) != wanted[: len(self._jobs)]:
            return  # out of order: `after` sorts it out at the switch
        for name in wanted:
            if not self._read_into_room(name, active):
                return

    def after(self, active: str) -> None:
        """Read the components expected after ``active`` that wait on disk, unedited since, in the order
        expected, as far as the budget allows next to ``active``: the first one all of it when it fits (others
        may move out, but none expected before it), then the next ones in what room is left (the small VAE,
        then the next generation's first expert). Read aheads kept from before are topped up; a new one is
        only queued behind them when they are the chain's first components in order."""
        chain = self._order.expected_chain(active, self._placement.handles)
        wanted = self._readable(chain)
        if list(self._jobs) != wanted[: len(self._jobs)]:
            self.give_up_all()  # out of order: a paused one would hold a later one up
        for position, name in enumerate(wanted):
            if position == 0:  # never moves out one expected before it
                self._make_room_for(name, {active, *chain[: chain.index(name) + 1]})
            if not self._read_into_room(name, active):
                return

    def _make_room_for(self, name: str, keep: set[str]) -> None:
        """Move others out until all of ``name`` fits next to ``keep``; reading ahead is optional, so a failure
        to move one out only warns (the component is read when it runs)."""
        job = self._jobs.get(name)
        missing = self._placement.stored_bytes(name) - (job.reserved_bytes if job is not None else 0)
        try:
            self._placement.make_room(keep, missing, drop_made=False)
        except FlexTensorError as exc:
            logger.warning("host tier: no read ahead of %s: %s", name, exc)

    def _read_into_room(self, name: str, active: str) -> bool:
        """Let ``name``'s read ahead go as far as the room left: a paused one is topped up, a new one starts
        when at least one unit fits. False when not all of it may be read: the components expected later get no
        room (a smaller unit of theirs would take what the next unit of ``name`` needs, and hold it at the
        switch)."""
        handle = self._placement.handles[name]
        job = self._jobs.get(name)
        # the units not begun (a unit begun meanwhile on a reader thread only makes this room smaller than it is)
        unread = handle.host.arrival_bytes() if job is None else [job.nbytes[p] for p in job.order[job.submitted :]]
        room = self._placement.budget.weights_budget - self._placement.ram_bytes()
        room -= self._pool.slack_for(unread)  # room for the larger buffers the pool may make for them
        if job is not None:
            job.allow_more(room)
            return job.allowed >= job.total_bytes
        job = read_job(name, handle, self._placement.sources.get(name), self._pin)
        if room <= 0 or job.units_within(room) == 0:
            return False
        job.allow(room)
        self._jobs[name] = job
        self._reader.start(job)
        self._placement.note_peak()
        packed = job.total_bytes
        logger.debug(
            "host tier: reading %s ahead while %s runs (%s of %s)",
            name,
            active,
            format_bytes(min(room, packed)),
            format_bytes(packed),
        )
        return job.allowed >= packed

    def readable_after(self, active: str) -> list[str]:
        """The components expected after ``active`` that may be read ahead (`may_read_ahead`), in the order expected."""
        return self._readable(self._order.expected_chain(active, self._placement.handles))

    def _readable(self, chain: list[str]) -> list[str]:
        return [name for name in chain if self.may_read_ahead(name)]

    def may_read_ahead(self, name: str) -> bool:
        """``name`` waits on disk, not active, unedited since it moved out, and its files unchanged."""
        handle = self._placement.handles[name]
        host_copies = handle.host
        if not host_copies.waiting_on_disk or handle.active or not host_copies.spill_is_current:
            return False
        source = self._placement.sources.get(name)
        return source is None or source.changed_file() is None  # a changed one is refused when it is needed
