# Triton kernel arguments stay unannotated: Triton reads annotations as specialisation hints.
# ruff: noqa: ANN001, ANN202
"""Exactly lossless compression of a unit's flat buffer, decoded on the device into the unit's slot.

Streaming a short workload is bound by the host→device link, not by the GPU. Floating-point weights waste
bits there: of a BF16 value's 8 exponent bits only about a third carry information, because weights sit within
a few octaves of their scale. This codec moves fewer bytes over the link and rebuilds the exact bytes on the
GPU, into the same slot the uncompressed copy would fill. That pays only while decoding outpaces the link, which
`worth_compressing` checks per unit (measured link and decode rates: see benchmarks/results/README.md).

The scheme keeps decode embarrassingly parallel. Each float word is split by a bit shuffle into

* its *symbol*: the 8 bits ``[m, m+8)`` (``m = 8·W − 9`` for a ``W``-byte word: 7 for BF16/FP16, 23 for FP32);
  for BF16 and FP32 that is exactly the exponent field (for FP16: 5 exponent + 3 mantissa bits);
* its *rest*: ``(sign << m) | (low m bits)``, ``W − 1`` bytes that are nearly incompressible and stored raw.

Each segment's elements are cut into chunks of ``chunk`` elements (the last one shorter). A chunk codes
its symbols with fixed-length codes of ``b ∈ {1, …, 8}`` bits, chosen per chunk to minimise its size:
with ``b < 8`` the ``2^b − 1`` most frequent symbols get codes ``0 … 2^b − 2`` (a table of ``2^b − 1``
bytes per chunk; 7 for the usual ``b = 3``) and code ``2^b − 1`` *escapes* to the next byte of the chunk's
escape stream; ``b = 8`` codes the symbol itself and never escapes. Element ``i`` finds its code at bit
``i·b`` without reading any other element's, and its escape (if any) at the chunk's escape offset plus the
number of escapes before it in the chunk (a prefix sum inside the chunk). On normal-random BF16 weights
the usual choice is ``b = 3`` with few escapes, close to what the exponents' entropy allows (measured ratios,
random and trained weights: see benchmarks/results/README.md).

Segments of other dtypes (int64 buffers, …), of misaligned placement, or too small to be worth a chunk's
metadata are stored raw and copied verbatim by the same kernel.

The encoder (:func:`encode_unit`) is made of torch ops vectorised over the chunks of a slice of the unit, so
it runs on the host or on a CUDA device (``device=``): per-chunk histograms by one
``bincount`` over ``256 · chunk + symbol``, a stable sort of each chunk's 256 counts, the size of each
``b`` from their cumulative sums, codes by a lookup in per-chunk code tables, escapes by a boolean index,
and codes packed eight at a time into ``b`` bytes with shifts. On the H200, an encoder that page-locked each
new payload buffer before copying into it (its pages not yet present) made device allocations of the process
fail with "CUDA error: resource already mapped" in some processes and not in others, and a pageable payload
ran wherever it was tried (``benchmarks/results/diag_device_encode_h200.json``); buffers are now locked only
once written.

Payload layout (one flat ``uint8`` tensor, everything the device needs; sections aligned to 64 bytes):

* ``rows``: ``int64[n_rows, 8]``. Rows ``[0, n16)`` are chunks of 16-bit words, ``[n16, n16 + n32)`` chunks
  of 32-bit words, each ``(out_off, n, raw_off, plane, code_off, esc_off, table_off, b)``; the remaining
  ``n_pieces`` rows are verbatim copies ``(out_off, nbytes, src_off, 0, 0, 0, 0, 0)``. All offsets are in
  bytes, ``*_off`` other than ``out_off`` relative to the payload start.
* ``tables``: ``2^b − 1`` bytes per chunk (none for ``b = 8``), symbol of code ``c`` at ``table_off + c``.
* ``codes``: chunk codes, little-endian bit strings of ``⌈n·b / 8⌉`` bytes, followed by one pad byte (the
  decoder reads a two-byte window for every code, so the window of the last code stays inside the payload).
* ``escapes``: the escaped symbols of each chunk, in element order.
* ``planes``: byte ``k`` of element ``i``'s rest at ``raw_off + k·plane + i`` (the encoder gives each slice of
  chunks its own block of planes, so ``plane`` is per row).
* ``verbatim``: raw segments' bytes, each at a 64-byte aligned offset.

Invariants the decoder relies on: a chunk never crosses a segment; ``out_off`` of a chunk, its ``raw_off``
and ``plane`` are multiples of 16 and every chunk but a segment's last holds exactly ``chunk`` elements (a
multiple of 16), so full chunks are decoded with unmasked, vectorised loads and stores; segments do not
overlap, so decode order is free. Bytes of the flat buffer outside segments are not preserved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .host_memory import host_buffer, pin_in_place

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
#: Raw bytes the encoder codes at a time on a device; the next slice's are copied meanwhile (see `encode_unit`).
DEVICE_SLICE_BYTES = 128 << 20
#: Raw bytes the encoder codes at a time on the host: small, so each pass's temporaries stay in cache.
HOST_SLICE_BYTES = 4 << 20
#: Chunk rows the host decoder (`_decode_torch`) decodes at a time: 1 Mi elements of the default chunk.
HOST_DECODE_ROWS = 64

#: Dtypes whose words are shuffled into (exponent symbol, rest), with their word size in bytes.
CODED_DTYPES: dict[torch.dtype, int] = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


class CodecError(ValueError):
    """A unit cannot be encoded or decoded as asked; the message names the fix."""


class CodecMismatch(CodecError):
    """A payload checked on the device (``encode_unit(..., verify=True)``) does not decode to its unit's bytes:
    an encoder or decoder fault on that device. ``segment`` is the index of the first segment that differs;
    ``unit`` the unit's index where the caller knows it."""

    def __init__(self, segment: int, unit: int | None = None) -> None:
        super().__init__(f"segment {segment} does not decode to its bytes; stream this unit uncompressed")
        self.segment = segment
        self.unit = unit


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
# Encoder: torch ops on any device, vectorised over the chunks of a slice of the unit
# ----------------------------------------------------------------------------------------------------------


