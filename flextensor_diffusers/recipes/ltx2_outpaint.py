"""LTX-2 video outpainting under a GPU budget: a clip placed on a larger canvas, the rest generated.

python -m flextensor_diffusers.recipes.ltx2_outpaint --random-weights tiny --canvas 64x64 --source-size 32x32 --steps 2
python -m flextensor_diffusers.recipes.ltx2_outpaint --model /models/LTX-2-Diffusers --input clip.mp4 --canvas 1280x704

The source frames are placed at the centre of the canvas (offsets rounded down to the VAE's
spatial factor, so that latent tokens line up with the source edge). The canvas is encoded by
the VAE; every latent token whose whole footprint lies inside the source is conditioned on
(conditioning mask 1: the pipeline keeps it clean at every step), the others are generated from
noise. This is the LTX-2 condition pipeline's own per-token conditioning, given a spatial mask:
`LTX2VideoCondition` has frame indices but no spatial mask, so `LTX2OutpaintPipeline` overrides
only how the initial latents and the mask are prepared. By default the source pixels are pasted
back over the decoded frames (``--no-paste`` keeps the decoded pixels).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import LTX2ConditionPipeline
from diffusers.pipelines.ltx2.pipeline_ltx2_condition import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from ..engine.errors import FlexTensorError
from ..models import ASSETS, build_pipeline, load_pipeline
from ..video import read_mp4
from . import common

SAMPLE_CLIP = ASSETS / "clips" / "sample.mp4"
FILL = 127  # mid-grey for the unknown part of the canvas, 0 after the VAE's [-1, 1] scaling


@dataclass
class Canvas:
    """The source frames on the canvas, and where they are."""

    pixels: np.ndarray  # (frames, height, width, 3) uint8, FILL outside the source
    top: int
    left: int
    source_height: int
    source_width: int
    #: Encoded canvas latents by (frames, device, dtype): the VAE encode runs once, not per generation.
    latents: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def pixel_mask(self) -> np.ndarray:
        """(height, width) bool: True where the canvas holds source pixels."""
        mask = np.zeros(self.pixels.shape[1:3], dtype=bool)
        mask[self.top : self.top + self.source_height, self.left : self.left + self.source_width] = True
        return mask

    def token_mask(self, spatial_factor: int) -> torch.Tensor:
        """(latent height, latent width) bool: tokens whose whole pixel footprint is source."""
        h, w = self.pixels.shape[1] // spatial_factor, self.pixels.shape[2] // spatial_factor
        blocks = self.pixel_mask[: h * spatial_factor, : w * spatial_factor]
        blocks = blocks.reshape(h, spatial_factor, w, spatial_factor)
        return torch.from_numpy(blocks.all(axis=(1, 3)))


def place_on_canvas(frames: np.ndarray, height: int, width: int, align: int) -> Canvas:
    """Centre ``frames`` (F, h, w, 3) on a FILL canvas of ``height`` x ``width``, offsets multiples of ``align``."""
    _, h, w, _ = frames.shape
    if h > height or w > width:
        raise FlexTensorError(
            f"the source ({w}x{h}) is larger than the canvas ({width}x{height}): pass a larger --canvas "
            "or --source-size to scale the source down"
        )
    top, left = (height - h) // 2 // align * align, (width - w) // 2 // align * align
    pixels = np.full((frames.shape[0], height, width, 3), FILL, dtype=np.uint8)
    pixels[:, top : top + h, left : left + w] = frames
    return Canvas(pixels=pixels, top=top, left=left, source_height=h, source_width=w)


class LTX2OutpaintPipeline(LTX2ConditionPipeline):
    """diffusers' LTX-2 condition pipeline, conditioned per latent token on ``self.canvas``.

    Only ``prepare_latents`` differs: the initial latents are the encoded canvas where the mask is
    1 and noise elsewhere, and the returned mask drives the parent's denoising loop unchanged
    (timestep ``t * (1 - mask)`` per token, ``x0 * (1 - mask) + clean * mask`` after each step).
    """

    canvas: Canvas | None = None  # set before a call: place_on_canvas(...)

    def prepare_latents(
        self,
        conditions: Any = None,
        batch_size: int = 1,
        num_channels_latents: int = 128,
        height: int = 512,
        width: int = 768,
        num_frames: int = 121,
        frame_rate: float = 24.0,
        noise_scale: float = 1.0,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        if self.canvas is None:
            raise FlexTensorError("LTX2OutpaintPipeline needs pipe.canvas = place_on_canvas(...) before a call")
        if conditions or latents is not None:
            raise FlexTensorError("outpainting conditions on the canvas: pass neither `conditions` nor `latents`")
        canvas = self.canvas
        if canvas.pixels.shape[1:3] != (height, width) or canvas.pixels.shape[0] < num_frames:
            raise FlexTensorError(
                f"the canvas is {canvas.pixels.shape[2]}x{canvas.pixels.shape[1]} with {canvas.pixels.shape[0]} "
                f"frames; the call asks for {width}x{height} with {num_frames}"
            )
        key = (num_frames, str(device), dtype)
        if key not in canvas.latents:  # (B=1, C, F', H', W'); the encode is deterministic (argmax)
            canvas.latents[key] = self.encode_canvas(canvas.pixels[:num_frames], device, dtype, generator)
        clean = canvas.latents[key]
        known = canvas.token_mask(self.vae_spatial_compression_ratio).to(device)
        mask = known.to(clean.dtype).expand(1, 1, clean.shape[2], *known.shape)
        patch, patch_t = self.transformer_spatial_patch_size, self.transformer_temporal_patch_size
        clean = self._pack_latents(clean, patch, patch_t).expand(batch_size, -1, -1)
        mask = self._pack_latents(mask, patch, patch_t).expand(batch_size, -1, -1)  # (B, tokens, 1)
        clean_latents = clean * mask
        noise = randn_tensor(clean.shape, generator=generator, device=clean.device, dtype=clean.dtype)
        scaled = (1.0 - mask) * noise_scale  # the parent's formula: known tokens stay clean
        latents = noise * scaled + clean_latents * (1 - scaled)
        return latents, mask.contiguous(), clean_latents.contiguous(), None

    def encode_canvas(
        self, pixels: np.ndarray, device: torch.device, dtype: torch.dtype | None, generator: Any
    ) -> torch.Tensor:
        """Normalised VAE latents of the canvas video (uint8 frames), as the parent encodes conditions."""
        video = torch.from_numpy(np.ascontiguousarray(pixels)).permute(3, 0, 1, 2).unsqueeze(0)
        video = (video.to(torch.float32) / 127.5 - 1.0).to(device=device, dtype=self.vae.dtype)
        latent = retrieve_latents(self.vae.encode(video), generator=generator, sample_mode="argmax")
        return self._normalize_latents(latent, self.vae.latents_mean, self.vae.latents_std).to(device, dtype)


def parse_size(text: str) -> tuple[int, int]:
    """'1280x704' -> (width, height)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 1280x704, got {text!r}") from None
    return width, height


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_arguments(parser, frames=0, height=0, width=0, steps=40)
    parser.set_defaults(prompt="a wide landscape around the scene, continuing it naturally", guidance=3.0)
    parser.add_argument("--input", type=Path, default=SAMPLE_CLIP, help="source mp4 (default: the shipped sample)")
    parser.add_argument("--canvas", type=parse_size, default=(1280, 704), help="output WIDTHxHEIGHT")
    parser.add_argument("--source-size", type=parse_size, help="scale the source to WIDTHxHEIGHT first")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--no-paste", action="store_true", help="keep decoded pixels inside the source area")
    parser.add_argument("--output", type=Path, default=Path("ltx2-outpaint.mp4"))
    args = parser.parse_args(argv)
    args.recipe = "ltx2_outpaint"
    args.width, args.height = args.canvas
    return args


