"""Weights built in memory, under a host budget with compression: their lossless payloads are their only host copy
(``raw_copies="none"``, the plan's choice there). Nothing raw is written to ``cache_dir`` (it used to write a raw cache
file as large as the weights: on the GPU machine the Wan2.2-A14B pipeline filled its 64 GB disk before its host budget
could work); the outputs stay bitwise equal to native; whatever needs the raw bytes decodes the payloads (disable,
``state_dict()``, ``load_state_dict``, a LoRA fuse, the write-back of an edit made in a device copy); and a weight read
outside its unit's call is refused with one line naming the fix, never given zeros or stale bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.storage import payload_cache
from flextensor_diffusers.storage.host_bytes import InPayloadsOnly
from flextensor_diffusers.storage.read_guard import WeightReadRefused
from tests.models import assert_same, set_host_overhead, set_ram_available, snapshot, wan_latents
from tests.test_compressed_tier import (
    BUDGET,
    EXPERTS,
    enable_one_expert_in_ram,
    one_component_in_ram,
    smallest_host_budget,
)

COMPONENTS = ("transformer", "transformer_2", "text_encoder", "vae")


@pytest.fixture(autouse=True)
def host_copies_only(monkeypatch):
    """Host budgets here are planned in the host copies' bytes (see tests.test_host_tier)."""
    set_host_overhead(monkeypatch, own=0, reserve=0)


def written(cache: Path) -> set[str]:
    """The suffixes of the files in ``cache`` once the payload files' writes under way are over."""
    payload_cache.wait_for_all_writes()
    return {path.suffix for path in cache.iterdir()}


def waiting_expert(pipe) -> str:
    """The expert whose payloads wait in their payload file now."""
    handles = ft.pipeline_offload(pipe).handles
    return next(name for name in EXPERTS if handles[name].host.waiting_on_disk)