def _align(n: int, alignment: int = SECTION_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x) - x


def _check_segments(flat: torch.Tensor, segments: list[Segment], device: torch.device) -> None:
    if (
        flat.dtype != torch.uint8
        or flat.dim() != 1
        or flat.device not in (torch.device("cpu"), device)
        or not flat.is_contiguous()
    ):
        raise CodecError(
            f"encode_unit needs a contiguous 1-D uint8 tensor on the host (or on the coding device), got "
            f"{flat.dtype} {tuple(flat.shape)} on {flat.device}; pass the unit's flat host buffer"
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


@dataclass(frozen=True)
class _Rows:
    """Consecutive chunks of one word width: ``n[r]`` elements from byte ``out_off[r]`` of the flat buffer.

    A *part* is a run of chunks of one segment: its words are contiguous in the flat buffer.
    """

    out_off: np.ndarray  # int64[k]
    n: np.ndarray  # int64[k]
    part_start: np.ndarray  # int64[parts]: first row of each part
    part_stop: np.ndarray
    part_n: np.ndarray  # elements of each part

    @staticmethod
    def of(out_off: np.ndarray, n: np.ndarray, seg_of: np.ndarray) -> _Rows:
        part_start = np.flatnonzero(np.diff(seg_of, prepend=-1))
        part_stop = np.append(part_start[1:], len(n))
        return _Rows(out_off, n, part_start, part_stop, np.add.reduceat(n, part_start))

    def parts(self) -> zip[tuple[int, int, int]]:
        return zip(self.part_start.tolist(), self.part_stop.tolist(), self.part_n.tolist(), strict=True)


@dataclass
class _Slice:
    """Consecutive chunks of one word width, coded; ``rows``' offsets are relative to this slice's own pieces."""

    rows: np.ndarray  # int64[k, 8]: code/esc/table offsets into codes/escapes/tables, raw_off into planes
    tables: torch.Tensor  # uint8, the chunks' tables back to back
    codes: torch.Tensor  # uint8, the chunks' code bytes, grouped by code width
    escapes: torch.Tensor  # uint8, the chunks' escapes back to back
    planes: torch.Tensor  # uint8[width - 1, rows[:, 3]]: this slice's own rest planes (the rows' plane stride)

    @property
    def pieces(self) -> tuple[torch.Tensor, ...]:
        return self.tables, self.codes, self.escapes, self.planes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.pieces)

    def to(self, device: torch.device) -> _Slice:
        return _Slice(self.rows, *(t.to(device) for t in self.pieces))


_WORD = {2: torch.int16, 4: torch.int32}


