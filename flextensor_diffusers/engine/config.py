"""`OffloadConfig`: what the user asks for, validated before anything is touched."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..storage.private_files import CACHE_FOLDER, default_cache_folder, private_folder
from .errors import BudgetError, FlexTensorError, NoCudaDeviceError

if TYPE_CHECKING:
    from ..storage.plan import StoragePlan
    from ..storage.shared_host import SharedHostMemory

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

#: What "auto" leaves free on the device for other processes, the CUDA context and fragmentation.
AUTO_BUDGET_MARGIN_BYTES = 2 * 2**30
#: What ``compression`` accepts (`OffloadConfig`, `enable_flextensor_offload`, the recipes' ``--compression``); the
#: first is every one's default, stated here once.
COMPRESSION_MODES = ("none", "lossless")
NO_COMPRESSION = COMPRESSION_MODES[0]


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte count: an int, or a string such as ``"24GiB"``, ``"500MB"``, ``"1.5 GB"``.

    Decimal suffixes (KB, MB, GB) are powers of ten and binary ones (KiB, MiB, GiB) powers of two,
    as on a GPU's spec sheet versus in ``nvidia-smi``.
    """
    if isinstance(value, bool):
        raise BudgetError(f"budget must be a byte count or a string like '24GiB', not {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise BudgetError(f"budget must be positive, got {value!r}")
        return int(value)
    match = _BUDGET_RE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise BudgetError(
            f"cannot parse budget {value!r}: use bytes (an int) or a number with a unit such as "
            "'24GiB', '500MB', or 'auto'"
        )
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number <= 0:
        raise BudgetError(f"budget must be positive, got {value!r}")
    return int(number)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``'23.50 GiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The compute device: CUDA when present (or asked for), else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NoCudaDeviceError(
                "OffloadConfig(device='cuda') but no CUDA device is visible: install a CUDA build of "
                "torch and check CUDA_VISIBLE_DEVICES, or pass device='cpu' to run the same plan on the CPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise FlexTensorError(f"unsupported device {device}: use 'cuda', 'cuda:N' or 'cpu'")
    return device


def is_auto(budget: int | str) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def room_on_device(device: torch.device) -> int:
    """Bytes this process could still allocate on ``device``: what is free on it, and no more than its
    own cap (``torch.cuda.set_per_process_memory_fraction``, which ``mem_get_info`` does not see)
    leaves above what it has reserved. On the CPU: the RAM available (`machine_memory.available_memory`: the least
    of the host's, its cgroups' room and its rlimits)."""
    if device.type != "cuda":
        from ..storage.machine_memory import available_memory  # it imports this module

        return available_memory().nbytes
    free, total = torch.cuda.mem_get_info(device)
    cap = int(total * torch.cuda.get_per_process_memory_fraction(device))
    return min(free, cap - torch.cuda.memory_reserved(device))


def resolve_budget(budget: int | str, device: torch.device) -> int:
    """The budget in bytes: parsed, or for ``"auto"`` what the process may hold on the device at its peak —
    what it has allocated there now (the model's own tensors included, which offloading gives back) plus the
    room left — less `AUTO_BUDGET_MARGIN_BYTES`. A budget bounds the process's whole peak of allocated device
    memory, inputs and other models included.

    The one place a budget is resolved; a pipeline resolves it once and hands every component the bytes.
    """
    if not is_auto(budget):
        return parse_bytes(budget)
    room = room_on_device(device)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    resolved = room + held - AUTO_BUDGET_MARGIN_BYTES
    if resolved <= 0:
        raise BudgetError(
            f"budget='auto' found only {format_bytes(max(room, 0))} free for this process on {device}: "
            "free memory on the device or pass an explicit budget",
            required_bytes=None,
        )
    return resolved


@dataclass
class OffloadConfig:
    """What to stream and under which budget.

    Attributes:
        include_patterns: fnmatch patterns over ``named_modules()`` names; the outermost module
            that matches a pattern becomes one streamed *unit* (e.g. ``["blocks.*"]``). Empty: no
            streaming, the whole model is resident while active (small components, e.g. a VAE).
        gpu_budget: bytes, a string like ``"24GiB"``, or ``"auto"``. It bounds the peak of
            *allocated* device memory: resident weights + slots + the measured activation peak.
        device: compute device; ``None`` picks CUDA when available, else the CPU (for tests).
        profile: path of a saved profile; when it matches model, device and workload, discovery
            and profiling are skipped. It is written once profiling has finished.
        profile_dir: a folder of profiles, one file per model, device and workload (the file name
            says which); a later run with the same inputs reuses its file. Exclusive with ``profile``.
        reprofile_on_mismatch: when ``profile`` does not match, profile again instead of raising.
        profiling_runs: forwards measured after discovery before a plan is made.
        pin_memory: keep host buffers page-locked (required for asynchronous copies on CUDA).
        max_slots: upper bound on streaming slots, i.e. on prefetch depth + 1.
        measure_stalls: record events around waits and copies in steady state, for ``stats()``.
        activation_margin: fraction added to the measured activation peak when planning, for
            allocator rounding and fragmentation.
        exclude_patterns: modules never made units, even when an include pattern matches.
        shared_host: a `SharedHostMemory`: unit buffers live in files shared by every process of
            the host (one creates, the others attach), instead of private host memory.
        entry_methods: methods besides ``forward`` through which the model is used, each a workload
            of its own that is profiled and planned (a VAE's ``["encode", "decode"]``).
        edit_methods: methods that change weights in place; each call runs inside
            ``handle.editing()`` so the change reaches the host copies (diffusers' ``fuse_lora``...).
        compression, raw_copies, compression_cache, progressive_packing, background_encoding, verify_loads: how the
            host copies are kept, as asked; ``None`` leaves an option to the storage plan. Which combine, their
            defaults and what set-up then does are decided once, by `storage.plan.resolve_storage`, into ``storage``
            (a `StoragePlan`): see `enable_flextensor_offload` for each option.
        cache_dir: the folder for cache files (default: this user's cache folder,
            ``~/.cache/flextensor-diffusers`` or under ``$XDG_CACHE_HOME``, made 0700). Refused before
            anything is packed when it is a symbolic link, belongs to another user or can be written by
            other users; every file in it is made 0600 (`private_files`).
        active_after_setup: take device memory at the end of set-up. A pipeline passes False: its
            components take device memory one at a time, when each first runs.
        storage: the storage plan these options resolve to (not an argument).
    """

    include_patterns: list[str]
    gpu_budget: int | str = "auto"
    device: str | torch.device | None = None
    profile: str | Path | None = None
    profile_dir: str | Path | None = None
    reprofile_on_mismatch: bool = False
    profiling_runs: int = 1
    pin_memory: bool = True
    max_slots: int = 6
    measure_stalls: bool = True
    activation_margin: float = 0.05
    exclude_patterns: list[str] = field(default_factory=list)
    shared_host: SharedHostMemory | None = None
    entry_methods: list[str] = field(default_factory=list)
    edit_methods: list[str] = field(default_factory=lambda: ["load_state_dict"])
    compression: str = NO_COMPRESSION
    raw_copies: str | None = None
    compression_cache: bool | None = None
    cache_dir: str | Path | None = None
    active_after_setup: bool = True
    progressive_packing: bool | None = None
    background_encoding: bool | None = None
    verify_loads: bool | None = None
    storage: StoragePlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.include_patterns, str):
            self.include_patterns = [self.include_patterns]
        if self.profile is not None and self.profile_dir is not None:
            raise FlexTensorError("pass OffloadConfig.profile or profile_dir, not both")
        if self.profiling_runs < 1:
            raise FlexTensorError("OffloadConfig.profiling_runs must be at least 1")
        if self.max_slots < 2:
            raise FlexTensorError("OffloadConfig.max_slots must be at least 2 (one computing, one loading)")
        if not 0 <= self.activation_margin < 1:
            raise FlexTensorError("OffloadConfig.activation_margin must be in [0, 1)")
        if not is_auto(self.gpu_budget):
            parse_bytes(self.gpu_budget)  # fail now, not at set-up
        self.entry_methods = list(self.entry_methods)
        self.storage = self._storage_plan()
        if "forward" in self.entry_methods:
            raise FlexTensorError("entry_methods lists methods besides forward (e.g. ['encode', 'decode'])")

    def _storage_plan(self) -> StoragePlan:
        """The options resolved (`storage.plan.resolve_storage`): refused here, before anything is touched, when
        they cannot be combined. A single model has no host budget; the device's kind decides the defaults."""
        from ..storage.plan import MachineFacts, StorageRequest, resolve_storage  # it imports this module

        request = StorageRequest(
            compression=self.compression,
            raw_copies=self.raw_copies,
            compression_cache=self.compression_cache,
            progressive_packing=self.progressive_packing,
            background_encoding=self.background_encoding,
            verify_loads=self.verify_loads,
            shared_host=self.shared_host is not None,
        )
        return resolve_storage(request, MachineFacts(device_kind=device_kind(self.device)))

    @property
    def compressed_only(self) -> bool:
        """Host RAM keeps compressed copies only (`StoragePlan.compressed_only`)."""
        return self.storage.compressed_only


def device_kind(device: str | torch.device | None) -> str:
    """The kind of device `resolve_device` will give (``"cuda"``, ``"cpu"``), without its checks."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):  # refused by `resolve_device`, naming the fix, when the handle is made
        return str(device)


def cache_folder(cache_dir: str | Path | None) -> Path:
    """The folder for cache files: ``cache_dir``, else this user's cache folder (`private_files.default_cache_folder`),
    made 0700 when missing; refused at once, naming ``cache_dir``, when it is a symbolic link, belongs to another
    user, can be written by other users, or cannot be written (`private_files.private_folder`)."""
    return private_folder(cache_dir if cache_dir is not None else default_cache_folder(), CACHE_FOLDER)
