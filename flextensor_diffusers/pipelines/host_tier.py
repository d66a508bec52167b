"""A host-memory budget for a pipeline: components whose host copies do not fit in RAM wait on disk.

A diffusers pipeline runs its components one after the other (Wan2.2: the text encoder once, the
high-noise expert for the first steps, the low-noise expert after the boundary, the VAE), and
only the active component needs its weights in host RAM, to stream them to the GPU. So the host
copies of the components that are not running can wait on disk: `HostTier` keeps as many
components in (pinned) RAM as ``host_budget`` allows; before a component on disk becomes active it
moves the least recently used ones out until the component fits, and reads it back.

Where a component waits:

* **its own weight files** when it was loaded with ``from_pretrained`` from a local folder and every
  packed tensor's bytes are in the folder's ``*.safetensors`` files, unconverted (`weight_files`):
  moving it out writes nothing, its tensors become views of private copy-on-write mappings of
  those files, and reading it back is large ``preadv`` reads. The files are stamped when offload is
  enabled; a changed file is refused before it is read. An edit made since (``load_state_dict``, a
  LoRA) means the files no longer hold its bytes: from the next move out on, it waits in a cache file.
* **a cache file** in ``cache_dir`` otherwise, written when it first moves out and kept, unwritten
  again, until an edit.

Reading back is progressive, unit by unit (`disk_reads`: a `ReadJob` on the `Reader`'s threads): the
units are read in the order the component will need them, a few at once, each into its own (pinned)
buffer, and the component starts at once. The engine asks `HostCopies.host_gate` before it reads a
unit's host bytes (`FillGate`): the gate blocks until the reader delivered that unit, then adopts the
buffer on the main thread, so the first blocks compute while the last ones are still being read. The time
blocked there (plus `bring_in`'s own) is the switch's exposed disk time, ``wait_s``; the reader's own
time is ``read_s``; both are measured with `disk_reads.clock` (a seam: tests fix the figures with a fake clock). A
read that fails is raised at the next gate as a one-line error, with the component left on disk as it was (read
again when it next runs).

Reading ahead: while a component runs, the ones expected after it (the order seen last time, else the
pipeline's declared ``model_cpu_offload_seq``, wrapping around to the next generation) that wait on disk are
read on the same thread, in that order, as far as the budget allows next to the active one (others, neither
active nor expected before, may move out): all of the first one when it fits, else its first units, then the
read pauses; what room is left goes to the next ones (past a small VAE that a latents generation does not even
run, to the next generation's first expert). When one becomes active, the one before moves out (free for
components that wait in their weight files) and its read goes on from where it paused. A wrong guess is stopped
between units and its buffers freed; an edit of the component since the read began makes its bytes stale: they
are dropped and it is read again.

The host budget bounds the process's anonymous and page-locked memory (RssAnon + RssShmem), not only
the host copies: what the process holds besides them comes off the top (`host_budget.HostOverhead`),
and the host copies get the rest, ``weights_budget``. The
host copies' share counts what the package allocates for host copies (page-locked or not), what is
read back and what is read ahead (reserved before it is read, so the share holds at all times);
mappings of files are file-backed pages the kernel may drop at any time. Not bounded: an edit made
while a component waits in its weight files (anonymous copy-on-write pages until it is read back),
what the process allocates after enabling beyond the reserve, and on the CPU device the "device"
copies (bounded by the GPU budget).

Not built yet: streaming single blocks from disk for a component larger than the host budget,
O_DIRECT / GPUDirect Storage (kvikio) reads, and finding the weight files of a pipeline loaded from
a hub id (only local folders are looked up).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..engine import format_bytes
from ..engine.errors import FlexTensorError
from . import disk_reads
from .disk_reads import FillGate, HowToRead, Reader, ReadJob, read_error, read_order
from .host_budget import HostOverhead
from .weight_files import WeightSource, component_folders, pipeline_folder

if TYPE_CHECKING:
    from ..engine import OffloadHandle

__all__ = [
    "HostTier",
    "SwitchForecast",
    "format_host_tier",
    "kept_in_ram_bytes",
    "offload_order",
    "pipeline_folder",
]

logger = logging.getLogger(__name__)

WEIGHTS_FILES, CACHE_FILE = "weights files", "cache file"
#: A switch that kept its component waiting this long for disk reads is worth a warning (once per component)
#: naming the host budget that would hide it: the user may have the RAM, and otherwise knows why steps stall.
SLOW_SWITCH_S = 2.0


def kept_in_ram_bytes(name: str, module: nn.Module, root: Path | None) -> int:
    """Bytes of ``module``'s non-persistent buffers (RoPE tables, say) when it may wait in weight files
    (it has a local folder): never in those files, they stay in RAM while it waits there."""
    if not component_folders(name, module, root):
        return 0
    buffers = {
        id(t): t
        for sub in module.modules()
        for n, t in sub._buffers.items()
        if t is not None and n in getattr(sub, "_non_persistent_buffers_set", ())
    }
    return sum(t.numel() * t.element_size() for t in buffers.values())


def offload_order(pipeline: Any) -> list[str]:
    """The order the pipeline declares its components run in (diffusers' ``model_cpu_offload_seq``,
    e.g. ``"text_encoder->transformer->transformer_2->vae"``)."""
    seq = getattr(pipeline, "model_cpu_offload_seq", None)
    return [name.strip() for name in seq.split("->") if name.strip()] if isinstance(seq, str) else []


@dataclass
class Switch:
    """One component brought in from disk: what its read cost and how much of it the component waited for."""

    component: str
    nbytes: int
    read_ahead_bytes: int = 0  # read while another component ran, before this one became active
    read_s: float = 0.0  # the reader's busy time on it, ahead and after (wall clock, paused time excluded)
    wait_s: float = 0.0  # time it was kept from computing: `bring_in`'s own, then blocked in the gate
    complete: bool = False  # every unit arrived (False: still arriving, or given up)
    prefetched: bool = field(init=False)  # some of it was read ahead (a field: records are read with asdict)

    def __post_init__(self) -> None:
        self.prefetched = self.read_ahead_bytes > 0

    @property
    def hidden_s(self) -> float:
        """Read time spent while a component computed."""
        return max(0.0, self.read_s - self.wait_s)

    @property
    def gbps(self) -> float | None:
        return round(self.nbytes / self.read_s / 1e9, 3) if self.complete and self.read_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "nbytes": self.nbytes,
            "read_ahead_bytes": self.read_ahead_bytes,
            "prefetched": self.prefetched,
            "read_s": round(self.read_s, 4),
            "wait_s": round(self.wait_s, 4),
            "gbps": self.gbps,
            "complete": self.complete,
        }


@dataclass(frozen=True)
class SwitchForecast:
    """What a switch to ``component`` is expected to keep it waiting, from the disk bandwidth measured so far
    and the component's planned forward time. ``after`` is the last component before it that does not fit in
    RAM next to it (the low-noise expert before the next generation's high-noise one): while ``after`` runs,
    only what the budget leaves next to it is read ahead. Reading also goes on while the smaller components
    between them run (a VAE, a text encoder); that is left out, so for such a switch this is an upper bound.

    Its units arrive in the order its first forward needs them, so that forward computes while the bytes not
    read ahead arrive; a second forward of the same step (CFG's) needs them all in RAM already. So the wait is
    about (bytes not read ahead) / (disk bandwidth) less one forward, and it vanishes once the read ahead
    covers all but one forward's worth of reading: ``hidden_from_host_budget`` is the host budget from which
    it does (what the read ahead may use next to ``after``, plus what the budget keeps for the process)."""

    component: str
    after: str
    nbytes: int
    read_ahead_bytes: int  # the most the budget lets be read while ``after`` runs
    disk_gbps: float
    forward_s: float
    wait_s: float
    hidden_from_host_budget: int

    @classmethod
    def of(
        cls,
        component: str,
        after: str,
        nbytes: int,
        after_bytes: int,
        tier: HostTier,
        disk_gbps: float,
        forward_s: float,
    ) -> SwitchForecast:
        """``nbytes``, ``after_bytes``: the two components' host copies; ``tier``: its budget and share."""
        ahead = min(nbytes, max(0, tier.weights_budget - after_bytes))
        per_forward = int(disk_gbps * 1e9 * forward_s)  # bytes read while one forward computes
        wait = max(0.0, (nbytes - ahead) / (disk_gbps * 1e9) - forward_s)
        hidden_from = tier.overhead.nbytes + after_bytes + max(0, nbytes - per_forward)
        return cls(component, after, nbytes, ahead, disk_gbps, forward_s, wait, hidden_from)

    def as_dict(self) -> dict[str, Any]:
        rounded = {
            "disk_gbps": round(self.disk_gbps, 3),
            "forward_s": round(self.forward_s, 4),
            "wait_s": round(self.wait_s, 3),
        }
        return {**dataclasses.asdict(self), **rounded}


@dataclass
class Fill:
    """A component made active while its units arrive from disk."""

    job: ReadJob
    switch: Switch
    source: WeightSource | None
    gate: FillGate | None = None


@dataclass
class ReadAhead:
    """The read ahead of a component expected soon, paused when the budget holds no more of it."""

    job: ReadJob


class ComponentOrder:
    """Which component is expected to run after another: the one seen after it last time, else the
    next one in the pipeline's declared order (wrapping around, to the next generation)."""

    def __init__(self, declared: list[str]) -> None:
        self.declared = declared
        self.seen_after: dict[str, str] = {}
        self._last: str | None = None

    def note(self, name: str) -> None:
        """``name`` becomes active now."""
        if self._last is not None and self._last != name:
            self.seen_after[self._last] = name
        self._last = name

    def expected_chain(self, name: str, candidates: Collection[str]) -> list[str]:
        """The components expected after ``name``, in order, each once, until ``name`` would come again
        (Wan2.2 without a VAE decode: after the low-noise expert, the high-noise one of the next generation)."""
        chain: list[str] = []
        after = self.expected_after(name, candidates)
        while after is not None and after != name and after not in chain:
            chain.append(after)
            after = self.expected_after(after, candidates)
        return chain

    def expected_after(self, name: str, candidates: Collection[str]) -> str | None:
        seen = self.seen_after.get(name)
        if seen is not None and seen in candidates:
            return seen
        declared = [n for n in self.declared if n in candidates]
        if name not in declared or len(declared) < 2:
            return None
        return declared[(declared.index(name) + 1) % len(declared)]


@dataclass
class HostTier:
    """Which components' host copies are in RAM, under ``weights_budget`` (the host ``budget`` less
    ``overhead``); the rest wait on disk (their own weight files, else cache files in ``folder``). One
    lock around its state; the reader threads only read a component's bytes into new buffers (`ReadJob`)
    and touch no state here."""

    budget: int  # the user's host budget: the whole process's anonymous and page-locked memory
    folder: Path
    pin: bool
    overhead: HostOverhead  # measured when offload was enabled
    weights_budget: int = field(init=False)  # the host copies' share, budget - overhead: what `ram_bytes` stays under
    weights_root: Path | None = None  # the pipeline's folder, where its components' folders are
    order: list[str] = field(default_factory=list)  # the pipeline's declared order (`offload_order`)
    handles: dict[str, OffloadHandle] = field(default_factory=dict)
    recency: list[str] = field(default_factory=list)  # least recently active first
    peak_ram_bytes: int = 0
    switches: list[Switch] = field(default_factory=list)
    sources: dict[str, WeightSource] = field(default_factory=dict)  # components that wait in their own files
    _files: list[Path] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _reader: Reader = field(default_factory=Reader, repr=False)
    _fill: Fill | None = field(default=None, repr=False)  # the active component's units still arriving
    #: Read aheads of the components expected next, in the order expected (the reader runs them in that order).
    _ahead: dict[str, ReadAhead] = field(default_factory=dict, repr=False)
    _seen: ComponentOrder = field(init=False, repr=False)
    _warned_slow: set[str] = field(default_factory=set, repr=False)  # components a slow switch was warned of

    def __post_init__(self) -> None:
        self._seen = ComponentOrder(self.order)
        self.weights_budget = self.budget - self.overhead.nbytes

    @property
    def reads(self) -> list[Switch]:
        """Every read from disk, in order (an alias of ``switches``)."""
        return self.switches

    def ram_bytes(self) -> int:
        """Host RAM of the host copies now, and what the reads under way may hold (reserved ahead)."""
        with self._lock:
            jobs = [r.job for r in self._readings()]
            return sum(h.host.host_ram_bytes for h in self.handles.values()) + sum(j.reserved_bytes for j in jobs)

    # ------------------------------------------------------------------------------------ set-up

    def add(self, name: str, handle: OffloadHandle) -> None:
        """Track a component just packed (in RAM): find its weight files, then move others to disk if
        it does not fit with them."""
        with self._lock:
            self.handles[name] = handle
            self.recency.append(name)
            folders = component_folders(name, handle.model, self.weights_root)
            host_copies = handle.host
            source = WeightSource.find(name, folders, host_copies.positions) if folders else None
            if source is not None:
                self.sources[name] = source
                host_copies.mark_spill_current()
            self._make_room({name}, 0)  # it is in RAM already: the others move out until all fit
            self._note_peak()

    def room_for_packing(self, nbytes: int) -> None:
        """Before a component of ``nbytes`` is packed: move others to disk until it fits."""
        with self._lock:
            self._make_room(set(), nbytes)

    # ------------------------------------------------------------------------------------ switches

    def bring_in(self, handle: OffloadHandle) -> None:
        """Before ``handle`` becomes active (the one before is released): the previous component's read
        back completed, a wrong read ahead given up; when ``handle`` waits on disk, its read back starts,
        or goes on from its read ahead, and it becomes active at once (its units arrive through the
        gate). Then the read aheads of the components expected next start or go on (`_read_ahead_after`)."""
        started = disk_reads.clock()
        with self._lock:
            name = next(n for n, h in self.handles.items() if h is handle)
            self.recency.remove(name)
            self.recency.append(name)
            self._seen.note(name)
            if self._fill is not None and self._fill.job.component == name:
                return  # activated again while its units arrive: the gate still serves them
            self._finish_fill()
            switch = None
            if handle.host.spilled_to is not None:
                self._give_up_ahead_of(name)
                switch = self._start_fill(name)
            self._note_peak()
            self._read_ahead_after(name)
            if switch is not None:  # all of it kept the component from computing
                switch.wait_s += disk_reads.clock() - started

    @staticmethod
    def _how_to_read(source: WeightSource | None, current: bool) -> HowToRead:
        """Straight from the weight files when they still hold the component's bytes (``current``: no
        edit through ``editing`` since it moved out; and no direct write into the views its tensors
        point at), else by copying from those views."""
        if source is None:
            return HowToRead(None, False)
        written = not source.views_unwritten()
        return HowToRead(source.read_into if current and not written else None, written)

    def _forget_files(self, name: str) -> None:
        """The weight files no longer hold ``name``'s bytes (written into while it waited): from its next
        move out on, it waits in a cache file."""
        if self.sources.pop(name, None) is not None:
            logger.info(
                "host tier: %s was written into while it waited in its weight files; a cache file holds it from now on",
                name,
            )

    def _new_job(self, name: str) -> ReadJob:
        """A read of ``name``'s units (on disk now), in the order it will need them; nothing allowed yet."""
        handle = self.handles[name]
        host_copies = handle.host
        source = self.sources.get(name)
        plan = functools.partial(self._how_to_read, source, host_copies.spill_is_current)
        return ReadJob(name, host_copies, read_order(handle), plan, self.pin)

    def _start_fill(self, name: str) -> Switch:
        """``name`` waits on disk and becomes active: room for all of it, its read going on (from its read
        ahead, unless that is stale) and its gate set; no byte is waited for here."""
        host_copies = self.handles[name].host
        source = self.sources.get(name)
        ahead = self._ahead.pop(name, None)
        try:
            if source is not None:
                source.check()  # a changed file is refused before anything moves
        except BaseException:
            if ahead is not None:
                self._reader.give_up(ahead.job)
            raise
        job = ahead.job if ahead is not None else None
        if job is not None and self._stale(job, source):
            self._reader.give_up(job)
            job = None
        fresh = job is None
        if fresh:  # a new job runs after those queued: none may pause before it
            self._give_up_ahead()
            job = self._new_job(name)
        switch = Switch(name, host_copies.packed_bytes, read_ahead_bytes=job.read_bytes)
        fill = Fill(job, switch, source)
        fill.gate = FillGate(len(job.nbytes), functools.partial(self._arrive, fill))
        self._fill = fill
        host_copies.host_gate = fill.gate
        self.switches.append(switch)
        try:
            self._make_room({name}, host_copies.packed_bytes - job.reserved_bytes)
            job.allow(host_copies.packed_bytes)
            if fresh:
                self._reader.start(job)
        except BaseException:
            self._give_up_fill()
            raise
        logger.info(
            "host tier: %s becomes active while it is read from disk (%s of %s read ahead)",
            name,
            format_bytes(switch.read_ahead_bytes),
            format_bytes(switch.nbytes),
        )
        return switch

    def _stale(self, job: ReadJob, source: WeightSource | None) -> bool:
        """A read ahead whose bytes may no longer be the component's: an edit since it began (the edit is in
        the stand-ins), a direct write into the weight-file views it did not read from, or a failure."""
        if job.error is not None or not job.host_copies.spill_is_current:
            return True
        how = job.how
        if how is None or how.read is None or source is None:
            return False
        return not source.views_unwritten()

    def _arrive(self, fill: Fill, position: int) -> None:
        """The gate, for a unit not taken yet: wait for the reader to deliver it and adopt its buffer; the
        last one ends the read back. A failed read gives the read back up (the component stays on disk as it
        was) and raises."""
        with self._lock:
            gate = fill.gate
            if self._fill is not fill or gate is None or not gate.pending[position]:
                return
            begin = disk_reads.clock()
            try:
                unit = fill.job.wait_for(position)
            except Exception as exc:
                fill.switch.wait_s += disk_reads.clock() - begin
                self._give_up_fill()
                error = read_error(fill.job.component, exc)
                if error is exc:
                    raise
                raise error from exc
            fill.switch.wait_s += disk_reads.clock() - begin
            assert unit is not None, "a read back stopped while its component still needs it"
            fill.job.host_copies.take_unit(unit)
            fill.job.taken_bytes += unit.nbytes
            gate.took(position)
            if gate.left == 0:
                self._end_fill(fill)

    def _end_fill(self, fill: Fill) -> None:
        job, switch = fill.job, fill.switch
        self._fill = None
        if job.host_copies.host_gate is fill.gate:
            job.host_copies.host_gate = None
        switch.read_s, switch.complete = job.read_s, True
        if fill.source is not None:
            fill.source.read_done()
        if job.how is not None and job.how.written:
            self._forget_files(job.component)
        logger.info(
            "host tier: %s read from disk in %.3f s (%s read ahead), waited %.3f s",
            job.component,
            switch.read_s,
            format_bytes(switch.read_ahead_bytes),
            switch.wait_s,
        )
        if switch.wait_s >= SLOW_SWITCH_S and job.component not in self._warned_slow:
            self._warn_slow(job.component, switch)

    def _warn_slow(self, name: str, switch: Switch) -> None:
        """Once per component: a switch waited long for disk, and the host budget its forecast says would hide it."""
        forecast = next((f for f in self.forecasts() if f.component == name), None)
        if forecast is None or forecast.hidden_from_host_budget <= self.budget:
            return  # no plan yet to forecast with, or a wait this budget should not see again
        self._warned_slow.add(name)
        logger.warning(
            "host tier: %s waited %.1f s for its weights from disk (%.2f GB/s, %s of %s read ahead); a host budget "
            "of %s would hide that (flextensor_report() forecasts each switch)",
            name,
            switch.wait_s,
            forecast.disk_gbps,
            format_bytes(switch.read_ahead_bytes),
            format_bytes(switch.nbytes),
            format_bytes(forecast.hidden_from_host_budget),
        )

    def _finish_fill(self) -> None:
        """Complete the read back of the component before (inactive now): every unit taken, in order. A
        failure gives it up, with a warning: that component is not the one needed now."""
        fill = self._fill
        if fill is None or fill.gate is None:
            return
        try:
            for position in fill.job.order:
                if self._fill is fill and fill.gate.pending[position]:
                    self._arrive(fill, position)
        except FlexTensorError as exc:
            logger.warning("host tier: %s", exc)

    def _give_up_fill(self) -> None:
        """Stop the read back under way between units: what was taken goes back to the stand-ins, which
        hold the same bytes, what was read is freed, and the component is spilled as it was."""
        fill, self._fill = self._fill, None
        if fill is None:
            return
        host_copies = fill.job.host_copies
        if host_copies.host_gate is fill.gate:
            host_copies.host_gate = None
        self._reader.give_up(fill.job)
        host_copies.untake_units(fill.job.hosts)
        fill.switch.read_s = fill.job.read_s
        logger.info("host tier: the read of %s from disk was given up; it stays on disk", fill.job.component)

    def _give_up_ahead(self) -> None:
        for name in list(self._ahead):
            self._give_up_read_ahead(name)

    def _give_up_ahead_of(self, name: str) -> None:
        """``name`` becomes active: the read aheads queued before its own were wrong guesses (and one paused
        for room would hold the reader up); all are when it has none (its read is queued after them)."""
        for other in list(self._ahead):
            if other == name:
                return
            self._give_up_read_ahead(other)

    def _give_up_read_ahead(self, name: str) -> None:
        self._reader.give_up(self._ahead.pop(name).job)
        logger.debug("host tier: the read ahead of %s was given up", name)

    def _read_ahead_after(self, active: str) -> None:
        """Read the components expected after ``active`` that wait on disk, unedited since, in the order
        expected, as far as the budget allows next to ``active``: the first one all of it when it fits (others
        may move out, but none expected before it), then the next ones in what room is left (the small VAE,
        then the next generation's first expert). Read aheads kept from before are topped up; a new one is
        only queued behind them when they are the chain's first components in order."""
        chain = self._seen.expected_chain(active, self.handles)
        wanted = [name for name in chain if self._may_read_ahead(name)]
        if list(self._ahead) != wanted[: len(self._ahead)]:
            self._give_up_ahead()  # out of order: a paused one would hold a later one up
        for position, name in enumerate(wanted):
            host_copies = self.handles[name].host
            ahead = self._ahead.get(name)
            if position == 0:  # never moves out one expected before it
                missing = host_copies.packed_bytes - (ahead.job.reserved_bytes if ahead is not None else 0)
                try:
                    self._make_room({active, *chain[: chain.index(name) + 1]}, missing)
                except FlexTensorError as exc:  # reading ahead is optional: the component is read when it runs
                    logger.warning("host tier: no read ahead of %s: %s", name, exc)
            room = self.weights_budget - self.ram_bytes()
            if ahead is not None:
                ahead.job.allow_more(room)
                continue
            job = self._new_job(name)
            if room <= 0 or job.units_within(room) == 0:
                return
            job.allow(room)
            self._ahead[name] = ReadAhead(job)
            self._reader.start(job)
            self._note_peak()
            logger.debug(
                "host tier: reading %s ahead while %s runs (%s of %s)",
                name,
                active,
                format_bytes(min(room, host_copies.packed_bytes)),
                format_bytes(host_copies.packed_bytes),
            )

    def _may_read_ahead(self, name: str) -> bool:
        """``name`` waits on disk, not active, unedited since it moved out, and its files unchanged."""
        handle = self.handles[name]
        host_copies = handle.host
        if host_copies.spilled_to is None or handle.active or not host_copies.spill_is_current:
            return False
        source = self.sources.get(name)
        return source is None or source.changed_file() is None  # a changed one is refused when it is needed

    def _readings(self) -> list[Fill | ReadAhead]:
        """The reads under way: the active component's read back, then the read aheads in order."""
        return [r for r in [self._fill, *self._ahead.values()] if r is not None]

    # ------------------------------------------------------------------------------------ room

    def _movable(self, name: str, keep: set[str]) -> bool:
        handle = self.handles[name]
        return name not in keep and handle.host.spilled_to is None and not handle.active

    def _freed_by_moving(self, name: str) -> int:
        source = self.sources.get(name)
        held = source.ram_bytes if source is not None else 0
        return self.handles[name].host.host_ram_bytes - held

    def _make_room(self, keep: set[str], nbytes: int, required: bool = True) -> bool:
        """Move least recently used components out (never those in ``keep`` nor an active one) until
        ``nbytes`` more fit. ``required=False``: move nothing unless that makes them fit."""
        if not required:
            movable = sum(self._freed_by_moving(n) for n in self.recency if self._movable(n, keep))
            if self.ram_bytes() + nbytes - movable > self.weights_budget:
                return False
        for other in list(self.recency):
            if self.ram_bytes() + nbytes <= self.weights_budget:
                return True
            if self._movable(other, keep):
                self._move_out(other)
        return self.ram_bytes() + nbytes <= self.weights_budget

    def _move_out(self, name: str) -> None:
        handle = self.handles[name]
        host_copies = handle.host
        source = self.sources.get(name)
        if source is not None and host_copies.spill_is_current:
            hosts = source.hosts(host_copies.positions)
            if hosts is not None:
                host_copies.spill(source.where, hosts=list(hosts), held_bytes=source.ram_bytes)
                logger.info("host tier: %s moved out to its weight files (%s)", name, source.where)
                return
            logger.warning(
                "host tier: a weight file of %s changed since offload was enabled; it moves to a cache file instead",
                name,
            )
        if source is not None:  # edited since (or its files changed): they no longer hold its bytes
            del self.sources[name]
        path = self.folder / f"{name}-{handle.fingerprint['sha256'][:16]}-{os.getpid()}.bin"
        host_copies.spill(path)
        if path not in self._files:
            self._files.append(path)
        logger.info("host tier: %s moved to disk (%s)", name, format_bytes(host_copies.packed_bytes))

    def _note_peak(self) -> None:
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes())

    # ------------------------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        """Budget and where it went (the process's own memory at enable, the reserve, the host copies'
        share), RAM, per component its bytes, where it is, where it waits and its reads; per switch the
        read, the wait, what was read ahead and the read's bandwidth; disk read bandwidth; the forecast
        of each switch that reads from disk (`forecasts`)."""
        with self._lock:
            if self._fill is not None:
                self._fill.switch.read_s = self._fill.job.read_s
            read_s = sum(s.read_s for s in self.switches)
            nbytes = sum(s.nbytes for s in self.switches)
            components = {}
            for name, handle in self.handles.items():
                mine = [s for s in self.switches if s.component == name]
                components[name] = {
                    "bytes": handle.host.packed_bytes,
                    "host": "disk" if handle.host.spilled_to is not None else "ram",
                    "source": WEIGHTS_FILES if name in self.sources else CACHE_FILE,
                    "reads": len(mine),
                    "disk_read_s": round(sum(s.read_s for s in mine), 4),
                    "wait_s": round(sum(s.wait_s for s in mine), 4),
                    "read_ahead_bytes": sum(s.read_ahead_bytes for s in mine),
                }
            return {
                "host_budget_bytes": self.budget,
                "process_own_bytes": self.overhead.own_bytes,
                "host_reserve_bytes": self.overhead.reserve_bytes,
                "weights_budget_bytes": self.weights_budget,
                "host_ram_bytes": self.ram_bytes(),
                "peak_host_ram_bytes": self.peak_ram_bytes,
                "on_disk": [n for n, c in components.items() if c["host"] == "disk"],
                "disk_reads_s": [round(s.read_s, 4) for s in self.switches],
                "disk_read_s": round(read_s, 4),
                "wait_s": round(sum(s.wait_s for s in self.switches), 4),
                "hidden_s": round(sum(s.hidden_s for s in self.switches), 4),
                "read_ahead_bytes": sum(s.read_ahead_bytes for s in self.switches),
                "disk_read_gbps": round(nbytes / read_s / 1e9, 3) if read_s > 0 else None,
                "switches": [s.as_dict() for s in self.switches],
                "reading": [self._reading(r) for r in self._readings()],
                "forecasts": [f.as_dict() for f in self.forecasts()],
                "cache_folder": str(self.folder),
                "components": components,
            }

    def forecasts(self) -> list[SwitchForecast]:
        """A `SwitchForecast` per switch seen so far whose two components do not fit in RAM together (so the
        second waits on disk), once reads have measured the disk and the component has a plan."""
        with self._lock:
            done = [s for s in self.switches if s.complete and s.read_s > 0]
            if not done:
                return []
            gbps = sum(s.nbytes for s in done) / sum(s.read_s for s in done) / 1e9
            before_of = {after: name for name, after in self._seen.seen_after.items()}
            forecasts = []
            for name, handle in self.handles.items():
                nbytes = handle.host.packed_bytes
                after, passed = before_of.get(name), {name}
                while after is not None and after not in passed and self._bytes(after) + nbytes <= self.weights_budget:
                    passed.add(after)  # small enough to run next to it: the read ahead goes on meanwhile
                    after = before_of.get(after)
                if after is None or after in passed or handle.plan is None:
                    continue
                forward_s = handle.plan.predicted_ms / 1e3
                forecasts.append(SwitchForecast.of(name, after, nbytes, self._bytes(after), self, gbps, forward_s))
            return forecasts

    def _bytes(self, name: str) -> int:
        return self.handles[name].host.packed_bytes

    def _reading(self, reading: Fill | ReadAhead) -> dict[str, Any]:
        """A read under way: the component, whether it is active, and bytes read, allowed and in all."""
        job = reading.job
        total = sum(job.nbytes)
        return {
            "component": job.component,
            "kind": "read back" if isinstance(reading, Fill) else "read ahead",
            "read_bytes": job.read_bytes,
            "allowed_bytes": min(job.allowed, total),
            "nbytes": total,
        }

    # ------------------------------------------------------------------------------------ the end

    def stop(self) -> None:
        """Before offload is disabled: give up the reads under way (a component still arriving goes back to
        disk as it was), and check the weight files of components waiting in them, which removal reads their
        weights back from. A changed file is restored as it is now (a warning says so); a truncated one
        would fault, so it is refused."""
        with self._lock:
            self._give_up_fill()  # first: a read ahead queued behind it is then skipped at once
            self._give_up_ahead()
            for name, source in self.sources.items():
                if self.handles[name].host.spilled_to is None:
                    continue
                truncated = source.truncated_file()
                if truncated is not None:
                    raise FlexTensorError(
                        f"the weight file {truncated} was truncated while {name} waited in it, so {name}'s weights "
                        "are lost: load the pipeline again"
                    )
                changed = source.changed_file()
                if changed is not None:
                    logger.warning(
                        "host tier: %s changed since offload was enabled; %s's weights are restored from it as it is",
                        changed,
                        name,
                    )

    def close(self) -> None:
        """Join the reader threads and delete the cache files (called once every handle is removed);
        the weight files' pages the removal read are dropped from the page cache."""
        with self._lock:
            self._give_up_fill()
            self._give_up_ahead()
            self._reader.close()
            for path in self._files:
                path.unlink(missing_ok=True)
            self._files = []
            for source in self.sources.values():
                source.read_done()
            if not any(self.folder.iterdir()) and self.folder.name == "flextensor-cache":
                shutil.rmtree(self.folder, ignore_errors=True)


