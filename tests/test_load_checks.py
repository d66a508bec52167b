"""``verify_loads=True``: every unit call compares the device bytes it computes with against its weights, and a
wrong load raises instead of giving a wrong output (`engine.load_checks`)."""

from __future__ import annotations

import itertools

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine.device_copies import DeviceCopies
from flextensor_diffusers.engine.load_checks import ByteRun, fingerprint, host_fingerprint, tensor_runs
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import Block, Stack, device_headroom, offload_compressed_on_the_device, wan_latents
from tests.test_compression import make as make_compressible
from tests.test_compression import planned_from_fixed_figures
from tests.test_engine import UNITS, make, native, run


def make_for(compression: str) -> tuple[Stack, torch.Tensor]:
    """The engine tests' stack; compressed, tests.test_compression's in BF16 (FP32 blocks compress too little
    for a plan to decode them)."""
    return make() if compression == "none" else make_compressible(torch.bfloat16)


def offload_verified(
    model: Stack, x: torch.Tensor, device: str, compression: str = "none", monkeypatch: pytest.MonkeyPatch | None = None
) -> ft.OffloadHandle:
    """Blocks streamed, every load verified: raw through two slots; compressed with room for two slots with
    staging (planned from fixed figures, as tests.test_compression does, so that the plan decodes), and
    discovery and profiling run already."""
    config = dict(include_patterns=["blocks.*"], device=device, compression=compression, verify_loads=True)
    if compression == "none":
        budget = 14_848 + 2 * UNITS[device, torch.float32] + device_headroom(device, model, x)
        return ft.offload(model, gpu_budget=budget, **config)
    assert monkeypatch is not None
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    # The probe set up as the test's model is (encoded on the device before set-up returns): what the device encoder
    # leaves on the device the first time it runs in the process is then part of both measurements, in any test order.
    headroom = device_headroom(device, model, x, offloader=offload_compressed_on_the_device, compression=compression)
    budget = int(3.8 * unit) + headroom
    handle = offload_compressed_on_the_device(model, gpu_budget=budget, **config)
    run(model, x, device, 2)
    if not handle.device_copies.decoding:  # the fixed figures make a CPU plan decode; a device may still load raw
        assert device != "cpu"
        pytest.skip("the plan loads these small blocks raw on this device: no decoded load to verify")
    return handle


def flip_first_tensor_byte(copies: DeviceCopies, index: int) -> None:
    """Change one byte of unit ``index``'s first tensor in its slot (what a wrong load would leave there)."""
    offset = copies.units[index].tensors[0].offset
    copies._dst[index][offset : offset + 1].bitwise_xor_(1)


def test_a_fingerprint_sums_tensor_bytes_only_and_sees_a_changed_byte() -> None:
    """Runs cover the tensors (contiguous ones merged), never the padding between them; one changed byte of a
    tensor changes the fingerprint, a changed padding byte does not."""
    torch.manual_seed(0)
    model = Stack(depth=1)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu")
    unit = handle.units[0]
    runs = tensor_runs(unit)
    covered = sum(r.stop - r.start for r in runs)
    assert covered == sum(p.nbytes for p in unit.tensors) < unit.nbytes
    assert all(a.stop < b.start for a, b in itertools.pairwise(runs))  # merged: a gap between runs
    flat = handle.host.raw_tensor(unit).clone()
    before = fingerprint(flat, runs)
    gap = next(r.stop for r in runs if r.stop < unit.nbytes)
    flat[gap] ^= 0xFF
    assert torch.equal(fingerprint(flat, runs), before)
    flat[runs[0].start + 3] ^= 0x10
    assert not torch.equal(fingerprint(flat, runs), before)
    handle.remove()
    assert torch.equal(host_fingerprint(flat, runs), fingerprint(flat, runs))  # tensor by tensor, the same
    shifted = torch.empty(flat.numel() + 1, dtype=torch.uint8)[1:]  # a stand-in's view off a word boundary
    shifted.copy_(flat)
    assert torch.equal(host_fingerprint(shifted, runs), fingerprint(flat, runs))


