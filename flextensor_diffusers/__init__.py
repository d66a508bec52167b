"""flextensor-diffusers: run large diffusers pipelines inside a GPU memory budget at full precision.

Weights live in pinned host memory and are streamed to the GPU just before they are used. The
engine (`flextensor_diffusers.engine`) works on any ``torch.nn.Module``.
"""

from .engine import (
    BudgetError,
    FlexTensorError,
    InferenceOnlyError,
    NoCudaDeviceError,
    OffloadConfig,
    OffloadHandle,
    OffloadStateError,
    OffloadStats,
    PatternError,
    ProfileMismatchError,
    offload,
)

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "FlexTensorError",
    "InferenceOnlyError",
    "NoCudaDeviceError",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadStateError",
    "OffloadStats",
    "PatternError",
    "ProfileMismatchError",
    "__version__",
    "offload",
]
