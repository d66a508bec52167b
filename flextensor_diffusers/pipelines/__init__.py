"""Diffusers integration: the pipeline mixin, per-model block patterns, component sequencing."""

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
    "FlexTensorPipelineMixin",
    "PipelineOffload",
    "attach_to_diffusers",
    "enable",
    "format_report",
    "patterns_for",
    "pipeline_offload",
    "repeated_blocks",
]
