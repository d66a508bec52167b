"""Set-up without waiting for the encoder (``background_encoding=True``): with no payload file to read, set-up returns
as a raw one does, the units are encoded between the model's forwards (each gap for about as long as the forward
before it took) while it streams raw, and the payloads are kept at a forward's start once all are made, each proven
byte for byte at its first decoded load before planned loads decode it; then the payload file is written for the
next set-up."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import flextensor_diffusers as ft
from flextensor_diffusers.engine.setup import encodes_between_forwards
from flextensor_diffusers.storage import arrivals
from flextensor_diffusers.storage.codec import Segment, device_encoding_need
from flextensor_diffusers.storage.device_encoding import EncodeJob
from flextensor_diffusers.storage.payload_cache import PayloadCache
from flextensor_diffusers.storage.plan import MachineFacts, StorageRequest, resolve_storage
from tests.clocks import ManualClock, drive_handles_by, encoding_takes
from tests.models import Stack, assert_same, snapshot
from tests.test_compression import make, planned_from_fixed_figures
from tests.test_payload_arrival import (
    assert_an_edit_now_reaches_the_outputs,
    assert_raw_then_every_payload_proven_and_decoded,
    offload_cached,
    run_until_payloads_are_taken,
)


def offload_encoding(model: nn.Module, folder: Path, cache: bool = True) -> ft.OffloadHandle:
    """Streamed with compression, encoded in the background (the payload file in ``folder`` when ``cache``)."""
    return offload_cached(model, folder, compression_cache=cache, background_encoding=True)


def test_set_up_returns_raw_and_the_payloads_made_meanwhile_decode_once_proven(tmp_path, monkeypatch) -> None:
    """Set-up encodes nothing; forwards are bitwise while units are encoded (raw), while the payloads are proven
    (discovery's decoded loads) and once planned loads decode them; the payload file is written, and the next
    set-up reads it without waiting either. Removal restores every tensor."""
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    before = snapshot(model)
    handle = offload_encoding(model, tmp_path)
    assert handle.payload_cache.describe().startswith("checked once packing is over")
    assert_raw_then_every_payload_proven_and_decoded(handle, model, x, reference)
    handle.remove()  # waits for the payload file's write
    assert_same(before, model)
    assert len(list(tmp_path.glob("*.payloads"))) == 1
    again, x = make(torch.bfloat16)
    handle = offload_encoding(again, tmp_path)
    assert_raw_then_every_payload_proven_and_decoded(handle, again, x, reference)
    assert handle.payload_cache.describe().startswith("read: ")  # read back, not encoded again
    handle.remove()


def test_set_up_reads_nothing_of_the_payload_file_and_a_missing_or_refused_one_is_encoded_between_forwards(
    tmp_path, monkeypatch, caplog
) -> None:
    """The file is checked only once packing is over (a set-up that checked its header took 1.14× raw's on an H100,
    call V): set-up opens nothing; a file found then is read, a missing one or one whose header is refused turns
    into encoding between forwards, and every output is the model's own."""
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    opened: list[Path] = []
    real_open = PayloadCache.open
    monkeypatch.setattr(PayloadCache, "open", lambda cache: opened.append(cache.path) or real_open(cache))
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    handle = offload_encoding(model, tmp_path)
    assert not opened  # no file yet, and none looked for
    assert_raw_then_every_payload_proven_and_decoded(handle, model, x, reference)
    assert len(opened) == 1 and handle.setup_times.compress is not None  # looked for once packed, then encoded
    handle.remove()
    (path,) = tmp_path.glob("*.payloads")
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # inside the header's JSON: refused as unreadable
    path.write_bytes(bytes(data))
    opened.clear()
    model, x = make(torch.bfloat16)
    handle = offload_encoding(model, tmp_path)
    assert not opened
    with caplog.at_level(logging.WARNING):
        assert_raw_then_every_payload_proven_and_decoded(handle, model, x, reference)
    assert len(opened) == 1 and "refused: it cannot be read" in caplog.text
    assert handle.setup_times.compress is not None  # encoded between forwards, not read
    handle.remove()  # writes the file again
    model, x = make(torch.bfloat16)
    handle = offload_encoding(model, tmp_path)
    assert_raw_then_every_payload_proven_and_decoded(handle, model, x, reference)
    assert handle.payload_cache.describe().startswith("read: ") and handle.setup_times.compress is None
    handle.remove()


def test_without_the_payload_file_nothing_is_written_and_the_loads_still_decode(tmp_path, monkeypatch) -> None:
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    handle = offload_encoding(model, tmp_path, cache=False)
    assert handle.payload_cache is None
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    assert handle.device_copies.decoding and not handle.host.compressed.unproven
    handle.remove()
    assert not list(tmp_path.glob("*.payloads"))


def test_a_payload_made_wrong_is_caught_at_its_first_decoded_load(tmp_path, monkeypatch, caplog) -> None:
    """The positive control of the proof: one unit's payload decodes to other bytes (a flipped payload byte). Its
    first decoded load finds it, every payload not proven yet is dropped, that block is loaded raw again, and the
    file is not kept: every output is the model's own."""
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    real = arrivals.EncodingBetweenForwards._on_host

    def flipped_for_block_2(jobs):
        for index, made in real(jobs):
            if index == 2 and made is not None:
                made.encoded.payload[made.encoded.payload.numel() // 2] ^= 0x20
            yield index, made

    monkeypatch.setattr(arrivals.EncodingBetweenForwards, "_on_host", staticmethod(flipped_for_block_2))
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    handle = offload_encoding(model, tmp_path)
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    assert "its copy of 'blocks.2' does not decode to the weights" in caplog.text
    assert 2 not in handle.host.encoded and not handle.host.compressed.unproven
    handle.remove()
    assert not list(tmp_path.glob("*.payloads"))  # not kept for the next run: it encodes again


@pytest.mark.parametrize(("forward_s", "per_gap"), [(0.45, 4), (0.25, 2), (0.05, 1)])
def test_units_are_encoded_only_between_forwards_each_gap_for_about_as_long_as_the_forward_before(
    tmp_path, monkeypatch, forward_s: float, per_gap: int
) -> None:
    """Nothing is encoded at set-up nor during a forward; after each forward, units are encoded until the next would
    end after as long as that forward took, and at least one. The handle's clock moves only when the test says:
    ``forward_s`` a forward, 0.1 s a unit encoded, so each gap encodes exactly ``per_gap`` of the twelve units
    (0.45 s: after four, a fifth would end at 0.5 s; 0.05 s: one, though it ends after the forward's time)."""
    clock = ManualClock()
    drive_handles_by(monkeypatch, clock)
    encoding_takes(monkeypatch, clock, 0.1)
    torch.manual_seed(0)
    model, x = Stack(dim=256, depth=12, dtype=torch.bfloat16).eval(), torch.randint(0, 50, (2, 16))
    with torch.inference_mode():
        reference = model(x)
    handle = offload_encoding(model, tmp_path, cache=False)
    encoding = handle.host.compressed.arrivals.current
    encoded_when_a_forward_began: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda *_: encoded_when_a_forward_began.append(encoding.encoded_units))
    model.blocks[0].register_forward_pre_hook(lambda *_: clock.advance(forward_s))
    encoded_after: list[int] = []
    forwards = -(-12 // per_gap)
    with torch.inference_mode():
        for _ in range(forwards):
            assert torch.equal(model(x), reference)
            encoded_after.append(encoding.encoded_units)
    assert encoded_when_a_forward_began == [0, *encoded_after[:-1]]  # none during a forward
    assert encoded_after == [min(12, per_gap * k) for k in range(1, forwards + 1)]
    assert handle.setup_times.compress == pytest.approx(1e3 * 0.1 * 12)  # the gaps, summed, in the report
    handle.remove()


def test_a_budget_under_the_device_encoders_need_for_one_unit_is_refused_naming_it() -> None:
    """What the device encoder needs for a 703 MB Wan2.2 block is `encode_unit`'s documented peak (~1.9 GB); a CUDA
    set-up whose budget cannot hold it for the largest unit is refused with one line naming the budget it needs
    (checked before anything touches a device: this runs on the CPU too), and that budget is accepted."""
    block = 703_000_000
    assert 1.85e9 < device_encoding_need(block) < 1.95e9
    jobs = [EncodeJob(i, torch.empty, [Segment(0, size, torch.bfloat16)]) for i, size in enumerate((block, block // 2))]
    cuda = torch.device("cuda", 0)
    with pytest.raises(ft.BudgetError) as refused:
        arrivals.EncodingBetweenForwards(jobs, cuda, pin=False, budget_bytes=2**30)
    message, need = str(refused.value), refused.value.required_bytes
    assert "\n" not in message and f"pass a budget of at least {need} bytes" in message
    assert need >= device_encoding_need(block)
    assert not arrivals.EncodingBetweenForwards(jobs, cuda, pin=False, budget_bytes=need).done


def test_by_default_set_up_encodes_between_forwards_on_cuda_where_the_encoder_fits_the_budget() -> None:
    """The default (None) encodes between forwards on CUDA wherever it can (raw copies in RAM packed progressively,
    or waiting on disk) and the device encoder's room for the largest unit fits the budget (its set-up then as
    raw's), and before set-up returns on the CPU (where the encoder would share the cores with the forwards) or where
    it cannot; True and False are taken as given."""
    block = 703_000_000
    units = [SimpleNamespace(tensors=[SimpleNamespace(nbytes=block // 2), SimpleNamespace(nbytes=block // 2)])]
    room = arrivals.encoder_room(block)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def between(device: torch.device, budget: int | None, **options: object) -> bool:
        asked = StorageRequest(**{"compression": "lossless", **options})  # type: ignore[arg-type]
        return encodes_between_forwards(resolve_storage(asked, MachineFacts(device.type)), budget, units)

    assert between(cuda, None) and between(cuda, room) and not between(cuda, room - 1)
    assert not between(cpu, None) and between(cpu, None, background_encoding=True)
    assert not between(cuda, None, background_encoding=False)
    assert not between(cuda, None, compression="none") and not between(cuda, None, progressive_packing=False)
    assert between(cuda, None, raw_copies="disk") and not between(cuda, room - 1, raw_copies="disk")
    assert not between(cpu, None, raw_copies="disk") and between(cpu, None, raw_copies="disk", background_encoding=True)


def test_ctrl_c_while_units_are_encoded_between_forwards_goes_on_at_the_next_forward(tmp_path, monkeypatch) -> None:
    """Ctrl-C in a gap (the model call that ended it raises KeyboardInterrupt): the units encoded before it are kept,
    the one under way is encoded again after the next forward, every later forward is bitwise, and in the end every
    unit's payload is kept and proven."""
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    real = arrivals.EncodingBetweenForwards._on_host
    interrupted: list[int] = []

    def ctrl_c_at_unit_3_once(jobs: list[EncodeJob]) -> Iterator[tuple[int, object]]:
        for job in jobs:
            if job.index == 3 and not interrupted:
                interrupted.append(job.index)
                raise KeyboardInterrupt
            yield from real([job])

    monkeypatch.setattr(arrivals.EncodingBetweenForwards, "_on_host", staticmethod(ctrl_c_at_unit_3_once))
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    handle = offload_encoding(model, tmp_path, cache=False)
    encoding = handle.host.compressed.arrivals.current
    raised = []
    with torch.inference_mode():
        while not interrupted:
            try:
                assert torch.equal(model(x), reference)
            except KeyboardInterrupt:
                raised.append(encoding.encoded_units)
    assert raised == [3] and handle.host.compressed.arriving  # units 0-2 kept, unit 3 not
    outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    compressed = handle.host.compressed
    assert compressed.encoded.keys() == {u.index for u in handle.units} and not compressed.unproven
    handle.remove()


@pytest.mark.parametrize(
    ("cache", "said"),
    [(False, "came while the weights were being compressed"), (True, "came before any payload was read or made")],
)
def test_an_edit_while_units_are_encoded_keeps_none_of_their_payloads(tmp_path, caplog, cache, said) -> None:
    """Right after set-up: without the file the units are being encoded; with it, the file is not checked yet."""
    model, x = make(torch.bfloat16)
    handle = offload_encoding(model, tmp_path, cache=cache)
    assert_an_edit_now_reaches_the_outputs(handle, model, x)
    assert not handle.host.encoded and not handle.host.compressed.arriving
    assert said in caplog.text
    handle.remove()


def test_a_failed_encoding_keeps_the_model_raw_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    def fails(*args: object, **kwargs: object) -> object:
        raise MemoryError("no memory for the payload")

    monkeypatch.setattr(arrivals, "encode_unit", fails)
    model, x = make(torch.bfloat16)
    with torch.inference_mode():
        reference = model(x)
    with caplog.at_level(logging.WARNING):
        handle = offload_encoding(model, tmp_path)
        outs = run_until_payloads_are_taken(handle, model, x)
    assert all(torch.equal(out, reference) for out in outs)
    assert not handle.host.encoded and "compressing the weights while the model ran failed" in caplog.text
    handle.remove()


def test_removal_while_units_are_encoded_restores_every_tensor(tmp_path) -> None:
    model, _ = make(torch.bfloat16)
    before = snapshot(model)
    handle = offload_encoding(model, tmp_path)
    handle.remove()
    assert_same(before, model)


@pytest.mark.parametrize(
    "options",
    [{"compression": "none"}, {"raw_copies": "ram", "progressive_packing": False}, {"progressive_packing": False}],
    ids=["no-compression", "raw-in-ram-packed-at-set-up", "packed-at-set-up"],
)
def test_background_encoding_without_what_it_needs_is_refused_naming_it(options: dict) -> None:
    config = {"compression": "lossless", **options}
    with pytest.raises(ft.FlexTensorError, match=r"background_encoding=True .* needs compression='lossless'"):
        ft.OffloadConfig(include_patterns=["blocks.*"], background_encoding=True, **config)


def test_a_pipeline_host_budget_with_progressive_packing_is_refused_naming_the_fix() -> None:
    """A host budget holds the pipeline's host memory to it: progressive packing, which keeps units twice until they
    are used, is refused before anything is packed, naming what to drop, and the pipeline is left as it was
    (``background_encoding=True`` is not: under a host budget the raw copies it streams wait on disk,
    `tests.test_first_enable`)."""
    from flextensor_diffusers.recipes.models import build_pipeline

    pipe = build_pipeline("wan22_t2v", "tiny")
    before = snapshot(pipe.transformer)
    with pytest.raises(ft.FlexTensorError) as raised:
        pipe.enable_flextensor_offload(
            budget="1GiB", device="cpu", compression="lossless", host_budget="1GiB", progressive_packing=True
        )
    message = str(raised.value)
    assert "progressive_packing=True cannot hold host memory to a host budget" in message and "\n" not in message
    assert "drop progressive_packing, or pass host_budget=None" in message
    assert ft.pipeline_offload(pipe) is None
    assert_same(before, pipe.transformer)


def test_a_pipeline_encodes_while_it_generates_bitwise_and_writes_its_payload_files(tmp_path, monkeypatch) -> None:
    """The tiny Wan2.2 pipeline, compression encoded in the background and no payload files yet: enable returns
    with nothing encoded, generations stay bitwise while the experts' blocks are encoded and once each payload is
    proven, and the files are written for the next enable, which reads them. The handles' clock stands still (no
    forward takes any time by it, nor any unit's encoding), so each gap encodes every unit left: the first gap of
    each component encodes all its blocks, whatever the machine's speed."""
    from flextensor_diffusers.recipes.models import build_pipeline
    from tests.models import wan_latents

    drive_handles_by(monkeypatch, ManualClock())
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(pipe)
    options = dict(budget=340_000, device="cpu", compression="lossless", compression_cache=True, cache_dir=tmp_path)
    pipe.enable_flextensor_offload(**options, background_encoding=True)
    transformer = ft.pipeline_offload(pipe).handles["transformer"]
    assert not transformer.host.encoded and transformer.payload_cache.describe().startswith("checked once packing")
    for _ in range(4):
        assert torch.equal(wan_latents(pipe), reference)
    compressed = transformer.host.compressed
    assert compressed.encoded and not compressed.unproven and not compressed.arriving
    pipe.disable_flextensor_offload()  # waits for the files written in the background
    assert torch.equal(wan_latents(pipe), reference)
    pipe.enable_flextensor_offload(**options, background_encoding=True)
    transformer = ft.pipeline_offload(pipe).handles["transformer"]
    assert torch.equal(wan_latents(pipe), reference)  # the file is checked once packing is over, then read
    assert transformer.payload_cache.describe().startswith(("being read while the model runs raw", "read: "))
    pipe.disable_flextensor_offload()


def test_the_recipe_starts_at_once_and_compresses_while_it_runs(tmp_path) -> None:
    """``--background-encoding`` in the Wan2.2 recipe: the run completes (its video written) and the report says
    the payload file is being written or was, from the blocks compressed while the first generations ran."""
    from flextensor_diffusers.recipes import wan22_t2v

    argv = ["--random-weights", "tiny", "--device", "cpu", "-q", "--budget", "340000", "--compression", "lossless"]
    argv += ["--compression-cache", "--background-encoding", "--host-budget", "none"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--profile-dir", str(tmp_path / "p")]
    info = wan22_t2v.main([*argv, "--output", str(tmp_path / "x.mp4")])
    transformer = info["offload_report"]["components"]["transformer"]
    assert info["compression"] == "lossless" and (tmp_path / "x.mp4").stat().st_size > 0
    assert transformer["payload_cache"].startswith(("not written yet", "writing", "written: ")), transformer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_units_are_encoded_between_forwards_within_the_budget_bitwise() -> None:
    """The CUDA path: a budget under what the device encoder needs for one unit is refused at set-up, naming the
    budget it needs, the model left as it was; under that budget set-up encodes nothing, the forwards are bitwise
    while units are encoded on the device between them and once planned loads decode, and the process's peak of
    allocated device memory stays within the budget throughout."""
    torch.manual_seed(0)
    model = Stack(dim=1024, depth=24, dtype=torch.bfloat16).eval().requires_grad_(False)  # more than the budget holds
    x = torch.randint(0, 50, (4, 64), device="cuda")
    with torch.inference_mode():
        reference = model.to("cuda")(x).cpu()
    model.to("cpu")
    before = snapshot(model)
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    options = dict(include_patterns=["blocks.*"], device="cuda", compression="lossless", background_encoding=True)
    with pytest.raises(ft.BudgetError, match="between forwards") as refused:
        ft.offload(model, gpu_budget=3 * unit, **options)  # over the streaming minimum (~2.2 units)
    assert_same(before, model)
    budget = refused.value.required_bytes + 4 * unit
    torch.cuda.synchronize()
    ft.reset_peak_memory_stats()  # the package's: the profiling forwards' resets of torch's counter are folded in
    handle = ft.offload(model, gpu_budget=budget, **options)
    try:
        assert not handle.host.encoded
        with torch.inference_mode():
            outs = [model(x).cpu() for _ in range(40)]  # about a unit a gap, then discovery and profiling
        assert all(torch.equal(out, reference) for out in outs)
        compressed = handle.host.compressed
        assert compressed.encoded and not compressed.unproven and not compressed.arriving
        assert handle.plan is not None and handle.plan.compressed
        torch.cuda.synchronize()
        assert ft.max_memory_allocated() <= budget
    finally:
        handle.remove()
    assert_same(before, model)
