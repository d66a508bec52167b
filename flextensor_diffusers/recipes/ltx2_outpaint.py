"""LTX-2 video outpainting under a GPU budget: a clip placed on a larger canvas, the rest generated.

examples:
  flextensor-ltx2-outpaint --random-weights tiny
  flextensor-ltx2-outpaint --random-weights tiny --canvas 96x64 --source-size 32x32 --frames 9 --steps 2
  flextensor-ltx2-outpaint --model /models/LTX-2-Diffusers --input clip.mp4 --canvas 1280x704

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
from ..media.video import VideoInfo, probe_mp4, read_mp4
from . import common
from .models import ASSETS, build_pipeline, load_pipeline
from .options import (
    OptionsError,
    RecipeOptions,
    SizeDefaults,
    add_output,
    command_name,
    common_values,
    existing_file,
    frames_of_form,
    recipe_parser,
)

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
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"expected a positive WIDTHxHEIGHT like 1280x704, got {text!r}")
    return width, height


DEFAULTS = {"tiny": SizeDefaults(frames=9, height=64, width=64, steps=2), "full": SizeDefaults(0, 704, 1280, 40)}
#: The tiny default: the shipped 640x352 clip scaled to fit the 64x64 default canvas with room around it.
TINY_SOURCE_SIZE = (32, 32)
#: LTX-2's condition pipeline needs canvas sides in multiples of 32 and 8k+1 frames.
CANVAS_MULTIPLE = 32
TEMPORAL_FACTOR = 8


@dataclass(frozen=True, kw_only=True)
class OutpaintOptions(RecipeOptions):
    """`RecipeOptions` plus the source clip and where it goes (height and width are the canvas)."""

    architecture = "ltx2"
    input: Path
    source_size: tuple[int, int] | None = None
    no_paste: bool = False

    @property
    def max_sequence_length(self) -> int:
        """Prompt tokens: the tiny Gemma's positions are few."""
        return 32 if self.random_weights == "tiny" else 1024


def parse_args(argv: list[str] | None = None) -> OutpaintOptions:
    parser = recipe_parser(
        command_name("ltx2_outpaint"),
        __doc__,
        DEFAULTS,
        sizes=False,
        frames_help="frames of the video, 8k+1 (default: the longest 8k+1 of the source; 9 with tiny weights)",
    )
    parser.set_defaults(prompt="a wide landscape around the scene, continuing it naturally", guidance=3.0)
    parser.add_argument("--input", type=Path, default=SAMPLE_CLIP, help="source mp4 (default: the shipped sample)")
    parser.add_argument(
        "--canvas", type=parse_size, help="output WIDTHxHEIGHT, multiples of 32 (default: 1280x704; 64x64 with tiny)"
    )
    parser.add_argument(
        "--source-size",
        type=parse_size,
        help="scale the source to WIDTHxHEIGHT first (default: its own size; 32x32 with tiny weights)",
    )
    parser.add_argument("--fps", type=int, default=24, help="frames per second of the mp4")
    parser.add_argument("--no-paste", action="store_true", help="keep decoded pixels inside the source area")
    add_output(parser, "ltx2-outpaint.mp4")
    ns = parser.parse_args(argv)
    tiny = ns.random_weights == "tiny"
    clip = probe_mp4(existing_file("--input", ns.input))
    if ns.frames is None and not tiny:
        ns.frames = (clip.frames - 1) // TEMPORAL_FACTOR * TEMPORAL_FACTOR + 1
    ns.width, ns.height = ns.canvas or (
        DEFAULTS["tiny" if tiny else "full"].width,
        DEFAULTS["tiny" if tiny else "full"].height,
    )
    if ns.source_size is None and tiny:
        ns.source_size = TINY_SOURCE_SIZE
    options = OutpaintOptions(
        **common_values(ns, "ltx2_outpaint", DEFAULTS), input=ns.input, source_size=ns.source_size, no_paste=ns.no_paste
    )
    check_geometry(options, clip)
    return options


