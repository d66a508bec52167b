"""What a host budget bounds, and the least one that works.

``host_budget`` bounds the process's anonymous and page-locked memory (RssAnon + RssShmem), not only the
host copies. Two parts come off the top when offload is enabled (`HostOverhead`): the process's own memory
then (Python, torch, the CUDA context, components not offloaded: its anonymous memory less the anonymous
weights about to be packed, which become host copies) and `HOST_RESERVE_BYTES` for what it allocates later
(reader threads, CUDA libraries). The host copies get the rest (`host_tier.HostTier.weights_budget`), so the
smallest workable host budget is the largest component's packed weights plus those two
(`check_host_budget`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine import format_bytes
from ..engine.errors import HostBudgetError
from ..engine.subclasses import storage_leaves
from ..engine.units import UnitLayout
from .machine_memory import AvailableMemory, available_memory

#: What ``host_budget="auto"`` may take of the RAM available when offload is enabled (the rest is the margin for
#: the page cache, other processes and what this one allocates unaccounted).
AUTO_HOST_SHARE = 0.8
#: Host memory kept free in the host budget for what the process allocates after offload is enabled,
#: besides host copies: the reader threads' malloc arenas and stacks, the host workspaces of CUDA
#: libraries loaded at the first generation, a generation's Python objects. Sized from what the full
#: Wan2.2-A14B run held above the tier's own peak: see benchmarks/results/README.md (host_tier_05890d0_h200).
HOST_RESERVE_BYTES = 2**30


def anonymous_bytes() -> int:
    """The process's anonymous and page-locked memory now, what the host budget bounds: RssAnon + RssShmem
    of /proc/self/status (page-locked host copies are anonymous mappings registered with CUDA). Where that
    file is missing (macOS, Windows), psutil's resident set size, file pages included (an overestimate);
    0 where neither can be read: a measurement never keeps offload from being enabled."""
    counted = ("RssAnon:", "RssShmem:")
    try:
        with open("/proc/self/status") as status:
            kib = [int(line.split()[1]) for line in status if line.startswith(counted)]
        if len(kib) == len(counted):
            return sum(kib) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # no psutil, or no access: 0, as documented
        return 0


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges mapped from files (/proc/self/maps lines with an inode), sorted; empty where unreadable."""
    ranges: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[4] != "0":
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return sorted(ranges)