def format_host_tier(tier: dict[str, Any]) -> list[str]:
    """The host tier's lines of the offload report: where the host budget went, a summary, then one row per
    component."""
    disk = ", ".join(tier["on_disk"]) or "none"
    gbps = f" at {tier['disk_read_gbps']:.2f} GB/s" if tier.get("disk_read_gbps") else ""
    lines = [
        f"host budget {format_bytes(tier['host_budget_bytes'])}: the process's own memory at enable "
        f"{format_bytes(tier['process_own_bytes'])}, reserve {format_bytes(tier['host_reserve_bytes'])}, "
        f"host copies {format_bytes(tier['weights_budget_bytes'])}",
        f"host copies in RAM {format_bytes(tier['host_ram_bytes'])} of {format_bytes(tier['weights_budget_bytes'])} "
        f"(peak {format_bytes(tier['peak_host_ram_bytes'])}); on disk now: {disk}; "
        f"{len(tier['disk_reads_s'])} reads from disk, {tier['disk_read_s']:.2f} s{gbps}, "
        f"waited {tier['wait_s']:.2f} s ({tier['hidden_s']:.2f} s hidden: "
        f"{format_bytes(tier.get('read_ahead_bytes', 0))} read ahead, the rest while computing)",
    ]
    rows = [("host copies", "bytes", "now", "waits in", "reads", "read ahead", "read s", "wait s")]
    for name, c in tier["components"].items():
        rows.append(
            (
                name,
                format_bytes(c["bytes"]),
                c["host"],
                c["source"],
                str(c["reads"]),
                format_bytes(c.get("read_ahead_bytes", 0)),
                f"{c['disk_read_s']:.2f}",
                f"{c['wait_s']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(w) if i in (0, 2, 3) else cell.rjust(w) for i, (cell, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    for f in tier.get("forecasts", []):
        hidden = (
            "hidden at this budget"
            if f["wait_s"] == 0
            else f"hidden from a host budget of {format_bytes(f['hidden_from_host_budget'])}"
        )
        lines.append(
            f"forecast: {f['after']} -> {f['component']}: {format_bytes(f['read_ahead_bytes'])} of "
            f"{format_bytes(f['nbytes'])} read ahead, ~{f['wait_s']:.3g} s waited at {f['disk_gbps']:.2f} GB/s "
            f"(one forward of {f['forward_s']:.2f} s overlaps the rest); {hidden}"
        )
    return lines
