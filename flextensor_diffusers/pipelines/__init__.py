"""Diffusers integration: the pipeline mixin, per-model block patterns, component sequencing."""

from .feed_forward import FeedForwardChunkingError, chunk_feed_forward, feed_forward_chunks, unchunk_feed_forward
from .offload import (
    FlexTensorPipelineMixin,
    PipelineOffload,
    attach_to_diffusers,
    enable,
    format_report,
    pipeline_offload,
)
from .patterns import BLOCK_PATTERNS, patterns_for, repeated_blocks

__all__ = [
    "BLOCK_PATTERNS",
    "FeedForwardChunkingError",
    "FlexTensorPipelineMixin",
    "PipelineOffload",
    "attach_to_diffusers",
    "chunk_feed_forward",
    "enable",
    "feed_forward_chunks",
    "format_report",
    "patterns_for",
    "pipeline_offload",
    "repeated_blocks",
    "unchunk_feed_forward",
]
