"""The safetensors files a component was loaded from, as the place its host copies wait on disk.

``from_pretrained`` on a local folder leaves every weight's bytes in the component's ``*.safetensors``
files. When each packed tensor's bytes are exactly there (same dtype and size, so nothing was converted at
load, and every byte equal, so nothing was edited since: sampled first, then all compared, `first_difference`),
a component that moves out of RAM needs no cache file: its tensors become views of private, copy-on-write
mappings of those files
(`torch.from_file` with ``shared=False``), so an edit made while it waits lands in anonymous memory and
never in the user's files. Reading it back is a few large ``preadv`` calls per unit, in pieces that several
threads read at once (`file_reads`), followed by dropping those files' pages from the page cache.

Each file is stamped when offload is enabled (size, mtime, a hash of its header); a file that changed
since is refused before anything is read from it. Nothing here ever writes into the model folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine.errors import FlexTensorError
from ..engine.units import Unit
from .cache_files import drop_cached_pages_later
from .file_reads import SERIAL, FileSpan, PieceReader

logger = logging.getLogger(__name__)

#: torch dtypes as safetensors names them.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
#: safetensors refuses headers above 100 MB; anything larger is not a safetensors file.
MAX_HEADER_BYTES = 100_000_000
#: Bytes compared at the start, middle and end of every tensor when offload is enabled: enough to catch
#: an edit made after loading (a fused LoRA, a loaded state dict) without reading whole files.
SAMPLE_BYTES = 4096


class NotSafetensors(Exception):
    """A file that does not parse as safetensors: that checkpoint is skipped, nothing is raised to the user."""


@dataclass(frozen=True)
class FileStamp:
    """What a weight file looked like when offload was enabled: a change means its bytes are unknown."""

    path: Path
    size: int
    mtime_ns: int
    header_sha256: str

    @classmethod
    def take(cls, path: Path) -> FileStamp:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            mtime_ns = os.fstat(file.fileno()).st_mtime_ns
            header = _header_bytes(file, size, path)
        return cls(path, size, mtime_ns, hashlib.sha256(header).hexdigest())

    def changed(self) -> bool:
        try:
            stat = self.path.stat()
            if (stat.st_size, stat.st_mtime_ns) != (self.size, self.mtime_ns):
                return True
            return FileStamp.take(self.path) != self
        except (OSError, NotSafetensors):
            return True

    def check(self, component: str) -> None:
        if self.changed():
            raise FlexTensorError(
                f"the weight file {self.path} changed since offload was enabled, so {component}'s weights on disk "
                "are no longer known: disable_flextensor_offload() and enable it again (reload the pipeline if "
                "the file's contents changed)"
            )


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in a safetensors file (``start``: absolute offset in the file)."""

    file: Path
    start: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorPlace:
    """One packed tensor: its range in its unit's flat buffer, and its bytes in a weight file
    (``entry`` None: not in the files, a non-persistent buffer such as a RoPE table, kept in RAM)."""

    offset: int
    nbytes: int
    entry: TensorEntry | None

    @property
    def key(self) -> tuple[int, int]:
        return (self.offset, self.offset + self.nbytes)


@dataclass(frozen=True)
class ReadRun:
    """Tensors whose bytes follow each other in one file: one ``preadv`` into their places in the buffer."""

    file: Path
    start: int
    places: tuple[TensorPlace, ...]


def _header_bytes(file: Any, size: int, path: Path) -> bytes:
    head = file.read(8)
    if len(head) < 8:
        raise NotSafetensors(f"{path} is shorter than a safetensors header")
    length = int.from_bytes(head, "little")
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise NotSafetensors(f"{path}: header length {length} does not fit the file")
    header = file.read(length)
    if len(header) < length:
        raise NotSafetensors(f"{path} ended inside its header")
    return header


