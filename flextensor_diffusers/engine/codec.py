# Triton kernel arguments stay unannotated: Triton reads annotations as specialisation hints.
# ruff: noqa: ANN001, ANN202
"""Exactly lossless compression of a unit's flat buffer, decoded on the device into the unit's slot.

Streaming a short workload is bound by the host→device link (~55 GB/s), not by the GPU. Floating-point
weights waste bits there: of a BF16 value's 8 exponent bits only ~2.7 bits of information remain, because
weights sit within a few octaves of their scale. This codec moves fewer bytes over the link and rebuilds the
exact bytes on the GPU, at several hundred GB/s, into the same slot the uncompressed copy would fill.

The scheme keeps decode embarrassingly parallel. Each float word is split by a bit shuffle into

* its *symbol*: the 8 bits ``[m, m+8)`` (``m = 8·W − 9`` for a ``W``-byte word: 7 for BF16/FP16, 23 for FP32);
  for BF16 and FP32 that is exactly the exponent field (for FP16: 5 exponent + 3 mantissa bits);
* its *rest*: ``(sign << m) | (low m bits)``, ``W − 1`` bytes that are nearly incompressible and stored raw.

Each segment's elements are cut into chunks of ``chunk`` elements (the last one shorter). A chunk codes
its symbols with fixed-length codes of ``b ∈ {1, 2, 3, 4, 8}`` bits, chosen per chunk to minimise its size:
with ``b < 8`` the ``2^b − 1`` most frequent symbols get codes ``0 … 2^b − 2`` (a 15-byte table per chunk)
and code ``2^b − 1`` *escapes* to the next byte of the chunk's escape stream; ``b = 8`` codes the symbol
itself and never escapes. Element ``i`` finds its code at bit ``i·b`` without reading any other element's,
and its escape (if any) at the chunk's escape offset plus the number of escapes before it in the chunk (a
prefix sum inside the chunk). On normal-random BF16 weights the usual choice is ``b = 3`` with ~2–3 %
escapes: ~11.2 of 16 bits, a ratio ~0.70 (the exponent entropy would allow ~0.67).

Segments of other dtypes (int64 buffers, …), of misaligned placement, or too small to be worth a chunk's
metadata are stored raw and copied verbatim by the same kernel.

Payload layout (one flat ``uint8`` tensor, everything the device needs; sections aligned to 64 bytes):

* ``rows``: ``int64[n_rows, 8]``. Rows ``[0, n16)`` are chunks of 16-bit words, ``[n16, n16 + n32)`` chunks
  of 32-bit words, each ``(out_off, n, raw_off, plane, code_off, esc_off, table_off, b)``; the remaining
  ``n_pieces`` rows are verbatim copies ``(out_off, nbytes, src_off, 0, 0, 0, 0, 0)``. All offsets are in
  bytes, ``*_off`` other than ``out_off`` relative to the payload start.
* ``tables``: ``2^b − 1`` bytes per chunk (none for ``b = 8``), symbol of code ``c`` at ``table_off + c``.
* ``codes``: chunk codes, little-endian bit strings, followed by one pad byte (the decoder reads a
  two-byte window for every code, so the window of the last code stays inside the payload).
* ``escapes``: the escaped symbols of each chunk, in element order.
* ``planes``: byte ``k`` of element ``i``'s rest at ``raw_off + k·plane + i``.
* ``verbatim``: raw segments' bytes, each at a 64-byte aligned offset.

Invariants the decoder relies on: a chunk never crosses a segment; ``out_off`` of a chunk and its
``raw_off`` are multiples of 16 and every chunk but a segment's last holds exactly ``chunk`` elements
(a multiple of 16), so full chunks are decoded with unmasked, vectorised loads and stores; segments
do not overlap, so decode order is free. Bytes of the flat buffer outside segments are not preserved.
"""

from __future__ import annotations

import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

try:  # Triton is only needed for the device decoder; encoding and the CPU decoder work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

logger = logging.getLogger(__name__)

