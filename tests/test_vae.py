"""VAE encode and decode are workloads of their own: profiled, planned and streamed, bitwise equal."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.pipelines.patterns import patterns_for
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import assert_same, snapshot


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=4,
        sample_size=32,
    )
    return vae.eval().requires_grad_(False)


def test_autoencoder_patterns_cover_encoder_and_decoder() -> None:
    assert patterns_for("vae", tiny_vae()) == [
        "encoder.down_blocks.*",
        "encoder.mid_block",
        "decoder.up_blocks.*",
        "decoder.mid_block",
    ]


def test_decode_and_encode_are_planned_and_stream_bitwise_equal() -> None:
    vae = tiny_vae()
    images = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        latents = vae.encode(images).latent_dist.mean
        ref_decoded = vae.decode(latents).sample
    before = snapshot(vae)
    config = ft.OffloadConfig(
        include_patterns=patterns_for("vae", vae),
        gpu_budget=200_000,  # two slots of the largest block and the rest, not every block at once
        device="cpu",
        entry_methods=["encode", "decode"],
    )
    handle = ft.offload(vae, config)
    with torch.inference_mode():
        decoded = [vae.decode(latents).sample for _ in range(4)]
    assert handle.phase is Phase.STEADY and handle.plan is not None
    assert handle.counters["discovery"] == 1 and handle.counters["profiling"] == 1 and handle.counters["steady"] == 2
    assert len(handle.plan.streamed) > 0
    decoder_units = {u.index for u in handle.units if u.name.startswith("decoder.")}
    assert {c.unit for c in handle.profile.calls} == decoder_units  # decode runs the decoder only
    assert all(torch.equal(d, ref_decoded) for d in decoded)
    with torch.inference_mode():
        encoded = [vae.encode(images).latent_dist.mean for _ in range(3)]  # a second workload, planned too
        assert torch.equal(vae.decode(latents).sample, ref_decoded)  # back to decode: its plan, no profiling
    assert all(torch.equal(e, latents) for e in encoded)
    assert handle.counters["discovery"] == 1 and handle.counters["profiling"] == 2 and handle.counters["plans"] == 3
    handle.remove()
    assert_same(before, vae)


def test_pipeline_vae_decode_is_planned() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    kw = dict(prompt="a cat", num_frames=9, height=32, width=32, num_inference_steps=2, guidance_scale=1.0)
    ref = pipe(**kw, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    pipe.enable_flextensor_offload(budget=250_000, device="cpu")
    outs = [pipe(**kw, output_type="np", generator=torch.Generator().manual_seed(0)).frames for _ in range(3)]
    vae = pipe.flextensor_report()["components"]["vae"]
    assert vae["phase"] == "steady" and vae["plan"] is not None and vae["units"] > 0
    assert all((o == ref).all() for o in outs)
    pipe.disable_flextensor_offload()


def test_a_small_vae_is_resident_while_it_is_profiled() -> None:
    """A decode in a single generation runs before any plan: with weights far under the budget, every
    block is resident from the start instead of loading into one profiling slot at every call."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    kw = dict(prompt="a cat", num_frames=9, height=32, width=32, num_inference_steps=2, guidance_scale=1.0)
    ref = pipe(**kw, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    pipe.enable_flextensor_offload(budget="1GiB", device="cpu")
    out = pipe(**kw, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    vae = ft.pipeline_offload(pipe).handles["vae"]
    assert vae.phase is Phase.PROFILING  # decoded once: discovery only
    assert vae.stats().loads == 0
    assert {u.placement for u in vae.stats().units} == {"resident (until planned)"}
    assert (out == ref).all()
    pipe.disable_flextensor_offload()
