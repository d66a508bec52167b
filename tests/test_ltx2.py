"""The tiny LTX-2 condition pipeline (video + audio) offloaded on the CPU: bitwise equal to native."""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

import flextensor_diffusers as ft
from flextensor_diffusers.models import build_pipeline


def generate(pipe):
    image = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    out = pipe(
        conditions=LTX2VideoCondition(frames=image, index=0, strength=1.0, crf=0),
        prompt="a robot dancing",
        negative_prompt="blurry",
        num_inference_steps=2,
        guidance_scale=2.0,
        height=32,
        width=32,
        num_frames=9,
        frame_rate=25.0,
        max_sequence_length=16,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    return out.frames, out.audio


def test_tiny_ltx2_offloaded_is_bitwise_native() -> None:
    pipe = build_pipeline("ltx2_condition", "tiny")
    video_ref, audio_ref = generate(pipe)
    pipe.enable_flextensor_offload(budget=250_000, device="cpu")
    for _ in range(2):
        video, audio = generate(pipe)
        assert torch.equal(video, video_ref) and torch.equal(audio, audio_ref)
    report = pipe.flextensor_report()
    assert report["components"]["transformer"]["streamed_units"] > 0
    assert report["components"]["text_encoder"]["patterns"] == ["model.language_model.layers.*"]
    pipe.disable_flextensor_offload()


def test_full_ltx2_config_is_not_shipped_yet() -> None:
    with pytest.raises(ft.FlexTensorError, match="no 'full' config for ltx2"):
        build_pipeline("ltx2_condition", "full")