def check_geometry(options: OutpaintOptions, clip: VideoInfo) -> None:
    """Canvas sides the pipeline takes, 8k+1 frames the source has, a source that fits the canvas."""
    for side, value in (("width", options.width), ("height", options.height)):
        if value % CANVAS_MULTIPLE:
            below = max(CANVAS_MULTIPLE, value // CANVAS_MULTIPLE * CANVAS_MULTIPLE)
            raise OptionsError(
                f"--canvas {options.width}x{options.height}: LTX-2 needs a {side} that is a multiple of "
                f"{CANVAS_MULTIPLE} (e.g. {below})"
            )
    frames_of_form("--frames", options.frames, TEMPORAL_FACTOR, "LTX-2")
    if options.frames > clip.frames:
        most = (clip.frames - 1) // TEMPORAL_FACTOR * TEMPORAL_FACTOR + 1
        raise OptionsError(
            f"--frames {options.frames}: {options.input} has {clip.frames} frames: pass --frames {most} or fewer, "
            "or a longer --input"
        )
    width, height = options.source_size or (clip.width, clip.height)
    if width > options.width or height > options.height:
        raise OptionsError(
            f"the source ({width}x{height}) is larger than the canvas ({options.width}x{options.height}): "
            "pass a larger --canvas or --source-size to scale the source down"
        )


def load_source(options: OutpaintOptions) -> np.ndarray:
    """The source frames, scaled to --source-size, trimmed to --frames (checked by `parse_args`)."""
    frames = read_mp4(options.input)
    if options.source_size is not None:
        resized = torch.nn.functional.interpolate(
            torch.from_numpy(frames).permute(0, 3, 1, 2).float(),
            size=options.source_size[::-1],
            mode="bilinear",
            antialias=True,
        )
        frames = resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return frames[: options.frames]


def load(options: OutpaintOptions, device: torch.device, attach: bool = False) -> Any:
    """The pipeline, CPU-first, with ``pipe.canvas`` made from the source clip."""
    source = load_source(options)
    if options.model is not None:
        pipe = load_pipeline(options.model, LTX2OutpaintPipeline, dtype=torch.bfloat16)
    else:
        init = common.init_device(options, device, attach)
        built = build_pipeline("ltx2_condition", options.random_weights, seed=options.seed, init_device=init)
        pipe = LTX2OutpaintPipeline(**built.components)
    pipe.canvas = place_on_canvas(source, options.height, options.width, pipe.vae_spatial_compression_ratio)
    return pipe


def generate(
    pipe: Any, options: OutpaintOptions, device: torch.device, steps: int, output_type: str, **extra: Any
) -> Any:
    """Video frames (or latents) of one outpainting generation; audio is generated and dropped."""
    return pipe(
        **common.call_arguments(options, steps, output_type),
        frame_rate=float(options.fps),
        audio_guidance_scale=options.guidance,
        stg_scale=0.0,  # spatio-temporal and modality guidance would add transformer calls per step
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        max_sequence_length=options.max_sequence_length,
        **extra,
    ).frames


def profiling_generation(pipe: Any, options: OutpaintOptions, device: torch.device) -> Any:
    """``--profiling-generation``: two steps, latents only; the text encoder (prompt, negative) and the
    transformer run twice each."""
    return generate(pipe, options, device, 2, "latent")


#: The decoded video stays on the device and is written in chunks (`common.write_decoded_video`): at 1 185
#: frames of 1280x704 it would be 12.8 GB of float32 on the host, twice over inside diffusers' ``"np"`` output.
DECODED_ON_DEVICE = True


def finish_chunk(pipe: Any, options: OutpaintOptions, pixels: torch.Tensor, start: int) -> torch.Tensor:
    """Paste the source pixels back over decoded frames ``start:start+len(pixels)`` (uint8, on their device),
    unless --no-paste."""
    if options.no_paste:
        return pixels
    canvas = pipe.canvas
    mask = torch.from_numpy(canvas.pixel_mask).to(pixels.device)
    source = torch.from_numpy(canvas.pixels[start : start + len(pixels)]).to(pixels.device)
    pixels[:, mask] = source[:, mask]
    return pixels


def peak_host_rss_bytes() -> int | None:
    """The process's peak resident set so far (the kernel's high-water mark, ``ru_maxrss``): loading, offload
    set-up, the generations, the decoded video and the mp4 written; None where ``resource`` is missing."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def describe(pipe: Any, options: OutpaintOptions) -> dict[str, Any]:
    canvas = pipe.canvas
    peak = peak_host_rss_bytes()
    if peak is not None and not options.quiet:
        print(f"peak host memory (RSS) {peak / 2**30:.2f} GiB")
    return {
        "peak_host_rss_bytes": peak,
        "peak_host_rss_scope": "the whole process until the mp4 was written (ru_maxrss)",
        "canvas": {
            "source": str(options.input),
            "source_size": [canvas.source_width, canvas.source_height],
            "offset": [canvas.left, canvas.top],
            "conditioned_tokens_per_frame": int(canvas.token_mask(pipe.vae_spatial_compression_ratio).sum()),
            "pasted": not options.no_paste,
        },
    }


def run(options: OutpaintOptions) -> dict[str, Any]:
    return common.run_recipe(sys.modules[__name__], options)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run with these arguments; errors propagate as exceptions."""
    return common.main(sys.modules[__name__], argv)


def cli(argv: list[str] | None = None) -> None:
    """The command line: one line per user error, exit status 2 (``-v``: the traceback too)."""
    common.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    cli()
