"""The storage wing: where each unit's host bytes live and how they reach a flat buffer the engine can copy.

Beside the streaming core (`flextensor_diffusers.engine`): the core decides *when* a unit's bytes must be on the
device; this package owns *where* they are on the host and in what form: raw copies in (page-locked) RAM
(`host_copies`, `host_memory`, `locked_pool`, `packing_line`), lossless payloads (`codec`, `compressed_copies` and
its parts `payload_records`, `set_up_payloads`, `arriving_payloads`, `waiting_payloads`, `device_encoding`,
`payload_cache`, `arrivals`), raw copies on disk and the weight files they come from, or none at all
(`raw_homes`, `raw_home`, `weight_files`, `disk_reads`, `file_reads`, `cache_files`, `private_files`, `payloads_only`,
`read_guard`), copies shared
between processes (`shared_host`), the machine's memory (`machine_memory`), the pipeline-wide host budget
(`host_budget`) and the tier that reads components back from disk while others compute (`host_tier`).

Its face for the pipelines (all they import of the storage wing): the pipeline-wide host budget (`host_budget`, whose
functions tests replace on the module, so it is named whole, and the names below), the host tier (`HostTier`,
`format_host_tier`, `kept_in_ram_bytes`, `offload_order`, `pipeline_folder`, `LastForwardForecast`), the RAM
available (`AvailableMemory`) and where raw bytes wait on disk, or that they wait nowhere (`WeightFilesHome`,
`component_folders`, `RawCacheFile`, `PayloadsOnlyHome`). The names are looked up on first use: the engine imports
storage modules while the engine package is still being imported, and the host tier imports the engine's face, so
importing the tier here at once would go round in a circle.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each name of the face, and the module (below this package) that defines it.
_FACE = {
    "HostOverhead": "host_budget",
    "HostRamDecision": "host_budget",
    "anonymous_bytes": "host_budget",
    "check_host_budget": "host_budget",
    "least_compressed_bytes": "host_budget",
    "HostTier": "host_tier",
    "format_host_tier": "host_tier",
    "kept_in_ram_bytes": "host_tier",
    "offload_order": "host_tier",
    "pipeline_folder": "host_tier",
    "LastForwardForecast": "host_tier.hand_over",
    "AvailableMemory": "machine_memory",
    "WeightFilesHome": "raw_home",
    "component_folders": "weight_files",
    "RawCacheFile": "cache_files",
    "PayloadsOnlyHome": "payloads_only",
    "HostCopiesSize": "plan",
    "HostTierPlan": "plan",
    "MachineFacts": "plan",
    "StoragePlan": "plan",
    "StorageRequest": "plan",
    "resolve_storage": "plan",
}

__all__ = ["host_budget", *_FACE]


def __getattr__(name: str) -> Any:
    """A name of the face, imported from its module on first use (see the module docstring)."""
    if name == "host_budget":
        return importlib.import_module(f"{__name__}.host_budget")
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FACE[name]}"), name)