def anonymous_weight_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the modules' CPU parameters and buffers in anonymous memory, each storage once: packing
    turns them into host copies, which the tier counts, so they are not the process's own memory. Views
    of mapped weight files (what ``from_pretrained`` gives for unconverted safetensors) are file pages,
    not counted; a model built or converted in memory is anonymous. Without /proc/self/maps every CPU
    weight counts (psutil's resident set holds mapped pages too)."""
    ranges = _file_mappings()
    starts = [start for start, _ in ranges]
    storages: dict[int, int] = {}
    for module in modules:
        for tensor in storage_leaves(itertools.chain(module.parameters(), module.buffers())):
            if tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()

    def mapped(address: int) -> bool:
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < ranges[i][1]

    return sum(nbytes for address, nbytes in storages.items() if not mapped(address))


def process_own_bytes(modules: Iterable[nn.Module]) -> int:
    """The process's own memory before ``modules`` (the components to offload) are packed: its anonymous
    and page-locked memory (`anonymous_bytes`) less their anonymous weights (`anonymous_weight_bytes`).
    Python, torch, the CUDA context, components not offloaded: host memory the host copies cannot have."""
    return max(0, anonymous_bytes() - anonymous_weight_bytes(modules))


@dataclass(frozen=True)
class HostOverhead:
    """What the host budget holds besides the host copies: the process's own memory when offload is
    enabled (`process_own_bytes`) and `HOST_RESERVE_BYTES` for what it allocates later."""

    own_bytes: int
    reserve_bytes: int

    @classmethod
    def measure(cls, modules: Iterable[nn.Module]) -> HostOverhead:
        """Now, before ``modules`` are packed (module-level names, so tests can set both)."""
        return cls(process_own_bytes(modules), HOST_RESERVE_BYTES)

    @property
    def nbytes(self) -> int:
        return self.own_bytes + self.reserve_bytes


def check_host_budget(
    host_budget: int,
    component_bytes: dict[str, int],
    overhead: HostOverhead,
    kept_bytes: dict[str, int] | None = None,
    compressed: bool = False,
    auto_from: AvailableMemory | None = None,
) -> None:
    """Refuse a host budget under the largest component's packed weights (plus what the others keep in
    RAM while they wait in their weight files, ``kept_bytes``) next to ``overhead``, naming the smallest
    workable one. ``compressed``: ``component_bytes`` are the least the compressed copies can take
    (`least_compressed_bytes`), so the figure named is a lower bound. ``auto_from``: the RAM available that
    ``host_budget="auto"`` made this budget of: the message names it, and more RAM as the fix (a larger host
    budget than the RAM holds would have the kernel kill the process), or ``None``, which checks the RAM itself."""
    kept = kept_bytes or {}
    need = {n: b + sum(kept.get(o, 0) for o in component_bytes if o != n) for n, b in component_bytes.items()}
    name = max(component_bytes, key=lambda n: component_bytes[n])
    smallest = max(need.values()) + overhead.nbytes
    if host_budget >= smallest:
        return
    given = f"host_budget {format_bytes(host_budget)}"
    if auto_from is not None:
        given = (
            f'host_budget="auto" (--host-budget auto) is {format_bytes(host_budget)}, what the process holds plus '
            f"{AUTO_HOST_SHARE:.0%} of the RAM available ({auto_from.describe()}), and"
        )
    message = (
        f"{given} cannot hold the largest component, {name} "
        f"({format_bytes(component_bytes[name])}{', compressed, at the very least' if compressed else ''}), "
        "which must be in RAM while it runs, next to the process's "
        f"own memory ({format_bytes(overhead.own_bytes)}: Python, torch, CUDA) and a reserve "
        f"({format_bytes(overhead.reserve_bytes)}) for what it allocates later: the smallest workable host "
        f"budget is {'at least ' if compressed else ''}{format_bytes(smallest)}"
    )
    if auto_from is not None:
        more = "raise that limit or free memory" if auto_from.limited else "free host memory"
        message += (
            f"; {more}, or pass host_budget=None (--host-budget none: every host copy in RAM, refused before packing "
            "where they do not fit)"
        )
    raise HostBudgetError(message, required_bytes=smallest)


#: The least share of its raw bytes a tensor's compressed copy can take: the codec codes exponents only, and keeps
#: sign and mantissa bits as they are (half of a bfloat16, 11/16 of a float16, 3/4 of a float32).
LEAST_COMPRESSED_SHARE = {torch.bfloat16: 8 / 16, torch.float16: 11 / 16, torch.float32: 24 / 32}


def least_compressed_bytes(layout: UnitLayout) -> int:
    """The least host RAM a component's copies can take with compression, from its architecture alone: its
    base raw, its units at `LEAST_COMPRESSED_SHARE` of their tensors' bytes (a unit never takes more than raw).
    What a host budget must hold at least; the real sizes are known once encoded."""
    least = layout.base.nbytes
    for unit in layout.units:
        least += sum(int(p.nbytes * LEAST_COMPRESSED_SHARE.get(p.dtype, 1.0)) for p in unit.tensors)
    return least


def available_ram() -> AvailableMemory:
    """The RAM this process may take now, and where that figure comes from: the least of the host's MemAvailable,
    its cgroups' room (a container's or job's memory limit) and its rlimits (`storage.machine_memory`). Measured
    once when offload is enabled; a module-level name, so that tests can set it."""
    return available_memory()


def new_host_bytes(component_bytes: dict[str, int], modules: Iterable[nn.Module]) -> int:
    """The new host memory packing takes: the packed bytes less the weights already in anonymous memory, which
    packing turns into host copies (weights mapped from files, as ``from_pretrained`` gives, are not, and are
    copied)."""
    return sum(component_bytes.values()) - anonymous_weight_bytes(modules)


@dataclass(frozen=True)
class HostRamDecision:
    """The RAM available when offload was enabled (``ram``, read once, `available_ram`) and what the host budget
    asked (``asked``: ``'auto'``, ``None`` or the size given, as typed) kept in RAM: every host copy
    (``tier_budget_bytes`` None) or, under a host tier, ``tier_weights_bytes`` of the ``packed_bytes``. What the
    offload report (and so a recipe's summary) says of the host's memory, and what ``"auto"`` logs."""

    ram: AvailableMemory
    asked: str
    packed_bytes: int
    tier_budget_bytes: int | None = None
    tier_weights_bytes: int | None = None

    def describe(self) -> str:
        """``the cgroup memory limit (...) is 48.00 GiB, 46.10 GiB of it free: the host copies take 57.50 GiB;
        host_budget='auto' keeps 36.90 GiB of them in RAM (a host budget of 38.40 GiB) and the rest on disk``."""
        keeps = f"host_budget={self.asked} keeps them all in RAM"
        if self.tier_budget_bytes is not None and self.tier_weights_bytes is not None:
            keeps = (
                f"host_budget={self.asked} keeps {format_bytes(min(self.tier_weights_bytes, self.packed_bytes))} "
                f"of them in RAM (a host budget of {format_bytes(self.tier_budget_bytes)}) and the rest on disk"
            )
        return f"{self.ram.describe()}: the host copies take {format_bytes(self.packed_bytes)}; {keeps}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "ram_available": self.ram.as_dict(),
            "host_budget": self.asked,
            "packed_bytes": self.packed_bytes,
            "tier_budget_bytes": self.tier_budget_bytes,
            "tier_weights_bytes": self.tier_weights_bytes,
            "described": self.describe(),
        }
