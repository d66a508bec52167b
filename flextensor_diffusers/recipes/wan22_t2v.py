"""Wan2.2 text-to-video (A14B: two experts, UMT5, Wan VAE) under a GPU budget, to an mp4.

python -m flextensor_diffusers.recipes.wan22_t2v --random-weights tiny --frames 9 --height 32 --width 32 --steps 2
python -m flextensor_diffusers.recipes.wan22_t2v --model /models/Wan2.2-T2V-A14B-Diffusers --budget 24GiB
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..models import build_pipeline, load_pipeline
from . import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_arguments(parser, frames=81, height=480, width=832, steps=40)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--output", type=Path, default=Path("wan-t2v.mp4"))
    args = parser.parse_args(argv)
    args.recipe = "wan22_t2v"
    return args


def load(args: argparse.Namespace, device: torch.device) -> Any:
    if args.model is not None:
        from diffusers import WanPipeline

        return load_pipeline(args.model, WanPipeline, dtype=torch.bfloat16)
    return build_pipeline(
        "wan22_t2v", args.random_weights, seed=args.seed, init_device=common.init_device(args, device)
    )


def generate(
    pipe: Any, args: argparse.Namespace, device: torch.device, steps: int, output_type: str, **extra: Any
) -> Any:
    """Frames (or latents) of one generation; ``extra`` goes to the pipeline call (callbacks)."""
    return pipe(**common.call_arguments(args, steps, output_type), **extra).frames


def profiling_generation(pipe: Any, args: argparse.Namespace, device: torch.device) -> Any:
    """The shortest generation of the same shapes that runs each expert twice (discovery, profiling).

    Two steps with CFG (cond and uncond forwards), four without; latents only, no VAE decode.
    """
    return generate(pipe, args, device, 2 if args.guidance > 1 else 4, "latent")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return common.run_recipe(sys.modules[__name__], args)


def main(argv: list[str] | None = None) -> None:
    common.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
