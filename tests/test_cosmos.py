"""Cosmos-Transfer2.5: the tiny pipeline offloaded on the CPU (bitwise equal to native), the recipe."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision", reason="Cosmos' ControlNet resizes its padding mask with torchvision")
pytest.importorskip("cv2", reason="the edge control uses OpenCV")

from flextensor_diffusers.engine import FlexTensorError
from flextensor_diffusers.media.video import read_mp4, write_mp4
from flextensor_diffusers.recipes import cosmos_transfer25 as recipe
from flextensor_diffusers.recipes.models import build_pipeline

SOURCE = np.zeros((5, 32, 32, 3), dtype=np.uint8)
for i in range(5):  # a white square moving right
    SOURCE[i, 8:24, 4 + 2 * i : 20 + 2 * i] = 255


def latents(pipe, controls):
    return pipe(
        controls=controls,
        prompt="a robot arm",
        negative_prompt="blurry",
        height=32,
        width=32,
        num_frames=5,
        num_frames_per_chunk=16,
        num_inference_steps=2,
        guidance_scale=3.0,
        max_sequence_length=16,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).frames


def test_canny_edges_trace_the_square() -> None:
    edges = recipe.canny_edges(SOURCE, 32, 32)
    first = np.asarray(edges[0])
    assert len(edges) == 5 and first.shape == (32, 32, 3)
    assert (first[..., 0] == first[..., 1]).all() and (first[..., 0] == first[..., 2]).all()
    on = first[..., 0] > 0
    assert on[8:24, 4].any() and on[8:24, 19].any()  # the left and right sides of the square
    assert not on[12:20, 8:16].any() and not on[:, 26:].any()  # nothing inside it or far from it


def test_tiny_cosmos_offloaded_is_bitwise_native() -> None:
    pipe = build_pipeline("cosmos_transfer25", "tiny", safety_checker=recipe.SkippedSafetyChecker())
    controls = recipe.canny_edges(SOURCE, 32, 32)
    ref = latents(pipe, controls)
    pipe.enable_flextensor_offload(budget=270_000, device="cpu")
    try:
        for _ in range(2):
            assert torch.equal(latents(pipe, controls), ref)
        report = pipe.flextensor_report()["components"]
        assert report["transformer"]["streamed_units"] > 0 and report["controlnet"]["streamed_units"] > 0
        assert report["text_encoder"]["phase"] == "steady"
    finally:
        pipe.disable_flextensor_offload()


def test_recipe_writes_the_frames_and_says_the_safety_check_was_skipped(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "cosmos_guardrail", None)  # as if not installed
    clip, out, summary = tmp_path / "edges.mp4", tmp_path / "out.mp4", tmp_path / "summary.json"
    write_mp4(clip, SOURCE, fps=24)
    argv = ["--random-weights", "tiny", "--input", str(clip), "--frames", "5", "--height", "32", "--width", "32"]
    argv += ["--steps", "2", "--chunk", "16", "--output", str(out), "--json", str(summary)]
    recipe.main([*argv, "--profile-dir", str(tmp_path / "profiles")])
    assert read_mp4(out).shape == (5, 32, 32, 3)
    info = json.loads(summary.read_text())
    assert info["safety_check"] == recipe.GUARDRAIL_SKIPPED
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("safety check skipped") == 1  # said once, not twice


def test_recipe_without_weights_says_how_to_get_them(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        recipe.cli([])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cosmos_transfer25: no weights") and "--random-weights" in err
    assert len(err.strip().splitlines()) == 1


def test_a_source_shorter_than_the_video_and_bad_chunks_are_refused_before_loading(tmp_path) -> None:
    """The pipeline would quietly make a video as long as its control; the recipe says so instead."""
    clip = tmp_path / "edges.mp4"
    write_mp4(clip, SOURCE, fps=24)
    tiny = ["--random-weights", "tiny", "--input", str(clip)]
    with pytest.raises(FlexTensorError, match="has 5 frames, fewer than --frames 9"):
        recipe.parse_args([*tiny, "--frames", "9"])
    with pytest.raises(FlexTensorError, match="--chunk 0 must be a positive whole number"):
        recipe.parse_args([*tiny, "--chunk", "0"])
    with pytest.raises(FlexTensorError, match="--chunk 3: a chunk has at least 5 frames: pass --chunk 5"):
        recipe.parse_args([*tiny, "--chunk", "3"])
    with pytest.raises(FlexTensorError, match=r"--chunk 17 is longer than .* pass --chunk 16 or less"):
        recipe.parse_args([*tiny, "--chunk", "17"])
    with pytest.raises(FlexTensorError, match=r"--height 40: Cosmos-Transfer2\.5 needs a multiple of 16"):
        recipe.parse_args([*tiny, "--height", "40"])


@pytest.mark.parametrize(
    ("missing", "says"), [("torchvision", "needs the torchvision package"), ("cv2", "needs the cv2 package")]
)
def test_missing_optional_packages_are_named_before_loading(monkeypatch, missing, says) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(FlexTensorError, match=rf"{says}: pip install -e \"\.\[cosmos\]\" \(in the clone"):
        recipe.parse_args(["--random-weights", "tiny"])


def test_compare_report_for_cosmos_is_bitwise(tmp_path) -> None:
    from flextensor_diffusers.reports.compare import compare

    clip = tmp_path / "edges.mp4"
    write_mp4(clip, SOURCE, fps=24)
    argv = ["--random-weights", "tiny", "--input", str(clip), "--frames", "5", "--height", "32", "--width", "32"]
    argv += ["--steps", "2", "--chunk", "16", "--profile-dir", str(tmp_path / "profiles")]
    report = compare("cosmos_transfer25", argv, tmp_path / "report")
    assert report["fidelity"]["latents"]["bitwise_equal"]
    assert report["runs"]["offloaded"]["status"] == "completed"
    assert json.loads((tmp_path / "report" / "report.json").read_text())["recipe"] == "cosmos_transfer25"
    assert "controls" not in report["arguments"]  # derived inputs are not arguments
