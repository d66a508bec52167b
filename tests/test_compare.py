"""The native-vs-offloaded report on the tiny pipeline, the metrics, and a native OOM as a result."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flextensor_diffusers.reports import compare, quality
from tests.fakes import st_lpips_without_ipython
from tests.models import TINY_WAN_ARGV


def test_report_files_exist_parse_and_identical_outputs_read_as_such(tmp_path, monkeypatch) -> None:
    """Also with the README's optional ST-LPIPS installed but failing to import: the report says why."""
    st_lpips_without_ipython(monkeypatch, tmp_path / "hub")
    report = compare.compare("wan22_t2v", [*TINY_WAN_ARGV, "--profile-dir", str(tmp_path / "p")], tmp_path)
    for name in ("native.mp4", "offloaded.mp4", "strip.png", "steps.png", "frames.png", "report.html"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert not (tmp_path / "memory.png").exists()  # the CPU has no allocator counters: a note instead
    data = json.loads((tmp_path / "report.json").read_text())  # strict JSON: no Infinity/NaN tokens
    assert data["fidelity"]["latents"] == {"bitwise_equal": True, "max_abs": 0.0, "mean_abs": 0.0}
    frames = data["fidelity"]["frames"]["frames"]
    assert len(frames) == 9 and all(f["psnr_db"] == "inf" and f["max_abs"] == 0 for f in frames)
    assert all(f["ssim"] == 1.0 for f in frames)
    assert data["gpu_figures"] == "not available (CPU run)"
    assert len(data["runs"]["native"]["step_s"]) == 2 and len(data["runs"]["offloaded"]["step_s"]) == 2
    offloaded = data["runs"]["offloaded"]  # profiled inside the recorded generation, as the recipe runs it
    assert offloaded["profiling_s"] is None and offloaded["profiled_in"] == "generation"
    assert offloaded["unplanned_forwards"] == 7  # text encoder, each expert: discovery and profiling; the VAE's decode
    note = data["fidelity"]["frames"]["lpips_note"]
    assert note.startswith("LPIPS not computed: ") and "No module named 'IPython'" in note
    assert not [p.name for p in tmp_path.iterdir() if ".partial" in p.name]  # every file renamed into place
    identical = data["fidelity"]["identical"]
    assert identical["frames"] and identical["mp4_bytes"] and identical["decoded"]  # deterministic encoding
    assert "before encoding" in identical["measured_on"] and "decoded" in identical["measured_on"]
    assert "output" not in data["arguments"] and data["arguments"]["frames"] == 9  # compare writes no --output
    assert data["compile"] == {"mode": "none", "components": []} and data["device_name"].startswith("CPU")
    assert data["memory_cap"] is None and data["videos"] == {"native": "native.mp4", "offloaded": "offloaded.mp4"}
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in html and "Latents bitwise equal:</b> True" in html
    assert '<a href="native.mp4">' in html and '<a href="offloaded.mp4">' in html
    assert "Not measured: this was a CPU run" in html and "cpu ()" not in html
    assert "decoded mp4 frames: True" in html and "<th>transformer_2</th>" in html  # the per-component table
    assert "PSNR infinite on every frame (identical)" in html and "compile none" in html
    assert "No module named &#x27;IPython&#x27;" in html
    assert report["runs"]["native"]["status"] == "completed"


def test_psnr_matches_an_independent_numpy_computation() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-3, 4, a.shape), 0, 255).astype(np.uint8)
    mse = ((a.astype(float) - b.astype(float)) ** 2).mean()
    assert quality.psnr(a, b) == pytest.approx(10 * np.log10(255**2 / mse), rel=1e-12)
    assert math.isinf(quality.psnr(a, a))
    assert 0.5 < quality.ssim(a, b) < 1.0 and quality.ssim(a, a) == pytest.approx(1.0)
    rows = quality.frame_metrics(a[None], b[None])["frames"]
    assert rows[0]["psnr_db"] == pytest.approx(10 * np.log10(255**2 / mse), abs=1e-4)
    assert rows[0]["max_abs"] == 3


def test_native_out_of_memory_is_a_result(tmp_path, monkeypatch) -> None:
    real = compare.run_generation
    calls = {"n": 0}

    def native_runs_out(recipe, pipe, args, device):
        calls["n"] += 1
        if calls["n"] == 1:  # the native run: the transformer's first forward fails like a full card
            hook = pipe.transformer.register_forward_pre_hook(
                lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
            )
            try:
                return real(recipe, pipe, args, device)
            finally:
                hook.remove()
        return real(recipe, pipe, args, device)

    monkeypatch.setattr(compare, "run_generation", native_runs_out)
    report = compare.compare("wan22_t2v", [*TINY_WAN_ARGV, "--profile-dir", str(tmp_path / "p")], tmp_path)
    assert report["runs"]["native"]["status"] == "out of memory"
    assert report["runs"]["native"]["stage"] == "transformer"
    assert report["runs"]["offloaded"]["status"] == "completed"
    assert "native: out of memory at transformer" in report["fidelity_note"]
    assert (tmp_path / "offloaded.mp4").exists() and not (tmp_path / "native.mp4").exists()
    assert "out of memory" in (tmp_path / "report.html").read_text()
