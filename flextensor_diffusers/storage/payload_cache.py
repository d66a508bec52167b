"""A file of a model's compressed copies, so that a later set-up of the same model reads them back
instead of encoding every unit again (``OffloadConfig(compression="lossless", compression_cache=True)``).

Encoding on the host takes far longer than packing the same weights; reading the payloads back is disk-bound
instead (measured set-up times with and without the file: see benchmarks/results/README.md). The file is named
after what identifies the weights cheaply: the model's structural fingerprint (every tensor's name, shape and dtype)
and a digest of a few sampled KiB of every unit's bytes, with the codec's version. That key tells models
apart, but not every edit of a weight: **a read payload is therefore never trusted**. `CompressedCopies.make`
decodes each one and compares it with the weights, byte for byte, before it is used; one mismatch refuses
the whole file (a warning says why), every unit is encoded again and the file is written anew.

Layout: an 8-byte little-endian header length, a JSON header (format version, key, one record per unit:
its index, the payload's offset, size and CRC-32 and the `EncodedUnit` launch parameters), then the payloads,
each at a 4 KiB-aligned offset after the header. The file is written to a temporary name and renamed, so a reader
never sees half a file; a write that fails (disk full) removes it and only costs the next run its encoding.

After encoding, the file is written on a thread of its own (`BackgroundWrite`): it is for the next run, so set-up
returns without waiting for the disk (the payloads are already in RAM, the host truth). Whatever needs the file
waits for it: a spill, a read of the same file in this process, dropping the payloads; and at exit the interpreter
waits for writes under way (Ctrl-C there gives them up, and no temporary file stays behind).

The same file is where a component's payloads wait while the host tier keeps it on disk (`CompressedCopies.spill`):
they are read back one unit at a time (`read_payload`), each checked as it arrives against the CRC-32 this process
holds in memory since it wrote that payload, or read it (and checked it against the file's record, and the caller
against the weights): never against the record in the file itself, which whoever changed the file could change
too. So a file changed on disk during the run, header and all, is refused at the read, never decoded into the
weights. A CRC-32, not a cryptographic digest: the file lies in a folder only this user can write
(`private_files`), so what it guards against is damage (a disk, a stray write of the user's own), not forgery;
and zlib's runs at 4.3 GB/s on one core of this project's CPU machine against 1.8 for SHA-256 and 0.9 for
BLAKE2b (64 MiB, 2026), on a path that reads gigabytes per switch of the host tier.

The file and its temporary are made as `private_files` says: new, 0600, never through a link; the file is opened
again without following a link, and mapped through that descriptor.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.errors import FlexTensorError
from ..engine.units import PackedTensor, Unit, align
from .codec import EncodedUnit, Segment
from .file_reads import SERIAL, FileSpan, PieceReader
from .host_memory import host_buffer
from .private_files import create_new, map_descriptor, open_own_file, temporary_name
from .setup_threads import PACK_THREADS

logger = logging.getLogger(__name__)

#: Bumped whenever the codec's payload layout or this file's layout changes: old files then never match.
FORMAT_VERSION = 2
#: Bytes sampled from each unit for the key: at its start, middle and end.
SAMPLE_BYTES = 4096
FILE_ALIGNMENT = 4096
_LENGTH_BYTES = 8


def header_segments(places: Iterable[Segment] | Iterable[PackedTensor]) -> list[tuple[int, int, str]]:
    """Where a unit's tensors lie as a payload file's header names them (`CacheRecord.segments`): offset, bytes and
    dtype name. Made from the encoded segments when the file is written, and from the unit's packed tensors when
    set-up checks a file against the model (no `Segment` made per record)."""
    return [(p.offset, p.nbytes, str(p.dtype).removeprefix("torch.")) for p in places]


@dataclass(frozen=True)
class CacheRecord:
    """Where one unit's payload lies in the file and how to decode it (an `EncodedUnit` without payload)."""

    index: int
    offset: int
    payload_nbytes: int
    raw_nbytes: int
    stored_nbytes: int
    segments: list[tuple[int, int, str]]
    chunk: int
    n16: int
    n32: int
    n_pieces: int
    coded_raw_nbytes: int
    crc32: int

    @classmethod
    def of(cls, index: int, offset: int, encoded: EncodedUnit, crc32: int) -> CacheRecord:
        return cls(
            index=index,
            offset=offset,
            payload_nbytes=encoded.payload.numel(),
            raw_nbytes=encoded.raw_nbytes,
            stored_nbytes=encoded.stored_nbytes,
            segments=header_segments(encoded.segments),
            chunk=encoded.chunk,
            n16=encoded.n16,
            n32=encoded.n32,
            n_pieces=encoded.n_pieces,
            coded_raw_nbytes=encoded.coded_raw_nbytes,
            crc32=crc32,
        )

    def encoded(self, payload: torch.Tensor) -> EncodedUnit:
        return EncodedUnit(
            payload=payload,
            raw_nbytes=self.raw_nbytes,
            stored_nbytes=self.stored_nbytes,
            segments=tuple(Segment(o, n, getattr(torch, d)) for o, n, d in self.segments),
            chunk=self.chunk,
            n16=self.n16,
            n32=self.n32,
            n_pieces=self.n_pieces,
            coded_raw_nbytes=self.coded_raw_nbytes,
        )


