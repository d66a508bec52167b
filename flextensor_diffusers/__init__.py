"""flextensor-diffusers: run large diffusers pipelines inside a GPU memory budget at full precision.

Weights live in pinned host memory and are streamed to the GPU just before they are used. The
engine (`flextensor_diffusers.engine`) works on any ``torch.nn.Module``.
"""

from .engine import (
    BudgetError,
    FlexTensorError,
    HostBudgetError,
    InferenceOnlyError,
    LoadCheckError,
    MeasuringOutOfMemoryError,
    NoCudaDeviceError,
    OffloadConfig,
    OffloadHandle,
    OffloadStateError,
    OffloadStats,
    PatternError,
    ProfileMismatchError,
    SharedHostMemory,
    UnsupportedTensorError,
    max_memory_allocated,
    offload,
    offload_shared,
    reset_peak_memory_stats,
)
from .pipelines import (
    FeedForwardChunkingError,
    FlexTensorPipelineMixin,
    PipelineOffload,
    attach_to_diffusers,
    chunk_feed_forward,
    feed_forward_chunks,
    pipeline_offload,
    unchunk_feed_forward,
)

__version__ = "0.1.0"

#: Importing the package gives diffusers' DiffusionPipeline the methods of FlexTensorPipelineMixin
#: (enable_flextensor_offload, flextensor_report, disable_flextensor_offload); nothing else changes.
attach_to_diffusers()

__all__ = [
    "BudgetError",
    "FeedForwardChunkingError",
    "FlexTensorError",
    "FlexTensorPipelineMixin",
    "HostBudgetError",
    "InferenceOnlyError",
    "LoadCheckError",
    "MeasuringOutOfMemoryError",
    "NoCudaDeviceError",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadStateError",
    "OffloadStats",
    "PatternError",
    "PipelineOffload",
    "ProfileMismatchError",
    "SharedHostMemory",
    "UnsupportedTensorError",
    "__version__",
    "attach_to_diffusers",
    "chunk_feed_forward",
    "feed_forward_chunks",
    "max_memory_allocated",
    "offload",
    "offload_shared",
    "pipeline_offload",
    "reset_peak_memory_stats",
    "unchunk_feed_forward",
]
