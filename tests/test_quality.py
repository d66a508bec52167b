"""Metrics, plots and encoding of the report: LPIPS computed (offline), deterministic mp4, readable strip."""

from __future__ import annotations

import hashlib
import importlib.machinery
import io
import os
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from flextensor_diffusers.media import files
from flextensor_diffusers.media.video import read_mp4, write_mp4
from flextensor_diffusers.reports import quality
from tests.fakes import open_that_stops, st_lpips_without_ipython

RNG = np.random.default_rng(0)
VIDEO = RNG.integers(0, 256, size=(3, 48, 64, 3), dtype=np.uint8)


def test_lpips_code_path_is_zero_on_identical_frames_and_positive_on_perturbed_ones() -> None:
    """A random AlexNet trunk needs no download; the package's calibrated linear layers are local."""
    pytest.importorskip("lpips")
    net = quality.lpips_network(random_backbone=True)
    perturbed = np.clip(VIDEO.astype(int) + RNG.integers(-20, 21, VIDEO.shape), 0, 255).astype(np.uint8)
    metric = quality.PerceptualMetric(net, "lpips", "note")
    same = quality.frame_metrics(VIDEO, VIDEO, perceptual=metric)
    other = quality.frame_metrics(VIDEO, perturbed, perceptual=metric)
    assert [r["lpips"] for r in same["frames"]] == [0.0, 0.0, 0.0]
    assert all(r["lpips"] > 0 for r in other["frames"])
    assert same["perceptual_metric"] == "lpips" and same["identical"] and not other["identical"]
    assert quality.plot_frames(other).startswith(b"\x89PNG")  # the LPIPS panel draws


def test_without_backbone_weights_the_report_says_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "stlpips_pytorch" else real(name))
    metric = quality.perceptual_metric()
    assert metric.model is None and metric.name is None
    assert metric.note.startswith("LPIPS not computed: ") and quality.ALEXNET_CHECKPOINT in metric.note
    assert "stlpips-pytorch is not installed" in metric.note and str(tmp_path) in metric.note


def test_with_backbone_weights_real_lpips_is_used(tmp_path, monkeypatch) -> None:
    pytest.importorskip("lpips")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / quality.ALEXNET_CHECKPOINT).write_bytes(b"")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.setattr(quality, "lpips_network", lambda random_backbone=False: ("net", random_backbone))
    metric = quality.perceptual_metric()
    assert metric == quality.PerceptualMetric(("net", False), "lpips", "LPIPS (AlexNet, v0.1) computed")


def test_an_st_lpips_that_fails_to_import_is_a_note_not_a_crash(tmp_path, monkeypatch) -> None:
    """stlpips-pytorch imports IPython without declaring it: the note names the error and the extra that fixes it."""
    st_lpips_without_ipython(monkeypatch, tmp_path)
    metrics = quality.frame_metrics(VIDEO, VIDEO[::-1].copy())
    note = metrics["lpips_note"]
    assert (
        note.startswith("LPIPS not computed: ") and "nor ST-LPIPS: importing or loading stlpips-pytorch failed" in note
    )
    assert "ModuleNotFoundError: No module named 'IPython'" in note and quality.ST_LPIPS_INSTALL in note
    assert metrics["perceptual_metric"] is None and all(
        set(r) == {"psnr_db", "ssim", "max_abs"} for r in metrics["frames"]
    )


def test_lpips_weights_that_fail_to_load_are_a_note(tmp_path, monkeypatch) -> None:
    """A checkpoint at the expected place that is not one (here: empty) does not stop the report."""
    pytest.importorskip("lpips")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / quality.ALEXNET_CHECKPOINT).write_bytes(b"")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "stlpips_pytorch" else real(name))
    metric = quality.perceptual_metric()
    assert metric.model is None and metric.note.startswith("LPIPS not computed: loading it failed (")