def weights_key(fingerprint: str, units: list[Unit]) -> str:
    """The file's key: the structural fingerprint, the codec format and sampled bytes of every unit (the start
    of its first tensor, the middle of its middle one, the end of its last one). Read from the tensors as they
    are, packed or not, so that naming the file never waits for packing: with ``raw_copies="disk"`` packing runs
    only a few units ahead of the encoder, and asking for every unit here would pack them all at once."""
    digest = hashlib.sha256(f"{fingerprint}:{FORMAT_VERSION}".encode())
    for unit in units:
        tensors = [packed.tensor for packed in unit.tensors]
        if tensors:
            for place, tensor in enumerate((tensors[0], tensors[len(tensors) // 2], tensors[-1])):
                digest.update(_sample(tensor, place))
    return digest.hexdigest()


#: Tensor types whose bytes lie at ``data_ptr()`` (`_sample` reads them in place).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _sample(tensor: torch.Tensor, place: int) -> bytes:
    """`SAMPLE_BYTES` of ``tensor``'s values at its start (``place`` 0), middle (1) or end (2).

    A plain contiguous tensor in RAM is read in place, with no tensor made per sample: set-up samples three per
    unit before it returns, and a cached compressed set-up is to cost no more than a raw one. Others (on a device,
    strided, or a subclass that may hold no storage of its own) are copied."""
    numel, size = tensor.numel(), tensor.element_size()
    count = min(numel, max(1, SAMPLE_BYTES // max(size, 1)))
    start = (0, max(0, numel // 2 - count // 2), numel - count)[place]
    if not count:
        return b""
    if type(tensor) in _PLAIN_TENSORS and tensor.device.type == "cpu" and tensor.is_contiguous():
        return ctypes.string_at(tensor.data_ptr() + start * size, count * size)
    piece = tensor.detach().reshape(-1)[start : start + count].to("cpu").contiguous()
    return piece.view(torch.uint8).numpy().tobytes()


def crc32_of(payload: torch.Tensor) -> int:
    """The CRC-32 of a payload's bytes (zlib releases the GIL: threads check several at once)."""
    return zlib.crc32(memoryview(payload.numpy())) if payload.numel() else 0


class UnusableCache(Exception):
    """A payload file that cannot be used, and why (`PayloadCache.read_checked`): the caller refuses it."""


#: How many live models of this process use each payload file (`PayloadCache.close` gives one back).
_users: dict[Path, int] = {}


@dataclass(frozen=True)
class _Mapping:
    """`PayloadCache.map`'s views of one mapping, and the file they map (inode, size, modification time)."""

    identity: tuple[int, int, int]
    views: dict[int, torch.Tensor]


class PayloadCache:
    """One model's payload file in ``folder``, named by `weights_key`.

    Live models of the same key (the same weights loaded twice) share the file while they only read it. A write
    by one of them (an edit, then a move to disk under a host budget) goes to a file of its own instead, named
    ``...-2.payloads`` and so on, deleted when the model goes (its payloads are of edited weights): rewriting
    the shared file would change the one the others wait in, and their reads would be refused as changed on
    disk."""

    def __init__(self, folder: Path, model_class: str, key: str) -> None:
        self.key = key
        self.path = folder / f"{model_class}-{key[:24]}.payloads"
        self._own_file = False  # ``path`` is a name of its own, taken to write beside a shared file
        _users[self.path] = _users.get(self.path, 0) + 1
        #: What the last `read`/`write` did, for the report: "read", "written", "refused: ...", "not written: ...".
        self.status = "not used"
        #: The records of the file as last read or written (what `read_payload` and `map` trust), and where
        #: its payloads start.
        self.records: dict[int, CacheRecord] = {}
        self.data_start = 0
        #: Each payload's CRC-32 as this process last held its bytes: computed from the payloads it wrote, or from
        #: the bytes it read (`read_checked`). What `read_payload` checks against; a header read again clears it.
        self._digests: dict[int, int] = {}
        self._mapping: _Mapping | None = None  # `map`'s views, kept while the file and its records stay the same

    def open(self) -> dict[int, CacheRecord]:
        """The file's records by unit index, its header checked (format and key); empty when there is no usable
        file (refused, saying why, when there is one). No payload is read here: `read_checked` reads each."""
        wait_for_writes(self.path)
        if not self.path.exists():
            return {}
        try:
            with open(open_own_file(self.path), "rb") as f:  # not through a link; a regular file of this user's
                length = int.from_bytes(f.read(_LENGTH_BYTES), "little")
                header = json.loads(f.read(length))
            if header.get("version") != FORMAT_VERSION or header.get("key") != self.key:
                self.refuse("its header names another key or format")
                return {}
            records = [CacheRecord(**fields) for fields in header["units"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.refuse(f"it cannot be read ({exc})")
            return {}
        self.records = {r.index: r for r in records}
        self.data_start = align(_LENGTH_BYTES + length, FILE_ALIGNMENT)
        self._digests = {}  # nothing of this header's payloads is held yet
        self._mapping = None
        return dict(self.records)

    def read_checked(self, index: int, reader: PieceReader = SERIAL) -> torch.Tensor:
        """Unit ``index``'s payload (from `open`'s records) in a new host buffer, read in pieces on ``reader``'s
        threads and checked against its record's CRC-32, which is then the one `read_payload` checks against;
        raises `UnusableCache` saying why when the file ends first or the bytes differ. Runs on any thread."""
        record = self.records[index]
        payload = host_buffer(record.payload_nbytes)
        span = FileSpan(self.path, self.data_start + record.offset, memoryview(payload.numpy()))
        try:
            reader.read([span], lambda _path: UnusableCache("it is shorter than its header says"))
        except OSError as exc:
            raise UnusableCache(f"it cannot be read ({exc})") from exc
        digest = crc32_of(payload)
        if digest != record.crc32:
            raise UnusableCache("a payload's checksum differs from its record (the file was changed on disk)")
        self._digests[index] = digest  # of the bytes read: the ones the caller keeps (and checks against the weights)
        return payload

    def discard(self) -> None:
        """Delete the file (refused: its payloads are stale or damaged), unless another live model of this process
        uses it too; the next set-up then encodes and writes it again."""
        wait_for_writes(self.path)
        if _users.get(self.path, 0) <= 1:
            self.path.unlink(missing_ok=True)

    def mark_read(self) -> None:
        """Every payload was read and kept (the report says so)."""
        self.status = "read"

    def close(self) -> None:
        """The model is gone: it no longer uses its file; a file of its own (edited weights) is deleted."""
        wait_for_writes(self.path)
        self._mapping = None
        _users[self.path] = _users.get(self.path, 1) - 1
        if _users[self.path] <= 0:
            del _users[self.path]
        if self._own_file:
            self.path.unlink(missing_ok=True)

    def own_for_writing(self) -> None:
        """Before a write (every writer calls it on the caller's thread, before `write`): when other live models
        use this file, move to a name of its own (see the class)."""
        if _users.get(self.path, 0) <= 1:
            return
        _users[self.path] -= 1
        stem = self.path.name.removesuffix(".payloads")
        names = (self.path.with_name(f"{stem}-{n}.payloads") for n in itertools.count(2))
        self.path = next(path for path in names if path not in _users)
        _users[self.path] = 1
        self._own_file = True

    def describe(self) -> str:
        """What the last read or write did; "writing" while a background write is under way."""
        if _writes.get(self.path):
            refused = self.status.startswith("refused")
            return f"{self.status}; writing again: {self.path}" if refused else f"writing: {self.path}"
        return f"{self.status}: {self.path}"

    def refuse(self, reason: str, then: str = "encoding again") -> None:
        """Note that the file is not used (``then``: what happens instead); it is written again after encoding."""
        self.status = f"refused: {reason}"
        logger.warning("payload cache %s refused: %s; %s", self.path, reason, then)

    def mark_reading(self) -> None:
        """Set-up did not wait for the file: its payloads are being read while the model runs raw."""
        self.status = "being read while the model runs raw"

    def mark_opening(self) -> None:
        """Set-up read nothing of the file: it is checked once packing is over, then read, or (missing or refused)
        written once the weights are compressed between forwards."""
        self.status = "checked once packing is over: read then, or written after compressing while the model runs raw"

    def mark_encoding(self) -> None:
        """Set-up found no file and did not wait for the encoder: the file is written once every unit is encoded."""
        self.status = "not written yet: the weights are being compressed while the model runs raw"

    def write(
        self, encoded: dict[int, EncodedUnit], strict: bool = False, cancel: threading.Event | None = None
    ) -> bool:
        """Write every payload (atomically), each with its CRC-32 (computed on `PACK_THREADS` threads). A
        failure leaves no file behind: with ``strict`` it raises a one-line error naming the fix (the file is
        where payloads wait on disk), else it only costs the next run its encoding. ``cancel``, set, gives the
        write up between payloads (False, no file). Offsets in the header are relative to the first payload,
        which starts at the first 4 KiB boundary after the header. The caller calls `own_for_writing` first."""
        wait_for_writes(self.path)  # one writer per file in this process: they would share the temporary name
        order = sorted(encoded)
        with ThreadPoolExecutor(PACK_THREADS) as pool:
            sums = dict(zip(order, pool.map(lambda i: crc32_of(encoded[i].payload), order), strict=True))
        records, offset = [], 0
        for index in order:
            unit = encoded[index]
            records.append(CacheRecord.of(index, offset, unit, sums[index]))
            offset = align(offset + unit.payload.numel(), FILE_ALIGNMENT)
        header = {"version": FORMAT_VERSION, "key": self.key, "units": [dataclasses.asdict(r) for r in records]}
        blob = json.dumps(header).encode()
        data_start = align(_LENGTH_BYTES + len(blob), FILE_ALIGNMENT)
        remove_stale_temporaries(self.path)
        tmp = temporary_name(self.path)
        try:
            with open(tmp, "wb", opener=create_new) as f:
                f.write(len(blob).to_bytes(_LENGTH_BYTES, "little") + blob)
                for record in records:
                    if cancel is not None and cancel.is_set():
                        tmp.unlink(missing_ok=True)
                        self.status = "not written: given up at exit"
                        return False
                    f.seek(data_start + record.offset)
                    f.write(memoryview(encoded[record.index].payload.numpy()))
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.status = f"not written: {exc}"
            if strict:
                raise FlexTensorError(
                    f"could not write the compressed weights to {self.path} ({exc}): free space there or pass "
                    "another cache_dir"
                ) from exc
            logger.warning("payload cache %s not written (%s): the next run encodes again", self.path, exc)
            return False
        except BaseException:  # Ctrl-C while writing (seconds for a large model): no partial file stays behind
            tmp.unlink(missing_ok=True)
            raise
        self.records = {r.index: r for r in records}
        self.data_start = data_start
        self._digests = sums  # of the payloads in RAM, computed before they were written
        self._mapping = None
        self.status = f"{self.status}; written again" if self.status.startswith("refused") else "written"
        return True

    def map(self) -> dict[int, torch.Tensor]:
        """Each payload as a view of a read-only private mapping of the file: what stands in for the payloads
        while they wait on disk (file pages, not anonymous memory). Raises when the file is shorter than its
        records say. One mapping serves every call while the file (its inode, size and time) and the records
        stay the same: a component handed over unit by unit asks once per unit. The file is opened without
        following a link, checked to be this user's, and mapped through that descriptor (`private_files`)."""
        try:
            fd = open_own_file(self.path)
        except OSError as exc:
            raise FlexTensorError(
                f"the compressed weights file {self.path} cannot be opened ({exc}): enable offload again"
            ) from exc
        try:
            found = os.fstat(fd)
            identity = (found.st_ino, found.st_size, found.st_mtime_ns)
            if self._mapping is not None and self._mapping.identity == identity:
                return self._mapping.views
            end = max((self.data_start + r.offset + r.payload_nbytes for r in self.records.values()), default=0)
            if found.st_size < end:
                raise self._truncated()
            mapped = map_descriptor(fd, max(found.st_size, 1), shared=False)
        finally:
            os.close(fd)
        views = {
            i: mapped[self.data_start + r.offset : self.data_start + r.offset + r.payload_nbytes]
            for i, r in self.records.items()
        }
        self._mapping = _Mapping(identity, views)
        return views

    def _truncated(self) -> FlexTensorError:
        return FlexTensorError(f"the compressed weights file {self.path} was truncated: enable offload again")

    def read_payload(self, index: int, into: torch.Tensor, reader: PieceReader = SERIAL) -> None:
        """Read unit ``index``'s payload into ``into`` (its size) with ``preadv``, in pieces on ``reader``'s
        threads, and check it against the CRC-32 held in memory since this process wrote or read that payload
        (see the module docstring): a payload changed on disk since, its record in the file with it or not, is
        refused with a one-line error, never used."""
        record = self.records[index]
        span = FileSpan(self.path, self.data_start + record.offset, memoryview(into.numpy())[: record.payload_nbytes])
        reader.read([span], lambda _path: self._truncated())
        held = self._digests.get(index)
        if held is None or crc32_of(into) != held:
            raise FlexTensorError(
                f"the compressed weights of unit {index} in {self.path} changed on disk since they were written: "
                "delete the file and enable offload again"
            )


class BackgroundWrite:
    """`PayloadCache.write` of ``encoded`` on a thread of its own, started at once: set-up does not wait for the
    disk. `held` waits for it and says whether the file holds these payloads (False after a failed write, or
    when ``stale`` was set: a payload changed since). The payloads written are the ones given, kept alive here
    until the write ends, whatever their owner does meanwhile."""

    def __init__(self, cache: PayloadCache, encoded: dict[int, EncodedUnit]) -> None:
        self.cache = cache
        self.stale = False
        self._written = False
        self._cancel = threading.Event()
        cache.own_for_writing()  # here, not on the thread: the file's name may change
        wait_for_writes(cache.path)
        self._thread = threading.Thread(
            target=self._run, args=(dict(encoded),), name="flextensor-payload-write", daemon=True
        )
        _writes.setdefault(cache.path, []).append(self)
        self._thread.start()

    def _run(self, encoded: dict[int, EncodedUnit]) -> None:
        try:
            self._written = self.cache.write(encoded, cancel=self._cancel)
        except BaseException as exc:  # not strict: only an unexpected fault gets here; the next run encodes
            self.cache.status = f"not written: {exc}"
            logger.warning("payload cache %s not written (%s): the next run encodes again", self.cache.path, exc)
        finally:
            writes = _writes.get(self.cache.path, [])
            if self in writes:
                writes.remove(self)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def on_this_thread(self) -> bool:
        """The caller is the write itself (it must not wait for itself)."""
        return self._thread is threading.current_thread()

    def held(self) -> bool:
        """Wait for the write; True when the file holds the payloads as they are now."""
        self._thread.join()
        return self._written and not self.stale

    def give_up(self) -> None:
        """Stop between payloads and remove the temporary file."""
        self._cancel.set()
        self._thread.join()


def remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files of ``path`` left by processes that no longer run (killed outright while
    writing: the background write runs for seconds after set-up, and such a file is as large as the payloads).
    A temporary file names its writer's pid (`private_files.temporary_name`: ``NAME.PID.RANDOM.tmp``); one of a
    live process (or of a pid this process may not signal) is kept."""
    for tmp in path.parent.glob(f"{path.name}.*.tmp"):
        pid = tmp.name.removeprefix(f"{path.name}.").split(".")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
            logger.info("removed %s, left by a process that no longer runs", tmp)
        except OSError:  # alive, another user's
            continue


#: The writes under way, by file: whoever reads or writes that file waits for them first.
_writes: dict[Path, list[BackgroundWrite]] = {}


def wait_for_writes(path: Path) -> None:
    """Wait for this process's background writes of ``path`` (none: returns at once)."""
    for write in list(_writes.get(path, [])):
        if not write.on_this_thread:
            write.held()


def _writes_under_way() -> list[BackgroundWrite]:
    return [write for writes in list(_writes.values()) for write in list(writes)]


def wait_for_all_writes() -> None:
    """Wait for every background write of this process: what a program that leaves with ``os._exit`` (which runs
    no exit handler) calls first, or its payload files are never written."""
    for write in _writes_under_way():
        write.held()


@atexit.register
def _finish_writes_at_exit() -> None:
    """At exit, finish the payload files still being written (they save the next run its encoding); Ctrl-C
    gives them up, leaving no temporary file behind."""
    pending = [write for write in _writes_under_way() if write.running]
    if not pending:
        return
    logger.warning("finishing the compressed weights file for the next run (Ctrl-C gives it up)")
    try:
        for write in pending:
            write.held()
    except KeyboardInterrupt:
        for write in pending:
            write.give_up()
