"""Reading a unit's bytes in pieces that several threads fill at once (`storage.file_reads`), and the host tier's
read backs through it: the bytes read are the file's, a failure is raised only once no piece still writes, and
the experts taking turns on disk stay bitwise when every unit is read in many pieces."""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flextensor_diffusers.storage import disk_reads, file_reads
from flextensor_diffusers.storage.file_reads import FileSpan, PieceReader, read_spans, split_spans
from tests.models import set_host_overhead, wan_latents
from tests.test_compressed_tier import enable_one_expert_in_ram
from tests.test_host_tier import load, save, smallest_budgets, tier_of


class EndedEarly(Exception):
    pass


def scattered_spans(path: Path, view: memoryview, expected: bytearray, rng: random.Random) -> list[FileSpan]:
    """Spans of ``path`` into ``view`` at scattered places (some following each other in the file, some not, some
    empty); what they bring is written into ``expected`` (a bytearray of ``view``'s size) at the same places."""
    data = path.read_bytes()
    spans, at, file_at = [], 0, 0
    while at < len(view) and file_at < len(data):
        n = min(rng.randrange(0, 5000), len(view) - at, len(data) - file_at)
        spans.append(FileSpan(path, file_at, view[at : at + n]))
        expected[at : at + n] = data[file_at : file_at + n]
        at += n + rng.choice((0, 0, 7, 512))  # a gap in the buffer (alignment padding)
        file_at += n + rng.choice((0, 0, 0, 33))  # a gap in the file (another tensor)
    return spans


def test_split_spans_covers_every_byte_once_in_order_within_the_piece_size() -> None:
    """Cut at any size, the pieces' views hold the spans' bytes in order (the buffer is random, so a view cut at
    the wrong place shows), each cut part's file offset follows the one before, and no piece is over the size."""
    rng = random.Random(0)
    buffer = bytearray(os.urandom(100_000))
    view = memoryview(buffer)
    spans = [FileSpan(Path("f"), 10 * i, view[i * 1000 : i * 1000 + rng.randrange(0, 1000)]) for i in range(90)]
    for piece_bytes in (1, 777, 4096, 10**9):
        pieces = split_spans(spans, piece_bytes)
        assert all(0 < sum(s.nbytes for s in piece) <= piece_bytes for piece in pieces)
        parts = iter([s for piece in pieces for s in piece])
        for span in spans:
            got, offset = b"", span.offset
            while len(got) < span.nbytes:
                part = next(parts)
                assert part.path == span.path and part.offset == offset
                got, offset = got + bytes(part.into), offset + part.nbytes
            assert got == bytes(span.into)
        assert next(parts, None) is None


@pytest.mark.parametrize("threads", [1, 3])
def test_pieces_read_the_files_bytes_into_their_places(tmp_path, threads) -> None:
    """Scattered spans of two files into one buffer, read in pieces of 300 bytes on 3 threads (or here, one piece
    at a time), and in shuffled order: the buffer holds the files' bytes at their places and zeros elsewhere."""
    rng = random.Random(threads)
    buffer, expected = bytearray(120_000), bytearray(120_000)
    spans = []
    for name, start in (("a", 0), ("b", 60_000)):
        path = tmp_path / name
        path.write_bytes(os.urandom(60_000))
        view = memoryview(buffer)[start : start + 60_000]
        spans += scattered_spans(path, view, memoryview(expected)[start : start + 60_000], rng)  # type: ignore[arg-type]
    with ThreadPoolExecutor(threads) as pool:
        reader = PieceReader(pool, threads) if threads > 1 else file_reads.SERIAL
        pieces = split_spans(spans, 300)
        assert len(pieces) > 10
        reader.run([functools.partial(read_spans, piece, EndedEarly) for piece in pieces])
    assert buffer == expected
    buffer[:] = bytes(len(buffer))
    file_reads.SERIAL.read(rng.sample(spans, len(spans)), EndedEarly)  # each span read where it says
    assert buffer == expected


