"""Writing and reading mp4 files with PyAV.

Encoding is deterministic: the same frames give the same bytes, and the same bytes decode to the
same frames. The colour conversion (RGB <-> YUV 4:2:0, BT.601 limited range) is done here in
integer NumPy, not by swscale: through swscale, identical frames encoded to different files within
one process (seen in the test suite once other tests had run; the cause inside swscale was not
pinned down), while integer arithmetic depends on nothing but the pixel values. The encoder runs on one
thread (x264's output depends on its thread count, the core count by default), and the muxer
writes no version or time stamps (``bitexact``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .files import atomic_path

logger = logging.getLogger(__name__)

#: Tried in order: H.264 (what players expect), then MPEG-4 part 2 where libx264 is missing.
CODECS = ("libx264", "h264", "mpeg4")
#: Frames of a decoded video made uint8 at a time by `uint8_chunks`.
WRITE_CHUNK_FRAMES = 32


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


def rgb_to_yuv420p(frame: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 RGB, even H and W -> the (3H/2, W) uint8 planes of yuv420p.

    BT.601 limited range in 8-bit fixed point (integers only: no BLAS, no float rounding that could
    differ between code paths); chroma is the rounded mean of each 2x2 block.
    """
    height, width, _ = frame.shape
    r, g, b = (frame[..., i].astype(np.int32) for i in range(3))
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    cb = ((-38 * r - 74 * g + 112 * b + 128) >> 8) + 128
    cr = ((112 * r - 94 * g - 18 * b + 128) >> 8) + 128

    def quarter(plane: np.ndarray) -> np.ndarray:
        return (plane.reshape(height // 2, 2, width // 2, 2).sum(axis=(1, 3)) + 2) // 4

    planes = np.concatenate([y.ravel(), quarter(cb).ravel(), quarter(cr).ravel()])
    return np.clip(planes, 0, 255).astype(np.uint8).reshape(height * 3 // 2, width)


def float_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """`to_uint8_frames`'s rounding (clip to [0, 1], x255 in float32, round half to even) on ``video``'s own
    device, so that a decoded video need not come to the host as float32 to be written."""
    return (video.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def uint8_chunks(video: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """A decoded (F, 3, H, W) video in [0, 1], on any device, as ``(start, frames)`` chunks of
    `WRITE_CHUNK_FRAMES` (N, H, W, 3) uint8 frames made where the video is (`float_to_uint8`), for
    `Mp4Writer.write_tensor`: the video never comes to the host as float, nor whole."""
    for start in range(0, len(video), WRITE_CHUNK_FRAMES):
        yield start, float_to_uint8(video[start : start + WRITE_CHUNK_FRAMES].permute(0, 2, 3, 1))


def rgb_to_yuv420p_tensor(frames: torch.Tensor) -> torch.Tensor:
    """`rgb_to_yuv420p` for a batch (N, H, W, 3) of uint8 frames on any device -> (N, 3H/2, W) uint8.

    The same integer arithmetic (int32, arithmetic right shifts, floor division of non-negative sums), so the
    planes equal the NumPy function's bit for bit; on a GPU it takes the colour conversion, most of an
    ultrafast encode's time, off the single encoding thread."""
    count, height, width, _ = frames.shape
    r, g, b = (frames[..., i].to(torch.int32) for i in range(3))
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    cb = ((-38 * r - 74 * g + 112 * b + 128) >> 8) + 128
    cr = ((112 * r - 94 * g - 18 * b + 128) >> 8) + 128

    def quarter(plane: torch.Tensor) -> torch.Tensor:
        sums = plane.reshape(count, height // 2, 2, width // 2, 2).sum(dim=(2, 4))
        return torch.div(sums + 2, 4, rounding_mode="floor")

    planes = torch.cat([y.reshape(count, -1), quarter(cb).reshape(count, -1), quarter(cr).reshape(count, -1)], dim=1)
    return planes.clamp(0, 255).to(torch.uint8).reshape(count, height * 3 // 2, width)


def yuv420p_to_rgb(planes: np.ndarray, height: int, width: int) -> np.ndarray:
    """The inverse of `rgb_to_yuv420p` (chroma repeated over each 2x2 block), as (H, W, 3) uint8."""
    flat = planes.ravel().astype(np.int32)
    size, quarter = height * width, (height // 2) * (width // 2)
    c = flat[:size].reshape(height, width) - 16
    d, e = (
        flat[size + i * quarter : size + (i + 1) * quarter]
        .reshape(height // 2, width // 2)
        .repeat(2, axis=0)
        .repeat(2, axis=1)
        - 128
        for i in range(2)
    )
    rgb = np.stack(
        [(298 * c + 409 * e + 128) >> 8, (298 * c - 100 * d - 208 * e + 128) >> 8, (298 * c + 516 * d + 128) >> 8],
        axis=-1,
    )
    return np.clip(rgb, 0, 255).astype(np.uint8)


def write_mp4(path: str | Path, video: Any, fps: int = 16) -> str:
    """Write frames to ``path`` as yuv420p, atomically (`files.atomic_path`: an interrupted or failed write
    leaves the file that was there, or none); returns the codec used (H.264 unless unavailable)."""
    frames = to_uint8_frames(video)
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:  # yuv420p needs even sizes
        frames = frames[:, : height - height % 2, : width - width % 2]
    with atomic_path(path) as temporary:
        codec = next((c for c in CODECS if _encode(temporary, frames, fps, c)), None)
        if codec is None:
            raise RuntimeError(f"PyAV has none of the encoders {', '.join(CODECS)}: cannot write {path}")
    if codec == "mpeg4":
        logger.warning("no H.264 encoder in this PyAV build; wrote %s with MPEG-4 part 2 instead", path)
    return codec


def _encode(path: Path, frames: np.ndarray, fps: int, codec: str) -> bool:
    """Encode ``frames`` into ``path`` with ``codec``; False when this PyAV build lacks the codec."""
    import av

    _, height, width, _ = frames.shape
    with av.open(str(path), mode="w", options={"fflags": "+bitexact"}) as container:
        try:
            stream = container.add_stream(codec, rate=Fraction(fps))
        except (av.error.FFmpegError, ValueError):  # codec not in this build
            return False
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        with contextlib.suppress(AttributeError):  # PyAV < 13 has no Flags enum; the muxer is still bitexact
            stream.codec_context.flags |= av.codec.context.Flags.bitexact
        options = {"threads": "1"}
        if codec != "mpeg4":
            options.update(
                crf="12",
                preset="medium",
                **{"x264-params": "threads=1:lookahead-threads=1:deterministic=1:cpu-independent=1"},
            )
        stream.options = options
        for frame in frames:
            planes = rgb_to_yuv420p(frame)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(planes, format="yuv420p")))
        container.mux(stream.encode())
    return True


def read_mp4(path: str | Path) -> np.ndarray:
    """All frames of a video as (frames, height, width, 3) uint8 (yuv420p converted here, see above)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame_to_rgb(f) for f in container.decode(video=0)])


def frame_to_rgb(frame: Any) -> np.ndarray:
    """One decoded frame as RGB: yuv420p of even size by `yuv420p_to_rgb`, anything else by swscale."""
    if frame.format.name == "yuv420p" and frame.height % 2 == 0 and frame.width % 2 == 0:
        return yuv420p_to_rgb(frame.to_ndarray(), frame.height, frame.width)
    return frame.to_ndarray(format="rgb24")


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


class Mp4Writer:
    """An mp4 written frame by frame as the frames come, so that a long video need not be in memory whole.

    The same encoding as `write_mp4` (the same frames give the same bytes, with the default ``preset``), to a
    temporary file beside ``path`` that is renamed to ``path`` when the block ends (`files.atomic_path`); when
    the block raises, the temporary file is deleted and whatever was at ``path`` stays::

        with Mp4Writer("out.mp4", fps=24) as writer:
            for frame in frames:  # (H, W, 3) uint8, or float in [0, 1]
                writer.write(frame)
        writer.codec, writer.frames  # 'libx264', 121

    ``preset`` is x264's (``"ultrafast"`` encodes several times faster, in larger files). Odd sizes are cropped
    to even, as `write_mp4` does.
    """

    def __init__(self, path: str | Path, fps: int = 16, preset: str = "medium") -> None:
        self.path = Path(path)
        self.fps = fps
        self.preset = preset
        self.codec: str | None = None
        self.frames = 0
        self._atomic: Any = None
        self._temporary: Path | None = None
        self._container: Any = None
        self._stream: Any = None

    def __enter__(self) -> Mp4Writer:
        self._atomic = atomic_path(self.path)
        self._temporary = self._atomic.__enter__()
        return self

    def write(self, frame: Any) -> None:
        """One (H, W, 3) frame: uint8, or float in [0, 1] (rounded as `to_uint8_frames` does)."""
        pixels = to_uint8_frames(np.asarray(frame)[None])[0]
        height, width, _ = pixels.shape
        pixels = pixels[: height - height % 2, : width - width % 2]
        self._check_size(pixels.shape[0], pixels.shape[1])
        self._mux(rgb_to_yuv420p(pixels))

    def write_tensor(self, frames: torch.Tensor) -> None:
        """A batch (N, H, W, 3) of uint8 frames as a tensor on any device (see `float_to_uint8`): the colour
        conversion runs on that device (`rgb_to_yuv420p_tensor`), only the YUV planes come to the host.
        The same bytes as `write` of the same frames."""
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected (N, H, W, 3) uint8 frames, got {tuple(frames.shape)} {frames.dtype}")
        _, height, width, _ = frames.shape
        frames = frames[:, : height - height % 2, : width - width % 2]
        self._check_size(frames.shape[1], frames.shape[2])
        for planes in rgb_to_yuv420p_tensor(frames).cpu().numpy():
            self._mux(planes)

    def _check_size(self, height: int, width: int) -> None:
        if self._stream is None:
            self._open(height, width)
        elif (height, width) != (self._stream.height, self._stream.width):
            raise ValueError(
                f"frame {self.frames} is {width}x{height}, "
                f"the video before it {self._stream.width}x{self._stream.height}"
            )

    def _mux(self, planes: np.ndarray) -> None:
        import av

        self._container.mux(self._stream.encode(av.VideoFrame.from_ndarray(planes, format="yuv420p")))
        self.frames += 1

    def _open(self, height: int, width: int) -> None:
        import av

        for codec in CODECS:
            container = av.open(str(self._temporary), mode="w", options={"fflags": "+bitexact"})
            try:
                stream = container.add_stream(codec, rate=Fraction(self.fps))
            except (av.error.FFmpegError, ValueError):  # codec not in this build
                container.close()
                continue
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.thread_count = 1
            with contextlib.suppress(AttributeError):  # PyAV < 13 has no Flags enum
                stream.codec_context.flags |= av.codec.context.Flags.bitexact
            options = {"threads": "1"}
            if codec != "mpeg4":
                options.update(
                    crf="12",
                    preset=self.preset,
                    **{"x264-params": "threads=1:lookahead-threads=1:deterministic=1:cpu-independent=1"},
                )
            stream.options = options
            self._container, self._stream, self.codec = container, stream, codec
            if codec == "mpeg4":
                logger.warning("no H.264 encoder in this PyAV build; writing %s with MPEG-4 part 2", self.path)
            return
        raise RuntimeError(f"PyAV has none of the encoders {', '.join(CODECS)}: cannot write {self.path}")

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if self._container is not None:
                try:
                    if kind is None:
                        self._container.mux(self._stream.encode())
                finally:
                    self._container.close()
            elif kind is None:
                raise ValueError(f"no frames were written to {self.path}")
        except BaseException:
            self._atomic.__exit__(*sys.exc_info())
            raise
        self._atomic.__exit__(kind, exc, tb)


def write_mp4_frames(path: str | Path, frames: Any, fps: int = 16, preset: str = "medium") -> Mp4Writer:
    """Each (H, W, 3) frame of the iterable ``frames`` into ``path`` as it comes (`Mp4Writer`); the writer,
    closed (``.codec``, ``.frames``)."""
    with Mp4Writer(path, fps=fps, preset=preset) as writer:
        for frame in frames:
            writer.write(frame)
    return writer