def test_weights_built_in_memory_stream_from_their_payloads_alone_bitwise(tmp_path) -> None:
    """The experts take turns on disk, each as its payload file; no raw byte of a block is anywhere but in its
    payload (no raw cache file: on the old code one per component); three generations bitwise; disable restores every
    tensor bitwise, decoded."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(pipe)
    before = {name: snapshot(getattr(pipe, name)) for name in COMPONENTS}
    cache = tmp_path / "cache"
    enable_one_expert_in_ram(pipe, cache)
    state = ft.pipeline_offload(pipe)
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(3))
    assert set(EXPERTS) & set(state.host_tier.report()["on_disk"])
    assert written(cache) == {".payloads"}
    for name in EXPERTS:
        host = state.handles[name].host
        places = host.where()
        assert places.payloads_only_bytes == sum(unit.nbytes for unit in host.units) and not places.raw_disk_bytes
        assert places.ram_raw_bytes == host.base.nbytes  # the base, which every activation copies
    pipe.disable_flextensor_offload()
    assert written(cache) == {".payloads"}  # kept for the next run
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert torch.equal(wan_latents(pipe), reference)


def test_state_dict_decodes_the_true_values_even_of_an_expert_waiting_on_disk(tmp_path) -> None:
    """``state_dict()`` gives each weight's true value, decoded (from the payload file, checked, for the expert that
    waits there, which stays there), as plain tensors; a unit the RAM available cannot hold decoded is refused first,
    one line naming the fix (on the old code it was read from the raw cache file)."""
    pipe, native = build_pipeline("wan22_t2v", "tiny"), build_pipeline("wan22_t2v", "tiny")
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    wan_latents(pipe)
    waiting = waiting_expert(pipe)
    for name in (*EXPERTS, "text_encoder"):
        got, expected = getattr(pipe, name).state_dict(), getattr(native, name).state_dict()
        assert got.keys() == expected.keys()
        assert all(type(got[key]) is torch.Tensor and torch.equal(got[key], value) for key, value in expected.items())
    assert ft.pipeline_offload(pipe).handles[waiting].host.waiting_on_disk
    with pytest.MonkeyPatch.context() as patch:
        set_ram_available(patch, 1024)
        with pytest.raises(ft.FlexTensorError, match=r"is available: free host memory, or .*raw_copies='disk'") as err:
            pipe.transformer.state_dict()
    assert len(str(err.value).splitlines()) == 1
    pipe.disable_flextensor_offload()


def test_a_weight_read_outside_its_call_is_refused_in_one_line_its_metadata_answered(tmp_path) -> None:
    """Between calls a block's weights answer what diffusers reads (shape, dtype, device, the model's dtype) and
    refuse every read of their bytes (on the old code they gave the raw cache file's bytes); a refused in-place write
    leaves the weights as they were, the outputs bitwise. Weights kept raw (outside the blocks) read as ever."""
    pipe, native = build_pipeline("wan22_t2v", "tiny"), build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(native)
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    assert torch.equal(wan_latents(pipe), reference)
    weight, same = pipe.transformer.blocks[0].attn1.to_q.weight, native.transformer.blocks[0].attn1.to_q.weight
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad == same.requires_grad
    assert (weight.shape, weight.dtype, weight.device, weight.numel()) == (
        same.shape,
        same.dtype,
        same.device,
        same.numel(),
    )
    assert pipe.transformer.dtype == native.transformer.dtype and weight.is_floating_point()
    reads = {
        "sum": lambda: weight.sum(),
        "repr": lambda: repr(weight),
        "cpu": lambda: weight.cpu(),
        "data": lambda: weight.data,
        "linear": lambda: torch.nn.functional.linear(torch.zeros(1, weight.shape[1]), weight),
        "detached": lambda: weight.detach().clone(),
        "in place": lambda: weight.mul_(2),
    }
    for read in reads.values():
        with torch.no_grad(), pytest.raises(WeightReadRefused, match=r"read them through state_dict\(\)") as err:
            read()
        assert len(str(err.value).splitlines()) == 1 and "raw_copies='disk'" in str(err.value)
    assert torch.equal(pipe.transformer.patch_embedding.weight, native.transformer.patch_embedding.weight)  # raw
    assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()
    assert torch.equal(weight, same)


def test_load_state_dict_decodes_applies_and_encodes_again_bitwise_verified(tmp_path) -> None:
    """``load_state_dict`` into the expert waiting on disk, loads verified: its blocks are decoded, edited and encoded
    again (their fingerprints taken then), nothing raw is written and nothing decoded stays in RAM; outputs follow the
    edit bitwise with no fault found, and disable gives the edited weights."""
    pipe, native = build_pipeline("wan22_t2v", "tiny"), build_pipeline("wan22_t2v", "tiny")
    cache = tmp_path / "cache"
    host_budget = smallest_host_budget(pipe, cache)
    pipe.enable_flextensor_offload(
        budget=BUDGET, device="cpu", compression="lossless", host_budget=host_budget, cache_dir=cache, verify_loads=True
    )
    wan_latents(pipe)
    name = waiting_expert(pipe)
    torch.manual_seed(5)
    edited = {k: v + 0.01 * torch.randn_like(v) for k, v in getattr(native, name).state_dict().items()}
    getattr(pipe, name).load_state_dict(edited)
    getattr(native, name).load_state_dict(edited)
    host = ft.pipeline_offload(pipe).handles[name].host
    assert all(isinstance(unit.stored, InPayloadsOnly) for unit in host.units)
    assert host.where().ram_raw_bytes == host.base.nbytes
    expected = wan_latents(native)
    assert all(torch.equal(wan_latents(pipe), expected) for _ in range(2))
    checks = pipe.flextensor_report()["components"][name]["load_checks"]
    assert checks["checks"] > 0 and checks["faults"] == []
    assert ".raw" not in written(cache)
    pipe.disable_flextensor_offload()
    assert all(torch.equal(t, edited[k]) for k, t in getattr(pipe, name).state_dict().items())


def test_an_edit_the_ram_available_cannot_hold_decoded_is_refused_before_anything_changes(tmp_path) -> None:
    pipe, native = build_pipeline("wan22_t2v", "tiny"), build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(native)
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    edited = {k: v + 1.0 for k, v in native.transformer.state_dict().items()}
    with pytest.MonkeyPatch.context() as patch:
        set_ram_available(patch, 1024)
        with pytest.raises(ft.FlexTensorError, match=r"an edit of WanTransformer3DModel decodes .* raw_copies='disk'"):
            pipe.transformer.load_state_dict(edited)
    assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()


@pytest.mark.parametrize("raw_copies", ["none", "disk"])
def test_a_lora_loaded_fused_unfused_and_unloaded_follows_native_bitwise(tmp_path, raw_copies) -> None:
    """diffusers' LoRA methods on an expert kept compressed only: each call that writes packed weights is decoded
    (payloads only), applied and encoded again, and the latents after each equal native's with the same calls. The
    pipeline's ``unfuse_lora`` unmerges each adapter layer itself (``weight.data -= ...``, which no version counter
    sees): on the old code its payloads stayed the fused weights' (``"disk"``: silently not bitwise)."""
    pytest.importorskip("peft")
    from tests.test_lora_methods import Lockstep, load, lora_state_dict

    cache = tmp_path / "cache"
    pair = Lockstep.start([], enable=lambda pipe: enable_one_expert_in_ram(pipe, cache, raw_copies=raw_copies))
    lora = lora_state_dict(pair.native, 1)
    pair.do(load("transformer_2", lora, "a"))
    assert pair.changed(-1)
    pair.do(lambda pipe: pipe.set_adapters(["a"], adapter_weights=[0.5]))
    assert pair.changed(-1)
    pair.do(lambda pipe: pipe.fuse_lora(components=["transformer_2"], lora_scale=0.75))
    pair.do(lambda pipe: pipe.unfuse_lora(components=["transformer_2"]))
    pair.do(lambda pipe: pipe.unload_lora_weights())
    assert (".raw" in written(cache)) == (raw_copies == "disk")
    pair.finish()