def load_source(args: argparse.Namespace) -> np.ndarray:
    """The source frames, scaled to --source-size, trimmed to --frames (or the longest 8k+1)."""
    if not args.input.exists():
        raise FlexTensorError(f"no video at {args.input}: pass --input PATH to an mp4")
    frames = read_mp4(args.input)
    if args.source_size is not None:
        resized = torch.nn.functional.interpolate(
            torch.from_numpy(frames).permute(0, 3, 1, 2).float(),
            size=args.source_size[::-1],
            mode="bilinear",
            antialias=True,
        )
        frames = resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    wanted = args.frames or (len(frames) - 1) // 8 * 8 + 1
    if wanted > len(frames) or (wanted - 1) % 8:
        raise FlexTensorError(f"--frames {wanted}: LTX-2 needs 8k+1 frames, at most the source's {len(frames)}")
    args.frames = wanted
    return frames[:wanted]


def load(args: argparse.Namespace, device: torch.device) -> Any:
    """The pipeline, CPU-first, with ``pipe.canvas`` made from the source clip."""
    source = load_source(args)
    args.max_sequence_length = 1024 if args.random_weights != "tiny" else 32
    if args.model is not None:
        pipe = load_pipeline(args.model, LTX2OutpaintPipeline, dtype=torch.bfloat16)
    else:
        init = common.init_device(args, device)
        built = build_pipeline("ltx2_condition", args.random_weights, seed=args.seed, init_device=init)
        pipe = LTX2OutpaintPipeline.from_pipe(built)
    pipe.canvas = place_on_canvas(source, args.height, args.width, pipe.vae_spatial_compression_ratio)
    return pipe


def generate(
    pipe: Any, args: argparse.Namespace, device: torch.device, steps: int, output_type: str, **extra: Any
) -> Any:
    """Video frames (or latents) of one outpainting generation; audio is generated and dropped."""
    return pipe(
        **common.call_arguments(args, steps, output_type),
        frame_rate=float(args.fps),
        audio_guidance_scale=args.guidance,
        stg_scale=0.0,  # spatio-temporal and modality guidance would add transformer calls per step
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        max_sequence_length=args.max_sequence_length,
        **extra,
    ).frames


def profiling_generation(pipe: Any, args: argparse.Namespace, device: torch.device) -> Any:
    """Two steps, latents only: the text encoder (prompt, negative) and the transformer run twice each."""
    return generate(pipe, args, device, 2, "latent")


def finish_frames(pipe: Any, args: argparse.Namespace, frames: np.ndarray) -> np.ndarray:
    """Paste the source pixels back over the decoded frames (unless --no-paste)."""
    if not args.no_paste:
        mask = pipe.canvas.pixel_mask
        frames[:, mask] = pipe.canvas.pixels[: len(frames), mask]
    return frames


def describe(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    canvas = pipe.canvas
    return {
        "canvas": {
            "source": str(args.input),
            "source_size": [canvas.source_width, canvas.source_height],
            "offset": [canvas.left, canvas.top],
            "conditioned_tokens_per_frame": int(canvas.token_mask(pipe.vae_spatial_compression_ratio).sum()),
            "pasted": not args.no_paste,
        }
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return common.run_recipe(sys.modules[__name__], args)


def main(argv: list[str] | None = None) -> None:
    common.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
