"""Wan2.2 text-to-video (A14B: two experts, UMT5, Wan VAE) under a GPU budget, to an mp4.

examples:
  flextensor-wan22-t2v --random-weights tiny
  flextensor-wan22-t2v --random-weights tiny --frames 9 --height 32 --width 32 --steps 2 --output wan-t2v.mp4
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --budget 24GiB
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from . import common
from .models import build_pipeline, load_pipeline
from .options import (
    OptionsError,
    RecipeOptions,
    SizeDefaults,
    add_output,
    command_name,
    common_values,
    frames_of_form,
    multiple_of,
    recipe_parser,
    transformer_config,
)

DEFAULTS = {"tiny": SizeDefaults(frames=9, height=32, width=32, steps=2), "full": SizeDefaults(81, 480, 832, 40)}
#: Pixels per latent token along height and width: the VAE's 8 times the transformer's patch of 2.
PIXELS_PER_TOKEN = 16
TEMPORAL_FACTOR = 4


@dataclass(frozen=True, kw_only=True)
class WanOptions(RecipeOptions):
    architecture = "wan22_t2v"


def parse_args(argv: list[str] | None = None) -> WanOptions:
    parser = recipe_parser(command_name("wan22_t2v"), __doc__, DEFAULTS)
    parser.set_defaults(prompt="a red fox running through a snowy forest, cinematic")
    parser.add_argument("--fps", type=int, default=16, help="frames per second of the mp4")
    add_output(parser, "wan-t2v.mp4")
    options = WanOptions(**common_values(parser.parse_args(argv), "wan22_t2v", DEFAULTS))
    check_geometry(options)
    return options


def check_geometry(options: WanOptions) -> None:
    """Sizes the model can make: 16-pixel multiples, 4k+1 frames, within the position table (RoPE)."""
    multiple_of("--height", options.height, PIXELS_PER_TOKEN, "Wan2.2")
    multiple_of("--width", options.width, PIXELS_PER_TOKEN, "Wan2.2")
    frames_of_form("--frames", options.frames, TEMPORAL_FACTOR, "Wan2.2")
    config = transformer_config(options)
    limit = (config or {}).get("rope_max_seq_len")
    if limit is None:
        return
    weights = f"{options.random_weights} random weights" if options.random_weights else str(options.model)
    for flag, value, per_token in (
        ("--height", options.height, PIXELS_PER_TOKEN),
        ("--width", options.width, PIXELS_PER_TOKEN),
        ("--frames", options.frames, None),
    ):
        tokens = (value - 1) // TEMPORAL_FACTOR + 1 if per_token is None else value // per_token
        if tokens > limit:
            most = (limit - 1) * TEMPORAL_FACTOR + 1 if per_token is None else limit * per_token
            raise OptionsError(
                f"{flag} {value} is more than the transformer of {weights} can place (its position table, "
                f"rope_max_seq_len {limit}, covers {most}): pass {flag} {most} or less"
            )


def load(options: WanOptions, device: torch.device, attach: bool = False) -> Any:
    if options.model is not None:
        from diffusers import WanPipeline

        return load_pipeline(options.model, WanPipeline, dtype=torch.bfloat16)
    init = common.init_device(options, device, attach)
    return build_pipeline("wan22_t2v", options.random_weights, seed=options.seed, init_device=init)


def generate(pipe: Any, options: WanOptions, device: torch.device, steps: int, output_type: str, **extra: Any) -> Any:
    """Frames (or latents) of one generation; ``extra`` goes to the pipeline call (callbacks)."""
    return pipe(**common.call_arguments(options, steps, output_type), **extra).frames


def profiling_generation(pipe: Any, options: WanOptions, device: torch.device) -> Any:
    """``--profiling-generation``: the shortest generation of the same shapes that runs each expert twice
    (discovery, profiling).

    Two steps with CFG (cond and uncond forwards), four without; latents only, no VAE decode.
    """
    return generate(pipe, options, device, 2 if options.guidance > 1 else 4, "latent")


def run(options: WanOptions) -> dict[str, Any]:
    return common.run_recipe(sys.modules[__name__], options)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run with these arguments; errors propagate as exceptions."""
    return common.main(sys.modules[__name__], argv)


def cli(argv: list[str] | None = None) -> None:
    """The command line: one line per user error, exit status 2 (``-v``: the traceback too)."""
    common.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    cli()
