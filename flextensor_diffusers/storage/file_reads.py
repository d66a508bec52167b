"""Reading one host buffer's bytes from files in pieces that several threads fill at once.

A component read back from disk is needed unit by unit, in order, while it already computes. Read with one
thread per unit and several units at once, the disk's rate is shared among those units and they all arrive
together, the first one only after about as many unit read times as there are units in flight. On this
project's 2-core machine, 16 units of 256 MiB from a cold file, 8 threads: the first unit came at 1.22-1.67 s
and all at 3.14-3.76 s with one thread per unit, at 0.24-0.38 s and 2.16-2.32 s with every thread reading each
unit's pieces in turn (benchmarks/results/read_order_cpu_8threads.json). On a switch the component waits for its
first unit not read ahead, so that latency is the switch's.

So every read of a unit's bytes is a list of `FileSpan`, cut into pieces (`split_spans`) that a `PieceReader`
runs: on a pool of threads shared by the units in flight (the first unit's pieces queued first, so units
still complete in order), or here, in one piece, where no pool is given (`SERIAL`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

#: Pieces are never smaller than this (a unit below it is read in one piece, without a hop to the pool).
MIN_PIECE_BYTES = 4 << 20
#: Pieces are a whole number of these (large reads stay large and page aligned).
PIECE_ALIGN = 1 << 20
#: Buffers per ``preadv`` call (the usual IOV_MAX).
IOV_MAX = 1024
#: Units read at once: the next unit's pieces are queued while one unit is checked and page-locked, so the
#: readers never idle; more would share the disk among units and delay the first.
UNITS_IN_FLIGHT = 2


@dataclass(frozen=True)
class FileSpan:
    """Bytes ``[offset, offset + len(into))`` of the file at ``path``, read into the buffer view ``into``."""

    path: Path
    offset: int
    into: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.into)


def split_spans(spans: list[FileSpan], piece_bytes: int) -> list[list[FileSpan]]:
    """``spans`` in order, cut into pieces of ``piece_bytes`` each (the last may be smaller); a span crossing a
    piece's end is split there."""
    pieces: list[list[FileSpan]] = [[]]
    room = piece_bytes
    for span in spans:
        offset, into = span.offset, span.into
        while len(into):
            if room == 0:
                pieces.append([])
                room = piece_bytes
            take = min(room, len(into))
            pieces[-1].append(FileSpan(span.path, offset, into[:take]))
            offset, into, room = offset + take, into[take:], room - take
    return [piece for piece in pieces if piece]


def read_spans(spans: list[FileSpan], ended_early: Callable[[Path], Exception]) -> None:
    """Read every span in full; spans of one file that follow each other in it go in one ``preadv``. A file
    that ends before a span does raises ``ended_early(path)``."""
    fds: dict[Path, int] = {}
    try:
        for run in _runs(spans):
            path = run[0].path
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
            _read_exactly(fds[path], [span.into for span in run], run[0].offset, lambda p=path: ended_early(p))
    finally:
        for fd in fds.values():
            os.close(fd)


def _runs(spans: list[FileSpan]) -> list[list[FileSpan]]:
    """``spans`` grouped into runs that one ``preadv`` reads: same file, each starting where the one before ends."""
    runs: list[list[FileSpan]] = []
    for span in spans:
        if not span.nbytes:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last.path == span.path and last.offset + last.nbytes == span.offset:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def _read_exactly(fd: int, views: list[memoryview], offset: int, ended_early: Callable[[], Exception]) -> None:
    """``preadv`` until every view is full (a read may return less than asked)."""
    while views:
        got = os.preadv(fd, views[:IOV_MAX], offset)
        if got <= 0:
            raise ended_early()
        offset += got
        while got:
            if got >= len(views[0]):
                got -= len(views.pop(0))
            else:
                views[0] = views[0][got:]
                got = 0


@dataclass(frozen=True)
class PieceReader:
    """How one buffer's read is run: its pieces on ``pool`` at once (``threads`` of them: the piece size gives
    each thread one piece of a unit), or here in one piece when ``pool`` is None."""

    pool: Executor | None = None
    threads: int = 1

    def piece_bytes(self, nbytes: int) -> int:
        """The size of one piece of a buffer of ``nbytes``."""
        if self.pool is None or self.threads <= 1:
            return max(nbytes, 1)
        share = -(-nbytes // self.threads)
        return max(MIN_PIECE_BYTES, -(-share // PIECE_ALIGN) * PIECE_ALIGN)

    def run(self, pieces: list[Callable[[], None]]) -> None:
        """Run every piece and return when all ended; the first failure is raised after all ended (no piece is
        still writing into a buffer its caller then frees)."""
        if self.pool is None or len(pieces) <= 1:
            for piece in pieces:
                piece()
            return
        futures = [self.pool.submit(piece) for piece in pieces]
        wait(futures)
        for future in futures:
            future.result()

    def read(self, spans: list[FileSpan], ended_early: Callable[[Path], Exception]) -> None:
        """Read ``spans`` in full, in pieces (`split_spans`, `read_spans`)."""
        total = sum(span.nbytes for span in spans)
        pieces = split_spans(spans, self.piece_bytes(total))
        self.run([functools.partial(read_spans, piece, ended_early) for piece in pieces])


#: Reads in one piece, on the calling thread.
SERIAL = PieceReader()