#: Element count of a chunk: large enough that the 80 bytes of row + table per chunk cost ~0.25 %,
#: small enough that each chunk's table follows the local exponent distribution. A multiple of 16.
DEFAULT_CHUNK = 16384
#: Segments with fewer elements are stored raw: a chunk's metadata would eat what coding saves.
DEFAULT_MIN_ELEMENTS = 256
#: Elements a decode program handles per step (the in-chunk escape prefix sum runs over this many).
DEFAULT_BLOCK = 2048
#: Bytes a verbatim-copy program moves per step.
COPY_BLOCK = 4096
#: Bytes per verbatim-copy program.
VERBATIM_PIECE = 1 << 16
#: Alignment of every payload section and verbatim segment; row offsets need 8, vector loads 16.
SECTION_ALIGN = 64
ROW_WORDS = 8
CODE_BITS = (1, 2, 3, 4, 5, 6, 7)  # table-coded widths; 8 (identity, no escape) is always a candidate too

#: Dtypes whose words are shuffled into (exponent symbol, rest), with their word size in bytes.
CODED_DTYPES: dict[torch.dtype, int] = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}
_WORD_NP = {2: np.uint16, 4: np.uint32}


class CodecError(ValueError):
    """A unit cannot be encoded or decoded as asked; the message names the fix."""


@dataclass(frozen=True)
class Segment:
    """A tensor's place inside a unit's flat buffer: ``nbytes`` bytes at byte ``offset``, holding ``dtype``."""

    offset: int
    nbytes: int
    dtype: torch.dtype


@dataclass(frozen=True)
class EncodedUnit:
    """A unit's flat buffer in coded form.

    ``payload`` is everything the decoder reads on the device (copy it in one transfer); the other fields are
    host-side launch parameters, so :func:`decode_into` never reads the payload on the host. ``raw_nbytes``
    is the size of the flat buffer it came from (what an uncompressed copy moves) and the least size of
    the decode target; ``stored_nbytes`` is the payload's size, metadata included.
    """

    payload: torch.Tensor
    raw_nbytes: int
    stored_nbytes: int
    segments: tuple[Segment, ...]
    chunk: int
    n16: int  # rows of 16-bit chunks
    n32: int  # rows of 32-bit chunks
    n_pieces: int  # rows of verbatim copies
    coded_raw_nbytes: int  # bytes of segments that went through the coder (the rest is verbatim)

    @property
    def ratio(self) -> float:
        """Bytes moved over the link per byte of the flat buffer (1.0 for an empty unit)."""
        return self.stored_nbytes / self.raw_nbytes if self.raw_nbytes else 1.0

    @property
    def n_rows(self) -> int:
        return self.n16 + self.n32 + self.n_pieces


def worth_compressing(
    encoded: EncodedUnit, *, link_gbps: float = 55.0, decode_gbps: float = 300.0, max_ratio: float = 0.95
) -> bool:
    """Whether streaming ``encoded`` beats streaming the raw buffer.

    The coded form moves ``stored_nbytes`` over the link and then spends ``raw_nbytes / decode_gbps`` on the
    device; the raw form moves ``raw_nbytes``. When copy and decode of successive units overlap, the stream
    runs at the slower of the two, so both must beat the raw copy; ``max_ratio`` keeps a margin for the
    decode kernel's share of the GPU, which the workload would otherwise use.
    """
    if encoded.raw_nbytes == 0 or encoded.ratio > max_ratio:
        return False
    raw_s = encoded.raw_nbytes / (link_gbps * 1e9)
    coded_s = max(encoded.stored_nbytes / (link_gbps * 1e9), encoded.raw_nbytes / (decode_gbps * 1e9))
    return coded_s < raw_s


# ----------------------------------------------------------------------------------------------------------
# Encoder (host, vectorised over the elements of a batch of chunks)
# ----------------------------------------------------------------------------------------------------------


