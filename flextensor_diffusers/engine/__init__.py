"""The streaming engine: knows nothing of diffusers.

Its public face: `offload` / `offload_shared` and the `OffloadHandle` they return (its public methods and
properties), the handle's ``host`` (`HostCopies`: where every unit's host bytes are, `HostCopies.where`, and
the verbs that move them between RAM and disk), `OffloadConfig`, the typed errors, `OffloadStats`, and the pure
planner (`plan_residency`, `simulate`). Other modules are the engine's own.
"""

from .config import OffloadConfig, format_bytes, parse_bytes
from .errors import (
    BudgetError,
    FlexTensorError,
    HostBudgetError,
    InferenceOnlyError,
    MeasuringOutOfMemoryError,
    NoCudaDeviceError,
    OffloadStateError,
    PatternError,
    ProfileMismatchError,
    UnsupportedTensorError,
)
from .handle import OffloadHandle, offload, offload_shared
from .host_copies import HostCopies, HostPlaces
from .load_checks import LoadCheckError
from .phases import Phase
from .planner import Call, Plan, WorkloadProfile, plan_residency, simulate
from .shared_host import SharedHostMemory
from .stats import OffloadStats

__all__ = [
    "BudgetError",
    "Call",
    "FlexTensorError",
    "HostBudgetError",
    "HostCopies",
    "HostPlaces",
    "InferenceOnlyError",
    "LoadCheckError",
    "MeasuringOutOfMemoryError",
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
    "UnsupportedTensorError",
    "WorkloadProfile",
    "format_bytes",
    "offload",
    "offload_shared",
    "parse_bytes",
    "plan_residency",
    "simulate",
]
