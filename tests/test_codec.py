"""The unit codec: bit-exact round trips (torch reference decoder, Triton kernel under the interpreter, CUDA)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from flextensor_diffusers.storage import codec
from flextensor_diffusers.storage.codec import (
    CODE_BITS,
    DEVICE_SLICE_BYTES,
    CodecError,
    CodecMismatch,
    EncodedUnit,
    Segment,
    decode_into,
    decode_to_host,
    encode_unit,
    worth_compressing,
)

CHUNK = 64  # small chunks so that short tensors still cross chunk boundaries

# Bit patterns that must survive: quiet/signalling/negative NaNs with payloads, ±inf, subnormals, ±0, extremes.
SPECIALS = {
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFC1, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x007F, 0x0000, 0x8000, 0x7F7F],
    torch.float16: [0x7E00, 0x7C01, 0xFE01, 0xFFFF, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x03FF, 0x0000, 0x8000, 0x7BFF],
    torch.float32: [
        0x7FC00000,
        0x7F800001,
        0xFFC00001,
        0xFFFFFFFF,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x00000000,
        0x80000000,
        0x7F7FFFFF,
    ],
}
INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits_tensor(dtype: torch.dtype, patterns: list[int]) -> torch.Tensor:
    int_dtype = INT_OF[dtype]
    bits = torch.tensor(patterns, dtype=torch.int64)
    width = torch.iinfo(int_dtype).bits
    bits = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)  # two's complement
    return bits.to(int_dtype).view(dtype)


def awkward(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Normal weights with special values sprinkled in (so they escape in some chunks)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    specials = bits_tensor(dtype, SPECIALS[dtype])
    where = torch.randint(0, n, (min(n, 3 * len(specials)),), generator=g)
    t[where] = specials[torch.arange(len(where)) % len(specials)]
    return t


def pack(tensors: list[torch.Tensor], align: int = 512, tail: int = 0) -> tuple[torch.Tensor, list[Segment]]:
    """A flat buffer as units.py lays it out: each tensor at an ``align``-aligned offset, junk in between."""
    segments, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        segments.append(Segment(offset, nbytes, t.dtype))
        offset = (offset + nbytes + align - 1) // align * align
    flat = torch.full((offset + tail,), 0xA5, dtype=torch.uint8)
    for seg, t in zip(segments, tensors, strict=True):
        flat[seg.offset : seg.offset + seg.nbytes] = t.reshape(-1).view(torch.uint8)
    return flat, segments


def assert_segments_equal(out: torch.Tensor, flat: torch.Tensor, segments: list[Segment]) -> None:
    for seg in segments:
        got, want = out[seg.offset : seg.offset + seg.nbytes].cpu(), flat[seg.offset : seg.offset + seg.nbytes]
        assert torch.equal(got, want), f"{seg}: {int((got != want).sum())} bytes differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 4000])
def test_round_trip_awkward_values(dtype: torch.dtype, n: int) -> None:
    t = awkward(dtype, n, seed=n)
    flat, segments = pack([t])
    encoded = encode_unit(flat, segments, chunk=CHUNK, min_elements=1)
    assert encoded.coded_raw_nbytes == t.numel() * t.element_size()  # went through the coder, not verbatim
    out = decode_to_host(encoded)
    assert_segments_equal(out, flat, segments)
    assert torch.equal(out[: t.numel() * t.element_size()].view(dtype).view(INT_OF[dtype]), t.view(INT_OF[dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_every_bit_pattern_and_code_width(dtype: torch.dtype) -> None:
    """Uniform random bits (b = 8 chunks), all-equal (b = 1), only specials, and few symbols (b = 2)."""
    int_dtype = INT_OF[dtype]
    info = torch.iinfo(int_dtype)
    g = torch.Generator().manual_seed(1)
    uniform = torch.randint(info.min, info.max, (5 * CHUNK,), generator=g, dtype=torch.int64).to(int_dtype)
    tensors = [
        uniform.view(dtype),
        torch.full((3 * CHUNK + 3,), -2.5).to(dtype),
        bits_tensor(dtype, SPECIALS[dtype] * 20),
        torch.tensor([1.0, -1.0, 2.0, 0.5] * 50).to(dtype),
    ]
    flat, segments = pack(tensors)
    encoded = encode_unit(flat, segments, chunk=CHUNK, min_elements=1)
    assert_segments_equal(decode_to_host(encoded), flat, segments)
    rows = encoded.payload[: encoded.n_rows * 64].view(torch.int64).reshape(-1, 8)
    used_bits = set(rows[: encoded.n16 + encoded.n32, 7].tolist())
    assert {1, 8} <= used_bits, used_bits


def test_mixed_unit_and_verbatim_segments() -> None:
    """BF16/FP16/FP32 next to int64 buffers, bytes, tiny and empty tensors and a misaligned float tensor."""
    tensors = [
        awkward(torch.bfloat16, 3000),
        torch.arange(-50, 50, dtype=torch.int64),
        awkward(torch.float32, 700, seed=2),
        torch.empty(0, dtype=torch.bfloat16),
        awkward(torch.float16, 900, seed=3),
        torch.tensor([7], dtype=torch.uint8),
        torch.tensor([3.0], dtype=torch.bfloat16),
        awkward(torch.bfloat16, 5, seed=4),
    ]
    flat, segments = pack(tensors, tail=100)
    misaligned = Segment(flat.numel() - 90, 80, torch.bfloat16)  # offset not a multiple of 16: kept verbatim
    segments.append(misaligned)
    encoded = encode_unit(flat, segments, chunk=CHUNK)  # default min_elements: the small tensors go verbatim
    assert encoded.raw_nbytes == flat.numel()
    assert encoded.stored_nbytes == encoded.payload.numel() and encoded.stored_nbytes % 512 == 0
    assert encoded.n16 and encoded.n32 and encoded.n_pieces
    assert_segments_equal(decode_to_host(encoded), flat, segments)


def test_decode_leaves_bytes_outside_segments_and_reads_a_payload_slice() -> None:
    flat, segments = pack([awkward(torch.bfloat16, 1000), torch.arange(10, dtype=torch.int64)])
    encoded = encode_unit(flat, segments, chunk=CHUNK)
    slot = torch.zeros(512 + encoded.stored_nbytes + 512, dtype=torch.uint8)
    slot[512 : 512 + encoded.stored_nbytes] = encoded.payload
    out = torch.full((flat.numel() + 64,), 0x5A, dtype=torch.uint8)
    decode_into(encoded, slot[512:], out)
    assert_segments_equal(out, flat, segments)
    inside = torch.zeros(out.numel(), dtype=torch.bool)
    for seg in segments:
        inside[seg.offset : seg.offset + seg.nbytes] = True
    assert bool((out[~inside] == 0x5A).all())


def test_empty_unit() -> None:
    flat = torch.zeros(512, dtype=torch.uint8)
    encoded = encode_unit(flat, [Segment(0, 0, torch.bfloat16)])
    assert encoded.n_rows == 0
    assert_segments_equal(decode_to_host(encoded), flat, [])
    assert not worth_compressing(encoded)


def test_ratio_on_normal_weights() -> None:
    """Measured: BF16 0.70 (the exponent entropy allows ~0.67), FP32 0.85, FP16 0.88 (3 mantissa bits in its symbol)."""
    ratios = {}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        flat, segments = pack([(torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)])
        encoded = encode_unit(flat, segments)
        ratios[dtype] = encoded.ratio
        if dtype == torch.bfloat16:
            assert worth_compressing(encoded)
    assert ratios[torch.bfloat16] < 0.72, ratios
    assert ratios[torch.float32] < 0.87, ratios
    assert ratios[torch.float16] < 0.9, ratios


def test_incompressible_unit_is_not_worth_it() -> None:
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-(1 << 15), 1 << 15, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int16)
    flat, segments = pack([noise.view(torch.bfloat16)])
    encoded = encode_unit(flat, segments)
    assert encoded.ratio > 0.99
    assert not worth_compressing(encoded)
    assert_segments_equal(decode_to_host(encoded), flat, segments)


def test_errors_name_the_fix() -> None:
    flat, segments = pack([awkward(torch.bfloat16, 100)])
    with pytest.raises(CodecError, match="overlap"):
        encode_unit(flat, [*segments, Segment(64, 16, torch.bfloat16)])
    with pytest.raises(CodecError, match="outside"):
        encode_unit(flat, [Segment(0, flat.numel() + 2, torch.bfloat16)])
    with pytest.raises(CodecError, match="multiple of 16"):
        encode_unit(flat, segments, chunk=100)
    encoded = encode_unit(flat, segments, min_elements=1)
    with pytest.raises(CodecError, match="whole slot"):
        decode_into(encoded, encoded.payload, torch.empty(encoded.raw_nbytes - 1, dtype=torch.uint8))


def chunk_rows(encoded: EncodedUnit) -> list[list[int]]:
    """The coded chunks' rows ``(out_off, n, raw_off, plane, code_off, esc_off, table_off, b)``."""
    rows = encoded.payload[: encoded.n_rows * 64].view(torch.int64).reshape(-1, 8)
    return rows[: encoded.n16 + encoded.n32].tolist()