def _align(n: int, alignment: int = SECTION_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def _check_segments(flat: torch.Tensor, segments: list[Segment]) -> None:
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.device.type != "cpu" or not flat.is_contiguous():
        raise CodecError(
            f"encode_unit needs a contiguous 1-D uint8 CPU tensor, got {flat.dtype} {tuple(flat.shape)} on "
            f"{flat.device}; pass the unit's flat host buffer"
        )
    spans = sorted((s.offset, s.offset + s.nbytes) for s in segments if s.nbytes)
    for s in segments:
        if s.offset < 0 or s.nbytes < 0 or s.offset + s.nbytes > flat.numel():
            raise CodecError(f"{s} lies outside the flat buffer of {flat.numel()} bytes; fix the unit's layout")
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise CodecError(f"segments overlap at byte {start}; each byte of the flat buffer belongs to one tensor")


def _is_coded(seg: Segment, min_elements: int) -> bool:
    width = CODED_DTYPES.get(seg.dtype)
    return (
        width is not None
        and seg.offset % 16 == 0  # vector stores of a chunk's words need 16-byte aligned chunk starts
        and seg.nbytes % width == 0
        and seg.nbytes // width >= max(min_elements, 1)
    )


@dataclass
class _CodedClass:
    """What the encoder produced for the coded segments of one word width, before payload placement."""

    width: int
    rows: np.ndarray  # int64[n, 8], code/esc/table offsets relative to their section, raw_off to the planes
    codes: np.ndarray  # uint8
    escapes: np.ndarray  # uint8
    planes: np.ndarray  # uint8[width - 1, plane]
    tables: np.ndarray  # uint8, the chunks' tables back to back


@dataclass
class _Batch:
    """Consecutive chunks of one segment, coded."""

    bits: np.ndarray  # int64[k]
    code_nbytes: np.ndarray  # int64[k]
    esc_count: np.ndarray  # int64[k]
    table_nbytes: np.ndarray  # int64[k]
    tables: np.ndarray  # uint8, the chunks' tables back to back
    codes: np.ndarray  # uint8, the chunks' code bytes back to back
    escapes: np.ndarray  # uint8
    rest: np.ndarray  # the words without their symbol bits, same dtype as the words


def _encode_batch(words: np.ndarray, chunk: int) -> _Batch:
    """Code ``words`` (a whole number of chunks, but for a segment's last) as consecutive chunks of ``chunk``.

    The words are laid out as a ``(k, chunk)`` matrix, the last row padded; padding never enters a histogram
    (it counts in bin 256) and is cut from the codes.
    """
    width = words.itemsize
    m = 8 * width - 9
    n = len(words)
    k = -(-n // chunk)
    lengths = np.full(k, chunk, dtype=np.int64)
    lengths[-1] = n - (k - 1) * chunk
    if n < k * chunk:
        words = np.concatenate([words, np.zeros(k * chunk - n, dtype=words.dtype)])
    sym = ((words >> m) & 0xFF).astype(np.int32).reshape(k, chunk)
    rest = ((words >> 8) & (1 << m)) | (words & ((1 << m) - 1))

    keyed = sym + (np.arange(k, dtype=np.int32) * 256)[:, None]  # (chunk, symbol) as one index
    hist = np.bincount(keyed.reshape(-1), minlength=k * 256).reshape(k, 256)
    hist[-1, 0] -= k * chunk - n  # the padding words are zeros: symbol 0
    order = np.argsort(-hist, axis=1, kind="stable")  # symbols by falling frequency, ties by value
    covered = np.cumsum(np.take_along_axis(hist, order, axis=1), axis=1)
    cost = np.stack(
        [lengths * b + 8 * (lengths - covered[:, (1 << b) - 2] + (1 << b) - 1) for b in CODE_BITS] + [8 * lengths],
        axis=1,
    )
    bits = np.asarray([*CODE_BITS, 8], dtype=np.int64)[np.argmin(cost, axis=1)]

    esc_code = (1 << bits) - 1
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(256)[None, :], axis=1)
    code_of = np.where(rank < esc_code[:, None], rank, esc_code[:, None])
    code_of = np.where(bits[:, None] == 8, np.arange(256)[None, :], code_of).astype(np.uint8)
    code = code_of.reshape(-1)[keyed]
    code[-1, lengths[-1] :] = 0
    is_esc = code == np.where(bits < 8, esc_code, 256).astype(np.int16)[:, None]  # b = 8 never escapes
    is_esc[-1, lengths[-1] :] = False
    escapes = sym[is_esc].astype(np.uint8)  # row-major: chunk by chunk, in element order

    # Eight b-bit codes fill b bytes exactly: pack them as one little-endian integer per group of eight.
    code_nbytes = (lengths * bits + 7) // 8
    groups = code.reshape(k, chunk // 8, 8)
    packed_by_bits = {8: code}
    for b in set(bits.tolist()) - {8}:
        word_type = np.uint32 if b <= 4 else np.uint64
        word = sum(groups[:, :, j].astype(word_type) << word_type(b * j) for j in range(8))
        size = np.dtype(word_type).itemsize
        packed_by_bits[b] = word.view(np.uint8).reshape(k, chunk // 8, size)[:, :, :b].reshape(k, -1)
    codes = np.concatenate(
        [
            packed_by_bits[b][row, :size]
            for row, (b, size) in enumerate(zip(bits.tolist(), code_nbytes.tolist(), strict=True))
        ]
    )

    table_nbytes = np.where(bits < 8, esc_code, 0)
    tables = np.concatenate([order[row, :size] for row, size in enumerate(table_nbytes.tolist())]).astype(np.uint8)
    return _Batch(bits, code_nbytes, is_esc.sum(axis=1), table_nbytes, tables, codes, escapes, rest[:n])


def _encode_class(flat_np: np.ndarray, segments: list[Segment], width: int, chunk: int) -> _CodedClass:
    """Code every segment of one word width.

    Chunks are coded in batches of ~1M elements, so temporaries stay small, on a thread pool (numpy releases
    the GIL); each batch writes its own slice of the planes, and offsets are assigned in order afterwards.
    """
    word_np = _WORD_NP[width]
    counts = [s.nbytes // width for s in segments]
    # Each segment's rest words start at a multiple of 16 elements in the planes, so raw_off stays 16-aligned.
    plane_starts = np.concatenate(([0], np.cumsum([_align(n, 16) for n in counts]))).astype(np.int64)
    planes = np.zeros((width - 1, _align(int(plane_starts[-1]), SECTION_ALIGN)), dtype=np.uint8)
    span = max(1, (1 << 20) // chunk) * chunk
    jobs = [
        (seg, n, int(plane_start), first)
        for seg, n, plane_start in zip(segments, counts, plane_starts, strict=False)
        for first in range(0, n, span)
    ]

    def run(job: tuple[Segment, int, int, int]) -> _Batch:
        seg, n, plane_start, first = job
        stop = min(n, first + span)
        words = flat_np[seg.offset + first * width : seg.offset + stop * width].view(word_np)
        batch = _encode_batch(words, chunk)
        for byte in range(width - 1):
            planes[byte, plane_start + first : plane_start + stop] = (batch.rest >> (8 * byte)).astype(np.uint8)
        return batch

    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        batches = list(pool.map(run, jobs))

    rows = []
    code_pos = esc_pos = table_pos = 0
    for (seg, n, plane_start, first), batch in zip(jobs, batches, strict=True):
        k = len(batch.bits)
        starts = first + np.arange(k, dtype=np.int64) * chunk
        batch_rows = np.zeros((k, ROW_WORDS), dtype=np.int64)
        batch_rows[:, 0] = seg.offset + starts * width
        batch_rows[:, 1] = np.minimum(chunk, n - starts)
        batch_rows[:, 2] = plane_start + starts
        batch_rows[:, 3] = planes.shape[1]
        batch_rows[:, 4] = code_pos + np.concatenate(([0], np.cumsum(batch.code_nbytes)[:-1]))
        batch_rows[:, 5] = esc_pos + np.concatenate(([0], np.cumsum(batch.esc_count)[:-1]))
        batch_rows[:, 6] = table_pos + np.concatenate(([0], np.cumsum(batch.table_nbytes)[:-1]))
        batch_rows[:, 7] = batch.bits
        rows.append(batch_rows)
        code_pos += len(batch.codes)
        esc_pos += len(batch.escapes)
        table_pos += len(batch.tables)
    empty = np.zeros(0, dtype=np.uint8)
    return _CodedClass(
        width=width,
        rows=np.concatenate(rows) if rows else np.zeros((0, ROW_WORDS), dtype=np.int64),
        codes=np.concatenate([b.codes for b in batches]) if batches else empty,
        escapes=np.concatenate([b.escapes for b in batches]) if batches else empty,
        planes=planes,
        tables=np.concatenate([b.tables for b in batches]) if batches else empty,
    )


def encode_unit(
    flat: torch.Tensor,
    segments: list[Segment],
    *,
    chunk: int = DEFAULT_CHUNK,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
) -> EncodedUnit:
    """Encode the segments of a unit's flat host buffer; see the module docstring for the format.

    ``chunk`` (a multiple of 16) is the element count of a coding chunk; segments of fewer than
    ``min_elements`` elements are stored verbatim. The result decodes to the exact bytes of every segment.
    """
    if chunk <= 0 or chunk % 16:
        raise CodecError(f"chunk={chunk} must be a positive multiple of 16")
    segments = list(segments)
    _check_segments(flat, segments)
    flat_np = flat.numpy()
    by_width: dict[int, list[Segment]] = {2: [], 4: []}
    verbatim: list[Segment] = []
    for seg in segments:
        if not seg.nbytes:
            continue
        if _is_coded(seg, min_elements):
            by_width[CODED_DTYPES[seg.dtype]].append(seg)
        else:
            verbatim.append(seg)
    classes = [_encode_class(flat_np, by_width[w], w, chunk) for w in (2, 4)]

    pieces = [
        (seg.offset + start, min(VERBATIM_PIECE, seg.nbytes - start), seg, start)
        for seg in verbatim
        for start in range(0, seg.nbytes, VERBATIM_PIECE)
    ]
    n_coded = sum(len(c.rows) for c in classes)
    n_rows = n_coded + len(pieces)

    # Section placement.
    pos = _align(n_rows * ROW_WORDS * 8)
    tables_off, pos = pos, _align(pos + sum(len(c.tables) for c in classes))
    codes_off = pos
    pos += sum(len(c.codes) for c in classes) + 1  # + the pad byte of the two-byte code window
    escapes_off, pos = _align(pos), _align(pos) + sum(len(c.escapes) for c in classes)
    pos = _align(pos)
    planes_off = []
    for c in classes:
        planes_off.append(pos)
        pos = _align(pos + c.planes.size)
    verbatim_off = {}
    for seg in verbatim:
        verbatim_off[seg] = pos
        pos = _align(pos + seg.nbytes)
    total = _align(pos, 512)

    payload = np.zeros(total, dtype=np.uint8)
    all_rows = np.zeros((n_rows, ROW_WORDS), dtype=np.int64)
    row = 0
    table_base = tables_off
    code_base, esc_base = codes_off, escapes_off
    for c, p_off in zip(classes, planes_off, strict=True):
        k = len(c.rows)
        r = c.rows.copy()
        r[:, 2] += p_off
        r[:, 4] += code_base
        r[:, 5] += esc_base
        r[:, 6] += table_base
        all_rows[row : row + k] = r
        payload[table_base : table_base + len(c.tables)] = c.tables
        payload[code_base : code_base + len(c.codes)] = c.codes
        payload[esc_base : esc_base + len(c.escapes)] = c.escapes
        payload[p_off : p_off + c.planes.size] = c.planes.reshape(-1)
        row += k
        table_base += len(c.tables)
        code_base += len(c.codes)
        esc_base += len(c.escapes)
    for out_off, nbytes, seg, start in pieces:
        all_rows[row] = (out_off, nbytes, verbatim_off[seg] + start, 0, 0, 0, 0, 0)
        row += 1
    for seg in verbatim:
        payload[verbatim_off[seg] : verbatim_off[seg] + seg.nbytes] = flat_np[seg.offset : seg.offset + seg.nbytes]
    payload[: all_rows.nbytes] = all_rows.reshape(-1).view(np.uint8)

    return EncodedUnit(
        payload=torch.from_numpy(payload),
        raw_nbytes=flat.numel(),
        stored_nbytes=total,
        segments=tuple(segments),
        chunk=chunk,
        n16=len(classes[0].rows),
        n32=len(classes[1].rows),
        n_pieces=len(pieces),
        coded_raw_nbytes=sum(s.nbytes for w in (2, 4) for s in by_width[w]),
    )


# ----------------------------------------------------------------------------------------------------------
# Decoders: a Triton kernel for the device, torch ops for the CPU (correctness, not speed)
# ----------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _decode_block(
        payload_ptr,
        out_words,
        start,
        n,
        raw_off,
        plane,
        code_off,
        esc_off,
        table_off,
        bits,
        seen,
        W: tl.constexpr,
        BLOCK: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """Decode elements ``[start, start + BLOCK)`` of a chunk after ``seen`` escapes; returns the new ``seen``."""
        idx = start + tl.arange(0, BLOCK)
        if MASKED:  # noqa: SIM108 - a constexpr branch, resolved when the kernel is compiled
            valid = idx < n
        else:
            valid = tl.full([BLOCK], 1, tl.int1)
        pos = idx * bits
        code_ptr = payload_ptr + code_off + (pos >> 3)
        lo = tl.load(code_ptr, mask=valid, other=0).to(tl.uint32)
        hi = tl.load(code_ptr + 1, mask=valid, other=0).to(tl.uint32)
        esc_code = (1 << bits) - 1
        code = (((lo | (hi << 8)) >> (pos & 7).to(tl.uint32)) & esc_code.to(tl.uint32)).to(tl.int32)
        coded = bits < 8
        is_esc = valid & coded & (code == esc_code)
        esc_flag = is_esc.to(tl.int32)
        slot = seen + tl.cumsum(esc_flag, axis=0) - esc_flag
        esc = tl.load(payload_ptr + esc_off + slot, mask=is_esc, other=0).to(tl.uint32)
        tab = tl.load(payload_ptr + table_off + code, mask=valid & coded & (code < esc_code), other=0).to(tl.uint32)
        sym = tl.where(coded, tl.where(is_esc, esc, tab), code.to(tl.uint32))
        rest = tl.load(payload_ptr + raw_off + idx, mask=valid, other=0).to(tl.uint32)
        if W == 4:
            rest |= tl.load(payload_ptr + raw_off + plane + idx, mask=valid, other=0).to(tl.uint32) << 8
            rest |= tl.load(payload_ptr + raw_off + 2 * plane + idx, mask=valid, other=0).to(tl.uint32) << 16
        m = 8 * W - 9
        word = ((rest >> m) << (m + 8)) | (sym << m) | (rest & ((1 << m) - 1))
        if W == 2:
            tl.store(out_words + idx, word.to(tl.uint16), mask=valid)
        else:
            tl.store(out_words + idx, word, mask=valid)
        return seen + tl.sum(esc_flag, axis=0)

    @triton.jit
    def _decode_chunk(payload_ptr, out_ptr, row, W: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        out_off = tl.multiple_of(tl.load(row), 16)
        n = tl.load(row + 1).to(tl.int32)
        raw_off = tl.multiple_of(tl.load(row + 2), 16)
        plane = tl.multiple_of(tl.load(row + 3), 16)
        code_off = tl.load(row + 4)
        esc_off = tl.load(row + 5)
        table_off = tl.load(row + 6)
        bits = tl.load(row + 7).to(tl.int32)
        if W == 2:
            out_words = (out_ptr + out_off).to(tl.pointer_type(tl.uint16))
        else:
            out_words = (out_ptr + out_off).to(tl.pointer_type(tl.uint32))
        seen = n * 0
        if n == CHUNK:  # every chunk but a segment's last: no masks, so loads and stores vectorise
            for start in range(0, CHUNK, BLOCK):
                seen = _decode_block(
                    payload_ptr, out_words, start, n, raw_off, plane, code_off, esc_off, table_off, bits, seen,
                    W, BLOCK, False,
                )  # fmt: skip
        else:
            for start in range(0, n, BLOCK):
                seen = _decode_block(
                    payload_ptr, out_words, start, n, raw_off, plane, code_off, esc_off, table_off, bits, seen,
                    W, BLOCK, True,
                )  # fmt: skip

    @triton.jit
    def _copy_piece(payload_ptr, out_ptr, row, BLOCK: tl.constexpr):
        out_off = tl.load(row)
        nbytes = tl.load(row + 1).to(tl.int32)
        src_off = tl.load(row + 2)
        for start in range(0, nbytes, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            keep = idx < nbytes
            tl.store(out_ptr + out_off + idx, tl.load(payload_ptr + src_off + idx, mask=keep), mask=keep)

    @triton.jit
    def _decode_unit_kernel(
        payload_ptr, out_ptr, n16, n32, CHUNK: tl.constexpr, BLOCK: tl.constexpr, COPY_BLOCK: tl.constexpr
    ):
        """One program per row: a 16-bit chunk, a 32-bit chunk or a verbatim piece."""
        pid = tl.program_id(0)
        row = payload_ptr.to(tl.pointer_type(tl.int64)) + pid * 8
        if pid < n16:
            _decode_chunk(payload_ptr, out_ptr, row, 2, CHUNK, BLOCK)
        elif pid < n16 + n32:
            _decode_chunk(payload_ptr, out_ptr, row, 4, CHUNK, BLOCK)
        else:
            _copy_piece(payload_ptr, out_ptr, row, COPY_BLOCK)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_decode_args(encoded: EncodedUnit, payload: torch.Tensor, out: torch.Tensor) -> None:
    if payload.dtype != torch.uint8 or out.dtype != torch.uint8 or payload.dim() != 1 or out.dim() != 1:
        raise CodecError("decode_into needs 1-D uint8 tensors for the payload and the output slot")
    if not (payload.is_contiguous() and out.is_contiguous()):
        raise CodecError("decode_into needs contiguous payload and output tensors")
    if payload.device != out.device:
        raise CodecError(f"payload is on {payload.device} but out is on {out.device}; copy the payload first")
    if payload.numel() < encoded.stored_nbytes:
        raise CodecError(f"payload has {payload.numel()} bytes, the unit stored {encoded.stored_nbytes}")
    if out.numel() < encoded.raw_nbytes:
        raise CodecError(f"out has {out.numel()} bytes, the unit needs {encoded.raw_nbytes}; pass the whole slot")


def decode_into(
    encoded: EncodedUnit,
    payload_on_device: torch.Tensor,
    out: torch.Tensor,
    *,
    backend: Literal["auto", "triton", "torch"] = "auto",
    block: int | None = None,
    num_warps: int = 4,
) -> None:
    """Write the exact bytes of every segment of ``encoded`` into ``out``.

    ``payload_on_device`` is a copy of ``encoded.payload`` (it may be longer, e.g. a slot); ``out`` is a uint8
    tensor of at least ``raw_nbytes`` on the same device. Bytes of ``out`` outside segments are left as they
    were. On CUDA (``backend="auto"``) this enqueues one Triton kernel on the current stream: no host
    synchronisation, no allocation, no scratch; the caller orders it after the payload's copy and before the
    unit's use, as for any kernel. Both base pointers must be 16-byte aligned (any tensor of the caching
    allocator, and any 512-aligned offset into one, is). ``backend="torch"`` (the CPU default) uses torch ops,
    allocates temporaries and reads the payload on the host; it is for tests. ``backend="triton"`` on CPU
    tensors runs the kernel under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported).
    ``block`` (a power of two dividing ``encoded.chunk``; default the largest such up to ``DEFAULT_BLOCK``) and
    ``num_warps`` tune the kernel.
    """
    _check_decode_args(encoded, payload_on_device, out)
    if backend == "auto":
        backend = "triton" if payload_on_device.is_cuda else "torch"
    if backend == "torch":
        _decode_torch(encoded, payload_on_device, out)
        return
    if triton is None:
        raise CodecError("the device decoder needs Triton; install triton or pass backend='torch'")
    if not payload_on_device.is_cuda and not _interpreting():
        raise CodecError("the Triton decoder on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    if block is None:
        block = min(DEFAULT_BLOCK, encoded.chunk & -encoded.chunk)
    if block <= 0 or block & (block - 1) or encoded.chunk % block:
        raise CodecError(f"block={block} must be a power of two dividing the unit's chunk ({encoded.chunk})")
    if payload_on_device.data_ptr() % 16 or out.data_ptr() % 16:
        raise CodecError("payload and out must start at 16-byte aligned addresses; pass 512-aligned slot offsets")
    if encoded.n_rows == 0:
        return
    _decode_unit_kernel[(encoded.n_rows,)](
        payload_on_device,
        out,
        encoded.n16,
        encoded.n32,
        CHUNK=encoded.chunk,
        BLOCK=block,
        COPY_BLOCK=COPY_BLOCK,
        num_warps=num_warps,
    )


def _decode_torch(encoded: EncodedUnit, payload: torch.Tensor, out: torch.Tensor) -> None:
    """The format's reference decoder, vectorised over all elements of a word width (reads rows from the payload)."""
    if encoded.n_rows == 0:
        return
    rows = payload[: encoded.n_rows * ROW_WORDS * 8].cpu().clone().view(torch.int64).reshape(-1, ROW_WORDS)
    host = payload.cpu()
    for first, stop, width in ((0, encoded.n16, 2), (encoded.n16, encoded.n16 + encoded.n32, 4)):
        if stop == first:
            continue
        out_off, n, raw_off, plane, code_off, esc_off, table_off, bits = rows[first:stop].unbind(1)
        cid = torch.repeat_interleave(torch.arange(stop - first), n)
        starts = torch.cumsum(n, 0) - n
        i = torch.arange(int(n.sum())) - starts[cid]
        b = bits[cid]
        pos = i * b
        byte = code_off[cid] + (pos >> 3)
        window = host[byte].long() | (host[byte + 1].long() << 8)
        esc_code = (1 << b) - 1
        code = (window >> (pos & 7)) & esc_code
        coded = b < 8
        is_esc = coded & (code == esc_code)
        flag = is_esc.long()
        before = torch.cumsum(flag, 0) - flag  # escapes before each element, over the whole width class
        slot = esc_off[cid] + before - before[starts][cid]
        esc = host[torch.where(is_esc, slot, 0)].long()
        tab = host[table_off[cid] + torch.where(coded & ~is_esc, code, 0)].long()
        sym = torch.where(coded, torch.where(is_esc, esc, tab), code)
        rest = torch.zeros_like(i)
        for k in range(width - 1):
            rest |= host[raw_off[cid] + k * plane[cid] + i].long() << (8 * k)
        m = 8 * width - 9
        word = ((rest >> m) << (m + 8)) | (sym << m) | (rest & ((1 << m) - 1))
        dst = (out_off[cid] + width * i).to(out.device)
        for k in range(width):
            out[dst + k] = ((word >> (8 * k)) & 0xFF).to(torch.uint8).to(out.device)
    for out_off, nbytes, src_off, *_ in rows[encoded.n16 + encoded.n32 :].tolist():
        out[out_off : out_off + nbytes].copy_(payload[src_off : src_off + nbytes])


def decode_to_host(encoded: EncodedUnit, *, backend: Literal["auto", "triton", "torch"] = "auto") -> torch.Tensor:
    """Decode on the host into a fresh zeroed buffer of ``raw_nbytes`` (tests, checks)."""
    out = torch.zeros(encoded.raw_nbytes, dtype=torch.uint8)
    decode_into(encoded, encoded.payload, out, backend=backend)
    return out
