"""The streaming engine: knows nothing of diffusers."""

from .config import OffloadConfig, format_bytes, parse_bytes
from .errors import (
    BudgetError,
    FlexTensorError,
    HostBudgetError,
    InferenceOnlyError,
    NoCudaDeviceError,
    OffloadStateError,
    PatternError,
    ProfileMismatchError,
)
from .handle import OffloadHandle, offload, offload_shared
from .phases import Phase
from .planner import Call, Plan, WorkloadProfile, plan_residency, simulate
from .shared_host import SharedHostMemory
from .stats import OffloadStats

__all__ = [
    "BudgetError",
    "Call",
    "FlexTensorError",
    "HostBudgetError",
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
    "SharedHostMemory",
    "WorkloadProfile",
    "format_bytes",
    "offload",
    "offload_shared",
    "parse_bytes",
    "plan_residency",
    "simulate",
]
