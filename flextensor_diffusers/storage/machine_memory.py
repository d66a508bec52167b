"""The RAM this process may still take: the least of the host's available memory, its cgroups' room and its rlimits.

``/proc/meminfo`` (and psutil, which reads it) tells the host's memory. A process in a container (Docker or
Kubernetes ``--memory``), a Slurm job (``--mem``) or a systemd unit (``MemoryMax``) runs under a cgroup memory limit
that the host's figures do not show: when its cgroup's usage reaches the limit the kernel reclaims the cgroup's page
cache, then kills a process of the cgroup, with no message, whatever the host has free. So the figure every decision
from RAM takes (`available_memory`) is the least room among:

* **the host**: MemAvailable (free pages and the page cache and slab the kernel can reclaim), MemTotal its limit;
* **every cgroup on the process's path**, from its own up to the root of the hierarchy as mounted here (a parent's
  limit bounds its children, whose usage it counts): the limit (cgroup v2: the lesser of ``memory.max`` and
  ``memory.high``, where above the kernel throttles the cgroup hard; v1: ``memory.limit_in_bytes``) less the usage
  (``memory.current``; ``memory.usage_in_bytes``), plus the page cache the kernel reclaims first when the cgroup
  is at its limit: its inactive file pages and (v2) its reclaimable slab (``memory.stat``). Active file pages
  (weights mapped from their files and read lately among them) are reclaimable too, but only after the inactive
  ones, and reading them again costs: they are not counted, so the figure errs low, never high;
* **the process's rlimits**, where set: ``RLIMIT_AS`` less its address space (VmSize), ``RLIMIT_DATA`` less its
  data (VmData). A CUDA process reserves a large address space, so an ``RLIMIT_AS`` leaves it little.

No well-kept Python library reads cgroup limits (psutil does not), so this module reads the files itself: plain
functions over a filesystem root, so that tests pass a fake tree, with rlimits read through an injectable function.
Both cgroup versions are read (a hybrid host mounts v1's memory controller and an empty v2 hierarchy); a hierarchy
that cannot be found or read gives no bound, so a reading never keeps anything from working.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..engine.config import format_bytes

try:
    import resource
except ImportError:  # not a Unix: no rlimits
    resource = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Kinds of bound, as `MemoryBound.kind` names them.
HOST, CGROUP, RLIMIT = "host", "cgroup", "rlimit"
#: cgroup v1 writes "no limit" as its largest page count in bytes (9223372036854771712 with 4 KiB pages); v2 "max".
UNLIMITED_FROM = 2**62
#: The reclaimable page cache a cgroup's ``memory.stat`` counts (v2, v1), in the order the kernel reclaims.
RECLAIMABLE_V2 = ("inactive_file", "slab_reclaimable")
RECLAIMABLE_V1 = ("total_inactive_file",)
#: What each bound is, as a message names it, with where it was read.
WHAT = {
    HOST: "the host's RAM ({source})",
    CGROUP: "the cgroup memory limit (a container's, Slurm job's or systemd unit's: {source})",
    RLIMIT: "the process's rlimit ({source})",
}

#: ``resource.getrlimit``'s shape: (soft, hard) of a resource.
RlimitReader = Callable[[int], tuple[int, int]]
#: Where `available_memory` reads by default: this machine's files and rlimits.
FILESYSTEM_ROOT = Path("/")
SYSTEM_GETRLIMIT: RlimitReader | None = getattr(resource, "getrlimit", None)


@dataclass(frozen=True)
class MemoryBound:
    """One bound on the RAM this process may still take, read now: ``free_bytes`` of ``limit_bytes`` (never more,
    never below 0). ``source`` says where it was read (a file and its key, or the rlimit and its shell name)."""

    kind: str  # HOST, CGROUP or RLIMIT
    source: str
    limit_bytes: int
    free_bytes: int

    def describe(self) -> str:
        """``the cgroup memory limit (...: /sys/fs/cgroup/memory.max) is 48.00 GiB, 46.10 GiB of it free``."""
        free = "available" if self.kind == HOST else "free"
        return (
            f"{WHAT[self.kind].format(source=self.source)} is {format_bytes(self.limit_bytes)}, "
            f"{format_bytes(self.free_bytes)} of it {free}"
        )


@dataclass(frozen=True)
class AvailableMemory:
    """The RAM this process may take now (``nbytes``): the least room among its ``bounds`` (the host's first, so
    that a limit is named only where it is tighter). The one figure every decision from RAM takes: the default
    host budget, the refusal before packing, a CPU device's room; its messages name where it came from."""

    bounds: tuple[MemoryBound, ...]

    def __post_init__(self) -> None:
        if not self.bounds:
            raise ValueError("AvailableMemory needs at least one bound")

    @property
    def tightest(self) -> MemoryBound:
        return min(self.bounds, key=lambda bound: bound.free_bytes)  # the first of equals: the host's

    @property
    def nbytes(self) -> int:
        return self.tightest.free_bytes

    @property
    def source(self) -> str:
        return self.tightest.source

    @property
    def limit_bytes(self) -> int:
        return self.tightest.limit_bytes

    @property
    def limited(self) -> bool:
        """Whether a limit (a cgroup's, an rlimit), not the host's RAM, gives the figure."""
        return self.tightest.kind != HOST

    def describe(self) -> str:
        return self.tightest.describe()

    def as_dict(self) -> dict[str, Any]:
        """For reports and JSON summaries: the figure, its source and every bound read."""
        return {
            "bytes": self.nbytes,
            "kind": self.tightest.kind,
            "source": self.source,
            "limit_bytes": self.limit_bytes,
            "described": self.describe(),
            "bounds": [asdict(bound) for bound in self.bounds],
        }


