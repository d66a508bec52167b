"""The streaming engine: knows nothing of diffusers.

Its public face, all that other layers import (the pipelines import nothing else of the engine):

* `offload` / `offload_shared` and the `OffloadHandle` they return (its public methods and properties), the handle's
  ``host`` (`HostCopies`: where every unit's host bytes are, `HostCopies.where`, and the verbs that move them between
  RAM and disk), and `HandleHooks` (what a handle tells whoever offloaded it, given at construction; `UnitDone`);
  `is_offloaded`;
* `OffloadConfig` and the helpers that read its options: `format_bytes`, `parse_bytes`, `is_auto`,
  `resolve_budget`, `resolve_device`, `cache_folder`;
* the typed errors, `OffloadStats`, the pure planner (`plan_residency`, `simulate`, `smallest_budget`,
  `CUDA_ALLOCATION_GRANULE`) and the unit layout a caller may check budgets from before offloading
  (`find_units`, `plan_layout`, `UnitLayout`; `refuse_whole_model_compile`);
* `VARIANT_ATTRIBUTE`: how a module says that it computes otherwise than its class (profiles tell such models apart);
* the process's true peaks of device memory (`peaks`: `max_memory_allocated`, `max_memory_reserved`,
  `reset_peak_memory_stats`, `open_window`).

Other modules are the engine's own.
"""

from ..storage.host_copies import HostCopies, HostPlaces
from ..storage.shared_host import SharedHostMemory
from .boundaries import refuse_whole_model_compile
from .config import (
    NO_COMPRESSION,
    OffloadConfig,
    cache_folder,
    format_bytes,
    is_auto,
    parse_bytes,
    resolve_budget,
    resolve_device,
)
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
from .handle import OffloadHandle, is_offloaded, offload, offload_shared
from .hooks import HandleHooks, UnitDone
from .load_checks import LoadCheckError
from .peaks import PeakWindow, max_memory_allocated, max_memory_reserved, open_window, reset_peak_memory_stats
from .phases import Phase
from .planner import (
    CUDA_ALLOCATION_GRANULE,
    Call,
    Plan,
    WorkloadProfile,
    plan_residency,
    simulate,
    smallest_budget,
)
from .profile import VARIANT_ATTRIBUTE
from .stats import OffloadStats
from .units import UnitLayout, find_units, plan_layout

__all__ = [
    "CUDA_ALLOCATION_GRANULE",
    "NO_COMPRESSION",
    "VARIANT_ATTRIBUTE",
    "BudgetError",
    "Call",
    "FlexTensorError",
    "HandleHooks",
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
    "UnitDone",
    "UnitLayout",
    "UnsupportedTensorError",
    "WorkloadProfile",
    "cache_folder",
    "find_units",
    "format_bytes",
    "is_auto",
    "is_offloaded",
    "max_memory_allocated",
    "max_memory_reserved",
    "offload",
    "offload_shared",
    "open_window",
    "parse_bytes",
    "plan_layout",
    "plan_residency",
    "refuse_whole_model_compile",
    "reset_peak_memory_stats",
    "resolve_budget",
    "resolve_device",
    "simulate",
    "smallest_budget",
]
