"""Wan2.2 text-to-video (A14B: two experts, UMT5, Wan VAE) under a GPU budget, to an mp4.

examples:
  flextensor-wan22-t2v --random-weights tiny
  flextensor-wan22-t2v --random-weights tiny --frames 9 --height 32 --width 32 --steps 2 --output wan-t2v.mp4
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --budget 24GiB
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --lora style.safetensors:0.8
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import common
from .models import build_pipeline, load_pipeline
from .options import (
    LoraFile,
    OptionsError,
    RecipeOptions,
    SizeDefaults,
    add_output,
    command_name,
    common_values,
    frames_of_form,
    lora_file,
    multiple_of,
    recipe_parser,
    transformer_config,
)

DEFAULTS = {"tiny": SizeDefaults(frames=9, height=32, width=32, steps=2), "full": SizeDefaults(81, 480, 832, 40)}
#: Pixels per latent token along height and width: the VAE's 8 times the transformer's patch of 2.
PIXELS_PER_TOKEN = 16
TEMPORAL_FACTOR = 4
#: A LoRA file's tensors for the second expert are named ``transformer_2.…``; all others are the first expert's
#: (``transformer.…``, or another format diffusers converts to it).
SECOND_EXPERT = "transformer_2."


@dataclass(frozen=True, kw_only=True)
class WanOptions(RecipeOptions):
    architecture = "wan22_t2v"
    loras: tuple[LoraFile, ...] = ()


def parse_args(argv: list[str] | None = None) -> WanOptions:
    parser = recipe_parser(command_name("wan22_t2v"), __doc__, DEFAULTS)
    parser.set_defaults(prompt="a red fox running through a snowy forest, cinematic")
    parser.add_argument("--fps", type=int, default=16, help="frames per second of the mp4")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="load a local LoRA file (.safetensors) into each expert it names (tensors 'transformer_2.…': the "
        "second; all others: the first), its adapter weighted by SCALE (default 1); repeat for several",
    )
    add_output(parser, "wan-t2v.mp4")
    ns = parser.parse_args(argv)
    options = WanOptions(**common_values(ns, "wan22_t2v", DEFAULTS), loras=tuple(lora_file(t) for t in ns.lora))
    if options.loras and options.gpus > 1:
        raise OptionsError(
            f"--lora cannot be combined with --gpus {options.gpus} yet (the ranks attach to one host copy of the "
            "weights as loaded, without adapters): drop --lora, or run on one GPU"
        )
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
    """The pipeline with ``--lora`` files loaded (not when ``attach``: a build on the meta device, for checks)."""
    if options.model is not None:
        from diffusers import WanPipeline

        pipe = load_pipeline(options.model, WanPipeline, dtype=torch.bfloat16)
    else:
        init = common.init_device(options, device, attach)
        pipe = build_pipeline("wan22_t2v", options.random_weights, seed=options.seed, init_device=init)
    if not attach:
        load_loras(pipe, options.loras)
    return pipe


class _DropErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _failures_said_by_us() -> Iterator[None]:
    """diffusers logs a LoRA that fails to load as an error before raising; the run's one line says it instead."""
    logger, quiet = logging.getLogger("diffusers.loaders.peft"), _DropErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def load_loras(pipe: Any, loras: tuple[LoraFile, ...]) -> None:
    """Each file's adapter (``lora0``, ``lora1``...) in each expert it names, then every adapter at its scale. A file
    that does not fit the model, or names none of its layers, stops the run with one line (`OptionsError`)."""
    from safetensors.torch import load_file

    names = []
    for index, lora in enumerate(loras):
        name, tensors = f"lora{index}", load_file(str(lora.path))
        second = {
            "transformer." + k[len(SECOND_EXPERT) :]: v for k, v in tensors.items() if k.startswith(SECOND_EXPERT)
        }
        first = {k: v for k, v in tensors.items() if not k.startswith(SECOND_EXPERT)}
        for expert, part in (("transformer", first), ("transformer_2", second)):
            if not part:
                continue
            if getattr(pipe, expert, None) is None:
                raise OptionsError(f"--lora {lora.path} has weights for {expert}, which this model has not")
            try:
                with _failures_said_by_us():
                    pipe.load_lora_weights(part, adapter_name=name, load_into_transformer_2=expert == "transformer_2")
            except (ValueError, RuntimeError, KeyError, IndexError) as exc:  # diffusers' and peft's refusals
                reason = " ".join(str(exc).split())[:200]
                raise OptionsError(
                    f"--lora {lora.path} does not fit the model's {expert} ({reason}): pass a LoRA made for these "
                    "weights"
                ) from exc
            if name not in pipe.get_list_adapters().get(expert, []):
                raise OptionsError(
                    f"--lora {lora.path}: none of its weights name a layer of the model's {expert}: pass a LoRA made "
                    "for Wan2.2"
                )
        names.append(name)
    if names:
        pipe.set_adapters(names, adapter_weights=[lora.scale for lora in loras])


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