def _fetch(flat: torch.Tensor, rows: _Rows, width: int, chunk: int, device: torch.device) -> torch.Tensor:
    """The words of ``rows`` on ``device`` as a ``uint8[k · chunk · width]`` matrix of rows padded with zeros
    (one copy per part; a view of ``flat`` when that is the same)."""
    k, row_bytes = len(rows.n), chunk * width
    if len(rows.part_start) == 1 and rows.part_n[0] == k * chunk and flat.device == device:
        return flat[rows.out_off[0] : rows.out_off[0] + k * row_bytes]
    raw = torch.empty(k * row_bytes, dtype=torch.uint8, device=device)
    for start, stop, count in rows.parts():
        src, nbytes = int(rows.out_off[start]), count * width
        raw[start * row_bytes : start * row_bytes + nbytes].copy_(flat[src : src + nbytes], non_blocking=True)
        raw[start * row_bytes + nbytes : stop * row_bytes].zero_()
    return raw


def _split_words(raw: torch.Tensor, width: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The words' keyed symbols ``int32[k, chunk]`` (``256 · row + symbol``: one histogram bin per chunk and
    symbol) and their rest bytes ``uint8[width - 1, k, chunk]``. Temporaries: ~1.25× the words' bytes."""
    by = raw.view(-1, chunk, width)
    rest_top = by[:, :, width - 2] & 0x7F  # the sign where the symbol's low bit was
    rest_top |= by[:, :, width - 1] & 0x80
    rest = rest_top[None] if width == 2 else torch.stack([*(by[:, :, j] for j in range(width - 2)), rest_top])
    del rest_top
    k = by.shape[0]
    keyed = torch.empty(k, chunk, dtype=torch.int32, device=raw.device)
    torch.bitwise_right_shift(raw.view(_WORD[width]).view(k, chunk), 8 * width - 9, out=keyed)  # bits [m, m + 8)
    keyed &= 0xFF
    keyed += torch.arange(0, 256 * k, 256, dtype=torch.int32, device=raw.device)[:, None]
    return keyed, rest


