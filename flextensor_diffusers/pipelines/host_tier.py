"""A host-memory budget for a pipeline: components whose host copies do not fit in RAM wait on disk.

A diffusers pipeline runs its components one after the other (Wan2.2: the text encoder once, the
high-noise expert for the first steps, the low-noise expert after the boundary, the VAE), and
only the active component needs its weights in host RAM, to stream them to the GPU. So the host
copies of the components that are not running can wait on disk: `HostTier` keeps as many
components in (pinned) RAM as ``host_budget`` allows, and before a component on disk becomes active
it moves the least recently used ones out until the component fits, then reads it back.

Where a component waits:

* **its own weight files** when it was loaded with ``from_pretrained`` from a local folder and every
  packed tensor's bytes are in the folder's ``*.safetensors`` files, unconverted (`weight_files`):
  moving it out writes nothing, its tensors become views of private copy-on-write mappings of
  those files, and reading it back is large ``preadv`` reads on several threads. The files are
  stamped when offload is enabled; a changed file is refused before it is read. An edit made since
  (``load_state_dict``, a LoRA) means the files no longer hold its bytes: from the next move out on,
  it waits in a cache file.
* **a cache file** in ``cache_dir`` otherwise, written when it first moves out and kept, unwritten
  again, until an edit.

While a component becomes active, the tier starts reading the one expected next on a background
thread (`Prefetcher`), when that one waits on disk and fits in the budget next to the active one
(others may move out, never the active one): the order is the one seen last time, else the
pipeline's declared ``model_cpu_offload_seq``. Each switch records how long the read took and how
long `bring_in` waited for it; the difference is what prefetching hid. ``report()`` has them.

The smallest workable host budget is the largest component's packed weights. Host RAM here is
what the package allocates for host copies (page-locked or not) and the read ahead; mappings of
files are file-backed pages the kernel may drop at any time. An edit made while a component waits
in its weight files lives in anonymous copy-on-write pages, not counted, until it is read back.

Not built yet: streaming single blocks from disk for a component larger than the host budget (and
so reading an expert while the other one runs, which needs both in the budget today), O_DIRECT /
GPUDirect Storage (kvikio) reads, and finding the weight files of a pipeline loaded from a hub id
(only local folders are looked up).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..engine import format_bytes
from ..engine.config import is_auto, parse_bytes
from ..engine.errors import FlexTensorError, HostBudgetError
from .weight_files import WeightSource, component_folders, pipeline_folder

if TYPE_CHECKING:
    from ..engine import OffloadHandle
    from ..engine.units import Unit

__all__ = [
    "HostTier",
    "cache_folder",
    "check_host_budget",
    "format_host_tier",
    "kept_in_ram_bytes",
    "offload_order",
    "pipeline_folder",
    "resolve_host_budget",
]

logger = logging.getLogger(__name__)

#: What ``host_budget="auto"`` takes: this share of the RAM available when offload is enabled.
AUTO_HOST_SHARE = 0.8
WEIGHTS_FILES, CACHE_FILE = "weights files", "cache file"


def resolve_host_budget(host_budget: int | str) -> int:
    """Bytes of host RAM for host copies; ``"auto"``: `AUTO_HOST_SHARE` of the RAM available now."""
    if is_auto(host_budget):
        import psutil

        return int(psutil.virtual_memory().available * AUTO_HOST_SHARE)
    return parse_bytes(host_budget)


def check_host_budget(
    host_budget: int, component_bytes: dict[str, int], kept_bytes: dict[str, int] | None = None
) -> None:
    """Refuse a host budget under the largest component's packed weights (plus what the others keep in
    RAM while they wait in their weight files, ``kept_bytes``), naming the smallest workable one."""
    kept = kept_bytes or {}
    need = {n: b + sum(kept.get(o, 0) for o in component_bytes if o != n) for n, b in component_bytes.items()}
    name = max(component_bytes, key=lambda n: component_bytes[n])
    smallest = max(need.values())
    if host_budget < smallest:
        raise HostBudgetError(
            f"host_budget {format_bytes(host_budget)} cannot hold the largest component, {name} "
            f"({format_bytes(component_bytes[name])}), which must be in RAM while it runs: the smallest workable host "
            f"budget is {format_bytes(smallest)}",
            required_bytes=smallest,
        )


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


def cache_folder(cache_dir: str | Path | None) -> Path:
    """The folder for cache files (created); refused at once when it cannot be written."""
    folder = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "flextensor-cache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FlexTensorError(
            f"cannot create the weight cache folder {folder} ({exc}): pass another cache_dir"
        ) from exc
    if not os.access(folder, os.W_OK):
        raise FlexTensorError(f"the weight cache folder {folder} is not writable: pass another cache_dir")
    return folder


def offload_order(pipeline: Any) -> list[str]:
    """The order the pipeline declares its components run in (diffusers' ``model_cpu_offload_seq``,
    e.g. ``"text_encoder->transformer->transformer_2->vae"``)."""
    seq = getattr(pipeline, "model_cpu_offload_seq", None)
    return [name.strip() for name in seq.split("->") if name.strip()] if isinstance(seq, str) else []


@dataclass
class Switch:
    """One component read back from disk before it ran."""

    component: str
    nbytes: int
    read_s: float  # how long the read took (on the background thread when prefetched)
    wait_s: float  # how long `bring_in` kept the component from running
    prefetched: bool

    @property
    def hidden_s(self) -> float:
        """Read time spent while another component computed."""
        return max(0.0, self.read_s - self.wait_s)


@dataclass(frozen=True)
class HowToRead:
    """How a component waiting in its weight files is read back."""

    read: Callable[[int, Any], None] | None  # straight from the files (None: copy from its tensors' views)
    written: bool  # its views were written into: the files no longer hold its bytes


@dataclass
class ReadAhead:
    """What a background read hands back: the units' new buffers (see `Residency.read_back`)."""

    units: list[Unit]
    seconds: float
    written: bool  # the component's weight-file views were written into: the files no longer hold its bytes