def reference_chunk(symbols: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """What a chunk should hold, chosen the slow way: its bits, table and escaped symbols."""
    n = len(symbols)
    hist = np.bincount(symbols, minlength=256)
    order = np.argsort(-hist, kind="stable")  # by falling count, ties by symbol
    covered = np.cumsum(hist[order])
    costs = [n * b + 8 * (n - covered[(1 << b) - 2] + (1 << b) - 1) for b in CODE_BITS] + [8 * n]
    bits = [*CODE_BITS, 8][int(np.argmin(costs))]
    if bits == 8:
        return bits, order[:0], symbols[:0]
    rank = np.empty(256, dtype=np.int64)
    rank[order] = np.arange(256)
    return bits, order[: (1 << bits) - 1], symbols[rank[symbols] >= (1 << bits) - 1]


def chunk_symbols(flat: torch.Tensor, row: list[int], width: int) -> np.ndarray:
    out_off, n = row[:2]
    words = flat[out_off : out_off + n * width].numpy().view({2: np.uint16, 4: np.uint32}[width])
    return ((words >> (8 * width - 9)) & 0xFF).astype(np.int64)


@pytest.mark.parametrize("slice_bytes", [None, 3 * CHUNK * 2, 5 * CHUNK * 4 + 100])
def test_every_chunk_holds_its_optimal_code(slice_bytes: int | None) -> None:
    """Per chunk: the code width of least size (the smaller among equals), the top 2^b − 1 symbols by count
    (ties: the smaller symbol) as its table, and its other symbols as escapes in element order. Slices of a
    few chunks cut segments and group small ones; the payload still decodes exactly."""
    int16 = torch.iinfo(torch.int16)
    uniform = torch.randint(int16.min, int16.max, (3 * CHUNK,), generator=torch.Generator().manual_seed(7))
    tensors = [
        awkward(torch.bfloat16, 7 * CHUNK + 9),
        awkward(torch.float32, 4 * CHUNK + 3, seed=1),
        awkward(torch.float16, 2 * CHUNK, seed=2),
        torch.full((CHUNK + 1,), 0.75, dtype=torch.bfloat16),
        uniform.to(torch.int16).view(torch.bfloat16),
        torch.tensor([1.0, -1.0, 2.0, 0.5] * 40).to(torch.float16),
        awkward(torch.bfloat16, 17, seed=3),
        awkward(torch.float32, CHUNK - 1, seed=4),
        torch.arange(300, dtype=torch.int64),  # verbatim
    ]
    flat, segments = pack(tensors)
    encoded = encode_unit(flat, segments, chunk=CHUNK, min_elements=1, slice_bytes=slice_bytes)
    payload = encoded.payload.numpy()
    rows = chunk_rows(encoded)
    assert len(rows) == sum(-(-t.numel() // CHUNK) for t in tensors[:-1])
    widths = set()
    for i, row in enumerate(rows):
        width = 2 if i < encoded.n16 else 4
        bits, table, escaped = reference_chunk(chunk_symbols(flat, row, width))
        *_, esc_off, table_off, got_bits = row
        assert got_bits == bits, row
        assert (payload[table_off : table_off + len(table)] == table).all(), row
        assert (payload[esc_off : esc_off + len(escaped)] == escaped).all(), row
        widths.add(bits)
    assert {1, 2, 3, 8} <= widths, widths
    assert_segments_equal(decode_to_host(encoded), flat, segments)
    again = encode_unit(flat, segments, chunk=CHUNK, min_elements=1, slice_bytes=slice_bytes, device="cpu")
    assert torch.equal(again.payload, encoded.payload)  # deterministic, padding included


def test_payload_size_is_the_chunks_optimum() -> None:
    """On random BF16 the payload is within 0.5 % of the sum of the chunks' optimal sizes (rows, tables, codes,
    escapes, planes): what the numpy encoder this one replaced produced, to the byte, on these weights."""
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(n, generator=g) * 0.02).to(torch.bfloat16) for n in (1 << 20, 5120, 3 * 16384 + 5)]
    flat, segments = pack(tensors)
    encoded = encode_unit(flat, segments)
    optimum = 0
    for row in chunk_rows(encoded):
        bits, table, escaped = reference_chunk(chunk_symbols(flat, row, 2))
        n = row[1]
        optimum += 64 + len(table) + (n * bits + 7) // 8 + len(escaped) + n
    assert optimum <= encoded.stored_nbytes <= 1.005 * optimum, (encoded.stored_nbytes, optimum)
    assert encoded.ratio < 0.71


def test_decode_on_device(device: str) -> None:
    """On CUDA this is the Triton kernel on the current stream; on the CPU the torch reference decoder."""
    tensors = [awkward(torch.bfloat16, 50_000), awkward(torch.float32, 3000, seed=1), torch.arange(9)]
    flat, segments = pack(tensors)
    encoded = encode_unit(flat, segments, chunk=4096)
    payload = encoded.payload.to(device)
    out = torch.zeros(encoded.raw_nbytes, dtype=torch.uint8, device=device)
    decode_into(encoded, payload, out)
    assert_segments_equal(out, flat, segments)


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.test_codec import CHUNK, assert_segments_equal, awkward, pack
    from flextensor_diffusers.storage.codec import decode_to_host, encode_unit

    tensors = [
        awkward(torch.bfloat16, 3 * CHUNK + 5),
        awkward(torch.float32, CHUNK + 3, seed=1),
        awkward(torch.float16, 2 * CHUNK, seed=2),
        torch.full((CHUNK,), 0.75, dtype=torch.bfloat16),
        torch.randint(-(1 << 15), 1 << 15, (CHUNK + 1,), dtype=torch.int64).to(torch.int16).view(torch.bfloat16),
        awkward(torch.bfloat16, 1, seed=3),
        torch.arange(70000, dtype=torch.int64),  # verbatim, more than one copy piece
    ]
    flat, segments = pack(tensors)
    encoded = encode_unit(flat, segments, chunk=CHUNK, min_elements=1)
    assert_segments_equal(decode_to_host(encoded, backend="triton"), flat, segments)
    sliced = encode_unit(flat, segments, chunk=CHUNK, min_elements=1, slice_bytes=2 * CHUNK * 2)
    assert_segments_equal(decode_to_host(sliced, backend="triton"), flat, segments)
    print("exact")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_kernel_exact_under_interpreter() -> None:
    """The device kernel itself, run on the CPU by Triton's interpreter (which must be on before import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0 and "exact" in result.stdout, result.stderr[-3000:]


def test_the_device_check_names_the_first_segment_that_does_not_decode() -> None:
    """``verify``'s check, `check_decodes` (run here on the CPU with the reference decoder): a good payload
    passes; one with a flipped byte in the second tensor's rest planes is refused naming that segment."""
    tensors = [torch.arange(40, dtype=torch.int64), awkward(torch.bfloat16, 5000), awkward(torch.bfloat16, 300)]
    flat, segments = pack(tensors)
    encoded = encode_unit(flat, segments, chunk=1024)
    codec.check_decodes(encoded, flat)
    rows = encoded.payload[: encoded.n_rows * 64].view(torch.int64).reshape(-1, 8)
    first_chunk = rows[0].tolist()  # a chunk of segment 1: its rest plane at raw_off
    assert first_chunk[0] == segments[1].offset
    broken = encoded.payload.clone()
    broken[first_chunk[2] + 3] ^= 0x01
    with pytest.raises(CodecMismatch, match="segment 1 does not decode") as caught:
        codec.check_decodes(dataclasses.replace(encoded, payload=broken), flat)
    assert caught.value.segment == 1


def test_encoded_unit_is_frozen() -> None:
    flat, segments = pack([awkward(torch.bfloat16, 10)])
    encoded = encode_unit(flat, segments)
    assert isinstance(encoded, EncodedUnit)
    with pytest.raises(AttributeError):
        encoded.chunk = 1  # type: ignore[misc]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_cuda_encoder_matches_the_host_encoder(pinned: bool) -> None:
    """The device encoder (the unit copied over once, coded in slices, the payload assembled and checked there,
    then copied back, page-locked in place when asked) writes the host encoder's payload byte for byte, and
    the kernel decodes it exactly; ``flat`` may already be on the device."""
    int16 = torch.iinfo(torch.int16)
    uniform = torch.randint(int16.min, int16.max, (20_000,), generator=torch.Generator().manual_seed(7))
    tensors = [
        awkward(torch.bfloat16, 200_000),
        awkward(torch.float32, 30_000, seed=1),
        awkward(torch.float16, 50_000, seed=2),
        uniform.to(torch.int16).view(torch.bfloat16),
        torch.full((9000,), -2.5, dtype=torch.bfloat16),
        torch.arange(99),
        awkward(torch.bfloat16, 5, seed=4),
    ]
    flat, segments = pack(tensors)
    if pinned:
        flat = flat.pin_memory()
    sliced = {"chunk": 4096, "slice_bytes": 3 * 4096 * 2}
    host = encode_unit(flat, segments, **sliced)
    encoded = encode_unit(flat, segments, device="cuda", pin=pinned, verify=True, **sliced)
    try:
        assert encoded.payload.device.type == "cpu" and encoded.payload.is_pinned() == pinned
        assert torch.equal(encoded.payload, host.payload)
        assert (encoded.n16, encoded.n32, encoded.n_pieces) == (host.n16, host.n32, host.n_pieces)
        out = torch.zeros(encoded.raw_nbytes, dtype=torch.uint8, device="cuda")
        decode_into(encoded, encoded.payload.to("cuda", non_blocking=True), out)
        assert_segments_equal(out, flat, segments)
    finally:
        if encoded.payload.is_pinned():
            torch.cuda.cudart().cudaHostUnregister(encoded.payload.data_ptr())
    on_device = encode_unit(flat.cuda(), segments, device="cuda", chunk=4096)  # default slices
    assert torch.equal(
        on_device.payload, encode_unit(flat, segments, chunk=4096, slice_bytes=DEVICE_SLICE_BYTES).payload
    )
    assert_segments_equal(decode_to_host(on_device), flat, segments)
