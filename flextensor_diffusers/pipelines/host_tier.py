"""A host-memory budget for a pipeline: components whose host copies do not fit in RAM wait on disk.

A diffusers pipeline runs its components one after the other (Wan2.2: the text encoder once, the
high-noise expert for the first steps, the low-noise expert after the boundary, the VAE), and
only the active component needs its weights in host RAM, to stream them to the GPU. So the host
copies of the components that are not running can live in cache files: `HostTier` keeps as many
components in (pinned) RAM as ``host_budget`` allows, and before a component on disk becomes
active it moves the least recently used ones to disk until the component fits, then reads it back.

The smallest workable host budget is the largest component's packed weights. Host RAM here is
what the package allocates for host copies (page-locked or not); the mappings of spilled cache
files are file-backed pages the kernel may drop at any time.

Not built yet (issue 15): reading the next component before it is needed (each switch reads
synchronously), streaming single blocks from disk for a component larger than the host budget, and
reusing the safetensors files ``from_pretrained`` maps instead of writing a cache.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine import format_bytes
from ..engine.config import is_auto, parse_bytes
from ..engine.errors import FlexTensorError, HostBudgetError

if TYPE_CHECKING:
    from ..engine import OffloadHandle

logger = logging.getLogger(__name__)

#: What ``host_budget="auto"`` takes: this share of the RAM available when offload is enabled.
AUTO_HOST_SHARE = 0.8


def resolve_host_budget(host_budget: int | str) -> int:
    """Bytes of host RAM for host copies; ``"auto"``: `AUTO_HOST_SHARE` of the RAM available now."""
    if is_auto(host_budget):
        import psutil

        return int(psutil.virtual_memory().available * AUTO_HOST_SHARE)
    return parse_bytes(host_budget)


def check_host_budget(host_budget: int, component_bytes: dict[str, int]) -> None:
    """Refuse a host budget under the largest component's packed weights, naming the smallest one."""
    name, largest = max(component_bytes.items(), key=lambda kv: kv[1])
    if host_budget < largest:
        raise HostBudgetError(
            f"host_budget {format_bytes(host_budget)} cannot hold the largest component, {name} "
            f"({format_bytes(largest)}), which must be in RAM while it runs: the smallest workable host budget "
            f"is {format_bytes(largest)}",
            required_bytes=largest,
        )


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


@dataclass
class HostTier:
    """Which components' host copies are in RAM, under ``budget``; the rest wait in ``folder``."""

    budget: int
    folder: Path
    pin: bool
    handles: dict[str, OffloadHandle] = field(default_factory=dict)
    recency: list[str] = field(default_factory=list)  # least recently active first
    peak_ram_bytes: int = 0
    reads: list[tuple[str, float]] = field(default_factory=list)  # (component, seconds) per read from disk
    _files: list[Path] = field(default_factory=list)

    def ram_bytes(self) -> int:
        return sum(h.residency.host_ram_bytes for h in self.handles.values())

    def add(self, name: str, handle: OffloadHandle) -> None:
        """Track a component just packed (in RAM), moving others to disk if it does not fit with them."""
        self.handles[name] = handle
        self.recency.append(name)
        self._make_room(name, 0)  # it is in RAM already: the others move out until all fit
        self._note_peak()

    def room_for_packing(self, nbytes: int) -> None:
        """Before a component of ``nbytes`` is packed: move others to disk until it fits."""
        self._make_room(None, nbytes)

    def bring_in(self, handle: OffloadHandle) -> None:
        """Before ``handle`` becomes active: its host copies in RAM, others moved out as needed."""
        name = next(n for n, h in self.handles.items() if h is handle)
        self.recency.remove(name)
        self.recency.append(name)
        residency = handle.residency
        if residency.spilled_to is None:
            return
        self._make_room(name, residency.packed_bytes)
        start = time.perf_counter()
        residency.fill(self.pin)
        self.reads.append((name, time.perf_counter() - start))
        self._note_peak()

    def _make_room(self, keep: str | None, nbytes: int) -> None:
        for other in list(self.recency):
            if self.ram_bytes() + nbytes <= self.budget:
                return
            handle = self.handles[other]
            if other == keep or handle.residency.spilled_to is not None or handle.active:
                continue
            path = self.folder / f"{other}-{handle.fingerprint['sha256'][:16]}-{os.getpid()}.bin"
            handle.residency.spill(path)
            if path not in self._files:
                self._files.append(path)
            logger.info("host tier: %s moved to disk (%s)", other, format_bytes(handle.residency.packed_bytes))

    def _note_peak(self) -> None:
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes())

    def report(self) -> dict[str, object]:
        return {
            "host_budget_bytes": self.budget,
            "host_ram_bytes": self.ram_bytes(),
            "peak_host_ram_bytes": self.peak_ram_bytes,
            "on_disk": [n for n, h in self.handles.items() if h.residency.spilled_to is not None],
            "disk_reads_s": [round(s, 4) for _, s in self.reads],
            "cache_folder": str(self.folder),
        }

    def close(self) -> None:
        """Delete the cache files (called once every handle is removed)."""
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files = []
        if not any(self.folder.iterdir()) and self.folder.name == "flextensor-cache":
            shutil.rmtree(self.folder, ignore_errors=True)
