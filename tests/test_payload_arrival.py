"""Set-up from the payload file without waiting for it (`StoragePlan.may_read_payloads_later`): the model runs raw at
once, the payloads are read on threads, kept once all arrived, and each is proven byte for byte at its first
decoded load before any planned load decodes it; a stale or damaged file is never used."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.storage import payload_cache
from flextensor_diffusers.storage.arrivals import PayloadArrival
from flextensor_diffusers.storage.host_copies import HostCopies
from flextensor_diffusers.storage.payload_cache import PayloadCache
from tests.models import assert_same, snapshot
from tests.test_compression import make, planned_from_fixed_figures


def offload_cached(model: nn.Module, folder: Path, **options: object) -> ft.OffloadHandle:
    """Streamed with compression and the payload file in ``folder`` (``options`` change or add `OffloadConfig`
    fields), under room for two slots with staging (the plan decodes on the fixed figures)."""
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    config = dict(compression="lossless", compression_cache=True, cache_dir=folder)
    return ft.offload(
        model, include_patterns=["blocks.*"], gpu_budget=int(3.8 * unit), device="cpu", **{**config, **options}
    )


def write_the_file(folder: Path) -> Path:
    """A first set-up with no file: it encodes, waits, and writes the file (in the background, done at removal)."""
    model, x = make(torch.bfloat16)
    handle = offload_cached(model, folder)
    assert handle.host.encoded and handle.payload_cache.describe().startswith(("writing", "written"))
    with torch.inference_mode():
        model(x)
    handle.remove()
    (path,) = folder.glob("*.payloads")
    return path


def run_until_payloads_are_taken(handle: ft.OffloadHandle, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Forwards until the payloads read since set-up were taken (at a forward's start), then three more."""
    outs = []
    with torch.inference_mode():
        for _ in range(50):
            outs.append(model(x))
            if not handle.host.compressed.arriving:
                break
            time.sleep(0.02)
        outs += [model(x) for _ in range(3)]
    return outs


def assert_raw_then_every_payload_proven_and_decoded(
    handle: ft.OffloadHandle, model: nn.Module, x: torch.Tensor, reference: torch.Tensor
) -> None:
    """A set-up that did not wait for its payloads (nothing encoded nor checked when it returned): every forward is
    bitwise equal to the native ``reference`` while the payloads arrive (raw), while they are proven and once
    planned loads decode them, and in the end every unit's payload is kept, proven, and decoded by the plan."""
    assert not handle.host.encoded and handle.setup_times.compress is None
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    compressed = handle.host.compressed
    assert compressed.encoded.keys() == {u.index for u in handle.units} and not compressed.unproven
    assert handle.phase is Phase.STEADY and handle.plan.compressed and handle.device_copies.decoding


def test_a_set_up_from_the_payload_file_runs_raw_at_once_and_decodes_once_each_payload_is_proven(
    tmp_path, monkeypatch
) -> None:
    """Set-up encodes and checks nothing; forwards are bitwise while the payloads arrive (raw), while they are proven
    (discovery's decoded loads) and once planned loads decode them; removal restores every tensor and keeps the
    file."""
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    write_the_file(tmp_path)
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    before = snapshot(model)
    handle = offload_cached(model, tmp_path)
    assert handle.payload_cache.describe().startswith("being read while the model runs raw")
    assert_raw_then_every_payload_proven_and_decoded(handle, model, x, reference)
    assert handle.payload_cache.describe().startswith("read: ")
    handle.remove()
    assert_same(before, model)
    assert list(tmp_path.glob("*.payloads"))  # kept for the next run