def test_a_run_is_summed_as_64_bit_words_with_its_ends_off_the_steps_as_bytes() -> None:
    """The sum is exact modulo 2**64 (it wraps), words sit on the layout's 8-byte steps wherever the run starts,
    and a run's sum is its tensors' sums when they meet on a step."""
    data = torch.randint(0, 256, (64,), dtype=torch.uint8)
    data[8:24] = 0xFF  # two words of -1: the sum wraps below zero
    run = ByteRun(3, 61, ((3, 24), (24, 61)))

    def by_hand(lo: int, hi: int) -> int:
        first, last = -(-lo // 8) * 8, hi // 8 * 8
        words = data[first:last].view(torch.int64).tolist()
        total = sum(words) + sum(data[lo:first].tolist()) + sum(data[last:hi].tolist())
        return (total + 2**63) % 2**64 - 2**63

    assert fingerprint(data, [run]).tolist() == [by_hand(3, 61)]
    assert host_fingerprint(data, [run]).tolist() == [by_hand(3, 24) + by_hand(24, 61)]
    shifted = torch.empty(data.numel() + 3, dtype=torch.uint8)[3:]  # a stand-in's bytes off a word boundary
    shifted.copy_(data)
    assert torch.equal(host_fingerprint(shifted, [run]), fingerprint(data, [run]))
    assert fingerprint(data, [ByteRun(9, 13, ((9, 13),))]).tolist() == [sum(data[9:13].tolist())]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_check_on_the_device_makes_no_copy_of_the_unit() -> None:
    """Summing into a type wider than the words makes PyTorch convert the whole input first on CUDA: a copy twice
    the unit's size per check (calls I and J paid it in time and in resident units). The check's new memory stays
    a few words."""
    flat = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    runs = [ByteRun(0, 1000, ((0, 1000),)), ByteRun(1024, flat.numel() - 5, ((1024, flat.numel() - 5),))]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sums = fingerprint(flat, runs)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 1 << 20
    assert torch.equal(sums.cpu(), host_fingerprint(flat.cpu(), runs))


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_verified_loads_stay_bitwise_and_find_nothing(device: str, compression: str, monkeypatch) -> None:
    model, x = make_for(compression)
    ref = native(model, x, device)
    handle = offload_verified(model, x, device, compression, monkeypatch)
    outs = run(model, x, device, 4)
    assert all(torch.equal(out, ref) for out in outs)
    assert handle.plan is not None and handle.plan.streamed
    summary = handle.check_loads()
    assert summary is not None and not summary.faults
    forwards = 4 if compression == "none" else 6
    calls = len(model.blocks) + model.repeat  # every block, and block 1 again
    assert summary.checks == 2 * calls * forwards  # before and after each call
    handle.remove()


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_a_wrong_load_is_raised_naming_the_unit_and_how_it_was_loaded(device: str, compression: str, monkeypatch):
    """A load that leaves one wrong byte in a slot (raw or decoded): `check_loads` raises naming the unit and its
    load path, and so does the next forward, before computing anything."""
    model, x = make_for(compression)
    handle = offload_verified(model, x, device, compression, monkeypatch)
    run(model, x, device, 3)
    assert not handle.check_loads().faults
    wrong = handle.schedule.order[2]
    original = DeviceCopies.decode_staged if compression != "none" else DeviceCopies.stage

    def corrupting(copies: DeviceCopies, index: int, slot: int) -> bool:
        result = original(copies, index, slot)
        if index == wrong and (compression != "none" or not result):
            flip_first_tensor_byte(copies, index)
        return result

    monkeypatch.setattr(DeviceCopies, "decode_staged" if compression != "none" else "stage", corrupting)
    run(model, x, device, 1)
    how = "decoded" if compression != "none" else "copied raw"
    with pytest.raises(ft.LoadCheckError, match=rf"{handle.units[wrong].name} \(slot \d, {how}, steady phase"):
        handle.check_loads()
    with pytest.raises(ft.LoadCheckError, match="this output is wrong"):
        run(model, x, device, 1)
    monkeypatch.undo()
    handle.remove()


class ScribblingBlock(Block):
    """Writes into its own weight through ``.data`` while it is called: an edit no version count sees."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.out.bias.data.add_(1.0)
        return out


def test_bytes_changed_during_a_call_are_found_after_it(device: str) -> None:
    model, x = make()
    model.blocks[3] = ScribblingBlock(32)
    handle = offload_verified(model, x, device)
    run(model, x, device, 1)
    with pytest.raises(ft.LoadCheckError, match=r"blocks\.3 .*found after its call"):
        handle.check_loads()
    handle.remove()


class CountingBlock(Block):
    """Counts its calls in a buffer, in place: an edit the binding finds and copies back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return super().forward(x)


@pytest.mark.parametrize("resident", [False, True])
def test_edits_are_not_taken_for_wrong_loads(device: str, resident: bool) -> None:
    """A unit that updates its own buffer (streamed, or resident and called twice in a forward: its second call
    computes with the edit its first made, not found yet), and an edit made inside ``editing()``: outputs as
    native, no fault."""
    model, x = make()
    counting = 1 if resident else 2  # block 1 is called twice per forward
    model.blocks[counting] = CountingBlock(32)
    twin, _ = make()
    twin.blocks[counting] = CountingBlock(32)
    twin.load_state_dict(model.state_dict())
    if resident:
        config = dict(include_patterns=["blocks.*"], device=device, verify_loads=True)
        handle = ft.offload(model, gpu_budget=2**30 if device == "cpu" else "auto", **config)
    else:
        handle = offload_verified(model, x, device)
    outs = run(model, x, device, 4)
    with handle.editing(), torch.no_grad():
        model.blocks[4].ff[0].weight.mul_(0.5)
    outs += run(model, x, device, 2)
    twin.to(device)
    with torch.inference_mode():
        expected = [twin(x.to(device)).cpu() for _ in range(4)]
        twin.blocks[4].ff[0].weight.mul_(0.5)
        expected += [twin(x.to(device)).cpu() for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))
    assert not handle.check_loads().faults
    assert not resident or handle.plan.resident
    handle.remove()


