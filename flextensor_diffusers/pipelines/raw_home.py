"""`WeightFilesHome`: a component's own safetensors files as the place its raw bytes wait while RAM holds
compressed copies only (``raw_copies="disk"``, and a host budget with compression).

Set-up hands each unit over as soon as its compressed copy is made (`HostCopies.settle`): when the files hold
the unit's tensors byte for byte (`weight_files.match_unit`: same dtype and size, sampled bytes equal), its
tensors become views of private, copy-on-write mappings of those files, and its RAM buffer is freed; nothing is
written. A unit the files do not hold (converted at load, edited since, a checkpoint elsewhere) goes to a cache
file in ``cache_dir`` instead (`RawCacheFile`), unit by unit, so a component may wait partly in each.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..engine.cache_files import RawCacheFile, drop_cached_pages
from ..engine.units import Unit
from .weight_files import (
    FileStamp,
    NotSafetensors,
    TensorEntry,
    checkpoints,
    match_unit,
    read_entries,
    scattered_host,
    truncated_file,
)

logger = logging.getLogger(__name__)


class WeightFilesHome:
    """A `host_copies.RawHome` over the checkpoints in ``folders`` (see the module docstring); ``fallback`` is
    the cache file for units they do not hold, created at the first such unit."""

    def __init__(self, component: str, folders: list[Path], fallback: RawCacheFile) -> None:
        self.component = component
        self.where = folders[0]
        self._checkpoints = [files for folder in folders for files in checkpoints(folder)]
        self._entries: list[dict[str, TensorEntry] | None] = [None] * len(self._checkpoints)
        self._fallback = fallback
        self._fallback_used = False
        self._maps: dict[Path, torch.Tensor] = {}
        self.stamps: dict[Path, FileStamp] = {}
        self._kept_bytes = 0

    def _entries_of(self, index: int) -> dict[str, TensorEntry]:
        entries = self._entries[index]
        if entries is None:
            entries = {}
            try:
                for path in self._checkpoints[index]:
                    entries.update(read_entries(path))
            except (OSError, NotSafetensors) as exc:
                logger.info("%s: %s cannot hold raw weights (%s)", self.component, self._checkpoints[index][0], exc)
                entries = {}
            self._entries[index] = entries
        return entries

    def stand_in(self, position: int, unit: Unit) -> object:
        """The unit's tensors in the first checkpoint that holds them all byte for byte; else its room in the
        fallback cache file (written there)."""
        fds: dict[Path, int] = {}
        reason = "no safetensors checkpoint in its folder"
        try:
            for index in range(len(self._checkpoints)):
                places, reason = match_unit(unit, self._entries_of(index), fds)
                if places is not None:
                    files = {p.entry.file for p in places if p.entry is not None}
                    for path in files - set(self._maps):
                        self.stamps[path] = FileStamp.take(path)
                        size = self.stamps[path].size
                        self._maps[path] = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
                    stand_in = scattered_host(places, unit.host, self._maps)  # type: ignore[arg-type]
                    self._kept_bytes += stand_in.kept_bytes
                    return stand_in
        except (OSError, NotSafetensors) as exc:
            reason = str(exc)
        finally:
            for fd in fds.values():
                os.close(fd)
        if not self._fallback_used:
            logger.info("%s: %s waits in a cache file (%s), not in its weight files", self.component, unit.name, reason)
            self._fallback_used = True
        return self._fallback.stand_in(position, unit)

    def ram_bytes(self) -> int:
        return self._kept_bytes

    def changed_file(self) -> Path | None:
        """The first weight file that changed since its units moved there (None: all as stamped)."""
        return next((s.path for s in self.stamps.values() if s.changed()), None)

    def truncated_file(self) -> Path | None:
        """A weight file now shorter than when it was stamped: its mapped views would fault (SIGBUS)."""
        return truncated_file(self.stamps.values())

    def close(self) -> None:
        """Offload removed (every unit restored from here): the fallback file goes, the files' pages that the
        restore read leave the page cache."""
        self._maps = {}
        self._fallback.close()
        for path in self.stamps:
            drop_cached_pages(path)
