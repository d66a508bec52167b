"""Cosmos-Transfer2.5 under a GPU budget: a new video that follows the edges of a source clip.

examples:
  flextensor-cosmos-transfer25 --random-weights tiny
  flextensor-cosmos-transfer25 --random-weights tiny --frames 5 --height 32 --width 32 --steps 2 --chunk 16
  flextensor-cosmos-transfer25 --model /models/Cosmos-Transfer2.5-2B --input clip.mp4

The control input is an edge video: OpenCV's Canny on each source frame, scaled to the output
size first. The pipeline is built on the CPU (text encoder, transformer, ControlNet, VAE) and
every component is offloaded. Cosmos ships a safety checker (Cosmos Guardrail, package
``cosmos_guardrail``) that the pipeline requires; when the package is not installed the recipe
runs without it and says so once on stdout and in the summary, every time. It needs torchvision
(the ControlNet resizes its padding mask with it) and OpenCV (the edges): both are checked before
loading (``pip install -e ".[cosmos]"`` in the clone; ``.[cosmos-guardrail]`` adds the safety checker).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.errors import FlexTensorError
from ..media.video import probe_mp4, read_mp4
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
    multiple_of,
    positive,
    recipe_parser,
    require_package,
    transformer_config,
)

logger = logging.getLogger(__name__)

SAMPLE_CLIP = ASSETS / "clips" / "sample.mp4"
GUARDRAIL_SKIPPED = (
    "safety check skipped: the cosmos_guardrail package is not installed, so Cosmos Guardrail did not check "
    'the prompt or the generated video. Install it (pip install -e ".[cosmos-guardrail]" in the clone) to run the '
    "checks the NVIDIA Open Model License expects."
)
GUARDRAIL_ON = "Cosmos Guardrail checked the prompt and the generated video"
DEFAULTS = {"tiny": SizeDefaults(frames=5, height=32, width=32, steps=2), "full": SizeDefaults(93, 480, 640, 35)}
DEFAULT_CHUNK = {"tiny": 16, "full": 93}
#: The Wan VAE's temporal compression: a chunk has at least 4 + 1 frames.
TEMPORAL_FACTOR = 4
PIXELS_PER_TOKEN = 16
EXTRA_INSTALL = 'pip install -e ".[cosmos]" (in the clone of flextensor-diffusers)'


class SkippedSafetyChecker:
    """Stands in for Cosmos Guardrail when its package is missing: passes everything, and says so."""

    reason = GUARDRAIL_SKIPPED

    def to(self, *args: Any, **kwargs: Any) -> SkippedSafetyChecker:
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, video: np.ndarray) -> np.ndarray:
        return video


def safety_checker() -> tuple[Any, str]:
    """Cosmos Guardrail if installed, else a pass-through; with the sentence that says which."""
    try:
        from cosmos_guardrail import CosmosSafetyChecker
    except ImportError:
        logger.info(GUARDRAIL_SKIPPED)  # said once on stdout by `run`, and in the summary
        return SkippedSafetyChecker(), GUARDRAIL_SKIPPED
    return CosmosSafetyChecker(), GUARDRAIL_ON


def canny_edges(frames: np.ndarray, width: int, height: int, low: int = 100, high: int = 200) -> list:
    """Edge maps (white on black, 3 channels, PIL images) of uint8 RGB ``frames`` at ``width`` x ``height``."""
    try:
        import cv2
    except ImportError:
        raise FlexTensorError(f"the edge control needs OpenCV: {EXTRA_INSTALL}") from None
    from PIL import Image

    edges = []
    for frame in frames:
        scaled = cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA)
        edge = cv2.Canny(cv2.cvtColor(scaled, cv2.COLOR_RGB2BGR), low, high)
        edges.append(Image.fromarray(np.repeat(edge[..., None], 3, axis=-1)))
    return edges


@dataclass(frozen=True, kw_only=True)
class TransferOptions(RecipeOptions):
    """`RecipeOptions` plus the source clip of the edges and the chunk length."""

    architecture = "cosmos_transfer25"
    input: Path
    chunk: int

    @property
    def max_sequence_length(self) -> int:
        return 16 if self.random_weights == "tiny" else 512


def parse_args(argv: list[str] | None = None) -> TransferOptions:
    parser = recipe_parser(command_name("cosmos_transfer25"), __doc__, DEFAULTS)
    parser.set_defaults(prompt="a robot arm folding a blue cloth on a table, studio light", guidance=3.0)
    parser.add_argument(
        "--input", type=Path, default=SAMPLE_CLIP, help="source mp4 for the edges (default: the shipped sample clip)"
    )
    parser.add_argument(
        "--chunk",
        type=int,
        help="frames per chunk (num_frames_per_chunk; default: 93, 16 with tiny weights)",
    )
    parser.add_argument("--fps", type=int, default=24, help="frames per second of the mp4")
    add_output(parser, "cosmos-transfer.mp4")
    ns = parser.parse_args(argv)
    values = common_values(ns, "cosmos_transfer25", DEFAULTS)
    chunk = ns.chunk if ns.chunk is not None else DEFAULT_CHUNK["tiny" if ns.random_weights == "tiny" else "full"]
    options = TransferOptions(**values, input=existing_file("--input", ns.input), chunk=chunk)
    require_package("torchvision", "Cosmos' ControlNet (it resizes its padding mask)", EXTRA_INSTALL)
    require_package("cv2", "the edge control (OpenCV's Canny)", EXTRA_INSTALL)
    check_geometry(options)
    return options


def check_geometry(options: TransferOptions) -> None:
    """16-pixel sides, a chunk between 5 frames and what the position table covers, a long enough source."""
    multiple_of("--height", options.height, PIXELS_PER_TOKEN, "Cosmos-Transfer2.5")
    multiple_of("--width", options.width, PIXELS_PER_TOKEN, "Cosmos-Transfer2.5")
    positive("--chunk", options.chunk)
    shortest = TEMPORAL_FACTOR + 1
    if options.chunk < shortest:
        raise OptionsError(f"--chunk {options.chunk}: a chunk has at least {shortest} frames: pass --chunk {shortest}")
    config = transformer_config(options) or {}
    if config.get("max_size") and config.get("patch_size"):
        longest = max(size // patch for size, patch in zip(config["max_size"], config["patch_size"], strict=True))
        if options.chunk > longest:
            raise OptionsError(
                f"--chunk {options.chunk} is longer than this transformer's position table covers: "
                f"pass --chunk {longest} or less"
            )
    clip = probe_mp4(options.input)
    if clip.frames < options.frames:  # the pipeline would quietly make a video as long as the source
        raise OptionsError(
            f"{options.input} has {clip.frames} frames, fewer than --frames {options.frames}: pass a longer --input "
            f"or --frames {clip.frames} or fewer"
        )


def load(options: TransferOptions, device: torch.device, attach: bool = False) -> Any:
    """The pipeline, CPU-first, with the safety checker; the edge video goes to ``pipe.control_frames``."""
    controls = canny_edges(read_mp4(options.input)[: options.frames], options.width, options.height)
    checker, note = safety_checker()
    if options.model is not None:
        from diffusers import Cosmos2_5_TransferPipeline

        pipe = load_pipeline(options.model, Cosmos2_5_TransferPipeline, dtype=torch.bfloat16, safety_checker=checker)
    else:
        init = common.init_device(options, device, attach)
        pipe = build_pipeline(
            "cosmos_transfer25", options.random_weights, seed=options.seed, init_device=init, safety_checker=checker
        )
    pipe.control_frames = controls  # derived input: the edges, made once per run
    pipe.safety_check_note = note
    return pipe


def generate(
    pipe: Any, options: TransferOptions, device: torch.device, steps: int, output_type: str, **extra: Any
) -> Any:
    return pipe(
        **common.call_arguments(options, steps, output_type),
        controls=pipe.control_frames,
        num_frames_per_chunk=options.chunk,
        max_sequence_length=options.max_sequence_length,
        **extra,
    ).frames


def profiling_generation(pipe: Any, options: TransferOptions, device: torch.device) -> Any:
    """``--profiling-generation``: two steps, latents only; the transformer and ControlNet run at least twice
    (discovery, profiling)."""
    return generate(pipe, options, device, 2, "latent")


def describe(pipe: Any, options: TransferOptions) -> dict[str, Any]:
    return {
        "safety_check": pipe.safety_check_note,
        "control": {"kind": "canny edges", "source": str(options.input), "frames": len(pipe.control_frames)},
    }


def run(options: TransferOptions) -> dict[str, Any]:
    info = common.run_recipe(sys.modules[__name__], options)
    print(info.get("safety_check", ""))
    return info


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run with these arguments; errors propagate as exceptions."""
    return common.main(sys.modules[__name__], argv)


def cli(argv: list[str] | None = None) -> None:
    """The command line: one line per user error, exit status 2 (``-v``: the traceback too)."""
    common.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    cli()
