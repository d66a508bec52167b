"""`HostTier`: the host tier's one entry point for the pipeline offload, wiring its parts under one lock.

`PipelineOffload` calls it at set-up (`room_for_packing`, `add`), at every switch (`bring_in`), for the report,
and at the end (`stop`, `close`); the engine calls only the gate a read back sets (`read_back`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import disk_reads
from ..disk_reads import Reader
from ..host_budget import HostOverhead
from ..locked_pool import LockedPool
from ..weight_files import WeightSource
from .forecast import SlowSwitchWarning, SwitchForecast, forecast_switches
from .hand_over import HandOver, HandOverRecord
from .order import ComponentOrder
from .placement import Placement, TierBudget
from .pool_room import PoolRoom
from .read_ahead import ReadAheads
from .read_back import ReadBack
from .records import ReadRecords, Switch
from .report import tier_report

if TYPE_CHECKING:
    from ...engine import OffloadHandle, UnitDone


class HostTier:
    """Which components' host copies are in RAM, under ``weights_budget`` (the host ``budget`` less
    ``overhead``); the rest wait on disk (their own weight files, else cache files in ``folder``).

    One lock around the parts' state (`Placement`, `ReadBack`, `ReadAheads`, `ComponentOrder`); the reader
    threads only read a component's bytes into new buffers (`ReadJob`) and touch no state here.

    Args:
        budget: the user's host budget, the whole process's anonymous and page-locked memory.
        folder: where cache files go.
        pin: read back into page-locked buffers (to stream them to a CUDA device).
        overhead: what the process holds besides the host copies, measured when offload was enabled.
        weights_root: the pipeline's folder, where its components' weight files are looked up.
        order: the pipeline's declared order (`offload_order`), until an order is seen.
    """

    def __init__(
        self,
        budget: int,
        folder: Path,
        pin: bool,
        overhead: HostOverhead,
        weights_root: Path | None = None,
        order: list[str] | None = None,
    ) -> None:
        self.budget = budget
        self.folder = folder
        self.pin = pin
        self.overhead = overhead
        self.weights_root = weights_root
        self.order = list(order or [])
        self._lock = threading.RLock()
        self._reader = Reader()
        self._seen = ComponentOrder(self.order)
        self._split = TierBudget(budget, overhead)
        self._reads = ReadRecords()  # first: the parts below count the reads or make them
        #: The buffers of payloads read back and let go, handed on instead of made (and locked and unlocked) per
        #: unit (`storage.locked_pool`); page-locked when ``pin``; held to the budget by `_pool_room`.
        self.locked_pool = LockedPool(page_lock=pin)
        self._placement = Placement(self._split, folder, weights_root, self._reads, self.locked_pool)
        self._pool_room: PoolRoom = self._placement.pool_room
        self._aheads = ReadAheads(self._placement, self._reads, self._reader, self._seen, pin, self.locked_pool)
        slow = SlowSwitchWarning(budget, self.forecasts)  # what it reads (switches, order, placement) is built
        self._read_back = ReadBack(self._lock, self._placement, self._reads, self._reader, self._aheads, slow, pin)
        self._hand_over: HandOver | None = None
        self.hand_overs: list[HandOverRecord] = []

    @property
    def weights_budget(self) -> int:
        """The host copies' share, budget - overhead: what `ram_bytes` stays under."""
        return self._split.weights_budget

    @property
    def handles(self) -> dict[str, OffloadHandle]:
        return self._placement.handles

    @property
    def sources(self) -> dict[str, WeightSource]:
        """Components that wait in their own weight files (the others wait in cache files)."""
        return self._placement.sources

    @property
    def peak_ram_bytes(self) -> int:
        return self._placement.peak_ram_bytes

    @property
    def switches(self) -> list[Switch]:
        """Every read from disk, in order."""
        return self._reads.switches

    @property
    def reads(self) -> list[Switch]:
        """Every read from disk, in order (an alias of ``switches``)."""
        return self.switches

    def ram_bytes(self) -> int:
        """Host RAM of the host copies now, and what the reads under way may hold (reserved ahead)."""
        with self._lock:
            return self._placement.ram_bytes()

    def add(self, name: str, handle: OffloadHandle) -> None:
        """Track a component just packed (in RAM): find its weight files, then move others to disk if
        it does not fit with them."""
        with self._lock, self._pool_room.changing():
            handle.host.compressed.hand_buffers_on_to(self.locked_pool)
            self.locked_pool.expect(e.payload.numel() for e in handle.host.encoded.values())
            self._placement.add(name, handle)

    def check_fits(self) -> None:
        """Once every component is added: refuse a host budget too small for their host copies as kept
        (`Placement.check_fits`)."""
        with self._lock:
            self._placement.check_fits()

    def room_for_packing(self, nbytes: int) -> None:
        """Before a component of ``nbytes`` is packed: move others to disk until it fits."""
        with self._lock, self._pool_room.changing(upcoming=nbytes):
            self._placement.make_room(set(), nbytes)

    def bring_in(self, handle: OffloadHandle) -> None:
        """Before ``handle`` becomes active (the one before is released): the previous component's read
        back completed, a wrong read ahead given up; when ``handle`` waits on disk, its read back starts,
        or goes on from its read ahead, and it becomes active at once (its units arrive through the
        gate). Then the read aheads of the components expected next start or go on (`ReadAheads.after`)."""
        started = disk_reads.clock()
        with self._lock, self._pool_room.changing():
            self._bring_in(handle, started)

    def _bring_in(self, handle: OffloadHandle, started: float) -> None:
        """`bring_in`'s work, under the lock."""
        self._finish_hand_over()
        name = self._placement.name_of(handle)
        self._placement.mark_active(name)
        self._seen.note(name)
        if self._read_back.serves(name):
            return  # activated again while its units arrive: the gate still serves them
        self._read_back.finish()
        switch = None
        if handle.host.waiting_on_disk:
            self._aheads.give_up_before(name)
            switch = self._read_back.start(name)
        self._placement.note_peak()
        self._aheads.after(name)
        if switch is not None:  # all of it kept the component from computing
            switch.bring_in_s = disk_reads.clock() - started
            switch.wait_s += switch.bring_in_s

    def hand_over(self, handle: OffloadHandle) -> UnitDone | None:
        """``handle``'s forward beginning now is expected to be its last before a switch (see `hand_over`): when it
        is compressed only, its payload file holds its payloads, nothing of it is arriving and a component expected
        after it waits on disk (not necessarily the next one: the VAE after the last expert stays in RAM), its
        payloads leave RAM one by one as the forward is done with them and the read aheads of those expected go on
        into that room. What the engine tells of each unit done; None: no hand-over."""
        with self._lock:
            name = self._placement.name_of(handle)
            current = self._hand_over
            if current is not None and current.component == name:
                return None if current.found_wrong else current.unit_done  # its gate still takes units back
            if not handle.host.form.lets_go_payloads or handle.host.arriving:
                return None
            if not self._aheads.readable_after(name):
                return None  # none expected waits on disk: nothing would read into the room
            self._finish_hand_over()
            current = HandOver(
                name, handle, self._lock, self.pin, lambda: self._room_freed(name), self._aheads.give_up_all
            )
            self._hand_over = current
            self.hand_overs.append(current.record)
            return current.unit_done

    def generation_ended(self) -> None:
        """The pipeline's generation returned: a hand-over still open ends. A switch ends it otherwise, and with
        latents as the output no VAE switches in after the last expert; left open, its gate would take every unit let
        go back from the payload file at the expert's next edit, warning of a wrong forecast."""
        with self._lock, self._pool_room.changing():
            self._finish_hand_over()

    @contextlib.contextmanager
    def encoding_room(self, handle: OffloadHandle) -> Iterator[int]:
        """Before units of ``handle`` (active) are encoded between its forwards (`HandleHooks.encoding_room`): how
        many of those left fit in the host budget with the encoder's working memory, others moved out to make room
        where needed (`Placement.room_to_encode`), and the read aheads given up when even one would not fit
        otherwise; that room is held until the gap ends."""
        with self._lock, self._pool_room.changing():
            name = self._placement.name_of(handle)
            needed = handle.host.compressed.encoding_room_needed()
            count = self._placement.room_to_encode(name, *needed, say=False)
            if not count:  # what is read ahead is only a guess: the room goes to the encoding first
                self._aheads.give_up_all()
                count = self._placement.room_to_encode(name, *needed)
        try:
            yield count
        finally:
            with self._lock, self._pool_room.changing():
                self._placement.encoding_done()

    def _room_freed(self, active: str) -> None:
        """A payload of ``active`` was handed over: the read ahead of the next component goes on into its room."""
        with self._pool_room.changing():
            self._aheads.top_up(active)
            self._placement.note_peak()

    def _finish_hand_over(self) -> None:
        if self._hand_over is not None:
            self._hand_over.finish()
            self._hand_over = None

    def report(self) -> dict[str, Any]:
        """What `report.tier_report` tells, the switch under way counted up to now."""
        with self._lock:
            self._read_back.note_read_time()
            pool = self.locked_pool.report()
            return tier_report(
                self._placement, self.switches, self._reads.readings(), self.forecasts(), self.hand_overs, pool
            )

    def forecasts(self) -> list[SwitchForecast]:
        """A `SwitchForecast` per switch seen so far whose two components do not fit in RAM together (so the
        second waits on disk), once reads have measured the disk and the component has a plan."""
        with self._lock:
            return forecast_switches(self.switches, self._seen.seen_before(), self.handles, self._split)

    def stop(self) -> None:
        """Before offload is disabled: give up the reads under way (a component still arriving goes back to
        disk as it was), and check the weight files of components waiting in them, which removal reads their
        weights back from (`Placement.check_files_for_removal`)."""
        with self._lock:
            with self._pool_room.changing():
                self._finish_hand_over()
                self._read_back.give_up()  # first: a read ahead queued behind it is then skipped at once
                self._aheads.give_up_all()
            self._placement.check_files_for_removal()

    def close(self) -> None:
        """Join the reader threads and delete the cache files (called once every handle is removed);
        the weight files' pages the removal read are dropped from the page cache."""
        with self._lock:
            self._finish_hand_over()
            self._read_back.give_up()
            self._aheads.give_up_all()
            self._reader.close()
            self.locked_pool.close()
            self._placement.delete_files()
