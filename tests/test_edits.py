"""In-place weight edits on an offloaded model reach the host copies (the weights' truth) or are
refused: a LoRA fused while its component is active, ``load_state_dict``, ``param.data.copy_()``
inside ``editing()``, and a parameter swapped for another object."""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import Stack, enable_with_one_component_in_ram, set_host_overhead, snapshot, wan_latents

peft = pytest.importorskip("peft")

BUDGET = 250_000


def generate(pipe) -> torch.Tensor:
    return wan_latents(pipe)


def with_lora(pipe):
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v", "ffn.net.2"], init_lora_weights=False)
    pipe.transformer_2.add_adapter(config, adapter_name="style")
    return pipe


def test_lora_fused_while_the_component_is_active_is_kept() -> None:
    native = with_lora(build_pipeline("wan22_t2v", "tiny"))
    unfused = generate(native)
    native.transformer_2.fuse_lora()
    fused = generate(native)
    assert not torch.equal(fused, unfused)  # the LoRA changes the output
    native.transformer_2.unfuse_lora()
    refused = generate(native)  # (W + d) - d: not bitwise W, natively either
    native.transformer_2.fuse_lora()

    pipe = with_lora(build_pipeline("wan22_t2v", "tiny"))
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    assert torch.equal(generate(pipe), unfused)
    handle = ft.pipeline_offload(pipe).handles["transformer_2"]
    handle.activate()  # the expert is the active component, its blocks in slots
    pipe.transformer_2.fuse_lora()
    assert handle.active  # the edit leaves the component as active as it found it
    assert all(torch.equal(generate(pipe), fused) for _ in range(2))
    pipe.transformer_2.unfuse_lora()
    assert torch.equal(generate(pipe), refused)
    pipe.transformer_2.fuse_lora()
    refused_fused = generate(native)
    assert torch.equal(generate(pipe), refused_fused)
    pipe.disable_flextensor_offload()
    assert torch.equal(generate(pipe), refused_fused)  # the fused weights survive disable
    expected = snapshot(native.transformer_2)
    for name, (data, _, _) in snapshot(pipe.transformer_2).items():
        assert torch.equal(data, expected[name][0]), name


def make_stack() -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(depth=6), torch.randint(0, 50, (2, 16))


def forward(model, x) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def test_load_state_dict_and_edits_inside_editing_reach_every_copy() -> None:
    model, x = make_stack()
    other, _ = make_stack()
    torch.manual_seed(1)
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    ref_other = forward(other, x)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    for _ in range(3):
        forward(model, x)  # steady: slots hold the last units
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(forward(model, x), ref_other) for _ in range(2))

    with handle.editing():
        model.blocks[2].out.weight.data.mul_(0.5)  # lands in the host copy
        model.blocks[3].out.bias.data = torch.zeros_like(model.blocks[3].out.bias)  # replaced: adopted
    other.blocks[2].out.weight.data.mul_(0.5)
    other.blocks[3].out.bias.data.zero_()
    assert all(torch.equal(forward(model, x), forward(other, x)) for _ in range(2))
    handle.remove()
    assert torch.equal(forward(model, x), forward(other, x))


def test_an_edit_that_changes_dtype_is_refused_and_undone() -> None:
    model, x = make_stack()
    ref = forward(model, x)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    forward(model, x)
    with pytest.raises(ft.FlexTensorError, match="shape or dtype"), handle.editing():
        model.blocks[1].qkv.weight.data = model.blocks[1].qkv.weight.data.half()
    assert model.blocks[1].qkv.weight.dtype == torch.float32
    assert all(torch.equal(forward(model, x), ref) for _ in range(3))
    handle.remove()


def test_a_parameter_swapped_behind_the_handle_is_refused_at_the_next_activation() -> None:
    model, x = make_stack()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    forward(model, x)
    handle.release()
    model.blocks[0].out.weight = torch.nn.Parameter(torch.zeros_like(model.blocks[0].out.weight))
    with pytest.raises(ft.OffloadStateError, match=r"blocks\.0\.out\.weight.*editing\(\)"):
        forward(model, x)


def test_lora_fused_while_its_expert_waits_on_disk_is_kept(tmp_path, monkeypatch) -> None:
    """A host budget of one expert: the LoRA'd low-noise expert waits on disk when the high-noise one runs.
    Fusing it there (and unfusing, and fusing again) reaches what it computes with, as natively, over
    the next generations and after disable."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    native = with_lora(build_pipeline("wan22_t2v", "tiny"))
    native.transformer_2.fuse_lora()
    fused = generate(native)
    native.transformer_2.unfuse_lora()
    native.transformer_2.fuse_lora()
    refused_fused = generate(native)

    pipe = with_lora(build_pipeline("wan22_t2v", "tiny"))
    enable_with_one_component_in_ram(pipe, BUDGET, tmp_path)
    generate(pipe)
    ft.pipeline_offload(pipe).handles["transformer"].activate()  # the low-noise expert moves out to disk
    assert "transformer_2" in ft.pipeline_offload(pipe).host_tier.report()["on_disk"]
    pipe.transformer_2.fuse_lora()
    assert all(torch.equal(generate(pipe), fused) for _ in range(2))
    pipe.transformer_2.unfuse_lora()
    ft.pipeline_offload(pipe).handles["transformer"].activate()
    pipe.transformer_2.fuse_lora()
    assert torch.equal(generate(pipe), refused_fused)
    pipe.disable_flextensor_offload()
    assert torch.equal(generate(pipe), refused_fused)


def test_load_state_dict_with_assign_keeps_streaming_what_it_assigns() -> None:
    """``load_state_dict(assign=True)`` (what peft's adapter loading calls) puts the given tensors in the model in
    place of packed ones: those take the given values and their places back, so they keep streaming, and the
    outputs are the other model's, over steady forwards and after removal."""
    model, x = make_stack()
    other, _ = make_stack()
    torch.manual_seed(2)
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    forward(model, x)
    packed = [p for p in model.blocks.parameters()]
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    assert all(a is b for a, b in zip(packed, model.blocks.parameters(), strict=True))  # still the packed ones
    assert all(torch.equal(forward(model, x), forward(other, x)) for _ in range(3))
    handle.remove()
    assert torch.equal(forward(model, x), forward(other, x))
