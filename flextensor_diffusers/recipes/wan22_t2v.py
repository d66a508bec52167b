"""Wan2.2 text-to-video (A14B: two experts, UMT5, Wan VAE) under a GPU budget, to an mp4.

examples:
  flextensor-wan22-t2v --random-weights tiny
  flextensor-wan22-t2v --random-weights tiny --frames 9 --height 32 --width 32 --steps 2 --output wan-t2v.mp4
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --budget 24GiB
  flextensor-wan22-t2v --random-weights tiny --quantize int8 --output wan-int8.mp4
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --lora style.safetensors:0.8
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --quantize int8
  flextensor-wan22-t2v --random-weights tiny --ffn-chunks 4 --output wan-chunked.mp4
  flextensor-wan22-t2v --model /models/Wan2.2-T2V-A14B-Diffusers --gguf high-Q8_0.gguf,low-Q8_0.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..pipelines.feed_forward import FeedForwardChunkingError, chunk_feed_forward, verified_block
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
from .quantized import GgufFiles, check_quantize, gguf_files, load_gguf_transformers, quantize_experts

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
    quantize: str | None = None  # torchao weight-only: int8 or fp8
    gguf: GgufFiles | None = None
    ffn_chunks: int | None = None  # chunk_feed_forward on both experts


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
    add_quantized(parser)
    parser.add_argument(
        "--ffn-chunks",
        metavar="N",
        help="run each transformer block's feed-forward over N slices of the video's tokens, natively and offloaded "
        "alike (chunk_feed_forward on both experts): its activations shrink about N-fold; the video may differ in "
        "the last bits from an unchunked run",
    )
    add_output(parser, "wan-t2v.mp4")
    ns = parser.parse_args(argv)
    values = common_values(ns, "wan22_t2v", DEFAULTS)
    check_combinations(ns)
    check_quantize(ns.quantize)
    options = WanOptions(
        **values,
        loras=tuple(lora_file(t) for t in ns.lora),
        quantize=ns.quantize,
        gguf=None if ns.gguf is None else gguf_files(ns.gguf),
        ffn_chunks=ffn_chunks(ns.ffn_chunks),
    )
    check_geometry(options)
    return options


def add_quantized(parser: argparse.ArgumentParser) -> None:
    """``--quantize`` and ``--gguf``: quantized transformers, streamed as they are."""
    parser.add_argument(
        "--quantize",
        choices=("int8", "fp8"),
        help="quantize the linears of both experts' blocks after loading (torchao weight-only int8 or float8; "
        "--lora adapters are loaded first and stay unquantized); needs the quantize extra",
    )
    parser.add_argument(
        "--gguf",
        metavar="HIGH.gguf[,LOW.gguf]",
        help="with --model: load the first expert (transformer, high noise) from a local GGUF file, and the second "
        "(transformer_2) from the file after the comma if there is one, the rest from the model folder; needs the "
        "gguf extra",
    )


def ffn_chunks(text: str | None) -> int | None:
    """``--ffn-chunks N``: a whole number >= 1, and a diffusers whose block forward the chunking was verified on."""
    if text is None:
        return None
    try:
        chunks = int(text)
    except ValueError:
        chunks = 0
    if chunks < 1:
        raise OptionsError(f"--ffn-chunks {text}: pass a whole number of 1 or more, e.g. --ffn-chunks 4")
    try:
        verified_block()
    except FeedForwardChunkingError as exc:
        raise OptionsError(f"--ffn-chunks {text}: {exc}") from None
    return chunks


def check_combinations(ns: argparse.Namespace) -> None:
    """Flags that cannot go together, refused before any file is read."""
    if ns.gpus > 1:
        for flag, given in (("--lora", ns.lora), ("--quantize", ns.quantize), ("--gguf", ns.gguf)):
            if given:
                raise OptionsError(
                    f"{flag} cannot be combined with --gpus {ns.gpus} yet (the ranks attach to one host copy of the "
                    f"weights as built, unmodified): drop {flag}, or run on one GPU"
                )
    if ns.gguf is None:
        return
    if ns.model is None:
        raise OptionsError(
            "--gguf replaces the transformers of a model folder, which gives their architecture and the other "
            "components: pass --model PATH with it (not --random-weights)"
        )
    if ns.quantize is not None:
        raise OptionsError(f"--gguf loads quantized transformers already: drop --quantize {ns.quantize}")


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
    """The pipeline with ``--gguf`` transformers, ``--lora`` files loaded (not when ``attach``: a build on the meta
    device, for checks), then ``--quantize``d, then its feed-forward in ``--ffn-chunks``: all before offload is
    enabled."""
    if options.model is not None:
        from diffusers import WanPipeline

        dtype = torch.bfloat16
        experts = {} if options.gguf is None else load_gguf_transformers(options.model, options.gguf, dtype)
        pipe = load_pipeline(options.model, WanPipeline, dtype=dtype, **experts)
    else:
        init = common.init_device(options, device, attach)
        pipe = build_pipeline("wan22_t2v", options.random_weights, seed=options.seed, init_device=init)
    if not attach:
        load_loras(pipe, options.loras)
    if options.quantize is not None and not attach:
        quantize_experts(pipe, options.quantize)
    if options.ffn_chunks is not None:  # a rank attaching to shared weights computes with this build too
        for expert in ("transformer", "transformer_2"):
            if getattr(pipe, expert, None) is not None:
                chunk_feed_forward(getattr(pipe, expert), options.ffn_chunks)
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
