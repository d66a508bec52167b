"""The streaming engine: knows nothing of diffusers.

Its public face: `offload` / `offload_shared` and the `OffloadHandle` they return (its public methods and
properties), the handle's ``host`` (`HostCopies`: where every unit's host bytes are, `HostCopies.where`, and
the verbs that move them between RAM and disk), `OffloadConfig`, the typed errors, `OffloadStats`, the pure
planner (`plan_residency`, `simulate`), and the process's true peaks of device memory (`peaks`:
`max_memory_allocated`, `max_memory_reserved`, `reset_peak_memory_stats`, `open_window`). Other modules are the
engine's own.
"""

from ..storage.host_copies import HostCopies, HostPlaces
from ..storage.shared_host import SharedHostMemory
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
from .load_checks import LoadCheckError
from .peaks import PeakWindow, max_memory_allocated, max_memory_reserved, open_window, reset_peak_memory_stats
from .phases import Phase
from .planner import Call, Plan, WorkloadProfile, plan_residency, simulate
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
    "PeakWindow",
    "Phase",
    "Plan",
    "ProfileMismatchError",
    "SharedHostMemory",
    "UnsupportedTensorError",
    "WorkloadProfile",
    "format_bytes",
    "max_memory_allocated",
    "max_memory_reserved",
    "offload",
    "offload_shared",
    "open_window",
    "parse_bytes",
    "plan_residency",
    "reset_peak_memory_stats",
    "simulate",
]
