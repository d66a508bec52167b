"""Host buffers for weights, and page-locking them in place.

Every flat host buffer the engine packs or reads weights into (a unit's raw copy, a compressed payload, a unit
read back from disk) comes from `host_buffer`: an anonymous mapping of its own, not the C allocator's heap.

* **Set-up speed.** Large buffers are advised to use transparent huge pages (``MADV_HUGEPAGE``, 2 MiB pages
  from a 2 MiB boundary). Filling a buffer then takes 512x fewer page faults, and ``cudaHostRegister``
  locks 512x fewer page-table entries, so filling and registering take a fraction of their time on
  ``torch.empty``'s 4 KiB pages (measured: see benchmarks/results/README.md).
* **Registration that cannot collide.** ``cudaHostRegister`` locks whole pages. A heap buffer shares its
  first and last page with its neighbours, so registering two neighbours fails, and a heap range that was
  freed while still registered fails the next registration over it. A mapping of its own starts on a page
  boundary and owns every page it spans.

**A lock that cannot outlive its pages.** A range left registered after its pages are unmapped is the worst
fault this module can cause: the driver keeps the old pages locked under that address, a new mapping placed there
cannot be registered (error 712), and copies from it may read the old pages, so a model computes with wrong
weights and says nothing. (On the H200 a test that failed before ``remove()`` left such ranges behind, and two
later tests computed garbage.) So a buffer from `host_buffer` owns its mapping through a `_Mapping`, which
unregisters the buffer before the mapping is unmapped, whoever drops it last and whenever: an owner that forgets
`unpin_in_place`, a handle garbage-collected without ``remove()``, an exception during set-up.

A failed CUDA runtime call leaves its error in the runtime's per-thread "last error", where the next kernel
launch check of PyTorch finds it and raises for an unrelated operation. `pin_in_place` and
`unpin_in_place` take that error back at once (`_take_cuda_error`), so a buffer that cannot be locked only
stays pageable.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from .private_files import fresh_file, open_own_file

logger = logging.getLogger(__name__)

#: Size of a transparent huge page on x86-64 and of its alignment.
HUGE_PAGE = 2 << 20
#: Buffers from this size on are huge-page aligned and advised (a smaller one would waste up to one huge page).
HUGE_PAGE_MIN_BYTES = 32 << 20


class _Mapping:
    """An anonymous mapping and the one range of it that may be page-locked: the tensor views of `host_buffer`
    keep it alive (through the ctypes array they were made from), and it unregisters that range before the
    mapping it holds is unmapped (`__del__` runs while ``region`` is still mapped)."""

    __slots__ = ("__weakref__", "locked_at", "locked_bytes", "region")

    def __init__(self, region: mmap.mmap) -> None:
        self.region = region
        self.locked_at: int | None = None  # the address `pin_in_place` registered, until unregistered
        self.locked_bytes = 0  # how many bytes from there

    def unlock(self) -> None:
        address, self.locked_at, self.locked_bytes = self.locked_at, None, 0
        if address is not None:
            _unregister(address)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the CUDA runtime may be gone already
            self.unlock()


#: The mapping of each live `host_buffer`, by the buffer's address (entries leave with their mapping).
_mappings: weakref.WeakValueDictionary[int, _Mapping] = weakref.WeakValueDictionary()


class TakesBack(Protocol):
    """What lends page-locked buffers out (`locked_pool.LockedPool`)."""

    def give_back(self, view: torch.Tensor) -> None: ...


#: Buffers a `locked_pool.LockedPool` lent out, by address: `unpin_in_place` gives them back to it instead of
#: unlocking them, so an owner that unlocks its buffer the usual way hands it on, locked, to the next read. Weak: a
#: pool dropped without being closed (a pipeline dropped with offload on) goes, its buffers unlocked with their
#: mappings as any other's.
lent_by_pool: weakref.WeakValueDictionary[int, TakesBack] = weakref.WeakValueDictionary()


def host_buffer(nbytes: int) -> torch.Tensor:
    """A new uninitialised uint8 CPU tensor of ``nbytes`` on an anonymous mapping of its own (see the module
    docstring); the mapping is unlocked and unmapped when the last view of the tensor is gone."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    huge = nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
    pad = HUGE_PAGE if huge else 0
    region = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        _advise_huge_pages(region, nbytes)
    return _owned_view(region, nbytes, HUGE_PAGE if huge else 1)


def _advise_huge_pages(region: mmap.mmap, nbytes: int) -> None:
    """Advise huge pages for the whole huge pages of the buffer `_owned_view` will cut from ``region`` (from its
    first 2 MiB boundary), and 4 KiB pages for the rest: a huge page over the buffer's last bytes would be
    resident whole, up to 2 MiB a buffer beyond its bytes (23 MB for a 403 MB model of 12 units on the CPU)."""
    probe = ctypes.c_uint8.from_buffer(region)
    start = -ctypes.addressof(probe) % HUGE_PAGE  # a multiple of the 4 KiB page: the mapping starts on one
    del probe  # the region cannot be closed while a ctypes object exports it
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages, still correct
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where the system uses huge pages unasked ("always")
            region.madvise(mmap.MADV_NOHUGEPAGE, start + whole, len(region) - start - whole)


