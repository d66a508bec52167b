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

from flextensor_diffusers.media.video import Mp4Writer, read_mp4, to_uint8_frames, write_mp4, write_mp4_frames

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


def test_summarise_recomputes_the_answers_of_a_call_cut_off_mid_trial(tmp_path) -> None:
    """The H200 result's 80 GB search was ended by the call's time limit during its 2 481-frame trial: the
    summary walks the recorded outcomes and answers "at least 2 473", never "2 481 fails"."""
    source = ROOT / "benchmarks" / "results" / "ltx2_max_length_decoded_h200.json"
    out = tmp_path / "s.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "max_length.py"), "--summarise", str(source)]
    subprocess.run([*cmd, "--max-frames", "4241", "--out", str(out)], check=True, capture_output=True, timeout=120)
    runs = {run["cap_bytes"]: run for run in json.loads(out.read_text())["runs"]}
    big, small = runs[80_000_000_000], runs[40_000_000_000]
    assert (big["native_max_frames"], big["native_first_failing_frames"]) == (409, 417)
    assert (big["offload_max_frames"], big["offload_first_failing_frames"]) == (2473, None)
    assert big["offload_status"].startswith("cut short")
    assert big["mp4_sha256"] == next(t["mp4_sha256"] for t in big["trials"] if t["frames"] == 2473)
    assert (small["offload_max_frames"], small["offload_first_failing_frames"], small["offload_status"]) == (
        1185,
        1193,
        "found",
    )


def test_frames_made_uint8_and_yuv_as_tensors_write_the_same_mp4_bytes(tmp_path) -> None:
    """max_length.py converts decoded frames on the GPU (`float_to_uint8`, `Mp4Writer.write_tensor`): the same
    rounding and integer colour conversion as the NumPy path, so the same bytes; odd sizes cropped alike."""
    import torch

    from flextensor_diffusers.media.video import float_to_uint8, rgb_to_yuv420p, rgb_to_yuv420p_tensor

    video = torch.rand(6, 35, 47, 3, generator=torch.Generator().manual_seed(1)) * 1.2 - 0.1
    video[0, 0, :8, 0] = (torch.arange(8) + 0.5) / 255  # ties: round half to even in both
    video = video.bfloat16()
    as_numpy = to_uint8_frames(video.float().numpy())
    as_tensor = float_to_uint8(video)
    assert np.array_equal(as_numpy, as_tensor.numpy())
    even = as_tensor[:, :34, :46]
    assert np.array_equal(rgb_to_yuv420p_tensor(even)[3].numpy(), rgb_to_yuv420p(even[3].numpy()))
    frame_by_frame, in_batches = tmp_path / "a.mp4", tmp_path / "b.mp4"
    write_mp4_frames(frame_by_frame, list(as_numpy), fps=24)
    with Mp4Writer(in_batches, fps=24) as writer:
        writer.write_tensor(as_tensor[:4])
        writer.write_tensor(as_tensor[4:])
    assert writer.frames == 6
    assert frame_by_frame.read_bytes() == in_batches.read_bytes()
    with pytest.raises(ValueError, match="uint8"), Mp4Writer(tmp_path / "c.mp4") as bad:
        bad.write_tensor(video)
