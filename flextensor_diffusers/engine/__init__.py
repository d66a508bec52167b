"""The streaming engine: knows nothing of diffusers."""

from .config import OffloadConfig, format_bytes, parse_bytes
from .errors import (
    BudgetError,
    FlexTensorError,
    InferenceOnlyError,
    NoCudaDeviceError,
    OffloadStateError,
    PatternError,
    ProfileMismatchError,
)
from .planner import Call, Plan, WorkloadProfile, plan_residency, simulate
from .runtime import OffloadHandle, Phase, offload
from .stats import OffloadStats

__all__ = [
    "BudgetError",
    "Call",
    "FlexTensorError",
    "InferenceOnlyError",
    "NoCudaDeviceError",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadStateError",
    "OffloadStats",
    "PatternError",
    "Phase",
    "Plan",
    "ProfileMismatchError",
    "WorkloadProfile",
    "format_bytes",
    "offload",
    "parse_bytes",
    "plan_residency",
    "simulate",
]