def read_entries(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of one safetensors file: 8-byte little-endian header length, a JSON header
    (``dtype``, ``shape``, ``data_offsets`` relative to the end of the header), then the bytes."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        header = _header_bytes(file, size, path)
    try:
        meta = json.loads(header)
        base = 8 + len(header)
        entries = {}
        for key, info in meta.items():
            if key == "__metadata__":
                continue
            begin, end = (int(x) for x in info["data_offsets"])
            if not 0 <= begin <= end or base + end > size:
                raise NotSafetensors(f"{path}: {key} lies outside the file")
            entries[key] = TensorEntry(path, base + begin, end - begin, str(info["dtype"]), tuple(info["shape"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NotSafetensors(f"{path}: unreadable header ({exc})") from exc
    return entries


def checkpoints(folder: Path) -> list[list[Path]]:
    """The checkpoints in a component folder, each as its files: the shards of every
    ``*.safetensors.index*.json``, then each ``*.safetensors`` no index names (variants such as
    ``*.fp16.safetensors`` are checkpoints of their own; matching picks the one that was loaded)."""
    found: list[list[Path]] = []
    indexed: set[Path] = set()
    for index in sorted(folder.glob("*.index*.json")):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if files and all(f.name.endswith(".safetensors") and f.is_file() for f in files):
            found.append(files)
            indexed.update(files)
    found += [[f] for f in sorted(folder.glob("*.safetensors")) if f not in indexed and f.is_file()]
    return found


def _config_value(config: Any, key: str) -> Any:
    value = getattr(config, key, None)
    if value is None and isinstance(config, Mapping):
        value = config.get(key)
    return value


def pipeline_folder(pipeline: Any) -> Path | None:
    """The local folder ``pipeline`` was loaded from (diffusers records it as ``name_or_path`` and
    ``config._name_or_path``); None for a pipeline built in memory or loaded from a hub id (its components
    still record the hub cache's snapshot folders they were loaded from: `component_folders` finds those)."""
    value = getattr(pipeline, "name_or_path", None) or _config_value(getattr(pipeline, "config", None), "_name_or_path")
    return _local_folder(value)


def _local_folder(value: Any) -> Path | None:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return None
    path = Path(value)
    return path.resolve() if path.is_dir() else None


def component_folders(name: str, module: torch.nn.Module, root: Path | None) -> list[Path]:
    """Where a component's weight files may be: the folder the model itself was loaded from
    (``config._name_or_path``, set by diffusers' and transformers' ``from_pretrained``), then the
    pipeline's folder joined with the component's name. Existing local folders only."""
    config = getattr(module, "config", None)
    candidates = [
        _local_folder(_config_value(config, "_name_or_path")),
        _local_folder(getattr(module, "name_or_path", None)),
        _local_folder(root / name) if root is not None else None,
    ]
    folders: list[Path] = []
    for folder in candidates:
        if folder is not None and folder not in folders:
            folders.append(folder)
    return folders


def _samples_match(fd: int, entry: TensorEntry, host: torch.Tensor) -> bool:
    """The tensor's bytes in RAM (``host``: uint8) equal the file's at its start, middle and end."""
    n = entry.nbytes
    windows = {(0, min(n, SAMPLE_BYTES)), (max(0, n // 2 - SAMPLE_BYTES // 2), min(n, n // 2 + SAMPLE_BYTES // 2))}
    windows.add((max(0, n - SAMPLE_BYTES), n))
    ram = host.numpy()
    for begin, end in windows:
        if end > begin and os.pread(fd, end - begin, entry.start + begin) != ram[begin:end].tobytes():
            return False
    return True


def changed_file(stamps: Iterable[FileStamp]) -> Path | None:
    """The first of ``stamps``' files that changed since it was stamped (None: all as stamped)."""
    return next((s.path for s in stamps if s.changed()), None)


def truncated_file(stamps: Iterable[FileStamp]) -> Path | None:
    """The first of ``stamps``' files now shorter than when it was stamped (or gone): mapped views of it would
    fault (SIGBUS)."""
    for stamp in stamps:
        try:
            if stamp.path.stat().st_size < stamp.size:
                return stamp.path
        except OSError:
            return stamp.path
    return None


def unit_difference(unit: Unit, places: list[TensorPlace], mapping: Callable[[Path], torch.Tensor]) -> str | None:
    """Where ``unit``'s first tensor (packed, in RAM) differs from its bytes in the file ``places`` found it in,
    every byte compared (an edit after loading that left the sampled bytes as they were); None when all are
    equal. ``mapping(path)``: a mapping of that file. Waiting in the files, a unit's bytes become the files', so a
    difference anywhere would change the weights."""
    assert unit.host is not None
    for place in places:
        entry = place.entry
        if entry is None:
            continue
        in_file = mapping(entry.file)[entry.start : entry.start + place.nbytes]
        if not torch.equal(unit.host[place.offset : place.offset + place.nbytes], in_file):
            return f"a tensor of {unit.name} differs from {entry.file.name} (edited after loading?)"
    return None


def first_difference(units: list[Unit], places: list[list[TensorPlace]]) -> str | None:
    """`unit_difference` of every unit, one unit per thread; the first difference found, None when none."""
    from .setup_threads import on_threads

    files = {p.entry.file for unit in places for p in unit if p.entry is not None}
    maps = {f: torch.from_file(str(f), shared=False, size=f.stat().st_size, dtype=torch.uint8) for f in files}
    found: list[str] = []

    def compare(position: int) -> None:
        difference = unit_difference(units[position], places[position], maps.__getitem__)
        if difference is not None:
            found.append(difference)

    on_threads(compare, list(range(len(units))), "comparing weights with their files")
    return min(found) if found else None


def match_unit(
    unit: Unit, entries: dict[str, TensorEntry], fds: dict[Path, int]
) -> tuple[list[TensorPlace] | None, str]:
    """Where each packed tensor of ``unit`` (packed, in RAM) is in the files of ``entries``, byte for byte
    (sampled); None with the reason when one is not there as it is in RAM. ``fds``: files opened so far, by
    path (the caller closes them)."""
    assert unit.host is not None
    found = []
    for packed in unit.tensors:
        keys = [rel if unit.index < 0 else f"{unit.name}.{rel}" for rel in packed.names]
        entry = next((entries[k] for k in keys if k in entries), None)
        if entry is None:
            if packed.persistent:
                return None, f"{keys[0]} is not in the files"
            found.append(TensorPlace(packed.offset, packed.nbytes, None))
            continue
        if SAFETENSORS_DTYPES.get(packed.dtype) != entry.dtype or entry.nbytes != packed.nbytes:
            return None, f"{keys[0]} is {packed.dtype} here, {entry.dtype} in the file (converted at load)"
        if entry.start % packed.dtype.itemsize:
            return None, f"{keys[0]} is not aligned to its dtype in the file"
        if not packed.view_of(unit.host).is_contiguous():
            return None, f"{keys[0]} has strides {packed.stride} here, the file holds it contiguous"
        if entry.file not in fds:
            fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        ram = unit.host[packed.offset : packed.offset + packed.nbytes]
        if not _samples_match(fds[entry.file], entry, ram):
            return None, f"{keys[0]} differs from the file (edited after loading?)"
        found.append(TensorPlace(packed.offset, packed.nbytes, entry))
    return found, ""


def scattered_host(places: list[TensorPlace], host: torch.Tensor, maps: dict[Path, torch.Tensor]) -> ScatteredHost:
    """A stand-in for a unit's flat buffer ``host`` over the files' mappings ``maps``; tensors the files lack
    are copied from ``host`` and kept in RAM."""
    views = {
        p.key: host[p.offset : p.offset + p.nbytes].clone()
        if p.entry is None
        else maps[p.entry.file][p.entry.start : p.entry.start + p.nbytes]
        for p in places
    }
    return ScatteredHost(views, kept_bytes=sum(p.nbytes for p in places if p.entry is None))


class ScatteredHost:
    """Stands in for a unit's flat host buffer while its bytes are elsewhere: slicing it at a packed
    tensor's range gives that tensor's bytes (a view of a weight file's mapping, or a small RAM copy),
    which is all `PackedTensor.view_of` asks of a flat buffer. Anything else is refused loudly."""

    def __init__(self, views: dict[tuple[int, int], torch.Tensor], kept_bytes: int = 0) -> None:
        self._views = views
        self.kept_bytes = kept_bytes  # what it keeps in RAM (tensors the files lack)

    def __getitem__(self, key: slice) -> torch.Tensor:
        view = self._views.get((key.start, key.stop)) if isinstance(key, slice) else None
        if view is None:
            raise FlexTensorError(
                f"bytes {key} of a unit waiting in its weight files are not one tensor: bring the component in first"
            )
        return view


class WeightSource:
    """A component's host copies, found byte for byte in the safetensors files it was loaded from.

    ``places[p]``: where every tensor of unit position ``p`` (0: the base, then the units) is. Tensors
    the files lack (non-persistent buffers) are copied from RAM at each spill and kept there.
    """

    def __init__(self, component: str, where: Path, places: list[list[TensorPlace]], stamps: list[FileStamp]) -> None:
        self.component = component
        self.where = where
        self.places = places
        self.stamps = stamps
        self.ram_bytes = sum(p.nbytes for unit in places for p in unit if p.entry is None)
        self.nbytes = sum(p.nbytes for unit in places for p in unit)
        self._runs = [self._plan_runs(unit) for unit in places]
        self._kept: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in places]
        self._mapped: list[tuple[int, int]] = []  # address ranges of the current mappings
        self._lock = threading.Lock()

    @staticmethod
    def _plan_runs(places: list[TensorPlace]) -> list[ReadRun]:
        runs: list[ReadRun] = []
        for place in sorted((p for p in places if p.entry is not None), key=lambda p: (p.entry.file, p.entry.start)):  # type: ignore[union-attr]
            entry = place.entry
            assert entry is not None
            last = runs[-1] if runs else None
            if last is not None and last.file == entry.file:
                end = last.places[-1].entry.start + last.places[-1].nbytes  # type: ignore[union-attr]
                if end == entry.start:
                    runs[-1] = ReadRun(last.file, last.start, (*last.places, place))
                    continue
            runs.append(ReadRun(entry.file, entry.start, (place,)))
        return runs

    # ------------------------------------------------------------------------------------ finding

    @classmethod
    def find(cls, component: str, folders: list[Path], units: list[Unit]) -> WeightSource | None:
        """The first checkpoint in ``folders`` that holds every packed tensor of ``units`` (packed, in
        RAM) byte for byte; None, with the reason logged, when there is none (or without ``preadv``)."""
        if not hasattr(os, "preadv"):
            return None
        for folder in folders:
            for files in checkpoints(folder):
                try:
                    entries: dict[str, TensorEntry] = {}
                    for path in files:
                        entries.update(read_entries(path))
                    places, reason = cls._match(units, entries)
                    if places is not None:  # the samples matched: now every byte
                        reason = first_difference(units, places) or ""
                        places = places if not reason else None
                    stamps = [FileStamp.take(path) for path in files] if places is not None else []
                except (OSError, NotSafetensors) as exc:
                    places, reason = None, str(exc)
                if places is None:
                    logger.info("host tier: %s cannot use %s (%s)", component, files[0].name, reason)
                    continue
                used = {p.entry.file for unit in places for p in unit if p.entry is not None}
                stamps = [s for s in stamps if s.path in used]
                logger.info("host tier: %s waits on disk in its own weight files (%s)", component, folder)
                return cls(component, folder, places, stamps)
        return None

    @staticmethod
    def _match(units: list[Unit], entries: dict[str, TensorEntry]) -> tuple[list[list[TensorPlace]] | None, str]:
        fds: dict[Path, int] = {}
        try:
            places: list[list[TensorPlace]] = []
            for unit in units:
                found, reason = match_unit(unit, entries, fds)
                if found is None:
                    return None, reason
                places.append(found)
            return places, ""
        finally:
            for fd in fds.values():
                os.close(fd)

    # ------------------------------------------------------------------------------------ checks

    def changed_file(self) -> Path | None:
        """The first weight file that changed since offload was enabled (None: all as stamped)."""
        return changed_file(self.stamps)

    def check(self) -> None:
        """Refuse, before anything is read, files that changed since offload was enabled."""
        for stamp in self.stamps:
            stamp.check(self.component)

    def truncated_file(self) -> Path | None:
        """A weight file now shorter than when it was stamped: its mapped views would fault (SIGBUS)."""
        return truncated_file(self.stamps)

    # ------------------------------------------------------------------------------------ spilling

    def hosts(self, units: list[Unit]) -> list[ScatteredHost] | None:
        """Per unit, a stand-in for its flat host buffer over fresh private mappings of the files (the
        units are in RAM: tensors the files lack are copied from there). None when a file changed."""
        if self.changed_file() is not None:
            return None
        maps = {s.path: torch.from_file(str(s.path), shared=False, size=s.size, dtype=torch.uint8) for s in self.stamps}
        hosts = []
        for position, (unit, places) in enumerate(zip(units, self.places, strict=True)):
            assert unit.host is not None
            kept = {p.key: unit.host[p.offset : p.offset + p.nbytes].clone() for p in places if p.entry is None}
            views = {
                p.key: kept[p.key] if p.entry is None else maps[p.entry.file][p.entry.start : p.entry.start + p.nbytes]
                for p in places
            }
            self._kept[position] = kept
            hosts.append(ScatteredHost(views))
        with self._lock:
            self._mapped = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in maps.values()]
        return hosts

    def views_unwritten(self) -> bool:
        """No page of the current mappings was written: their bytes are still the files' bytes, so
        reading the files gives the current weights. An edit through ``editing`` is known to the engine
        anyway; this also catches a direct write into an inactive component's tensors. Read from
        /proc/self/smaps (a written private page is anonymous); False where that cannot be read."""
        with self._lock:
            ranges = list(self._mapped)
        try:
            with open("/proc/self/smaps") as smaps:
                inside = False
                for line in smaps:
                    if line[:1] in "0123456789abcdef":
                        low, high = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                        inside = any(low < end and start < high for start, end in ranges)
                    elif inside and line.startswith("Anonymous:") and int(line.split()[1]) > 0:
                        return False
        except (OSError, ValueError):
            return False
        return True

    # ------------------------------------------------------------------------------------ reading

    def read_into(self, position: int, buffer: torch.Tensor, reader: PieceReader = SERIAL) -> None:
        """Fill unit ``position``'s flat RAM ``buffer`` from the files: large ``preadv`` reads of runs of adjacent
        tensors straight into their places (no staging copy), in pieces on ``reader``'s threads, and the kept
        tensors from RAM."""
        flat = memoryview(buffer.numpy())
        spans = []
        for run in self._runs[position]:
            at = run.start
            for place in run.places:
                spans.append(FileSpan(run.file, at, flat[place.offset : place.offset + place.nbytes]))
                at += place.nbytes
        reader.read(spans, _ended_early)
        for (begin, end), kept in self._kept[position].items():
            buffer[begin:end].copy_(kept)

    def read_done(self) -> None:
        """Drop the files' pages from the page cache once read into RAM: a second copy there would only
        crowd out other memory (they are clean; pages still mapped somewhere stay)."""
        for stamp in self.stamps:
            drop_cached_pages_later(stamp.path)


def _ended_early(path: Path) -> FlexTensorError:
    return FlexTensorError(
        f"the weight file {path} ended early: it changed since offload was enabled; "
        "disable_flextensor_offload() and enable it again"
    )
