"""Make assets/clips/sample.mp4: a short synthetic clip for the outpainting and Cosmos recipes and tests.

97 frames (4 s at 24 fps: LTX-2 lengths are 8k+1, Cosmos-Transfer2.5 makes 93 by default) of
640x352: a sky-to-ground gradient, a sun moving left to right and a box bouncing, drawn with numpy
so that it needs no footage.

    python scripts/make_sample_clip.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.media.video import write_mp4

OUT = Path(__file__).resolve().parents[1] / "assets" / "clips" / "sample.mp4"
FRAMES, HEIGHT, WIDTH, FPS = 97, 352, 640, 24


def frame(i: int) -> np.ndarray:
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    t = i / (FRAMES - 1)
    sky = np.stack([90 + 80 * y / HEIGHT, 140 + 60 * y / HEIGHT, 230 - 40 * y / HEIGHT], axis=-1)
    ground = np.stack([60 + 0 * y, 140 - 40 * (y - 0.6 * HEIGHT) / HEIGHT, 60 + 0 * y], axis=-1)
    img = np.where((y > 0.6 * HEIGHT)[..., None], ground, sky)
    cx, cy = 60 + t * (WIDTH - 120), 80 - 30 * np.sin(np.pi * t)
    sun = (x - cx) ** 2 + (y - cy) ** 2 < 30**2
    img[sun] = (250, 220, 80)
    bx, by = int(WIDTH * 0.35 + 150 * np.sin(2 * np.pi * t)), int(0.6 * HEIGHT - 50 - 40 * abs(np.sin(3 * np.pi * t)))
    img[by : by + 50, bx : bx + 50] = (200, 60, 50)
    return img.clip(0, 255).astype(np.uint8)


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    codec = write_mp4(OUT, np.stack([frame(i) for i in range(FRAMES)]), fps=FPS)
    print(f"wrote {OUT} ({FRAMES} frames {WIDTH}x{HEIGHT} at {FPS} fps, {codec}, {OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