def test_an_edit_made_in_a_device_copy_is_written_back_through_its_payload(tmp_path) -> None:
    """A block that updates a buffer of its own in its forward: the edit, made in its device copy, reaches its host
    copy (its payload, made again from the device bytes), as natively; ``state_dict()`` and disable carry it."""

    def count(module: torch.nn.Module, args: tuple) -> None:
        module.calls.add_(1)

    pipe, native = build_pipeline("wan22_t2v", "tiny"), build_pipeline("wan22_t2v", "tiny")
    for model in (pipe.transformer, native.transformer):
        block = model.blocks[0]
        block.register_buffer("calls", torch.zeros(()))
        block.register_forward_pre_hook(count)
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    assert torch.equal(wan_latents(pipe), wan_latents(native))
    calls = native.transformer.state_dict()["blocks.0.calls"]
    assert calls > 0 and torch.equal(pipe.transformer.state_dict()["blocks.0.calls"], calls)
    assert isinstance(pipe.transformer.blocks[0].calls, torch.Tensor)
    pipe.disable_flextensor_offload()
    assert torch.equal(pipe.transformer.blocks[0].calls, calls)


def test_a_set_up_that_fails_after_blocks_lost_their_raw_bytes_restores_them_from_their_payloads(monkeypatch) -> None:
    """On CUDA a block's raw bytes leave RAM as soon as its payload is made, before the payloads are kept: a set-up
    that fails then (an error, Ctrl-C) drops them. The payload each such block was settled with is held until set-up
    is done, so the failed set-up leaves the model as it was, bitwise (here the CPU's set-up, made to fail so)."""
    from flextensor_diffusers.storage.compressed_copies import CompressedCopies

    model = build_pipeline("wan22_t2v", "tiny").transformer
    before = snapshot(model)
    made = CompressedCopies.make

    def fails_after_settling(self, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        self.records.drop_all()  # as a failure in the device encoder's loop does
        raise KeyboardInterrupt

    monkeypatch.setattr(CompressedCopies, "make", fails_after_settling)
    with pytest.raises(KeyboardInterrupt):
        ft.offload(model, include_patterns=["blocks.*"], device="cpu", compression="lossless", raw_copies="none")
    assert_same(before, model)


def test_raw_copies_none_needs_compression_in_the_flags_words(capsys) -> None:
    with pytest.raises(SystemExit):
        wan22_t2v.cli(["--random-weights", "tiny", "--device", "cpu", "-q", "--raw-copies", "none"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --raw-copies none keeps only compressed copies in RAM") and "\n" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_weights_built_in_memory_run_from_their_payloads_alone_bitwise(tmp_path) -> None:
    """On CUDA: blocks lose their raw bytes as the device encoder makes their payloads (held until set-up kept them);
    with room for every block resident, activation decodes each through a room of its payload's size; every load
    verified (the default there) finds nothing; three generations bitwise with native on CUDA; ``state_dict()``,
    ``load_state_dict`` and disable decode on the device, bitwise; nothing raw is written."""
    pipe, native = build_pipeline("wan22_t2v", "tiny"), build_pipeline("wan22_t2v", "tiny")
    native.to("cuda")
    reference = wan_latents(native).cpu()
    cache = tmp_path / "cache"
    budget = 2**28  # the text encoder's activations and cuBLAS's workspace need tens of MiB: every block resident
    pipe.enable_flextensor_offload(
        budget=budget, device="cuda", compression="lossless", host_budget="1GiB", cache_dir=cache
    )
    host_budget = one_component_in_ram(ft.pipeline_offload(pipe).handles)
    pipe.disable_flextensor_offload()
    pipe.enable_flextensor_offload(
        budget=budget, device="cuda", compression="lossless", host_budget=host_budget, cache_dir=cache
    )
    state = ft.pipeline_offload(pipe)
    assert all(torch.equal(wan_latents(pipe).cpu(), reference) for _ in range(3))
    assert set(EXPERTS) & set(state.host_tier.report()["on_disk"]) and written(cache) == {".payloads"}
    assert all(state.handles[name].host.where().payloads_only_bytes for name in EXPERTS)
    for name in EXPERTS:
        checks = pipe.flextensor_report()["components"][name]["load_checks"]
        assert checks["checks"] > 0 and checks["faults"] == []
        expected = {k: v.cpu() for k, v in getattr(native, name).state_dict().items()}
        assert all(torch.equal(v, expected[k]) for k, v in getattr(pipe, name).state_dict().items())
    name = waiting_expert(pipe)
    torch.manual_seed(5)
    edited = {k: v + 0.01 * torch.randn_like(v) for k, v in getattr(pipe, name).state_dict().items()}
    getattr(pipe, name).load_state_dict(edited)
    getattr(native, name).load_state_dict({k: v.cuda() for k, v in edited.items()})
    assert torch.equal(wan_latents(pipe).cpu(), wan_latents(native).cpu())
    pipe.disable_flextensor_offload()
    assert all(torch.equal(t, edited[k]) for k, t in getattr(pipe, name).state_dict().items())