def test_the_payload_file_is_read_only_once_the_raw_copies_are_packed(tmp_path, monkeypatch) -> None:
    """Set-up checks the file's header and reads no payload: the reads begin when progressive packing ends (the
    first forward adopts the last unit), so that they share nothing with set-up and packing; then each payload is
    read once, and an edit after the reads began keeps none of them. No read can start before `PayloadArrival.begin`
    (it submits them all), so the test watches that call, and whether packing was over when it came."""
    write_the_file(tmp_path)
    reads: list[int] = []
    real = PayloadCache.read_checked

    def counted(cache: PayloadCache, index: int, *args: object) -> torch.Tensor:
        reads.append(index)
        return real(cache, index, *args)

    monkeypatch.setattr(PayloadCache, "read_checked", counted)
    packing_over_at_begin: list[bool] = []  # one entry a call of `begin`
    hosts: list[HostCopies] = []
    real_begin = PayloadArrival.begin

    def watched_begin(arrival: PayloadArrival) -> PayloadArrival:
        packing_over_at_begin.append(bool(hosts) and hosts[0]._progressive is None)
        return real_begin(arrival)

    monkeypatch.setattr(PayloadArrival, "begin", watched_begin)
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    handle = offload_cached(model, tmp_path)
    hosts.append(handle.host)
    assert packing_over_at_begin == [] and handle.host.compressed.arrivals.current._futures is None  # not begun
    assert reads == [] and handle.host._progressive is not None and handle.host.compressed.arriving
    with torch.inference_mode():
        assert torch.equal(model(x), reference)
    assert handle.host._progressive is None  # packing over: the reads have begun
    assert packing_over_at_begin == [True]
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    assert sorted(reads) == sorted(u.index for u in handle.units) == sorted(handle.host.compressed.encoded)
    handle.remove()

    reads.clear()
    model, x = make(torch.bfloat16)
    handle = offload_cached(model, tmp_path)
    with torch.inference_mode():
        model(x)  # packing over: the reads begin
    assert handle.host.compressed.arriving and handle.host.compressed.arrivals.current._futures is not None  # begun
    assert_an_edit_now_reaches_the_outputs(handle, model, x)
    assert not handle.host.encoded and handle.payload_cache.describe().startswith("refused: an edit")
    handle.remove()


