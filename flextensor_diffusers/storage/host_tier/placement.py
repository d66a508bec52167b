"""Where each component's host copies are, and which move out of RAM to make room for another.

Components are moved out least recently active first: the pipeline runs them in a cycle, so the one that
ran longest ago is the one needed furthest ahead. A component in its weight files moves out without a
write (its tensors become views of mappings of those files); any other is written to a cache file the
first time and kept there, unwritten again, until an edit.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from ...engine import format_bytes
from ...engine.errors import FlexTensorError, HostBudgetError
from ..host_budget import HostOverhead
from ..locked_pool import LockedPool
from ..private_files import default_cache_folder
from ..raw_home import WeightFilesHome
from ..weight_files import WeightSource, component_folders
from .pool_room import PoolRoom
from .records import ReadRecords

if TYPE_CHECKING:
    from ...engine import OffloadHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierBudget:
    """The user's host budget (the whole process's anonymous and page-locked memory) and its split: what the
    process holds besides the host copies comes off the top (``overhead``, measured when offload was
    enabled), the host copies get the rest, ``weights_budget``."""

    budget: int
    overhead: HostOverhead

    @property
    def weights_budget(self) -> int:
        """The host copies' share: what `Placement.ram_bytes` stays under."""
        return self.budget - self.overhead.nbytes


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


