"""Which blocks of each pipeline component are streamed.

Built in for the models of Wan2.2, LTX-2 and Cosmos-Transfer2.5; for any other model the largest
list of repeated blocks is found and the choice is logged.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)

#: Component class name -> include patterns. An empty list: the component is moved in and out
#: whole (its memory is activations, not weights).
BLOCK_PATTERNS: dict[str, list[str]] = {
    # Wan2.2
    "WanTransformer3DModel": ["blocks.*"],
    "UMT5EncoderModel": ["encoder.block.*"],
    "T5EncoderModel": ["encoder.block.*"],
    "AutoencoderKLWan": [],
    # LTX-2
    "LTX2VideoTransformer3DModel": ["transformer_blocks.*"],
    "Gemma3ForConditionalGeneration": ["model.language_model.layers.*"],
    "LTX2TextConnectors": [],
    "AutoencoderKLLTX2Video": [],
    "AutoencoderKLLTX2Audio": [],
    "LTX2Vocoder": [],
    # Cosmos-Transfer2.5
    "CosmosTransformer3DModel": ["transformer_blocks.*"],
    "CosmosControlNetModel": ["control_blocks.*"],
    "Qwen2_5_VLForConditionalGeneration": ["model.language_model.layers.*", "model.visual.blocks.*"],
}


def repeated_blocks(module: nn.Module) -> tuple[str, int, int] | None:
    """(name, count, bytes) of the ModuleList of same-class blocks holding the most weight."""
    best: tuple[str, int, int] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        if len({type(m) for m in child}) != 1:
            continue
        size = sum(p.numel() * p.element_size() for p in child.parameters())
        if best is None or size > best[2]:
            best = (name, len(child), size)
    return best


def patterns_for(name: str, module: nn.Module) -> list[str]:
    """Built-in patterns for the component's class, else its largest list of repeated blocks."""
    cls = type(module).__name__
    if cls in BLOCK_PATTERNS:
        return list(BLOCK_PATTERNS[cls])
    found = repeated_blocks(module)
    if found is None:
        logger.info("component %s (%s): no repeated blocks; moved in and out whole", name, cls)
        return []
    block_list, count, _ = found
    logger.info("component %s (%s): streaming %r (%d repeated blocks)", name, cls, f"{block_list}.*", count)
    return [f"{block_list}.*"]