def available_memory(
    root: Path = FILESYSTEM_ROOT, getrlimit: RlimitReader | None = SYSTEM_GETRLIMIT
) -> AvailableMemory:
    """What `AvailableMemory` tells, read under ``root`` (a fake tree in tests: ``proc/``, ``sys/fs/cgroup/``...)
    with ``getrlimit`` (None: no rlimits). The host's figure comes from psutil where ``proc/meminfo`` is missing."""
    bounds = [host_bound(root), *cgroup_bounds(root), *rlimit_bounds(root, getrlimit)]
    return AvailableMemory(tuple(bounds))


def host_bound(root: Path) -> MemoryBound:
    """MemAvailable of MemTotal from ``root/proc/meminfo``; psutil's figures where it cannot be read (macOS)."""
    fields = _key_values(root / "proc" / "meminfo")
    if "MemAvailable" in fields and "MemTotal" in fields:
        total, free = fields["MemTotal"] * 1024, fields["MemAvailable"] * 1024  # in kB
        return MemoryBound(HOST, "/proc/meminfo MemAvailable", total, min(free, total))
    import psutil

    memory = psutil.virtual_memory()
    return MemoryBound(HOST, "psutil.virtual_memory", int(memory.total), int(memory.available))


# ---------------------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup hierarchy mounted here (a line of ``/proc/self/mountinfo``): the cgroup it shows (``cgroup_root``,
    as ``/proc/self/cgroup`` names cgroups) at ``mount_point``; v1 mounts name their controllers."""

    version: int
    cgroup_root: str
    mount_point: str
    controllers: frozenset[str]


def cgroup_bounds(root: Path) -> list[MemoryBound]:
    """A bound for every limited cgroup on the process's paths (v2, and v1's memory controller), leaf to root."""
    bounds = []
    for version, directories in _memory_cgroups(root):
        for directory in directories:
            bound = _v2_bound(root, directory) if version == 2 else _v1_bound(root, directory)
            if bound is not None:
                bounds.append(bound)
    return bounds


def read_mounts(root: Path) -> list[CgroupMount]:
    """The cgroup mounts of ``root/proc/self/mountinfo`` (fields: id, parent, dev, root, mount point, options,
    optional fields, ``-``, type, source, super options; spaces and such written as octal escapes)."""
    mounts = []
    for line in _lines(root / "proc" / "self" / "mountinfo"):
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        after = fields.index("-", 6) + 1
        kind = fields[after] if after < len(fields) else ""
        options = set(fields[after + 2].split(",")) if after + 2 < len(fields) else set()
        if kind in ("cgroup", "cgroup2"):
            version = 2 if kind == "cgroup2" else 1
            cgroup_root, point = _unescape(fields[3]), _unescape(fields[4])
            mounts.append(CgroupMount(version, cgroup_root, point, frozenset(options)))
    return mounts


def _memory_cgroups(root: Path) -> Iterator[tuple[int, list[Path]]]:
    """Per hierarchy with memory limits that the process is in: its version and the directories from the
    process's cgroup up to the mount point (``/proc/self/cgroup``: ``0::PATH`` for v2, ``ID:memory,...:PATH``)."""
    mounts = read_mounts(root)
    for line in _lines(root / "proc" / "self" / "cgroup"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            matching = [m for m in mounts if m.version == 2]
        elif "memory" in controllers.split(","):
            matching = [m for m in mounts if m.version == 1 and "memory" in m.controllers]
        else:
            continue
        directories = _path_to_mount(root, path, matching)
        if directories:
            yield (2 if hierarchy == "0" else 1), directories


def _path_to_mount(root: Path, path: str, mounts: list[CgroupMount]) -> list[Path]:
    """The directories of cgroup ``path`` and of its parents up to the first mount of ``mounts`` that shows it;
    empty where none does (a cgroup outside what is mounted here, or nothing mounted)."""
    cgroup = PurePosixPath(path.removesuffix(" (deleted)"))
    for mount in mounts:
        try:
            below = cgroup.relative_to(mount.cgroup_root)
        except ValueError:
            continue
        top = root / mount.mount_point.lstrip("/")
        leaf = top.joinpath(*below.parts)
        if not leaf.is_dir():
            continue
        return [leaf, *[p for p in leaf.parents if p == top or top in p.parents]]
    logger.debug("cgroup %s is not under any mount of its hierarchy here: no bound from it", path)
    return []


def _v2_bound(root: Path, directory: Path) -> MemoryBound | None:
    """A v2 cgroup's room: the lesser of memory.max and memory.high (where set) less memory.current, plus its
    reclaimable page cache; None where it has no limit (a root cgroup has no such files)."""
    limits = [(_limit(directory / name), name) for name in ("memory.max", "memory.high")]
    set_limits = [(nbytes, name) for nbytes, name in limits if nbytes is not None]
    if not set_limits:
        return None
    limit, name = min(set_limits)
    usage = _integer(directory / "memory.current")
    return _cgroup_bound(root, directory / name, limit, usage, _key_values(directory / "memory.stat"), RECLAIMABLE_V2)


def _v1_bound(root: Path, directory: Path) -> MemoryBound | None:
    """A v1 cgroup's room: memory.limit_in_bytes less memory.usage_in_bytes, plus its inactive page cache."""
    path = directory / "memory.limit_in_bytes"
    limit = _limit(path)
    if limit is None:
        return None
    usage = _integer(directory / "memory.usage_in_bytes")
    return _cgroup_bound(root, path, limit, usage, _key_values(directory / "memory.stat"), RECLAIMABLE_V1)


def _cgroup_bound(
    root: Path, path: Path, limit: int, usage: int | None, stat: dict[str, int], reclaimable: tuple[str, ...]
) -> MemoryBound:
    """``limit`` less ``usage`` plus the reclaimable pages (never more than the usage), within 0 and ``limit``.
    An unreadable usage counts as the whole limit used: the figure errs low."""
    used = limit if usage is None else usage
    cache = min(sum(stat.get(key, 0) for key in reclaimable), used)
    free = max(0, min(limit, limit - used + cache))
    return MemoryBound(CGROUP, "/" + str(path.relative_to(root)), limit, free)


# ---------------------------------------------------------------------------------------- rlimits

#: The rlimits that bound the memory a process takes: (``resource`` constant name, what counts against it in
#: /proc/self/status, its shell name).
RLIMITS = (("RLIMIT_AS", "VmSize", "ulimit -v"), ("RLIMIT_DATA", "VmData", "ulimit -d"))


def rlimit_bounds(root: Path, getrlimit: RlimitReader | None) -> list[MemoryBound]:
    """A bound per rlimit set (its soft limit) less what the process has of it now (``root/proc/self/status``,
    in kB; 0 where unreadable)."""
    if getrlimit is None or resource is None:
        return []
    status = _key_values(root / "proc" / "self" / "status")
    bounds = []
    for name, counted, shell in RLIMITS:
        soft, _ = getrlimit(getattr(resource, name))
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        free = max(0, soft - status.get(counted, 0) * 1024)
        bounds.append(MemoryBound(RLIMIT, f"{name}, {shell}", soft, free))
    return bounds


# ---------------------------------------------------------------------------------------- files


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []


def _integer(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _limit(path: Path) -> int | None:
    """A limit file's bytes; None for ``max``, v1's "no limit" and a file missing or unreadable."""
    value = _integer(path)
    return value if value is not None and 0 <= value < UNLIMITED_FROM else None


def _key_values(path: Path) -> dict[str, int]:
    """``key value`` or ``Key: value kB`` lines (memory.stat, /proc/meminfo, /proc/self/status) as integers."""
    values = {}
    for line in _lines(path):
        fields = line.replace(":", " ").split()
        if len(fields) >= 2 and fields[1].isdigit():
            values[fields[0]] = int(fields[1])
    return values


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as ``\\040``-style octal escapes."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