def test_a_stale_payload_file_is_caught_at_the_first_decoded_load_and_deleted(tmp_path, monkeypatch, caplog) -> None:
    """Weights changed where the file's key does not sample them: the payloads arrive and are kept unproven; the
    first decoded load of the changed block finds its bytes differ, drops every unproven payload, loads that block
    raw again, and deletes the file: every output is the changed model's own."""
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    path = write_the_file(tmp_path)
    model, x = make(torch.bfloat16)
    weight = max(model.blocks[0].parameters(), key=lambda p: p.numel())
    with torch.no_grad():
        weight.view(-1)[weight.numel() // 3] += 1  # far from the bytes the key samples
    with torch.inference_mode():
        reference = model(x)
    handle = offload_cached(model, tmp_path)
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    assert not path.exists() and "does not decode to the weights" in caplog.text
    assert handle.payload_cache.describe().startswith("refused: its copy of 'blocks.0' does not decode")
    assert 0 not in handle.host.encoded and not handle.host.compressed.unproven
    handle.remove()


def test_a_damaged_payload_file_is_not_used_and_deleted(tmp_path, caplog) -> None:
    """A payload byte flipped on disk: its read fails its checksum, no payload is kept, the model streams raw, and
    the file goes so that the next set-up encodes again."""
    path = write_the_file(tmp_path)
    with path.open("r+b") as f:
        f.seek(path.stat().st_size - 5000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    handle = offload_cached(model, tmp_path)
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    assert not handle.host.encoded and not path.exists()
    assert "checksum differs" in caplog.text and "streams raw" in caplog.text
    handle.remove()
    handle = offload_cached(make(torch.bfloat16)[0], tmp_path)  # no file: encoded again, and written
    assert handle.host.encoded
    handle.remove()
    assert path.exists()


def assert_an_edit_now_reaches_the_outputs(handle: ft.OffloadHandle, model: nn.Module, x: torch.Tensor) -> None:
    """Halve one block's weight through ``handle.editing()``: four forwards equal a native twin's edited alike."""
    with handle.editing(), torch.no_grad():
        model.blocks[2].ff[0].weight.mul_(0.5)
    twin, _ = make(torch.bfloat16)
    with torch.no_grad():
        twin.blocks[2].ff[0].weight.mul_(0.5)
    with torch.inference_mode():
        expected = twin(x)
        assert all(torch.equal(model(x), expected) for _ in range(4))


def test_an_edit_while_the_payloads_arrive_keeps_none_of_them(tmp_path) -> None:
    write_the_file(tmp_path)
    model, x = make(torch.bfloat16)
    handle = offload_cached(model, tmp_path)
    assert_an_edit_now_reaches_the_outputs(handle, model, x)
    assert not handle.host.encoded and handle.payload_cache.describe().startswith("refused: an edit")
    handle.remove()


def test_removal_while_the_payloads_arrive_restores_every_tensor(tmp_path) -> None:
    write_the_file(tmp_path)
    model, _ = make(torch.bfloat16)
    before = snapshot(model)
    handle = offload_cached(model, tmp_path)
    handle.remove()
    assert_same(before, model)


def test_a_pipeline_set_up_from_its_payload_files_streams_raw_then_compressed_bitwise(tmp_path, monkeypatch) -> None:
    """The tiny Wan2.2 pipeline with compression and its payload files: a first enable encodes and writes them;
    the next returns without reading them, generations stay bitwise while they arrive and once each is proven (by
    the decoded loads of the discovery forward after they arrived), and every payload ends up proven."""
    from flextensor_diffusers.recipes.models import build_pipeline
    from tests.models import wan_latents

    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(pipe)
    options = dict(budget=340_000, device="cpu", compression="lossless", compression_cache=True, cache_dir=tmp_path)
    pipe.enable_flextensor_offload(**options)
    assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()  # waits for the files written in the background
    pipe.enable_flextensor_offload(**options)
    transformer = ft.pipeline_offload(pipe).handles["transformer"]
    assert not transformer.host.encoded and transformer.host.compressed.arriving
    for _ in range(4):
        assert torch.equal(wan_latents(pipe), reference)
        time.sleep(0.05)
    compressed = transformer.host.compressed
    assert compressed.encoded and not compressed.unproven and not compressed.arriving
    assert transformer.payload_cache.describe().startswith("read: ")
    pipe.disable_flextensor_offload()


def test_a_header_whose_tensors_lie_elsewhere_is_refused_and_encoded_again(tmp_path, caplog) -> None:
    """The header's key matches but one unit's tensors are laid out otherwise (one segment's dtype differs): the
    file is refused at set-up, saying why, and set-up encodes as with no file."""
    path = write_the_file(tmp_path)
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    first = header["units"][0]["segments"][0]
    first[2] = "float16" if first[2] != "float16" else "bfloat16"
    text = json.dumps(header).encode()
    assert len(text) <= length
    data[8 : 8 + length] = text.ljust(length)
    path.write_bytes(bytes(data))
    handle = offload_cached(make(torch.bfloat16)[0], tmp_path)
    assert handle.host.encoded and "lie elsewhere" in caplog.text
    handle.remove()


def test_the_file_keeps_its_key_when_samples_are_read_in_place() -> None:
    """Set-up reads a contiguous tensor's samples in place (`payload_cache._sample`): the bytes are those a copy of
    the same values gives, for every dtype and size, so that files written before still match their models."""
    torch.manual_seed(0)
    tensors = [
        torch.randn(3000, dtype=torch.bfloat16),
        torch.randn(64, 97),
        torch.randn(5, dtype=torch.float16),
        torch.randint(0, 255, (10_001,), dtype=torch.uint8),
        torch.randn(40, 30).t(),  # not contiguous: copied as before
        torch.nn.Parameter(torch.randn(700, dtype=torch.bfloat16)[100:], requires_grad=False),  # at an offset
        torch.randn(0),
    ]
    for tensor in tensors:
        flat = tensor.reshape(-1)
        count = min(flat.numel(), max(1, payload_cache.SAMPLE_BYTES // flat.element_size()))
        starts = (0, max(0, flat.numel() // 2 - count // 2), flat.numel() - count)
        for place, start in enumerate(starts):
            copied = flat[start : start + count].contiguous().view(torch.uint8).numpy().tobytes()
            assert payload_cache._sample(tensor, place) == copied