def test_a_pipeline_refuses_the_output_of_a_generation_with_a_wrong_load(monkeypatch) -> None:
    """``enable_flextensor_offload(verify_loads=True)``: a clean generation is bitwise and the report counts the
    comparisons; one with a wrong load raises at its end instead of returning its latents."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(pipe)
    pipe.enable_flextensor_offload(budget=250_000, device="cpu", verify_loads=True)
    assert torch.equal(wan_latents(pipe), reference)
    record = pipe.flextensor_report()["components"]["transformer"]["load_checks"]
    assert record["checks"] > 0 and record["faults"] == []
    assert f"transformer {record['checks']} compared, no fault(s)" in pipe.flextensor_report(as_text=True)
    original = DeviceCopies.stage

    def corrupting(copies: DeviceCopies, index: int, slot: int) -> bool:
        decoding = original(copies, index, slot)
        flip_first_tensor_byte(copies, index)
        return decoding

    monkeypatch.setattr(DeviceCopies, "stage", corrupting)
    with pytest.raises(ft.LoadCheckError, match="WanTransformer3DModel"):
        wan_latents(pipe)
    monkeypatch.undo()
    pipe.disable_flextensor_offload()


def test_the_recipes_pass_verify_loads_as_typed(monkeypatch) -> None:
    """``--verify-loads`` / ``--no-verify-loads`` reach ``enable_flextensor_offload``; without either, the offload
    chooses."""
    from flextensor_diffusers.recipes import common, wan22_t2v
    from tests.models import TINY_WAN_ARGV

    seen: list[dict] = []

    class Pipe:
        def enable_flextensor_offload(self, **kwargs: object) -> None:
            seen.append(kwargs)

    for argv in (TINY_WAN_ARGV, [*TINY_WAN_ARGV, "--verify-loads"], [*TINY_WAN_ARGV, "--no-verify-loads"]):
        common.enable_offload(Pipe(), wan22_t2v.parse_args(argv), torch.device("cpu"))
    assert "verify_loads" not in seen[0] and seen[1]["verify_loads"] is True and seen[2]["verify_loads"] is False


def test_a_compressed_host_tier_on_a_gpu_verifies_loads_unless_told_not_to() -> None:
    """The policy (the storage plan, `storage.plan.resolve_storage`): on CUDA, a host tier with compression turns
    ``verify_loads`` on, and says so; ``verify_loads=False`` stays, with a warning naming the fix; raw tiers and the
    CPU are left as asked."""
    from flextensor_diffusers.storage.plan import (
        UNTRUSTED_COMPRESSED_TIER,
        MachineFacts,
        StorageRequest,
        resolve_storage,
    )

    cuda, cpu = MachineFacts("cuda"), MachineFacts("cpu")

    def plan(machine: MachineFacts, **asked: object):  # under a host tier (a sized host budget)
        return resolve_storage(StorageRequest(host_budget="1GiB", **asked), machine)  # type: ignore[arg-type]

    compressed = {"compression": "lossless"}
    assert plan(cuda, **compressed).verify_loads is True
    assert "verify_loads" in [choice.option for choice in plan(cuda, **compressed).choices]
    assert plan(cuda, **compressed, verify_loads=True).verify_loads is True
    assert plan(cpu, **compressed).verify_loads is False
    assert plan(cuda, compression="none").verify_loads is False
    untrusted = plan(cuda, **compressed, verify_loads=False)
    assert untrusted.verify_loads is False and untrusted.warnings == (UNTRUSTED_COMPRESSED_TIER,)