@dataclass
class PrefetchJob:
    """The background read of one component: its reserved bytes count against the host budget."""

    component: str
    nbytes: int
    future: Future[ReadAhead | None]
    stop: threading.Event


class Prefetcher:
    """At most one background read at a time, on one thread of its own; no busy waiting anywhere."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self.job: PrefetchJob | None = None

    @property
    def reserved_bytes(self) -> int:
        return self.job.nbytes if self.job is not None else 0

    def start(self, component: str, nbytes: int, work: Callable[[Callable[[], bool]], ReadAhead | None]) -> None:
        """Run ``work(stopped)`` on the prefetch thread; ``stopped()`` turns true when it is given up."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="flextensor-prefetch")
        stop = threading.Event()
        self.job = PrefetchJob(component, nbytes, self._pool.submit(work, stop.is_set), stop)

    def take(self) -> PrefetchJob | None:
        """The job, no longer this prefetcher's (its bytes are the caller's from now on)."""
        job, self.job = self.job, None
        return job

    def give_up(self) -> PrefetchJob | None:
        """Stop the job (it stops between units), wait for it and return it; its failure is not raised."""
        job = self.take()
        if job is not None:
            job.stop.set()
            try:
                job.future.result()
            except Exception as exc:  # the component is read again, and its error raised, when it is needed
                logger.debug("host tier: a read ahead of %s that was given up failed: %s", job.component, exc)
        return job

    def close(self) -> None:
        """Join the thread (the caller gave the job up first: it frees what the job read)."""
        assert self.job is None, "give_up() the job first"
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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
    """Which components' host copies are in RAM, under ``budget``; the rest wait on disk (their own
    weight files, else cache files in ``folder``). Thread-safe: one lock around its state; the
    prefetch thread only reads a component's bytes into new buffers and touches no state here."""

    budget: int
    folder: Path
    pin: bool
    weights_root: Path | None = None  # the pipeline's folder, where its components' folders are
    order: list[str] = field(default_factory=list)  # the pipeline's declared order (`offload_order`)
    handles: dict[str, OffloadHandle] = field(default_factory=dict)
    recency: list[str] = field(default_factory=list)  # least recently active first
    peak_ram_bytes: int = 0
    switches: list[Switch] = field(default_factory=list)
    sources: dict[str, WeightSource] = field(default_factory=dict)  # components that wait in their own files
    _files: list[Path] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _prefetch: Prefetcher = field(default_factory=Prefetcher, repr=False)
    _seen: ComponentOrder = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seen = ComponentOrder(self.order)

    @property
    def reads(self) -> list[Switch]:
        """Every read from disk, in order (an alias of ``switches``)."""
        return self.switches

    def ram_bytes(self) -> int:
        """Host RAM of the host copies now, and of the read ahead under way."""
        with self._lock:
            return sum(h.residency.host_ram_bytes for h in self.handles.values()) + self._prefetch.reserved_bytes

    # ------------------------------------------------------------------------------------ set-up

    def add(self, name: str, handle: OffloadHandle) -> None:
        """Track a component just packed (in RAM): find its weight files, then move others to disk if
        it does not fit with them."""
        with self._lock:
            self.handles[name] = handle
            self.recency.append(name)
            folders = component_folders(name, handle.model, self.weights_root)
            residency = handle.residency
            source = WeightSource.find(name, folders, [residency.base, *residency.units]) if folders else None
            if source is not None:
                self.sources[name] = source
                residency.mark_spill_current()
            self._make_room({name}, 0)  # it is in RAM already: the others move out until all fit
            self._note_peak()

    def room_for_packing(self, nbytes: int) -> None:
        """Before a component of ``nbytes`` is packed: move others to disk until it fits."""
        with self._lock:
            self._make_room(set(), nbytes)

    # ------------------------------------------------------------------------------------ switches

    def bring_in(self, handle: OffloadHandle) -> None:
        """Before ``handle`` becomes active: its host copies in RAM (from the read ahead when one was
        started for it), others moved out as needed; then the read ahead of the next one starts."""
        started = time.perf_counter()
        with self._lock:
            name = next(n for n, h in self.handles.items() if h is handle)
            self.recency.remove(name)
            self.recency.append(name)
            self._seen.note(name)
            job = self._prefetch.job
            if job is not None and (job.component != name or handle.residency.spilled_to is None):
                self._give_up_prefetch()  # guessed wrong: its bytes go
                job = None
            if handle.residency.spilled_to is not None:
                if job is not None:
                    self._take_read_ahead(name, started)
                else:
                    self._read_now(name, started)
            self._note_peak()
            self._read_ahead_after(name)

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

    def _read_now(self, name: str, started: float) -> None:
        residency = self.handles[name].residency
        source = self.sources.get(name)
        if source is not None:
            source.check()  # a changed file is refused before anything moves
        self._make_room({name}, residency.packed_bytes)
        how = self._how_to_read(source, residency.spill_is_current)
        begin = time.perf_counter()
        residency.fill(self.pin, how.read)
        read_s = time.perf_counter() - begin
        if source is not None:
            source.read_done()
        if how.written:
            self._forget_files(name)
        self.switches.append(Switch(name, residency.packed_bytes, read_s, time.perf_counter() - started, False))
        logger.info("host tier: %s read from disk in %.3f s", name, read_s)

    def _take_read_ahead(self, name: str, started: float) -> None:
        residency = self.handles[name].residency
        job = self._prefetch.take()
        assert job is not None
        result = job.future.result()  # waits for the read; a failure on the thread is raised here
        if result is None or not residency.spill_is_current:  # edited since the read began: its bytes are stale
            if result is not None:
                residency.drop_read(result.units)
            self._read_now(name, started)
            return
        residency.take_back(result.units, self.pin)
        self._make_room({name}, 0)  # its bytes were reserved when the read began: nothing should move
        if result.written:
            self._forget_files(name)
        wait_s = time.perf_counter() - started
        self.switches.append(Switch(name, residency.packed_bytes, result.seconds, wait_s, True))
        logger.info("host tier: %s read ahead in %.3f s, waited %.3f s", name, result.seconds, wait_s)

    def _read_ahead_after(self, active: str) -> None:
        """Start reading the component expected after ``active`` on the prefetch thread, when it waits
        on disk, is unedited since, and fits in the budget without moving ``active`` out."""
        name = self._seen.expected_after(active, self.handles)
        if name is None or name == active:
            return
        handle = self.handles[name]
        residency = handle.residency
        if residency.spilled_to is None or handle.active or not residency.spill_is_current:
            return
        nbytes = residency.packed_bytes
        if not self._make_room({active, name}, nbytes, required=False):
            return
        source = self.sources.get(name)
        pin = self.pin

        def work(stopped: Callable[[], bool]) -> ReadAhead | None:
            begin = time.perf_counter()
            if source is not None:
                source.check()
            how = self._how_to_read(source, current=True)  # current: checked before it started, and when taken
            units = residency.read_back(pin, how.read, stopped)
            if units is None:
                return None
            if source is not None:
                source.read_done()
            return ReadAhead(units, time.perf_counter() - begin, how.written)

        self._prefetch.start(name, nbytes, work)
        self._note_peak()
        logger.debug("host tier: reading %s ahead while %s runs", name, active)

    def _give_up_prefetch(self) -> None:
        job = self._prefetch.give_up()
        if job is None or job.future.exception() is not None:
            return
        result = job.future.result()
        if result is not None:
            self.handles[job.component].residency.drop_read(result.units)

    # ------------------------------------------------------------------------------------ room

    def _movable(self, name: str, keep: set[str]) -> bool:
        handle = self.handles[name]
        return name not in keep and handle.residency.spilled_to is None and not handle.active

    def _freed_by_moving(self, name: str) -> int:
        source = self.sources.get(name)
        held = source.ram_bytes if source is not None else 0
        return self.handles[name].residency.host_ram_bytes - held

    def _make_room(self, keep: set[str], nbytes: int, required: bool = True) -> bool:
        """Move least recently used components out (never those in ``keep`` nor an active one) until
        ``nbytes`` more fit. ``required=False``: move nothing unless that makes them fit."""
        if not required:
            movable = sum(self._freed_by_moving(n) for n in self.recency if self._movable(n, keep))
            if self.ram_bytes() + nbytes - movable > self.budget:
                return False
        for other in list(self.recency):
            if self.ram_bytes() + nbytes <= self.budget:
                return True
            if self._movable(other, keep):
                self._move_out(other)
        return self.ram_bytes() + nbytes <= self.budget

    def _move_out(self, name: str) -> None:
        handle = self.handles[name]
        residency = handle.residency
        source = self.sources.get(name)
        if source is not None and residency.spill_is_current:
            hosts = source.hosts([residency.base, *residency.units])
            if hosts is not None:
                residency.spill(source.where, hosts=list(hosts), held_bytes=source.ram_bytes)
                logger.info("host tier: %s moved out to its weight files (%s)", name, source.where)
                return
            logger.warning(
                "host tier: a weight file of %s changed since offload was enabled; it moves to a cache file instead",
                name,
            )
        if source is not None:  # edited since (or its files changed): they no longer hold its bytes
            del self.sources[name]
        path = self.folder / f"{name}-{handle.fingerprint['sha256'][:16]}-{os.getpid()}.bin"
        residency.spill(path)
        if path not in self._files:
            self._files.append(path)
        logger.info("host tier: %s moved to disk (%s)", name, format_bytes(residency.packed_bytes))

    def _note_peak(self) -> None:
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes())

    # ------------------------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        """Budget, RAM, per component its bytes, where it is, where it waits and its reads; per switch
        the read and the wait; disk read bandwidth."""
        with self._lock:
            read_s = sum(s.read_s for s in self.switches)
            nbytes = sum(s.nbytes for s in self.switches)
            components = {}
            for name, handle in self.handles.items():
                mine = [s for s in self.switches if s.component == name]
                components[name] = {
                    "bytes": handle.residency.packed_bytes,
                    "host": "disk" if handle.residency.spilled_to is not None else "ram",
                    "source": WEIGHTS_FILES if name in self.sources else CACHE_FILE,
                    "reads": len(mine),
                    "disk_read_s": round(sum(s.read_s for s in mine), 4),
                    "wait_s": round(sum(s.wait_s for s in mine), 4),
                }
            return {
                "host_budget_bytes": self.budget,
                "host_ram_bytes": self.ram_bytes(),
                "peak_host_ram_bytes": self.peak_ram_bytes,
                "on_disk": [n for n, c in components.items() if c["host"] == "disk"],
                "disk_reads_s": [round(s.read_s, 4) for s in self.switches],
                "disk_read_s": round(read_s, 4),
                "wait_s": round(sum(s.wait_s for s in self.switches), 4),
                "hidden_s": round(sum(s.hidden_s for s in self.switches), 4),
                "disk_read_gbps": round(nbytes / read_s / 1e9, 3) if read_s > 0 else None,
                "switches": [
                    {**asdict(s), "read_s": round(s.read_s, 4), "wait_s": round(s.wait_s, 4)} for s in self.switches
                ],
                "cache_folder": str(self.folder),
                "components": components,
            }

    # ------------------------------------------------------------------------------------ the end

    def stop(self) -> None:
        """Before offload is disabled: give up the read ahead, and check the weight files of components
        waiting in them, which removal reads their weights back from. A changed file is restored as it
        is now (a warning says so); a truncated one would fault, so it is refused."""
        with self._lock:
            self._give_up_prefetch()
            for name, source in self.sources.items():
                if self.handles[name].residency.spilled_to is None:
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
        """Join the prefetch thread and delete the cache files (called once every handle is removed);
        the weight files' pages the removal read are dropped from the page cache."""
        with self._lock:
            self._give_up_prefetch()
            self._prefetch.close()
            for path in self._files:
                path.unlink(missing_ok=True)
            self._files = []
            for source in self.sources.values():
                source.read_done()
            if not any(self.folder.iterdir()) and self.folder.name == "flextensor-cache":
                shutil.rmtree(self.folder, ignore_errors=True)


def format_host_tier(tier: dict[str, Any]) -> list[str]:
    """The host tier's lines of the offload report: a summary, then one row per component."""
    disk = ", ".join(tier["on_disk"]) or "none"
    gbps = f" at {tier['disk_read_gbps']:.2f} GB/s" if tier.get("disk_read_gbps") else ""
    lines = [
        f"host RAM {format_bytes(tier['host_ram_bytes'])} of {format_bytes(tier['host_budget_bytes'])} "
        f"(peak {format_bytes(tier['peak_host_ram_bytes'])}); on disk now: {disk}; "
        f"{len(tier['disk_reads_s'])} reads from disk, {tier['disk_read_s']:.2f} s{gbps}, "
        f"waited {tier['wait_s']:.2f} s ({tier['hidden_s']:.2f} s hidden by reading ahead)"
    ]
    rows = [("host copies", "bytes", "now", "waits in", "reads", "read s", "wait s")]
    for name, c in tier["components"].items():
        rows.append(
            (
                name,
                format_bytes(c["bytes"]),
                c["host"],
                c["source"],
                str(c["reads"]),
                f"{c['disk_read_s']:.2f}",
                f"{c['wait_s']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(w) if i in (0, 2, 3) else cell.rjust(w) for i, (cell, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return lines
