"""LTX-2: the tiny condition pipeline offloaded on the CPU (bitwise equal to native), outpainting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

import flextensor_diffusers as ft
from flextensor_diffusers.media.video import read_mp4, to_uint8_frames, write_mp4
from flextensor_diffusers.recipes import ltx2_outpaint
from flextensor_diffusers.recipes.ltx2_outpaint import LTX2OutpaintPipeline, place_on_canvas
from flextensor_diffusers.recipes.models import build_pipeline, load_config
from flextensor_diffusers.recipes.options import OptionsError


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
    pipe.enable_flextensor_offload(budget=200_000, device="cpu")
    for _ in range(2):
        video, audio = generate(pipe)
        assert torch.equal(video, video_ref) and torch.equal(audio, audio_ref)
    report = pipe.flextensor_report()
    assert report["components"]["transformer"]["streamed_units"] > 0
    assert report["components"]["text_encoder"]["patterns"] == ["model.language_model.layers.*"]
    pipe.disable_flextensor_offload()


def test_full_ltx2_config_has_the_published_sizes() -> None:
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel

    cfg = load_config("ltx2", "full")
    with torch.device("meta"):
        vae = AutoencoderKLLTX2Video(**cfg["vae"])
        transformer = LTX2VideoTransformer3DModel(**cfg["transformer"])
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio) == (32, 8)
    assert round(sum(p.numel() for p in transformer.parameters()) / 1e9, 2) == 18.88
    assert len(transformer.transformer_blocks) == 48


SOURCE = np.random.default_rng(0).integers(0, 256, size=(9, 32, 32, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def outpaint():
    pipe = LTX2OutpaintPipeline.from_pipe(build_pipeline("ltx2_condition", "tiny"))
    pipe.canvas = place_on_canvas(SOURCE, 64, 64, pipe.vae_spatial_compression_ratio)
    return pipe


def tokens(latents, patch: int, patch_t: int):
    """Latents as the transformer's tokens, in the pipeline's own order (the one the outpaint mask follows)."""
    return LTX2OutpaintPipeline._pack_latents(latents, patch, patch_t)  # diffusers' private static method


def outpaint_latents(pipe):
    return pipe(
        prompt="a wide landscape",
        negative_prompt="blurry",
        height=64,
        width=64,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=2.0,
        audio_guidance_scale=2.0,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        max_sequence_length=16,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).frames


def test_outpaint_canvas_conditions_exactly_the_source_tokens(outpaint) -> None:
    canvas = outpaint.canvas
    assert (canvas.top, canvas.left) == (16, 16)
    assert np.array_equal(canvas.pixels[:, canvas.pixel_mask], SOURCE.reshape(9, -1, 3))
    assert (canvas.pixels[:, ~canvas.pixel_mask] == ltx2_outpaint.FILL).all()
    known = canvas.token_mask(2)  # the tiny VAE halves height and width
    expected = torch.zeros(32, 32, dtype=torch.bool)
    expected[8:24, 8:24] = True
    assert torch.equal(known, expected)

    g = torch.Generator().manual_seed(0)
    latents, mask, clean, _ = outpaint.prepare_latents(
        height=64, width=64, num_frames=9, num_channels_latents=4, dtype=torch.float32, generator=g
    )
    assert latents.shape == (1, 5 * 32 * 32, 4) and mask.shape == (1, 5 * 32 * 32, 1)
    per_token = expected.flatten().repeat(5)  # packed order: frame, row, column
    assert torch.equal(mask[0, :, 0], per_token.float())
    encoded = outpaint.encode_canvas(canvas.pixels, torch.device("cpu"), torch.float32, None)
    packed = tokens(encoded, 1, 1)
    assert torch.equal(clean[0, per_token], packed[0, per_token]) and not clean[0, ~per_token].any()
    assert torch.equal(latents[0, per_token], packed[0, per_token])  # known tokens start clean
    assert not torch.equal(latents[0, ~per_token], packed[0, ~per_token])  # the rest is noise


def test_outpaint_offloaded_is_bitwise_native_and_keeps_the_known_tokens(outpaint) -> None:
    ref = outpaint_latents(outpaint)
    packed = tokens(ref, 1, 1)
    clean = tokens(outpaint.encode_canvas(outpaint.canvas.pixels, torch.device("cpu"), torch.float32, None), 1, 1)
    known = outpaint.canvas.token_mask(2).flatten().repeat(5)
    assert torch.allclose(packed[0, known], clean[0, known], atol=1e-5)  # the source survives denoising
    outpaint.enable_flextensor_offload(budget=200_000, device="cpu")
    try:
        for _ in range(3):  # discovery, profiling, steady
            assert torch.equal(outpaint_latents(outpaint), ref)
        assert outpaint.flextensor_report()["components"]["transformer"]["streamed_units"] > 0
    finally:
        outpaint.disable_flextensor_offload()


def test_outpaint_recipe_writes_the_canvas_video(tmp_path) -> None:
    clip = tmp_path / "source.mp4"
    write_mp4(clip, np.repeat(SOURCE[:1], 17, axis=0), fps=24)
    out, summary = tmp_path / "out.mp4", tmp_path / "summary.json"
    argv = ["--random-weights", "tiny", "--input", str(clip), "--canvas", "96x64", "--steps", "2", "-q"]
    argv += ["--output", str(out), "--json", str(summary), "--profile-dir", str(tmp_path / "profiles")]
    ltx2_outpaint.main(argv)
    video = read_mp4(out)
    assert video.shape == (9, 64, 96, 3)  # tiny weights: 9 frames by default, on the canvas
    info = json.loads(summary.read_text())
    assert info["canvas"]["offset"] == [32, 16] and info["canvas"]["source_size"] == [32, 32]
    assert info["canvas"]["conditioned_tokens_per_frame"] == 16 * 16
    assert info["frames"] == info["frames_written"] == 9
    assert info["peak_host_rss_bytes"] > 2**20 and "ru_maxrss" in info["peak_host_rss_scope"]


def test_outpaint_recipe_streams_the_bytes_of_the_whole_video_written_on_the_host(tmp_path, monkeypatch) -> None:
    """The recipe keeps the decoded video on the device and writes it in uint8 chunks (here 4, 4 and 1 frames),
    pasting the source per chunk: the same mp4 bytes as the whole float video made uint8, pasted and written."""
    from flextensor_diffusers.media import video

    monkeypatch.setattr(video, "WRITE_CHUNK_FRAMES", 4)
    clip, out = tmp_path / "source.mp4", tmp_path / "out.mp4"
    write_mp4(clip, SOURCE[:9], fps=24)
    argv = ["--random-weights", "tiny", "--input", str(clip), "--canvas", "96x64", "--steps", "2", "-q"]
    ltx2_outpaint.main([*argv, "--output", str(out), "--profile-dir", str(tmp_path / "profiles")])
    options = ltx2_outpaint.parse_args([*argv, "--output", str(tmp_path / "unused.mp4")])
    pipe = ltx2_outpaint.load(options, torch.device("cpu"))
    frames = to_uint8_frames(ltx2_outpaint.generate(pipe, options, torch.device("cpu"), options.steps, "np")[0])
    mask = pipe.canvas.pixel_mask
    frames[:, mask] = pipe.canvas.pixels[: len(frames), mask]
    write_mp4(tmp_path / "whole.mp4", frames, fps=24)
    assert out.read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_outpaint_defaults_to_the_whole_clip_with_real_weights(tmp_path) -> None:
    """Real (or full random) weights: the longest 8k+1 frames of the source, on a 1280x704 canvas."""
    clip, model = tmp_path / "source.mp4", tmp_path / "model"
    write_mp4(clip, np.repeat(SOURCE[:1], 20, axis=0), fps=24)
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    options = ltx2_outpaint.parse_args(["--model", str(model), "--input", str(clip)])
    assert (options.frames, options.width, options.height, options.steps) == (17, 1280, 704, 40)
    assert options.source_size is None and options.max_sequence_length == 1024


def test_outpaint_refuses_a_source_larger_than_the_canvas_and_bad_lengths(tmp_path) -> None:
    with pytest.raises(ft.FlexTensorError, match="larger than the canvas"):
        place_on_canvas(SOURCE, 16, 64, 2)
    clip = tmp_path / "source.mp4"
    write_mp4(clip, SOURCE, fps=24)
    tiny = ["--random-weights", "tiny", "--input", str(clip)]
    with pytest.raises(OptionsError, match=r"--frames 8: LTX-2 makes 8k\+1 frames: pass --frames 1 or 9"):
        ltx2_outpaint.parse_args([*tiny, "--frames", "8"])
    with pytest.raises(OptionsError, match=r"--frames 17: .* has 9 frames: pass --frames 9 or fewer"):
        ltx2_outpaint.parse_args([*tiny, "--frames", "17"])
    with pytest.raises(OptionsError, match=r"--canvas 32x16: LTX-2 needs a height that is a multiple of 32"):
        ltx2_outpaint.parse_args([*tiny, "--canvas", "32x16"])
    with pytest.raises(OptionsError, match=r"--canvas 48x64: LTX-2 needs a width that is a multiple of 32"):
        ltx2_outpaint.parse_args([*tiny, "--canvas", "48x64"])
    with pytest.raises(OptionsError, match=r"the source \(64x64\) is larger than the canvas \(64x32\)"):
        ltx2_outpaint.parse_args([*tiny, "--source-size", "64x64", "--canvas", "64x32"])
