"""benchmarks/max_length.py end to end on the CPU (tiny LTX-2), and the streaming mp4 writer it uses."""

from __future__ import annotations

import hashlib
import json
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