class Placement:
    """The components' host copies against ``budget.weights_budget``: which are in RAM, which wait on disk and
    where (``sources``: those that wait in their own weight files; the others' cache files in ``folder``), and
    the peak. The reads under way (``reads``) may still take RAM they hold before the host copies adopt it, and
    the locked pool's lent buffers may hold more than their reads' pages (``pool``): both are counted here, so that
    the share holds at all times. The pool's idle buffers, kept for reads to come, are held to the share by
    ``pool_room`` (`PoolRoom`, built on this count): counted in the peak and when making room beyond what the
    reads reserved will take, and trimmed after each component moves out (the RAM it frees may be held that way,
    and must be given up when others need it). Not thread-safe: `HostTier` holds its lock."""

    def __init__(
        self, budget: TierBudget, folder: Path, weights_root: Path | None, reads: ReadRecords, pool: LockedPool
    ) -> None:
        self.budget = budget
        self.folder = folder
        self.weights_root = weights_root  # the pipeline's folder, where its components' folders are
        self.handles: dict[str, OffloadHandle] = {}
        self.recency: list[str] = []  # least recently active first
        self.sources: dict[str, WeightSource] = {}  # components that wait in their own weight files
        self.peak_ram_bytes = 0
        self._files: list[Path] = []  # cache files written, deleted by `delete_files`
        self._reads = reads
        self._pool = pool
        #: RAM held for the encoder while the active component's units are encoded between its forwards: its
        #: working memory and the most the payloads made in that gap take (`room_to_encode`); 0 between gaps.
        self.encoding_held = 0
        self._no_room_said: set[str] = set()
        #: The locked pool held to the share, on this placement's count of RAM (`ram_bytes`: all it reads is set).
        self.pool_room = PoolRoom(pool, budget, self.ram_bytes, reads.readings)

    def ram_bytes(self) -> int:
        """Host RAM of the host copies now (payloads made between forwards and not kept yet included), what the
        reads under way may hold (reserved ahead), what the locked pool's lent buffers hold beyond their reads'
        pages, and what is held for the encoder during a gap (`encoding_held`)."""
        copies = sum(h.host.host_ram_bytes for h in self.handles.values())
        return copies + self._reads.reserved_bytes + self._pool.slack_bytes + self.encoding_held

    def room_to_encode(self, name: str, bounds: list[int], working: int, say: bool = True) -> int:
        """How many of the units left of ``name`` (active) may be encoded between its forwards now: room for the
        encoder's ``working`` memory and those units' payloads at their most (``bounds``, in order), made where
        needed as `make_room` makes it. That room is held (`encoding_held`) until
        `encoding_done`. 0: no room for one unit now (a warning says so when ``say``, once per component)."""
        if not bounds:
            return 0
        first = working + bounds[0]
        self.make_room({name}, first)
        free = self.budget.weights_budget - self.ram_bytes()
        count, held = 0, working
        while count < len(bounds) and held + bounds[count] <= free:
            held, count = held + bounds[count], count + 1
        if count:
            self.encoding_held = held
            self.pool_room.trim()  # idle pool buffers beyond the room left go now, before the encoder takes it
            self.note_peak()
        elif say and name not in self._no_room_said:
            self._no_room_said.add(name)
            logger.warning(
                "host tier: no room in the host budget to compress %s's weights between its forwards now (%s for "
                "one block and the encoder, beside what RAM holds): it streams them raw from where they wait on disk "
                "until there is; pass a larger host_budget, or background_encoding=False to compress them at enable "
                "(which names the smallest workable host budget)",
                name,
                format_bytes(first),
            )
        return count

    def encoding_done(self) -> None:
        """The gap `room_to_encode` held room for is over: the payloads made in it are counted as host copies."""
        self.encoding_held = 0
        self.note_peak()

    def note_peak(self) -> None:
        """The peak of `ram_bytes` and of the pool's idle buffers no read will take: RAM kept for the reads to come."""
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes() + self.pool_room.held_beyond(0))

    def stored_bytes(self, name: str) -> int:
        """What ``name``'s host copies take in RAM when all are there (`HostCopies.stored_bytes`)."""
        return self.handles[name].host.stored_bytes

    def name_of(self, handle: OffloadHandle) -> str:
        return next(n for n, h in self.handles.items() if h is handle)

    def add(self, name: str, handle: OffloadHandle) -> None:
        """Track a component just packed (in RAM): find its weight files, then move others to disk if
        it does not fit with them."""
        self.handles[name] = handle
        self.recency.append(name)
        host_copies = handle.host
        if not host_copies.form.moves_payloads:  # its raw bytes move: its weight files may hold them
            folders = component_folders(name, handle.model, self.weights_root)
            source = WeightSource.find(name, folders, host_copies.positions) if folders else None
            if source is not None:
                self.sources[name] = source
                host_copies.mark_spill_current()
        self.make_room({name}, 0)  # it is in RAM already: the others move out until all fit
        self.note_peak()

    def check_fits(self) -> None:
        """Once every component is added: refuse a host budget in which one component's host copies, all in
        RAM, do not fit next to what the others keep in RAM while they wait on disk (compressed only: their raw
        base; the sizes are known only once encoded: `HostForm.ram_bytes_while_waiting`), naming the smallest
        workable host budget."""
        on_disk = {n: h.host.form.ram_bytes_while_waiting for n, h in self.handles.items()}
        need = {n: h.host.stored_bytes + sum(b for o, b in on_disk.items() if o != n) for n, h in self.handles.items()}
        name = max(need, key=lambda n: need[n], default=None)
        if name is None or need[name] <= self.budget.weights_budget:
            return
        smallest = need[name] + self.budget.overhead.nbytes
        raise HostBudgetError(
            f"host_budget {format_bytes(self.budget.budget)} cannot hold {name}'s host copies "
            f"({format_bytes(self.handles[name].host.stored_bytes)} as kept), which must be in RAM while it runs, "
            f"next to what the others keep in RAM on disk and the process's own memory and reserve "
            f"({format_bytes(self.budget.overhead.nbytes)}): the smallest workable host budget is "
            f"{format_bytes(smallest)}",
            required_bytes=smallest,
        )

    def mark_active(self, name: str) -> None:
        """``name`` becomes active: the most recently active, the last to move out."""
        self.recency.remove(name)
        self.recency.append(name)

    def make_room(self, keep: set[str], nbytes: int, drop_made: bool = True) -> None:
        """Move least recently used components out (never those in ``keep`` nor an active one) until
        ``nbytes`` more fit, or none is left to move; then, as a last resort and unless ``drop_made`` is False (a
        read ahead, which is optional), drop the payloads the others made between their forwards and did not keep
        yet (made again from their first unit when next they run: `CompressedCopies.restart_encoding`)."""
        for other in list(self.recency):
            if self._fits(nbytes):
                return
            if self._movable(other, keep):
                self._move_out(other)
                self.pool_room.trim()
        for other in list(self.recency) if drop_made else []:  # what others made between forwards, made again later
            if self._fits(nbytes):
                return
            handle = self.handles[other]
            if other not in keep and not handle.active and handle.host.compressed.arrivals.arriving_bytes:
                handle.host.compressed.restart_encoding(f"host tier: {other}'s room is needed")

    def _fits(self, nbytes: int) -> bool:
        return self.ram_bytes() + nbytes + self.pool_room.held_beyond(nbytes) <= self.budget.weights_budget

    def _movable(self, name: str, keep: set[str]) -> bool:
        handle = self.handles[name]
        return name not in keep and handle.host.holds_movable_bytes and not handle.active

    def _move_out(self, name: str) -> None:
        """To its weight files when they still hold its bytes (nothing written), else to a cache file; a
        component kept compressed only moves its compressed copies to their payload file."""
        handle = self.handles[name]
        host_copies = handle.host
        if host_copies.form.moves_payloads:
            host_copies.spill_payloads()
            logger.info("host tier: %s's compressed copies moved to disk (%s)", name, host_copies.where().disk_path)
            return
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
        logger.info("host tier: %s moved to disk (%s)", name, format_bytes(host_copies.stored_bytes))

    def forget_files(self, name: str) -> None:
        """The weight files no longer hold ``name``'s bytes (written into while it waited): from its next
        move out on, it waits in a cache file."""
        if self.sources.pop(name, None) is not None:
            logger.info(
                "host tier: %s was written into while it waited in its weight files; a cache file holds it from now on",
                name,
            )

    def check_files_for_removal(self) -> None:
        """Check the weight files of components waiting in them, which removal reads their weights back from.
        A changed file is restored as it is now (a warning says so); a truncated one would fault, so it is
        refused."""
        for name, source in self._files_waited_in():
            if not self.handles[name].host.form.restores_from_disk:
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

    def _files_waited_in(self) -> list[tuple[str, WeightSource | WeightFilesHome]]:
        """Per component, the weight files its raw bytes may wait in: a spill's source, or its raw home."""
        homes = [(n, h.host.raw_home) for n, h in self.handles.items() if isinstance(h.host.raw_home, WeightFilesHome)]
        return [*self.sources.items(), *homes]  # type: ignore[list-item]

    def delete_files(self) -> None:
        """Delete the cache files (every handle is removed) and drop from the page cache the weight files'
        pages the removal read; this user's default cache folder (`private_files.default_cache_folder`) goes too
        once it is empty (``rmdir``: a file another process of the user's put there since keeps it)."""
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files = []
        for source in self.sources.values():
            source.read_done()
        if self.folder == default_cache_folder():
            with contextlib.suppress(OSError):
                self.folder.rmdir()
