"""Saving an offloaded pipeline writes what native writes, in either serialization, and a pipeline loaded from what
it wrote can be offloaded again: ``state_dict()`` gives each packed weight in a storage of its own (as natively)
that is its host copy's bytes, not a copy of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import wan_latents

BUDGET = 250_000
WEIGHT_SUFFIXES = (".bin", ".safetensors")


def latents(pipe) -> torch.Tensor:
    return wan_latents(pipe, num_inference_steps=2)


def offloaded_and_run():
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    latents(pipe)
    for handle in ft.pipeline_offload(pipe).handles.values():
        handle.wait_until_packed()  # the VAE too, which a generation of latents never calls
    return pipe


def weight_files(folder: Path) -> dict[str, bytes]:
    files = [p for p in sorted(folder.rglob("*")) if p.suffix in WEIGHT_SUFFIXES]
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


@pytest.mark.parametrize("safe_serialization", [False, True], ids=["torch.save", "safetensors"])
def test_saving_while_offloaded_writes_the_native_files(tmp_path: Path, safe_serialization: bool) -> None:
    native = build_pipeline("wan22_t2v", "tiny")
    native.save_pretrained(tmp_path / "native", safe_serialization=safe_serialization)
    pipe = offloaded_and_run()
    pipe.save_pretrained(tmp_path / "offloaded", safe_serialization=safe_serialization)
    written, expected = weight_files(tmp_path / "offloaded"), weight_files(tmp_path / "native")
    assert written.keys() == expected.keys() and len(expected) == 4
    for name, data in expected.items():
        assert written[name] == data, name  # byte for byte: the same tensors, each its own storage

    reloaded = type(pipe).from_pretrained(tmp_path / "offloaded")
    reloaded.enable_flextensor_offload(budget=BUDGET, device="cpu")
    expected_latents = latents(native)
    assert all(torch.equal(latents(reloaded), expected_latents) for _ in range(2))


def test_state_dict_gives_each_weight_its_own_storage_over_the_host_copy() -> None:
    native = build_pipeline("wan22_t2v", "tiny").transformer.state_dict()
    pipe = offloaded_and_run()
    handle = ft.pipeline_offload(pipe).handles["transformer"]
    handle.activate()  # its blocks in device copies (slots): state_dict() still reads the host copies
    state = pipe.transformer.state_dict()
    assert state.keys() == native.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, native[name]), name
        assert tensor.untyped_storage().nbytes() == native[name].untyped_storage().nbytes(), name
    block = handle.units[1]
    for packed in block.tensors:  # no copy: the host copy's own bytes
        own = state[f"{block.name}.{packed.names[0]}"]
        assert own.data_ptr() == packed.view_of(block.host).data_ptr()


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".bin":
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        elif path.suffix == ".safetensors":
            loaded = load_file(str(path))
        else:
            continue
        out.update({f"{path.parent.name}/{k}": v for k, v in loaded.items()})
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("safe_serialization", [False, True], ids=["torch.save", "safetensors"])
def test_saving_while_offloaded_on_cuda(tmp_path: Path, safe_serialization: bool) -> None:
    """The same tensors, each its own storage, as native's on the GPU (a torch.save file records the CPU as their
    device: they are the host copies); reloaded and offloaded again, the same latents."""
    native = build_pipeline("wan22_t2v", "tiny").to("cuda")
    native.save_pretrained(tmp_path / "native", safe_serialization=safe_serialization)
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget="512MiB", device="cuda")
    latents(pipe)
    for handle in ft.pipeline_offload(pipe).handles.values():
        handle.wait_until_packed()
    pipe.save_pretrained(tmp_path / "offloaded", safe_serialization=safe_serialization)
    written, expected = saved_tensors(tmp_path / "offloaded"), saved_tensors(tmp_path / "native")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
        assert written[name].untyped_storage().nbytes() == tensor.untyped_storage().nbytes(), name
    reloaded = type(pipe).from_pretrained(tmp_path / "offloaded")
    reloaded.enable_flextensor_offload(budget="512MiB", device="cuda")
    assert torch.equal(latents(reloaded), latents(native))
