"""The read back of the active component: it computes while its units arrive from disk.

Reading back is progressive, unit by unit (`disk_reads`: a `ReadJob` on the `Reader`'s threads): the
units are read in the order the component will need them, a few at once, each into its own (pinned)
buffer, and the component starts at once. The engine asks the gate opened by `HostCopies.expect_arrivals`
before it reads a unit's host bytes (`FillGate`): the gate blocks until the reader delivered that unit, then adopts the
buffer on the main thread, so the first blocks compute while the last ones are still being read. The time
blocked there (plus `HostTier.bring_in`'s own) is the switch's exposed disk time, ``wait_s``; the reader's
own time is ``read_s``; both are measured with `disk_reads.clock` (a seam: tests fix the figures with a fake
clock, so it is looked up at each use). A read that fails is raised at the next gate as a one-line error,
with the component left on disk as it was (read again when it next runs).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

from ...engine import format_bytes
from ...engine.errors import FlexTensorError
from .. import disk_reads
from ..disk_reads import FillGate, Reader, ReadJob, read_error
from ..host_gates import OpenGate
from ..weight_files import WeightSource
from .forecast import SlowSwitchWarning
from .jobs import is_stale, read_job
from .placement import Placement
from .read_ahead import ReadAheads
from .records import ReadRecords, Switch

logger = logging.getLogger(__name__)


@dataclass
class Fill:
    """A component made active while its units arrive from disk."""

    job: ReadJob
    switch: Switch
    source: WeightSource | None
    gate: FillGate | None = None
    opened: OpenGate | None = None  # the gate open on the component's host copies, closed by this read back alone

    def close_gate(self) -> None:
        """Reads of the component's host bytes no longer ask this read back's gate."""
        if self.opened is not None:
            self.opened.close()


class ReadBack:
    """The active component's read back (at most one at a time), kept in ``reads`` (`ReadRecords.back`, where the
    placement counts what it reserves), and the `Switch` of every read back so far (`ReadRecords.switches`).

    ``lock`` is the host tier's: the gate is called by the engine, outside the tier, and takes it itself. A
    component's read ahead becomes its read back (``aheads``), and a new read back gives every read ahead up
    first, since the reader runs jobs in order and a paused one would hold the new one up."""

    def __init__(
        self,
        lock: threading.RLock,
        placement: Placement,
        reads: ReadRecords,
        reader: Reader,
        aheads: ReadAheads,
        slow: SlowSwitchWarning,
        pin: bool,
    ) -> None:
        self._lock = lock
        self._placement = placement
        self._reads = reads
        self._reader = reader
        self._aheads = aheads
        self._slow = slow
        self._pin = pin
        self._fill: Fill | None = None

    def _hold(self, fill: Fill | None) -> None:
        """``fill`` is the read back under way now (None: none), counted among the reads under way."""
        self._fill = fill
        self._reads.back = None if fill is None else fill.job

    def serves(self, name: str) -> bool:
        """``name``'s units are still arriving (activated again meanwhile: its gate still serves them)."""
        return self._fill is not None and self._fill.job.component == name

    def note_read_time(self) -> None:
        """Bring the switch under way up to date with its reader's time so far (for a report)."""
        if self._fill is not None:
            self._fill.switch.read_s = self._fill.job.read_s

    def start(self, name: str) -> Switch:
        """``name`` waits on disk and becomes active: room for all of it, its read going on (from its read
        ahead, unless that is stale) and its gate set; no byte is waited for here."""
        host_copies = self._placement.handles[name].host
        source = self._placement.sources.get(name)
        job = self._resumable(name, source)
        fresh = job is None
        if job is None:  # a new job runs after those queued: none may pause before it
            self._aheads.give_up_all()
            job = read_job(name, self._placement.handles[name], source, self._pin)
        switch = Switch(name, job.total_bytes, read_ahead_bytes=job.read_bytes)
        fill = Fill(job, switch, source)
        fill.gate = FillGate(len(job.nbytes), job.order, functools.partial(self._arrive, fill))
        self._hold(fill)
        fill.opened = host_copies.expect_arrivals(fill.gate)
        self._reads.switches.append(switch)
        try:
            self._placement.make_room({name}, job.total_bytes - job.reserved_bytes)
            job.allow(job.total_bytes)
            if fresh:
                self._reader.start(job)
        except BaseException:
            self.give_up()
            raise
        logger.info(
            "host tier: %s becomes active while it is read from disk (%s of %s read ahead)",
            name,
            format_bytes(switch.read_ahead_bytes),
            format_bytes(switch.nbytes),
        )
        return switch

    def _resumable(self, name: str, source: WeightSource | None) -> ReadJob | None:
        """``name``'s read ahead when its read may go on from it; a stale one is given up. A changed weight
        file is refused here, before anything moves (the read ahead given up with it)."""
        job = self._aheads.take(name)
        try:
            if source is not None:
                source.check()
        except BaseException:
            if job is not None:
                self._reader.give_up(job)
            raise
        if job is not None and is_stale(job, source):
            self._reader.give_up(job)
            return None
        return job

    def _arrive(self, fill: Fill, position: int, asked: bool = True) -> None:
        """The gate, for a unit not taken yet: wait for the reader to deliver it and adopt its buffer; the
        last one ends the read back. A failed read gives the read back up (the component stays on disk as it
        was) and raises. ``asked``: the component asked for it (not the switch away completing its read)."""
        with self._lock:
            gate = fill.gate
            if self._fill is not fill or gate is None or not gate.pending[position]:
                return
            begin = disk_reads.clock()
            try:
                unit = fill.job.wait_for(position)
            except Exception as exc:
                fill.switch.wait_s += disk_reads.clock() - begin
                self.give_up()
                error = read_error(fill.job.component, exc)
                if error is exc:
                    raise
                raise error from exc
            fill.switch.wait_s += disk_reads.clock() - begin
            assert unit is not None, "a read back stopped while its component still needs it"
            fill.job.host_copies.take_unit(unit)
            fill.job.taken_bytes += unit.nbytes
            read_at = fill.job.delivered_at.get(position)
            fill.switch.note_taken(position, unit.nbytes, read_at, begin if asked else None)
            gate.took(position)
            if gate.left == 0:
                self._end(fill)

    def _end(self, fill: Fill) -> None:
        """Every unit arrived: the gate goes, the switch is complete (and warned of when it was slow)."""
        job, switch = fill.job, fill.switch
        self._hold(None)
        fill.close_gate()
        switch.read_s, switch.complete = job.read_s, True
        if fill.source is not None:
            fill.source.read_done()
        if job.how is not None and job.how.written:
            self._placement.forget_files(job.component)
        logger.info(
            "host tier: %s read from disk in %.3f s (%s read ahead), waited %.3f s",
            job.component,
            switch.read_s,
            format_bytes(switch.read_ahead_bytes),
            switch.wait_s,
        )
        self._slow.check(switch)

    def finish(self) -> None:
        """Complete the read back of the component before (inactive now): every unit taken, in order. A
        failure gives it up, with a warning: that component is not the one needed now."""
        fill = self._fill
        if fill is None or fill.gate is None:
            return
        try:
            for position in fill.job.order:
                if self._fill is fill and fill.gate.pending[position]:
                    self._arrive(fill, position, asked=False)
        except FlexTensorError as exc:
            logger.warning("host tier: %s", exc)

    def give_up(self) -> None:
        """Stop the read back under way between units: what was taken goes back to the stand-ins, which
        hold the same bytes, what was read is freed, and the component is spilled as it was."""
        fill = self._fill
        self._hold(None)
        if fill is None:
            return
        host_copies = fill.job.host_copies
        fill.close_gate()
        self._reader.give_up(fill.job)
        host_copies.untake_units(fill.job.hosts)
        fill.switch.read_s = fill.job.read_s
        logger.info("host tier: the read of %s from disk was given up; it stays on disk", fill.job.component)
