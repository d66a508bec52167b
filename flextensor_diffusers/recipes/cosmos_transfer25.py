"""Cosmos-Transfer2.5 under a GPU budget: a new video that follows the edges of a source clip.

    python -m flextensor_diffusers.recipes.cosmos_transfer25 --random-weights tiny \
        --frames 5 --height 32 --width 32 --steps 2 --chunk 16
    python -m flextensor_diffusers.recipes.cosmos_transfer25 --model /models/Cosmos-Transfer2.5-2B --input clip.mp4

The control input is an edge video: OpenCV's Canny on each source frame, scaled to the output
size first. The pipeline is built on the CPU (text encoder, transformer, ControlNet, VAE) and
every component is offloaded. Cosmos ships a safety checker (Cosmos Guardrail, package
``cosmos_guardrail``) that the pipeline requires; when the package is not installed the recipe
runs without it and says so, in the log and in the summary, every time.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.errors import FlexTensorError
from ..models import ASSETS, build_pipeline, load_pipeline
from ..video import read_mp4
from . import common

logger = logging.getLogger(__name__)

SAMPLE_CLIP = ASSETS / "clips" / "sample.mp4"
GUARDRAIL_SKIPPED = (
    "safety check skipped: the cosmos_guardrail package is not installed, so Cosmos Guardrail did not check "
    "the prompt or the generated video. Install it (pip install cosmos_guardrail) to run the checks the "
    "NVIDIA Open Model License expects."
)
GUARDRAIL_ON = "Cosmos Guardrail checked the prompt and the generated video"


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
        logger.warning(GUARDRAIL_SKIPPED)
        return SkippedSafetyChecker(), GUARDRAIL_SKIPPED
    return CosmosSafetyChecker(), GUARDRAIL_ON


def canny_edges(frames: np.ndarray, width: int, height: int, low: int = 100, high: int = 200) -> list:
    """Edge maps (white on black, 3 channels, PIL images) of uint8 RGB ``frames`` at ``width`` x ``height``."""
    try:
        import cv2
    except ImportError:
        raise FlexTensorError(
            "the edge control needs OpenCV: pip install opencv-python-headless (or flextensor-diffusers[cosmos])"
        ) from None
    from PIL import Image

    edges = []
    for frame in frames:
        scaled = cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA)
        edge = cv2.Canny(cv2.cvtColor(scaled, cv2.COLOR_RGB2BGR), low, high)
        edges.append(Image.fromarray(np.repeat(edge[..., None], 3, axis=-1)))
    return edges


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_arguments(parser, frames=93, height=480, width=640, steps=35)
    parser.set_defaults(prompt="a robot arm folding a blue cloth on a table, studio light", guidance=3.0)
    parser.add_argument("--input", type=Path, default=SAMPLE_CLIP, help="source mp4 for the edges")
    parser.add_argument("--chunk", type=int, default=93, help="frames per chunk (num_frames_per_chunk)")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--output", type=Path, default=Path("cosmos-transfer.mp4"))
    args = parser.parse_args(argv)
    args.recipe = "cosmos_transfer25"
    return args


def load(args: argparse.Namespace, device: torch.device) -> Any:
    """The pipeline, CPU-first, with the safety checker; the edge video goes to ``args.controls``."""
    if not args.input.exists():
        raise FlexTensorError(f"no video at {args.input}: pass --input PATH to an mp4")
    args.max_sequence_length = 16 if args.random_weights == "tiny" else 512
    source = read_mp4(args.input)
    if len(source) < args.frames:  # the pipeline would quietly make a video as long as the source
        raise FlexTensorError(
            f"{args.input} has {len(source)} frames, fewer than --frames {args.frames}: pass a longer --input "
            f"or --frames {len(source)} or fewer"
        )
    args.controls = canny_edges(source[: args.frames], args.width, args.height)
    checker, args.safety_check = safety_checker()
    if args.model is not None:
        from diffusers import Cosmos2_5_TransferPipeline

        return load_pipeline(args.model, Cosmos2_5_TransferPipeline, dtype=torch.bfloat16, safety_checker=checker)
    return build_pipeline(
        "cosmos_transfer25",
        args.random_weights,
        seed=args.seed,
        init_device=common.init_device(args, device),
        safety_checker=checker,
    )


def generate(
    pipe: Any, args: argparse.Namespace, device: torch.device, steps: int, output_type: str, **extra: Any
) -> Any:
    return pipe(
        **common.call_arguments(args, steps, output_type),
        controls=args.controls,
        num_frames_per_chunk=args.chunk,
        max_sequence_length=args.max_sequence_length,
        **extra,
    ).frames


def profiling_generation(pipe: Any, args: argparse.Namespace, device: torch.device) -> Any:
    """Two steps, latents only: the transformer and ControlNet run at least twice (discovery, profiling)."""
    return generate(pipe, args, device, 2, "latent")


def describe(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "safety_check": args.safety_check,
        "control": {"kind": "canny edges", "source": str(args.input), "frames": len(args.controls)},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    info = common.run_recipe(sys.modules[__name__], args)
    print(info.get("safety_check", ""))
    return info


def main(argv: list[str] | None = None) -> None:
    common.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
