"""Which blocks of each pipeline component are streamed.

Built in for the models of Wan2.2, LTX-2 and Cosmos-Transfer2.5; for any other model the largest
list of repeated blocks is found and the choice is logged.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)

#: Component class name -> include patterns. An empty list: the component is moved in and out
#: whole (its memory is activations, not weights). "autoencoder": the blocks of its encoder and
#: decoder (`autoencoder_patterns`), so that encode and decode are each a planned workload.
BLOCK_PATTERNS: dict[str, list[str] | str] = {
    # Wan2.2
    "WanTransformer3DModel": ["blocks.*"],
    "UMT5EncoderModel": ["encoder.block.*"],
    "T5EncoderModel": ["encoder.block.*"],
    "AutoencoderKLWan": "autoencoder",
    # LTX-2
    "LTX2VideoTransformer3DModel": ["transformer_blocks.*"],
    "Gemma3ForConditionalGeneration": ["model.language_model.layers.*"],
    "LTX2TextConnectors": [],
    "AutoencoderKLLTX2Video": "autoencoder",
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


def autoencoder_patterns(module: nn.Module) -> list[str]:
    """The block lists and mid blocks of a VAE's encoder and decoder.

    A VAE is used through ``encode`` and ``decode``, each running only one half of it; streaming
    only the largest block list (often the encoder's) would leave decoding unplanned.
    """
    patterns = []
    for half in ("encoder", "decoder"):
        part = getattr(module, half, None)
        if not isinstance(part, nn.Module):
            continue
        for child_name, child in part.named_children():
            if not any(True for _ in child.parameters()):
                continue
            if isinstance(child, nn.ModuleList) and len(child) > 0:
                patterns.append(f"{half}.{child_name}.*")
            elif child_name == "mid_block":
                patterns.append(f"{half}.{child_name}")
    return patterns


def is_autoencoder(module: nn.Module) -> bool:
    return isinstance(getattr(module, "encoder", None), nn.Module) and isinstance(
        getattr(module, "decoder", None), nn.Module
    )


def patterns_for(name: str, module: nn.Module) -> list[str]:
    """Built-in patterns for the component's class; for a VAE its encoder's and decoder's blocks;
    else its largest list of repeated blocks."""
    cls = type(module).__name__
    builtin = BLOCK_PATTERNS.get(cls)
    if builtin == "autoencoder" or (builtin is None and is_autoencoder(module)):
        patterns = autoencoder_patterns(module)
        logger.info("component %s (%s): streaming encoder and decoder blocks %s", name, cls, patterns)
        return patterns
    if builtin is not None:
        return list(builtin)
    found = repeated_blocks(module)
    if found is None:
        logger.info("component %s (%s): no repeated blocks; moved in and out whole", name, cls)
        return []
    block_list, count, _ = found
    logger.info("component %s (%s): streaming %r (%d repeated blocks)", name, cls, f"{block_list}.*", count)
    return [f"{block_list}.*"]