def test_a_file_that_ends_before_a_span_raises_its_error(tmp_path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 1000)
    buffer = bytearray(2000)
    with pytest.raises(EndedEarly):
        read_spans([FileSpan(path, 500, memoryview(buffer))], EndedEarly)


def test_a_failed_piece_is_raised_only_after_every_piece_ended() -> None:
    """The caller frees the buffer when the read fails: no piece may still be writing into it then."""
    ended = threading.Event()

    def fails() -> None:
        raise OSError(5, "Input/output error")

    def slow() -> None:
        time.sleep(0.2)
        ended.set()

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(OSError):
            PieceReader(pool, 2).run([fails, slow])
        assert ended.is_set()


def test_piece_sizes_give_each_thread_one_piece_and_never_less_than_the_minimum() -> None:
    with ThreadPoolExecutor(1) as pool:
        reader = PieceReader(pool, 8)
        assert reader.piece_bytes(488 << 20) == 61 << 20  # one piece a thread, whole MiB
        assert reader.piece_bytes(1 << 20) == file_reads.MIN_PIECE_BYTES  # a small unit: one piece
    assert file_reads.SERIAL.piece_bytes(488 << 20) == 488 << 20


@pytest.fixture
def tiny_pieces(monkeypatch):
    """Every unit read in 4 pieces on 4 threads (of at least 512 bytes: the tiny models' units, tens of KB, go
    through the piece pool); the piece counts of every read, in a list."""
    monkeypatch.setattr(disk_reads, "READ_THREADS", 4)
    monkeypatch.setattr(file_reads, "MIN_PIECE_BYTES", 512)
    monkeypatch.setattr(file_reads, "PIECE_ALIGN", 512)
    pieces: list[int] = []
    real = PieceReader.run

    def counted(self, parts):
        pieces.append(len(parts))
        return real(self, parts)

    monkeypatch.setattr(PieceReader, "run", counted)
    return pieces


def test_experts_read_back_from_their_weight_files_in_pieces_stay_bitwise(tmp_path, tiny_pieces, monkeypatch) -> None:
    """Raw host tier, the experts waiting in their own (sharded) weight files: each unit read back in many pieces
    on several threads, three generations bitwise equal to native."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    folder = save(tmp_path / "wan22", "200KB")
    reference = wan_latents(load(folder))
    pipe = load(folder)
    gpu, host = smallest_budgets(pipe, tmp_path / "cache")
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host, cache_dir=tmp_path / "cache")
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(3))
    report = tier_of(pipe).report()
    assert {c["source"] for c in report["components"].values()} == {"weights files"}
    assert len(report["switches"]) >= 3 and max(tiny_pieces) == 4  # read back, in many pieces
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)


def test_experts_read_back_compressed_in_pieces_stay_bitwise(tmp_path, tiny_pieces, monkeypatch) -> None:
    """Compressed tier: each payload read back from the payload file in many pieces, checked against its CRC-32
    once all are in; three generations bitwise equal to native."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    folder = save(tmp_path / "wan22", "200KB")
    reference = wan_latents(load(folder))
    pipe = load(folder)
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(3))
    assert len(tier_of(pipe).report()["switches"]) >= 3 and max(tiny_pieces) == 4
    pipe.disable_flextensor_offload()


def test_the_payload_file_read_at_set_up_in_pieces_is_used_or_refused_as_whole_reads_are(
    tmp_path, tiny_pieces, monkeypatch
) -> None:
    """A set-up that reads the payload file (`compressed_copies.PayloadArrival`) with every payload in pieces: the
    whole scenario of `test_the_payload_cache_is_read_back_and_refused_when_the_weights_changed` holds as it does
    with whole reads (written, read back bitwise, refused when stale, refused when cut short, written again)."""
    from tests.test_compression import test_the_payload_cache_is_read_back_and_refused_when_the_weights_changed

    test_the_payload_cache_is_read_back_and_refused_when_the_weights_changed(tmp_path, "cpu", monkeypatch)
    assert max(tiny_pieces) >= 2  # the payloads were read in pieces
