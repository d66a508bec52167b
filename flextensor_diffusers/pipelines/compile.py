"""``torch.compile`` for a pipeline's denoisers, the way diffusers documents it.

*Regional* compilation compiles each repeated block once (``compile_repeated_blocks``): one graph
reused by every block, and each block is exactly one streamed unit, so streaming happens between
compiled regions, before or after `enable_flextensor_offload`, with outputs bitwise equal to the
same compilation run natively. *Full* compilation (``module.compile()``) is for native runs: with
offload its graph would break at every block, changing its kernels and so its outputs, and the
engine refuses it with an error naming regional compilation.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ..engine import FlexTensorError, find_units
from .patterns import patterns_for

logger = logging.getLogger(__name__)

#: What ``--compile`` accepts.
COMPILE_MODES = ("none", "regional", "full")
#: Components that run every denoising step: the ones worth compiling.
DENOISERS = ("transformer", "transformer_2", "controlnet")


def compile_blocks(name: str, module: nn.Module, **compile_kwargs: Any) -> None:
    """Compile each repeated block: diffusers' ``compile_repeated_blocks`` where the model declares
    them, else each block the offload patterns stream (Cosmos' transformer and ControlNet declare none)."""
    if getattr(module, "_repeated_blocks", None):
        module.compile_repeated_blocks(fullgraph=True, **compile_kwargs)
        return
    blocks = find_units(module, patterns_for(name, module))
    if not blocks:
        raise FlexTensorError(f"{type(module).__name__} has no repeated blocks to compile regionally")
    for _, block in blocks:
        block.compile(fullgraph=True, **compile_kwargs)


def compile_pipeline(pipe: Any, mode: str, **compile_kwargs: Any) -> list[str]:
    """Compile the pipeline's denoisers in place; returns the names of the components compiled.

    ``mode``: ``"none"``, ``"regional"`` (``compile_repeated_blocks(fullgraph=True)``) or
    ``"full"`` (``module.compile()``). Further keyword arguments go to ``torch.compile``.
    """
    if mode not in COMPILE_MODES:
        raise FlexTensorError(f"unknown compile mode {mode!r}: use one of {', '.join(COMPILE_MODES)}")
    if mode == "none":
        return []
    compiled = []
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if not isinstance(module, nn.Module):
            continue
        if mode == "regional":
            compile_blocks(name, module, **compile_kwargs)
        else:
            module.compile(**compile_kwargs)
        compiled.append(name)
    logger.info("compiled (%s): %s", mode, ", ".join(compiled) or "nothing")
    return compiled