def return_freed_heap() -> None:
    """Give the pages of the C heap's free blocks back to the system now (glibc's ``malloc_trim``; nothing where
    the C library has none).

    A block freed on glibc's heap stays in the process's resident memory until the heap's top is free beyond the
    trim threshold, which rises with the mmap threshold (from 128 KiB up to 32 MiB, each time a mapped block is
    freed). And a tensor of any size may sit on the heap: a request is served from free heap blocks before a new
    mapping is made, so a model built in FP32 and cast has its BF16 tensors where the FP32 ones were. Originals
    freed as their units are packed then stayed resident (on the CPU, 0.5 GB of a 0.78 GB pipeline). The call takes
    about 10 ms where it gives pages back, a few microseconds where there are none: once per unit packed, never
    per forward."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


def shared_file_buffer(path: str | os.PathLike[str], nbytes: int, create: bool = True) -> torch.Tensor:
    """The first ``nbytes`` of the file at ``path`` as a uint8 CPU tensor on a shared mapping of it, owned like
    `host_buffer`'s: writes reach the file and every process that maps it, and a lock on it is undone before it
    is unmapped. ``create``: a new file of zeros, private to this user, replacing whatever was at ``path``
    (`private_files.fresh_file`); else the existing one, opened without following a link and checked to be this
    user's (`private_files.open_own_file`), extended with zeros when shorter."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    fd = fresh_file(Path(path)) if create else open_own_file(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return _owned_view(region, nbytes, 1)


def _owned_view(region: mmap.mmap, nbytes: int, alignment: int) -> torch.Tensor:
    """``nbytes`` of ``region`` from its first ``alignment``-aligned address, as a tensor whose views keep a
    `_Mapping` of the region alive, registered in `_mappings` under the tensor's address."""
    mapping = _Mapping(region)
    pages = (ctypes.c_uint8 * len(region)).from_buffer(region)
    pages.mapping = mapping  # type: ignore[attr-defined]  # the views' last reference to the mapping
    whole = torch.frombuffer(pages, dtype=torch.uint8)  # keeps ``pages`` alive as long as a view is
    start = -whole.data_ptr() % alignment
    buffer = whole[start : start + nbytes]
    _mappings[buffer.data_ptr()] = mapping
    return buffer


def pin_in_place(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` without copying it (``cudaHostRegister``); False when that fails or is unavailable
    (the buffer then stays pageable, and no CUDA error is left behind). A buffer from `host_buffer` is
    unlocked when its mapping goes, if `unpin_in_place` has not done it before; any other buffer's owner
    must call `unpin_in_place` before its pages go."""
    mapping = _mappings.get(buffer.data_ptr())
    if mapping is not None and mapping.locked_at is not None:
        return False  # locked already
    try:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    except (AttributeError, RuntimeError) as exc:  # pragma: no cover - depends on the CUDA build
        logger.debug("cudaHostRegister unavailable: %s", exc)
        return False
    if _code(err) == 0:
        if mapping is not None:
            mapping.locked_at, mapping.locked_bytes = buffer.data_ptr(), buffer.numel()
        return True
    logger.warning("cudaHostRegister of %d bytes failed (error %d): they stay pageable", buffer.numel(), _code(err))
    _take_cuda_error()
    return False


def page_locked(buffer: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``buffer`` page-locked: itself, locked in place (True: the owner calls `unpin_in_place` before dropping
    it), where `pin_in_place` works, else a pinned copy from torch's allocator (False)."""
    if pin_in_place(buffer):
        return buffer, True
    return buffer.pin_memory(), False


def locked_in_place(buffer: torch.Tensor) -> bool:
    """``buffer`` is a `host_buffer` that `pin_in_place` locked, all of it, and still is."""
    mapping = _mappings.get(buffer.data_ptr())
    return mapping is not None and mapping.locked_at == buffer.data_ptr() and mapping.locked_bytes == buffer.numel()


def unpin_in_place(buffer: torch.Tensor) -> None:
    """Undo `pin_in_place` now (its owner knows no copy still reads the buffer); a buffer a pool lent goes back to
    the pool instead, still locked (`lent_by_pool`)."""
    pool = lent_by_pool.get(buffer.data_ptr())
    if pool is not None:
        pool.give_back(buffer)
        return
    mapping = _mappings.get(buffer.data_ptr())
    if mapping is not None:
        mapping.unlock()
    else:
        _unregister(buffer.data_ptr())


def _unregister(address: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(address)
    if _code(err) != 0:
        logger.warning("cudaHostUnregister failed (error %d)", _code(err))
        _take_cuda_error()


def _code(err: object) -> int:
    return int(getattr(err, "value", err))  # type: ignore[call-overload]


def _take_cuda_error() -> None:
    """Clear the runtime's last error: PyTorch's next launch check (a tiny kernel here) reads and resets it."""
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # torch.AcceleratorError is a RuntimeError
            torch.zeros(1, device="cuda").add_(1)
