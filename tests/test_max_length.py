"""benchmarks/max_length.py end to end on the CPU (tiny LTX-2), and the streaming mp4 writer it uses."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flextensor_diffusers.reports.video import Mp4Writer, read_mp4, write_mp4, write_mp4_frames

ROOT = Path(__file__).resolve().parents[1]
FRAMES = np.random.default_rng(0).integers(0, 256, size=(5, 34, 48, 3), dtype=np.uint8)


def test_streamed_mp4_has_the_bytes_of_write_mp4(tmp_path) -> None:
    whole, streamed = tmp_path / "whole.mp4", tmp_path / "streamed.mp4"
    codec = write_mp4(whole, FRAMES, fps=24)
    writer = write_mp4_frames(streamed, iter(FRAMES.astype(np.float32) / 255.0), fps=24)
    assert (writer.codec, writer.frames) == (codec, 5)
    assert streamed.read_bytes() == whole.read_bytes()
    assert np.array_equal(read_mp4(streamed), read_mp4(whole))
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_streamed_mp4_is_all_or_nothing(tmp_path) -> None:
    target = tmp_path / "out.mp4"
    target.write_bytes(b"before")
    with pytest.raises(KeyboardInterrupt), Mp4Writer(target, fps=24) as writer:
        writer.write(FRAMES[0])
        raise KeyboardInterrupt
    assert target.read_bytes() == b"before" and sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4"]
    with pytest.raises(ValueError, match="frame 1 is"), Mp4Writer(target) as writer:
        writer.write(FRAMES[0])
        writer.write(FRAMES[0, :16])
    assert target.read_bytes() == b"before" and sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4"]


def test_max_length_search_on_the_cpu(tmp_path) -> None:
    """Tiny LTX-2 at 32x32: a simulated out-of-memory above 9 frames, and a cap the planner refuses."""
    out = tmp_path / "max_length.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "max_length.py"), "--size", "tiny", "--height", "32"]
    cmd += ["--width", "32", "--caps", "1GB", "100KB", "--max-frames", "17", "--start-frames", "9"]
    cmd += ["--simulate-oom-above", "9", "--steps", "1", "--profiling-steps", "1", "--out", str(out)]
    cmd += ["--video-dir", str(tmp_path / "videos")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["workload"]["steps"] == 1 and "VAE tiling on" in result["workload"]["vae_decode"]
    fitted, refused = result["runs"]
    for run in result["runs"]:
        for key in ("cap_bytes", "offload_max_frames", "offload_first_failing_frames", "native_max_frames"):
            assert key in run
        assert run["decoded"] is True and "native_first_failing_frames" in run and "mp4_sha256" in run
        assert "offload_max_video_s" in run and "native_max_video_s" in run
        for trial in run["trials"]:
            assert trial["outcome"] in ("completed", "gpu_oom", "budget_refused"), trial
            assert trial["reason"] is None if trial["outcome"] == "completed" else trial["reason"]
            assert {"frames", "seconds", "peak_gpu_allocated_bytes", "peak_host_rss_bytes"} <= trial.keys()
            if trial["outcome"] == "completed":
                assert len(trial["mp4_sha256"]) == 64 and trial["peak_host_rss_bytes"] > 0
    assert (fitted["native_max_frames"], fitted["native_first_failing_frames"]) == (9, 17)
    assert (fitted["offload_max_frames"], fitted["offload_first_failing_frames"]) == (9, 17)
    assert fitted["offload_max_video_s"] == 0.375 and fitted["offload_status"] == "found"
    assert fitted["quality"] == {
        "frames": 9,
        "latents_bitwise": True,
        "latents_max_abs_diff": 0.0,
        "frames_bitwise": True,
        "frames_max_abs_diff": 0,
        "mp4_bitwise": True,
    }
    kept = tmp_path / fitted["kept_files"][0]
    longest = next(t for t in fitted["trials"] if t["mode"] == "offload" and t["frames"] == 9)
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == fitted["mp4_sha256"] == longest["mp4_sha256"]
    assert read_mp4(kept).shape == (9, 32, 32, 3)
    assert refused["offload_max_frames"] is None and refused["mp4_sha256"] is None and refused["quality"] is None
    assert {t["outcome"] for t in refused["trials"] if t["mode"] == "offload"} == {"budget_refused"}
    assert "BudgetError at set-up" in refused["trials"][-1]["reason"]
    assert list((tmp_path / "videos").iterdir()) == []  # trial mp4s are not left behind


def test_max_length_says_at_least_when_it_completes_at_max_frames(tmp_path) -> None:
    out = tmp_path / "max_length.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "max_length.py"), "--size", "tiny", "--height", "32"]
    cmd += ["--width", "32", "--caps", "1GB", "--modes", "offload", "--max-frames", "9", "--start-frames", "9"]
    cmd += ["--steps", "1", "--profiling-steps", "0", "--out", str(out), "--video-dir", str(tmp_path / "v")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["offload_max_frames"], run["offload_first_failing_frames"]) == (9, None)
    assert run["offload_status"].startswith("at least 9 frames")