def test_a_metric_that_fails_on_the_frames_is_a_note() -> None:
    def broken(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Given input size: (64x1x1). Calculated output size: (64x0x0). Output size is too small")

    metrics = quality.frame_metrics(
        VIDEO, VIDEO, perceptual=quality.PerceptualMetric(broken, "lpips", "LPIPS computed")
    )
    assert metrics["perceptual_metric"] is None and all("lpips" not in r for r in metrics["frames"])
    assert metrics["lpips_note"].startswith("lpips not computed: it failed on these frames (RuntimeError: Given input")


def test_st_lpips_is_reported_under_its_own_name(tmp_path, monkeypatch) -> None:
    """Where stlpips-pytorch is installed (it ships its weights) and LPIPS cannot run, ST-LPIPS is named as such."""

    class FakeSTLPIPS(torch.nn.Module):
        def __init__(self, net: str, variant: str, verbose: bool) -> None:
            super().__init__()
            assert (net, variant, verbose) == ("alex", "shift_tolerant", False)  # verbose: it would print

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (a - b).abs().mean().reshape(1, 1, 1, 1)

    package = types.ModuleType("stlpips_pytorch")
    package.__spec__ = importlib.machinery.ModuleSpec("stlpips_pytorch", None)
    package.stlpips = types.SimpleNamespace(LPIPS=FakeSTLPIPS)
    monkeypatch.setitem(sys.modules, "stlpips_pytorch", package)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    metrics = quality.frame_metrics(VIDEO, VIDEO[::-1].copy())
    assert metrics["perceptual_metric"] == "st_lpips" and "ST-LPIPS" in metrics["lpips_note"]
    assert all("st_lpips" in r and "lpips" not in r for r in metrics["frames"])


def test_same_frames_encode_to_the_same_bytes_wherever_they_lie_in_memory(tmp_path) -> None:
    """Equal frames, equal files: whatever the arrays' memory layout (the colour conversion is ours)."""
    frames = RNG.integers(0, 256, size=(9, 96, 128, 3), dtype=np.uint8)
    shifted = np.zeros(frames.size + 1, dtype=np.uint8)[1:].reshape(frames.shape)  # one byte off
    shifted[...] = frames
    digests = set()
    for i, copy in enumerate((frames, shifted, frames.copy())):
        write_mp4(tmp_path / f"{i}.mp4", copy)
        digests.add(hashlib.sha256((tmp_path / f"{i}.mp4").read_bytes()).hexdigest())
    assert len(digests) == 1
    assert np.array_equal(read_mp4(tmp_path / "0.mp4"), read_mp4(tmp_path / "1.mp4"))


def test_colour_conversion_round_trips_within_rounding() -> None:
    from flextensor_diffusers.media.video import rgb_to_yuv420p, yuv420p_to_rgb

    flat = np.repeat(np.repeat(VIDEO[0, ::2, ::2], 2, axis=0), 2, axis=1)  # constant over each 2x2 block
    back = yuv420p_to_rgb(rgb_to_yuv420p(flat), *flat.shape[:2])
    assert np.abs(back.astype(int) - flat).max() <= 3


def test_frame_strip_scales_small_frames_up_and_keeps_labels_off_them() -> None:
    videos = {"native": VIDEO, "offloaded": VIDEO}
    strip = np.asarray(Image.open(io.BytesIO(quality.frame_strip(videos))).convert("RGB"))
    scale = -(-quality.STRIP_MIN_HEIGHT // VIDEO.shape[1])
    assert strip.shape[0] >= 2 * quality.STRIP_MIN_HEIGHT
    first = strip[: VIDEO.shape[1] * scale, quality.LABEL_WIDTH : quality.LABEL_WIDTH + VIDEO.shape[2] * scale]
    assert np.array_equal(first[::scale, ::scale], VIDEO[0])  # the frame itself, nothing drawn over it


def test_plots_use_whole_steps_and_say_identical_instead_of_drawing_infinity() -> None:
    identical = quality.frame_metrics(VIDEO, VIDEO, perceptual=quality.PerceptualMetric(None, None, "no LPIPS"))
    assert all(r["psnr_db"] == quality.INF for r in identical["frames"])
    import matplotlib.pyplot as plt

    psnr, ssim, max_abs = quality.frames_figure(identical).axes
    assert not psnr.lines and "3 of 3 frames identical" in psnr.get_title()  # no line drawn at a made-up dB
    assert ssim.get_title() == "SSIM" and max_abs.lines and max_abs.get_ylim()[0] == 0
    runs = {"native": {"step_s": [0.5, 0.4, 0.45]}, "offloaded": {"step_s": [0.5, 0.41, 0.44]}}
    fig, ax = quality.steps_figure(runs)
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks()) and ax.get_ylim()[0] == 0
    plt.close("all")
    assert quality.plot_steps(runs).startswith(b"\x89PNG") and quality.plot_frames(identical).startswith(b"\x89PNG")


def test_an_interrupted_mp4_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch) -> None:
    """Ctrl-C once the new file has begun (its first packets muxed): the old file is still whole at the path,
    and no temporary file stays (the issue's run left a 48-byte file that PyAV could not read)."""
    import av

    def interrupt() -> None:
        raise KeyboardInterrupt

    target = tmp_path / "out.mp4"
    write_mp4(target, VIDEO)
    before = target.read_bytes()
    monkeypatch.setattr(av, "open", open_that_stops(av.open, interrupt))
    with pytest.raises(KeyboardInterrupt):
        write_mp4(target, VIDEO[::-1].copy())
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out.mp4"]
    with pytest.raises(KeyboardInterrupt):
        write_mp4(tmp_path / "new" / "first.mp4", VIDEO)
    assert list((tmp_path / "new").iterdir()) == []  # nothing at all where nothing was


def test_atomic_files_replace_whole_and_keep_the_usual_permissions(tmp_path) -> None:
    target = tmp_path / "deep" / "report.json"
    files.write_text(target, "old")
    with pytest.raises(ValueError), files.atomic_path(target) as temporary:
        temporary.write_text("half")
        assert temporary.parent == target.parent and temporary.name.endswith(".partial.json")
        raise ValueError("the writer failed")
    assert target.read_text() == "old" and len(list(target.parent.iterdir())) == 1
    files.write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_html_tables_show_small_sizes_in_kib() -> None:
    component = {
        "class": "AutoencoderKLWan",
        "resident_weight_bytes": 33_280,
        "streamed_unit_bytes": 0,
        "streamed_units": 0,
        "units": 13,
        "stall_ms": 0.0,
        "overlap_pct": None,
        "phase": "steady",
    }
    table = quality.offload_table({"components": {"vae": component}, "component_switches": 3})
    assert "<td>32.50 KiB</td>" in table and "0.00 GiB" not in table