def _choose_codes(
    keyed: torch.Tensor, n: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk (row of ``keyed``: ``256 · row + symbol``, padding words symbol 0): the code width minimising
    its size, its table and codes; returns bits and escape counts (host), and tables, codes, escapes (device).

    ``b < 8`` gives the ``2^b − 1`` most frequent symbols (ties: the smaller symbol) codes by falling frequency,
    every other symbol the escape code ``2^b − 1``; ``b = 8`` codes symbols as they are.
    """
    dev, (k, _) = keyed.device, keyed.shape
    n_dev = torch.from_numpy(n).to(dev, non_blocking=True)
    hist = torch.bincount(keyed.view(-1), minlength=256 * k).view(k, 256)
    hist[:, 0] -= chunk - n_dev  # not the padding
    counts, order = torch.sort(hist, dim=1, descending=True, stable=True)
    del hist
    covered = counts.cumsum(1)
    cands = torch.tensor(CODE_BITS, dtype=torch.int64, device=dev)
    escapes = n_dev[:, None] - covered[:, (1 << cands) - 2]
    del counts, covered
    cost = torch.cat([n_dev[:, None] * cands + 8 * (escapes + (1 << cands) - 1), 8 * n_dev[:, None]], dim=1)
    choice = torch.argmin(cost, dim=1)  # the first minimum: the smallest width among equals
    bits_dev = torch.cat([cands, cands.new_tensor([8])])[choice]
    escapes = torch.cat([escapes, torch.zeros_like(escapes[:, :1])], dim=1).gather(1, choice[:, None])[:, 0]
    bits, esc_count = torch.stack([bits_dev, escapes]).cpu().numpy()

    esc_code = (1 << bits_dev) - 1
    symbols = torch.arange(256, device=dev).expand(k, 256)
    tables = order.to(torch.uint8)[symbols < torch.where(bits_dev < 8, esc_code, 0)[:, None]]
    code_of = torch.minimum(torch.empty_like(order).scatter_(1, order, symbols), esc_code[:, None])  # rank or escape
    del order
    if (bits == 8).any():
        code_of = torch.where(bits_dev[:, None] == 8, symbols, code_of)
    code = code_of.to(torch.uint8).view(-1).index_select(0, keyed.view(-1)).view(k, chunk)
    del code_of
    tails = np.flatnonzero(n < chunk)
    if len(tails):  # padding codes 0: they fill the high bits of a chunk's last code byte and never escape
        tail_dev = torch.from_numpy(tails).to(dev)
        code[tail_dev] *= torch.arange(chunk, device=dev)[None, :] < n_dev[tail_dev, None]
    if esc_count.any():
        is_esc = code == esc_code.clamp(max=255).to(torch.uint8)[:, None]
        if (bits == 8).any():  # b = 8 never escapes
            is_esc &= (bits_dev < 8)[:, None]
        escaped = (keyed[is_esc] & 0xFF).to(torch.uint8)  # row-major: chunk by chunk, in element order
    else:
        escaped = torch.zeros(0, dtype=torch.uint8, device=dev)
    return bits, esc_count, tables, code, escaped


def _pack_codes(code: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8[k, chunk]`` codes of ``bits`` bits as ``uint8[k, chunk · bits / 8]`` little-endian bit strings.

    Eight ``bits``-bit codes fill ``bits`` bytes exactly: each group of eight is summed, shifted into place, into
    one integer (codes never overlap, so OR is ADD) whose low ``bits`` bytes are kept.
    """
    if bits == 8:
        return code
    k, chunk = code.shape
    word_dtype, word_bytes = (torch.int32, 4) if bits <= 4 else (torch.int64, 8)
    groups = code.view(k, chunk // 8, 8)
    packed = groups[:, :, 0].to(word_dtype)
    for j in range(1, 8):
        packed |= groups[:, :, j].to(word_dtype) << (bits * j)
    return packed.view(torch.uint8).view(k, chunk // 8, word_bytes)[:, :, :bits].reshape(k, chunk * bits // 8)


def _pack_all(code: torch.Tensor, n: np.ndarray, bits: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """The chunks' code bytes, ``(n · b + 7) // 8`` each, grouped by ``b`` (so each group packs with constant
    shifts; the format lets every chunk say where its codes are), and each chunk's offset into them."""
    dev, k = code.device, len(n)
    code_nbytes = (n * bits + 7) // 8
    code_off = np.zeros(k, dtype=np.int64)
    codes, pos = [], 0
    for b in np.unique(bits).tolist():
        idx = np.flatnonzero(bits == b)
        packed = _pack_codes(code if len(idx) == k else code[torch.from_numpy(idx).to(dev)], b)
        nbytes = code_nbytes[idx]
        if (nbytes < packed.shape[1]).any():  # short chunks: keep their first code_nbytes bytes
            keep = torch.arange(packed.shape[1], device=dev)[None, :] < torch.from_numpy(nbytes).to(dev)[:, None]
            codes.append(packed[keep])
        else:
            codes.append(packed.reshape(-1))
        code_off[idx] = pos + _exclusive_cumsum(nbytes)
        pos += int(nbytes.sum())
    return (torch.cat(codes) if len(codes) > 1 else codes[0]), code_off


def _encode_slice(raw: list[torch.Tensor], rows: _Rows, width: int, chunk: int) -> _Slice:
    """Code the padded word matrix ``raw.pop()`` (see `_fetch`) of ``rows`` on its device.

    ``raw`` comes in a list so that its bytes are freed as soon as they are split, before the histograms.
    """
    keyed, rest = _split_words(raw.pop(), width, chunk)
    dev, k = keyed.device, len(rows.n)
    bits, esc_count, tables, code, escapes = _choose_codes(keyed, rows.n, chunk)
    del keyed
    codes, code_off = _pack_all(code, rows.n, bits)
    del code

    # Each part's rest bytes start at a multiple of 16 elements in the planes, so raw_off stays 16-aligned.
    plane_len = (rows.part_n + 15) // 16 * 16
    plane_base = _exclusive_cumsum(plane_len)
    plane = int(plane_len.sum())
    rest = rest.view(width - 1, k * chunk)
    if len(plane_len) == 1:
        planes = rest[:, :plane]
    else:
        planes = torch.empty(width - 1, plane, dtype=torch.uint8, device=dev)
        for (start, _, _), base, length in zip(rows.parts(), plane_base.tolist(), plane_len.tolist(), strict=True):
            planes[:, base : base + length] = rest[:, start * chunk : start * chunk + length]

    part_of = np.repeat(np.arange(len(rows.part_start)), rows.part_stop - rows.part_start)
    table = np.zeros((k, ROW_WORDS), dtype=np.int64)
    table[:, 0] = rows.out_off
    table[:, 1] = rows.n
    table[:, 2] = plane_base[part_of] + (np.arange(k) - rows.part_start[part_of]) * chunk
    table[:, 3] = plane
    table[:, 4] = code_off
    table[:, 5] = _exclusive_cumsum(esc_count)
    table[:, 6] = _exclusive_cumsum(np.where(bits < 8, (1 << bits) - 1, 0))
    table[:, 7] = bits
    return _Slice(table, tables, codes, escapes, planes)


def _slice_rows(per_seg: np.ndarray, step: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``step`` rows (chunks), cut at segment boundaries where possible: a segment of
    ``step`` rows or more is cut into near-equal slices of its own (they need no copy on the host, and their
    planes are the slice's rest bytes as they come), smaller ones share slices."""
    step = max(1, step)
    ranges: list[tuple[int, int]] = []
    start = stop = 0  # the slice being filled: rows [start, stop)
    for rows in per_seg.tolist():
        if stop > start and (rows >= step or stop - start + rows > step):
            ranges.append((start, stop))
            start = stop
        if rows >= step:
            cuts = np.linspace(stop, stop + rows, -(-rows // step) + 1).round().astype(np.int64).tolist()
            ranges += itertools.pairwise(cuts)
            start = stop = stop + rows
        else:
            stop += rows
    if stop > start:
        ranges.append((start, stop))
    return ranges


def _encode_class(
    flat: torch.Tensor, segments: list[Segment], width: int, chunk: int, device: torch.device, slice_bytes: int
) -> list[_Slice]:
    """Code every segment of one word width, ``slice_bytes`` of chunks at a time, where ``flat`` lies."""
    if not segments:
        return []
    counts = np.array([s.nbytes // width for s in segments], dtype=np.int64)
    per_seg = -(-counts // chunk)
    seg_of = np.repeat(np.arange(len(segments)), per_seg)
    first = (np.arange(len(seg_of)) - np.repeat(_exclusive_cumsum(per_seg), per_seg)) * chunk
    n = np.minimum(chunk, counts[seg_of] - first)
    out_off = np.array([s.offset for s in segments], dtype=np.int64)[seg_of] + first * width
    step = min(slice_bytes // (chunk * width), (1 << 31) // 256 - 1)  # 256 · row + symbol stays an int32
    plan = [_Rows.of(out_off[a:b], n[a:b], seg_of[a:b]) for a, b in _slice_rows(per_seg, step)]
    return [_encode_slice([_fetch(flat, rows, width, chunk, device)], rows, width, chunk) for rows in plan]


def encode_unit(
    flat: torch.Tensor,
    segments: list[Segment],
    *,
    chunk: int = DEFAULT_CHUNK,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
    device: torch.device | str | None = None,
    slice_bytes: int | None = None,
    pin: bool = False,
    verify: bool = False,
    payload_on_device: bool = False,
) -> EncodedUnit:
    """Encode the segments of a unit's flat host buffer; see the module docstring for the format.

    ``chunk`` (a multiple of 16) is the element count of a coding chunk; segments of fewer than
    ``min_elements`` elements are stored verbatim. The result decodes to the exact bytes of every segment.

    ``device`` is where the coding runs: ``None`` (or ``"cpu"``) on the host, with torch's CPU threads, in
    slices of ``HOST_SLICE_BYTES``. On a CUDA device ``flat`` is copied over in one transfer (``flat`` may
    also be there already), coded there in slices of ``slice_bytes`` raw bytes (default
    ``DEVICE_SLICE_BYTES``), the payload is assembled there, and it comes back to host memory in one
    transfer; the call returns once it has. Each byte crosses the link once each way, whatever the unit's
    layout. The device memory the call allocates peaks at about the unit's bytes plus the larger of
    ``3.6 · slice_bytes + 0.7 · (coded bytes)`` (a slice's temporaries while the coded slices accumulate)
    and ``1.7 · (unit bytes)`` (payload and check): ~1.9 GB for a 703 MB Wan2.2 block.

    ``verify`` (CUDA only) decodes the assembled payload on the device and compares every segment with
    ``flat``'s bytes there before it comes back, and raises `CodecMismatch` naming the first segment that
    differs: a check of encoder and decoder on this device at the cost of one decode, with no extra copy.

    ``payload_on_device`` (CUDA only) returns the payload where it was assembled, for the caller to bring
    back to host memory its own way (set-up overlaps that with the next unit's coding: `device_encoding`).

    ``pin`` (CUDA only) page-locks the payload in place with ``cudaHostRegister`` once it has arrived, so
    that it is ready for async loads; when that worked ``payload.is_pinned()`` and the caller must
    ``cudaHostUnregister(payload.data_ptr())`` (``host_memory.unpin_in_place``) before dropping it.
    """
    if chunk <= 0 or chunk % 16:
        raise CodecError(f"chunk={chunk} must be a positive multiple of 16")
    device = _coding_device(device)
    segments = list(segments)
    _check_segments(flat, segments, device)
    if slice_bytes is None:
        slice_bytes = HOST_SLICE_BYTES if device.type == "cpu" else DEVICE_SLICE_BYTES
    by_width, verbatim = _sort_segments(segments, min_elements)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        source = flat.to(device, non_blocking=True)  # on the device: one transfer; on the host: ``flat`` itself
        classes = [_encode_class(source, by_width[w], w, chunk, device, slice_bytes) for w in (2, 4)]
        encoded = _assemble(source, segments, classes, by_width, verbatim, chunk, device, verify)
    if device.type != "cuda" or payload_on_device:
        return encoded
    return dataclasses.replace(encoded, payload=_download(encoded.payload, pin))


def device_encoding_need(unit_bytes: int, slice_bytes: int = DEVICE_SLICE_BYTES) -> int:
    """The device memory `encode_unit` allocates for a unit of ``unit_bytes`` on a CUDA device, at most (every
    byte counted as coded): the unit's bytes plus the larger of a slice's temporaries with the coded slices so far,
    and the payload with the check's decode (see `encode_unit`; a unit smaller than a slice is one slice)."""
    one_slice = min(slice_bytes, unit_bytes)
    return unit_bytes + int(max(3.6 * one_slice + 0.7 * unit_bytes, 1.7 * unit_bytes))


def _coding_device(device: torch.device | str | None) -> torch.device:
    """The device ``encode_unit`` codes on, a CUDA one with its index: ``flat`` may already lie there, and a
    tensor's device always has an index, so ``cuda`` alone would never compare equal to it."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _sort_segments(segments: list[Segment], min_elements: int) -> tuple[dict[int, list[Segment]], list[Segment]]:
    """The non-empty ``segments`` that are coded, by word width (each width has its own rows and its own branch
    of the decode kernel), and those stored verbatim; both in the unit's order, which the payload keeps."""
    by_width: dict[int, list[Segment]] = {2: [], 4: []}
    verbatim: list[Segment] = []
    for seg in segments:
        if not seg.nbytes:
            continue
        if _is_coded(seg, min_elements):
            by_width[CODED_DTYPES[seg.dtype]].append(seg)
        else:
            verbatim.append(seg)
    return by_width, verbatim


@dataclass(frozen=True)
class _Sections:
    """Byte offsets of the payload's sections (see the module docstring); ``planes`` has one entry per slice,
    ``verbatim`` one per verbatim segment; ``total`` is the payload's size."""

    tables: int
    codes: int
    escapes: int
    planes: list[int]
    verbatim: dict[Segment, int]
    total: int


def _place_sections(slices: list[_Slice], verbatim: list[Segment], n_rows: int) -> _Sections:
    """Lay the sections out after the ``n_rows`` rows, each 64-byte aligned: each slice's tables, codes and
    escapes follow the previous slice's in their section, while each slice keeps a block of planes of its own
    (its rows' plane stride). Then the verbatim segments, each at an aligned offset; the total is rounded up to
    a multiple of 512 bytes."""
    pos = _align(n_rows * ROW_WORDS * 8)
    tables_off, pos = pos, _align(pos + sum(s.tables.numel() for s in slices))
    codes_off = pos
    pos += sum(s.codes.numel() for s in slices) + 1  # + the pad byte of the two-byte code window
    escapes_off, pos = _align(pos), _align(pos) + sum(s.escapes.numel() for s in slices)
    pos = _align(pos)
    planes_off = []
    for s in slices:  # back to back: a block of planes is a multiple of 16 bytes, so raw_off stays 16-aligned
        planes_off.append(pos)
        pos += s.planes.numel()
    pos = _align(pos)
    verbatim_off = {}
    for seg in verbatim:
        verbatim_off[seg] = pos
        pos = _align(pos + seg.nbytes)
    return _Sections(tables_off, codes_off, escapes_off, planes_off, verbatim_off, _align(pos, 512))


def _verbatim_pieces(verbatim: list[Segment]) -> list[tuple[int, int, Segment, int]]:
    """``(out_off, nbytes, segment, start)`` of each verbatim copy: segments cut into `VERBATIM_PIECE` bytes,
    one decode program each, so that a large raw segment is copied by many programs at once."""
    return [
        (seg.offset + start, min(VERBATIM_PIECE, seg.nbytes - start), seg, start)
        for seg in verbatim
        for start in range(0, seg.nbytes, VERBATIM_PIECE)
    ]


class _PayloadWriter:
    """Copies sections into ``payload`` and remembers the spans written, so that the bytes between them
    (alignment, the code window's pad byte) can be zeroed: a unit's payload is then the same, byte for byte,
    in every run (payload caches and checks compare payloads)."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload
        self.written: list[tuple[int, int]] = []

    def put(self, at: int, data: torch.Tensor) -> None:
        self.payload[at : at + data.numel()].copy_(data.reshape(-1), non_blocking=True)
        self.written.append((at, at + data.numel()))

    def zero_gaps(self, total: int) -> None:
        end = 0
        for start, stop in [*sorted(self.written), (total, total)]:
            if start > end:
                self.payload[end:start].zero_()
            end = max(end, stop)


def _write_slices(slices: list[_Slice], at: _Sections, all_rows: np.ndarray, writer: _PayloadWriter) -> int:
    """Copy each slice's tables, codes, escapes and planes to their places and its rows into ``all_rows`` with
    offsets made relative to the payload; returns the next free row. Each slice's tensors are dropped once
    copied, so the coded slices do not stay on the device beside the whole payload."""
    row = 0
    table_pos, code_pos, esc_pos = at.tables, at.codes, at.escapes
    for s, plane_pos in zip(slices, at.planes, strict=True):
        rows = all_rows[row : row + len(s.rows)]
        rows[:] = s.rows
        rows[:, 2] += plane_pos
        rows[:, 4] += code_pos
        rows[:, 5] += esc_pos
        rows[:, 6] += table_pos
        row += len(s.rows)
        for pos, data in zip((table_pos, code_pos, esc_pos, plane_pos), s.pieces, strict=True):
            writer.put(pos, data)
        table_pos += s.tables.numel()
        code_pos += s.codes.numel()
        esc_pos += s.escapes.numel()
        s.tables = s.codes = s.escapes = s.planes = writer.payload[:0]  # freed once copied: less device memory
    return row


def _assemble(
    source: torch.Tensor,
    segments: list[Segment],
    classes: list[list[_Slice]],
    by_width: dict[int, list[Segment]],
    verbatim: list[Segment],
    chunk: int,
    device: torch.device,
    verify: bool,
) -> EncodedUnit:
    """The payload of the coded ``classes`` and the ``verbatim`` segments of ``source`` (the unit's bytes where
    they were coded), laid out as the module docstring says, on ``device``; checked there when ``verify``."""
    slices = [s for c in classes for s in c]
    pieces = _verbatim_pieces(verbatim)
    n_rows = sum(len(s.rows) for s in slices) + len(pieces)
    at = _place_sections(slices, verbatim, n_rows)
    total = at.total
    payload = torch.empty(total, dtype=torch.uint8, device=device) if device.type == "cuda" else host_buffer(total)
    writer = _PayloadWriter(payload)
    all_rows = np.zeros((n_rows, ROW_WORDS), dtype=np.int64)
    row = _write_slices(slices, at, all_rows, writer)
    for out_off, nbytes, seg, start in pieces:
        all_rows[row] = (out_off, nbytes, at.verbatim[seg] + start, 0, 0, 0, 0, 0)
        row += 1
    for seg in verbatim:
        writer.put(at.verbatim[seg], source[seg.offset : seg.offset + seg.nbytes])
    writer.put(0, torch.from_numpy(all_rows.reshape(-1).view(np.uint8)))
    writer.zero_gaps(total)
    encoded = EncodedUnit(
        payload=payload,
        raw_nbytes=source.numel(),
        stored_nbytes=total,
        segments=tuple(segments),
        chunk=chunk,
        n16=sum(len(s.rows) for s in classes[0]),
        n32=sum(len(s.rows) for s in classes[1]),
        n_pieces=len(pieces),
        coded_raw_nbytes=sum(s.nbytes for w in (2, 4) for s in by_width[w]),
    )
    del slices, classes
    if verify and device.type == "cuda":
        check_decodes(encoded, source)
    return encoded


def check_decodes(encoded: EncodedUnit, source: torch.Tensor) -> None:
    """Decode ``encoded`` where its payload lies and compare each segment with ``source``'s bytes (on the same
    device): one decode, one synchronisation. Raises `CodecMismatch` for the first segment that differs."""
    out = torch.empty(encoded.raw_nbytes, dtype=torch.uint8, device=source.device)
    decode_into(encoded, encoded.payload, out)
    spans = [(i, slice(s.offset, s.offset + s.nbytes)) for i, s in enumerate(encoded.segments) if s.nbytes]
    if not spans:
        return
    differs = torch.stack([torch.ne(out[span], source[span]).any() for _, span in spans]).cpu()
    if differs.any():
        raise CodecMismatch(spans[int(differs.nonzero()[0])][0])


def _download(payload: torch.Tensor, pin: bool) -> torch.Tensor:
    """The device ``payload`` in a new host buffer, then page-locked in place there when ``pin`` (and that
    works): locked once its pages are present, as every buffer the package locks is (see the module
    docstring for what locking a fresh one before the copy did on the H200)."""
    host = host_buffer(payload.numel())
    host.copy_(payload)
    if pin and payload.numel():
        pin_in_place(host)
    return host


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
    were. On CUDA (``backend="auto"``) this enqueues one Triton kernel on ``out``'s device's current stream: no host
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
    with _on_device_of(out):
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


def _on_device_of(out: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Where a decode into ``out`` is launched: Triton launches on the *current device*'s current stream, not on
    the device of its arguments. A model on another device than the current one (``device="cuda:1"`` while cuda:0
    is current) would have its on-demand decodes enqueued on cuda:0's stream, in no order with the copy of the
    payload and the calls that read the slot on cuda:1's stream (or failing outright). Switched only when they
    differ: the usual decode pays one device query."""
    if out.is_cuda and out.device.index != torch.cuda.current_device():
        return torch.cuda.device(out.device)
    return contextlib.nullcontext()


def _decode_torch(encoded: EncodedUnit, payload: torch.Tensor, out: torch.Tensor) -> None:
    """The format's reference decoder, vectorised over the elements of `HOST_DECODE_ROWS` chunk rows at a time (reads
    rows from the payload): its temporaries, several int64 per element, stay near 100 MB whatever the unit's size
    (one pass over a whole 0.7 GB block would take tens of GB)."""
    if encoded.n_rows == 0:
        return
    rows = payload[: encoded.n_rows * ROW_WORDS * 8].cpu().clone().view(torch.int64).reshape(-1, ROW_WORDS)
    host = payload.cpu()
    for first, stop, width in ((0, encoded.n16, 2), (encoded.n16, encoded.n16 + encoded.n32, 4)):
        for start in range(first, stop, HOST_DECODE_ROWS):
            _decode_rows(rows[start : min(start + HOST_DECODE_ROWS, stop)], host, out, width)
    for out_off, nbytes, src_off, *_ in rows[encoded.n16 + encoded.n32 :].tolist():
        out[out_off : out_off + nbytes].copy_(payload[src_off : src_off + nbytes])


def _decode_rows(rows: torch.Tensor, host: torch.Tensor, out: torch.Tensor, width: int) -> None:
    """Decode the chunks of ``rows`` (all of words of ``width`` bytes) from the payload ``host`` into ``out``. A
    chunk's escapes are counted within the chunk, so any run of whole rows decodes alone."""
    out_off, n, raw_off, plane, code_off, esc_off, table_off, bits = rows.unbind(1)
    cid = torch.repeat_interleave(torch.arange(rows.shape[0]), n)
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
    before = torch.cumsum(flag, 0) - flag  # escapes before each element, over these rows
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


def decode_to_host(encoded: EncodedUnit, *, backend: Literal["auto", "triton", "torch"] = "auto") -> torch.Tensor:
    """Decode on the host into a fresh zeroed buffer of ``raw_nbytes`` (tests, checks)."""
    out = torch.zeros(encoded.raw_nbytes, dtype=torch.uint8)
    decode_into(encoded, encoded.payload, out, backend=backend)
    return out
