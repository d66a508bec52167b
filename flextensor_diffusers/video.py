"""Writing and reading mp4 files with PyAV.

Encoding is deterministic: the same frames give the same bytes. The encoder runs on one thread
(x264's output depends on its thread count, which is the core count by default), and the muxer
writes no version or time stamps (``bitexact``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Tried in order: H.264 (what players expect), then MPEG-4 part 2 where libx264 is missing.
CODECS = ("libx264", "h264", "mpeg4")


def to_uint8_frames(video: Any) -> np.ndarray:
    """(frames, height, width, 3) uint8 from a list of PIL images, or a float array in [0, 1]."""
    if isinstance(video, np.ndarray):
        arr = video
    elif hasattr(video, "detach"):
        arr = video.detach().float().cpu().numpy()
    else:
        arr = np.stack([np.asarray(frame) for frame in video])
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"expected frames of shape (F, H, W, 3), got {arr.shape}")
    return arr


def write_mp4(path: str | Path, video: Any, fps: int = 16) -> str:
    """Write frames to ``path`` as yuv420p; returns the codec used (H.264 unless unavailable)."""
    import av

    frames = to_uint8_frames(video)
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:  # yuv420p needs even sizes
        frames = frames[:, : height - height % 2, : width - width % 2]
        height, width = frames.shape[1:3]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for codec in CODECS:
        container = av.open(str(path), mode="w", options={"fflags": "+bitexact"})
        try:
            stream = container.add_stream(codec, rate=Fraction(fps))
        except (av.error.FFmpegError, ValueError):  # codec not in this build
            container.close()
            continue
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        with contextlib.suppress(AttributeError):  # PyAV < 13 has no Flags enum; the muxer is still bitexact
            stream.codec_context.flags |= av.codec.context.Flags.bitexact
        options = {"threads": "1"}
        if codec != "mpeg4":
            options.update(
                crf="12", preset="medium", **{"x264-params": "threads=1:lookahead-threads=1:deterministic=1"}
            )
        stream.options = options
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        container.close()
        if codec == "mpeg4":
            logger.warning("no H.264 encoder in this PyAV build; wrote %s with MPEG-4 part 2 instead", path)
        return codec
    raise RuntimeError(f"PyAV has none of the encoders {', '.join(CODECS)}: cannot write {path}")


def read_mp4(path: str | Path) -> np.ndarray:
    """All frames of a video as (frames, height, width, 3) uint8."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    width: int
    height: int


def probe_mp4(path: str | Path) -> VideoInfo:
    """Frame count and size of a video without keeping its frames (to check options before loading)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        count = stream.frames or sum(1 for _ in container.decode(video=0))
        return VideoInfo(frames=count, width=stream.codec_context.width, height=stream.codec_context.height)
