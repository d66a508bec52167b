"""The RAM available to the process: the least of the host's, its cgroups' room and its rlimits, read from fake
trees (``proc/``, ``sys/fs/cgroup/`` under ``tmp_path``), and the default host budget deciding from it."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import format_bytes
from flextensor_diffusers.pipelines.offload import format_report
from flextensor_diffusers.storage import host_budget, machine_memory
from flextensor_diffusers.storage.machine_memory import CGROUP, HOST, RLIMIT, available_memory, read_mounts
from tests.models import set_host_overhead, set_ram_available, wan_latents
from tests.test_host_tier import load, save

GIB = 2**30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit" (its largest page count, 4 KiB pages)
BUDGET = 250_000  # GPU budget: the transformer blocks stream


class FakeMachine:
    """A filesystem root with a host's /proc/meminfo and the cgroup files a test writes."""

    def __init__(self, root: Path, host_total: int = 256 * GIB, host_available: int = 250 * GIB) -> None:
        self.root = root
        self.write("proc/meminfo", f"MemTotal: {host_total // 1024} kB\nMemAvailable: {host_available // 1024} kB\n")
        self.mounts: list[str] = []

    def write(self, relative: str, text: str) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def member_of(self, *lines: str) -> None:
        """The process's /proc/self/cgroup lines (``0::/path``, ``4:memory:/path``)."""
        self.write("proc/self/cgroup", "".join(line + "\n" for line in lines))

    def mount(self, point: str, kind: str, cgroup_root: str = "/", options: str = "rw") -> None:
        """A mountinfo line (mount id, parent, device, root, mount point, options, optional field, -, type...)."""
        n = len(self.mounts) + 30
        self.mounts.append(f"{n} 23 0:{n} {cgroup_root} {point} rw,relatime shared:{n} - {kind} {kind} {options}")
        self.write("proc/self/mountinfo", "".join(line + "\n" for line in self.mounts))
        (self.root / point.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def cgroup_v2(self, directory: str, limit: int | str, current: int, high: int | str = "max", **stat: int) -> None:
        for name, value in (("memory.max", limit), ("memory.high", high), ("memory.current", current)):
            self.write(f"{directory}/{name}", f"{value}\n")
        self.write(f"{directory}/memory.stat", "".join(f"{k} {v}\n" for k, v in {"anon": 1, **stat}.items()))

    def cgroup_v1(self, directory: str, limit: int, usage: int, **stat: int) -> None:
        self.write(f"{directory}/memory.limit_in_bytes", f"{limit}\n")
        self.write(f"{directory}/memory.usage_in_bytes", f"{usage}\n")
        self.write(f"{directory}/memory.stat", "".join(f"{k} {v}\n" for k, v in {"cache": 0, **stat}.items()))

    def available(self, getrlimit=None):
        return available_memory(self.root, getrlimit)


def container_v2(tmp_path: Path, limit: int | str, current: int, **kwargs) -> FakeMachine:
    """A container with its own cgroup namespace: the process sees its cgroup as ``/``, mounted at /sys/fs/cgroup."""
    machine = FakeMachine(tmp_path, **kwargs)
    machine.member_of("0::/")
    machine.mount("/sys/fs/cgroup", "cgroup2")
    machine.cgroup_v2("sys/fs/cgroup", limit, current)
    return machine


def test_a_v2_limit_below_the_host_free_ram_is_the_figure_and_names_its_file(tmp_path) -> None:
    """256 GB host, 48 GiB container: the figure is the container's room (its limit less its usage plus the page
    cache it can reclaim), and the message names the file it came from."""
    machine = container_v2(tmp_path, 48 * GIB, 3 * GIB)
    machine.cgroup_v2("sys/fs/cgroup", 48 * GIB, 3 * GIB, inactive_file=GIB, slab_reclaimable=GIB // 2)
    ram = machine.available()
    assert ram.nbytes == 48 * GIB - 3 * GIB + GIB + GIB // 2
    assert ram.limited and ram.tightest.kind == CGROUP and ram.limit_bytes == 48 * GIB
    assert ram.source == "/sys/fs/cgroup/memory.max"
    assert ram.describe() == (
        "the cgroup memory limit (a container's, Slurm job's or systemd unit's: /sys/fs/cgroup/memory.max) "
        "is 48.00 GiB, 46.50 GiB of it free"
    )
    assert [b.kind for b in ram.bounds] == [HOST, CGROUP]
    assert ram.as_dict()["bytes"] == ram.nbytes and ram.as_dict()["source"] == ram.source


def test_a_limit_above_the_host_free_ram_leaves_the_host_figure(tmp_path) -> None:
    """A 64 GiB limit on a host with 20 GiB available: the host's MemAvailable is the tighter, and named."""
    machine = container_v2(tmp_path, 64 * GIB, 2 * GIB, host_total=32 * GIB, host_available=20 * GIB)
    ram = machine.available()
    assert ram.nbytes == 20 * GIB and not ram.limited
    assert ram.describe() == "the host's RAM (/proc/meminfo MemAvailable) is 32.00 GiB, 20.00 GiB of it available"
    assert [b.kind for b in ram.bounds] == [HOST, CGROUP]  # the limit is read, and not the figure


def test_an_unlimited_cgroup_gives_no_bound(tmp_path) -> None:
    """``max`` in memory.max and memory.high (v2) and v1's largest page count mean no limit: the host's figure."""
    machine = container_v2(tmp_path, "max", 5 * GIB)
    assert [b.kind for b in machine.available().bounds] == [HOST]
    v1 = FakeMachine(tmp_path / "v1")
    v1.member_of("4:memory:/job", "0::/")
    v1.mount("/sys/fs/cgroup/memory", "cgroup", options="rw,memory")
    v1.cgroup_v1("sys/fs/cgroup/memory/job", V1_UNLIMITED, 5 * GIB)
    assert v1.available().nbytes == 250 * GIB and len(v1.available().bounds) == 1


def test_memory_high_below_memory_max_is_the_limit(tmp_path) -> None:
    """Above memory.high the kernel throttles the cgroup hard: where it is set below memory.max it is the limit."""
    machine = container_v2(tmp_path, 48 * GIB, 2 * GIB)
    machine.cgroup_v2("sys/fs/cgroup", 48 * GIB, 2 * GIB, high=16 * GIB)
    ram = machine.available()
    assert (ram.nbytes, ram.limit_bytes, ram.source) == (14 * GIB, 16 * GIB, "/sys/fs/cgroup/memory.high")


def test_nested_cgroups_give_the_least_room_along_the_path(tmp_path) -> None:
    """Without a cgroup namespace the process sees its full path: a parent (a Slurm job, say) with little room left
    bounds a child whose own limit is generous; the root cgroup has no limit files at all."""
    machine = FakeMachine(tmp_path)
    machine.member_of("0::/slurm/job_7/step_0")
    machine.mount("/sys/fs/cgroup", "cgroup2")
    machine.cgroup_v2("sys/fs/cgroup/slurm", "max", 40 * GIB)
    machine.cgroup_v2("sys/fs/cgroup/slurm/job_7", 10 * GIB, 9 * GIB, inactive_file=GIB // 4)
    machine.cgroup_v2("sys/fs/cgroup/slurm/job_7/step_0", 20 * GIB, 2 * GIB)
    ram = machine.available()
    assert ram.nbytes == GIB + GIB // 4 and ram.source == "/sys/fs/cgroup/slurm/job_7/memory.max"
    assert sorted(b.free_bytes for b in ram.bounds if b.kind == CGROUP) == [GIB + GIB // 4, 18 * GIB]


def test_cgroup_v1_limits_are_read_with_their_inactive_page_cache(tmp_path) -> None:
    """v1 (a hybrid host: v1's memory controller beside an empty v2 hierarchy): memory.limit_in_bytes less
    memory.usage_in_bytes plus total_inactive_file, up to the hierarchy's root; v2 gives nothing there."""
    machine = FakeMachine(tmp_path)
    machine.member_of("9:name=systemd:/", "4:memory,hugetlb:/process_api/abc", "0::/")
    machine.mount("/sys/fs/cgroup/memory", "cgroup", options="rw,memory,hugetlb")
    machine.mount("/sys/fs/cgroup/unified", "cgroup2")
    machine.write("sys/fs/cgroup/unified/cgroup.procs", "1\n")  # no memory controller: no memory.* files
    machine.cgroup_v1("sys/fs/cgroup/memory", V1_UNLIMITED, 9 * GIB)
    machine.cgroup_v1("sys/fs/cgroup/memory/process_api", 6 * GIB, 5 * GIB, total_inactive_file=GIB)
    machine.cgroup_v1("sys/fs/cgroup/memory/process_api/abc", 8 * GIB, 3 * GIB, total_inactive_file=GIB // 2)
    ram = machine.available()
    assert ram.nbytes == 2 * GIB and ram.source == "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes"
    assert "is 6.00 GiB, 2.00 GiB of it free" in ram.describe()


def test_a_mount_of_the_container_own_cgroup_is_found_from_its_root_field(tmp_path) -> None:
    """Docker without a cgroup namespace mounts the container's cgroup (``/docker/abc``) at /sys/fs/cgroup/memory;
    /proc/self/cgroup names the full path. A mount point with a space is written ``\\040`` in mountinfo."""
    machine = FakeMachine(tmp_path)
    machine.member_of("4:memory:/docker/abc")
    machine.mount("/sys/fs/cgroup/memory", "cgroup", cgroup_root="/docker/abc", options="rw,memory")
    machine.cgroup_v1("sys/fs/cgroup/memory", 4 * GIB, GIB)
    assert machine.available().nbytes == 3 * GIB
    spaced = FakeMachine(tmp_path / "spaced")
    spaced.member_of("0::/")
    spaced.mount("/mnt/my\\040cgroups", "cgroup2")
    spaced.cgroup_v2("mnt/my cgroups", 2 * GIB, GIB)
    assert read_mounts(spaced.root)[0].mount_point == "/mnt/my cgroups"
    assert spaced.available().source == "/mnt/my cgroups/memory.max"


def test_a_cgroup_outside_what_is_mounted_or_unreadable_gives_no_bound(tmp_path) -> None:
    """A path no mount shows, or no /proc/self/cgroup at all (macOS): the host's figure, never an error."""
    machine = FakeMachine(tmp_path)
    machine.member_of("0::/elsewhere")
    machine.mount("/sys/fs/cgroup", "cgroup2", cgroup_root="/mine")
    machine.cgroup_v2("sys/fs/cgroup", GIB, 0)
    assert [b.kind for b in machine.available().bounds] == [HOST]
    (tmp_path / "proc/self/cgroup").unlink()
    assert machine.available().nbytes == 250 * GIB


def test_a_usage_that_cannot_be_read_counts_as_the_whole_limit_used(tmp_path) -> None:
    """The figure errs low, never high: no memory.current, no room; usage past memory.high, no room either."""
    machine = container_v2(tmp_path, 4 * GIB, GIB)
    (tmp_path / "sys/fs/cgroup/memory.current").unlink()
    assert machine.available().nbytes == 0
    machine.cgroup_v2("sys/fs/cgroup", 8 * GIB, 5 * GIB, high=4 * GIB)
    assert machine.available().nbytes == 0


def test_rlimits_where_set_bound_the_room_by_what_the_process_has_of_them(tmp_path) -> None:
    """RLIMIT_AS less VmSize and RLIMIT_DATA less VmData; unlimited (RLIM_INFINITY) gives no bound."""
    machine = FakeMachine(tmp_path)
    machine.write("proc/self/status", "Name: python\nVmSize: 5242880 kB\nVmData: 1048576 kB\n")
    limits = {resource.RLIMIT_AS: 8 * GIB, resource.RLIMIT_DATA: resource.RLIM_INFINITY}

    def getrlimit(which: int) -> tuple[int, int]:
        return limits.get(which, resource.RLIM_INFINITY), resource.RLIM_INFINITY

    ram = machine.available(getrlimit)
    assert ram.nbytes == 3 * GIB and ram.tightest.kind == RLIMIT
    assert ram.describe() == "the process's rlimit (RLIMIT_AS, ulimit -v) is 8.00 GiB, 3.00 GiB of it free"
    limits[resource.RLIMIT_AS] = resource.RLIM_INFINITY
    assert machine.available(getrlimit).nbytes == 250 * GIB


def test_without_meminfo_the_host_figure_is_psutil(tmp_path, monkeypatch) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"total": 8 * GIB, "available": 6 * GIB}))
    ram = available_memory(tmp_path / "nothing", None)
    assert (ram.nbytes, ram.source, ram.limit_bytes) == (6 * GIB, "psutil.virtual_memory", 8 * GIB)


def test_this_machine_reads_without_error() -> None:
    """The real files: at least the host's bound, and a figure no larger than the host's RAM available."""
    ram = machine_memory.available_memory()
    assert ram.bounds[0].kind == HOST and 0 <= ram.nbytes <= ram.bounds[0].free_bytes


# ---------------------------------------------------------------------------------------- the default host budget


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The tiny pipeline's folder (loaded from it, its weights are file pages: every host copy is new memory)."""
    folder = save(tmp_path_factory.mktemp("tiny") / "wan22", "200KB")
    return folder, wan_latents(load(folder))


def test_auto_under_a_1_gib_cgroup_limit_takes_the_host_budget_path_and_stays_bitwise(
    saved, tmp_path, monkeypatch
) -> None:
    """The host has 250 GiB available, the process's cgroup 1 GiB of limit with room for one expert's host copies
    only: ``host_budget="auto"`` keeps the experts under a host budget of what the process holds plus 80 % of the
    cgroup's room (the host's figure would have kept everything in RAM), the report names the limit's file, and
    the latents are bitwise those of native execution."""
    folder, reference = saved
    set_host_overhead(monkeypatch, own=0, reserve=0)  # a tiny model's budget in its host copies' bytes
    pipe = load(folder)
    set_ram_available(monkeypatch, 2**40)
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", cache_dir=tmp_path)
    sizes = {name: h.host.packed_bytes for name, h in ft.pipeline_offload(pipe).handles.items()}
    pipe.disable_flextensor_offload()

    room = int((max(sizes.values()) + 1) / host_budget.AUTO_HOST_SHARE) + 1  # one expert at a time
    assert room * host_budget.AUTO_HOST_SHARE < sum(sizes.values())
    machine = container_v2(tmp_path / "machine", GIB, GIB - room)
    monkeypatch.setattr(host_budget, "available_ram", lambda: machine.available())
    held = 12345
    monkeypatch.setattr(host_budget, "anonymous_bytes", lambda: held)
    pipe = load(folder)
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", cache_dir=tmp_path)
    state = ft.pipeline_offload(pipe)
    assert state.host_tier is not None and state.host_tier.budget == held + int(room * host_budget.AUTO_HOST_SHARE)
    said = state.host_ram.describe()
    assert said.startswith(
        "the cgroup memory limit (a container's, Slurm job's or systemd unit's: /sys/fs/cgroup/memory.max) is "
        f"1.00 GiB, {format_bytes(room)} of it free: the host copies take {format_bytes(sum(sizes.values()))}; "
        "host_budget='auto' keeps "
    ), said
    assert said.endswith("and the rest on disk")
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(2))
    report = state.report()
    assert report["host_tier"]["on_disk"] and report["host_ram"]["ram_available"]["bytes"] == room
    assert f"RAM available at enable {format_bytes(room)}: {said}" in format_report(report)
    pipe.disable_flextensor_offload()


def test_the_refusals_name_the_limit_they_come_from(saved, tmp_path, monkeypatch) -> None:
    """With ``host_budget=None`` more new memory than the cgroup's room is refused before packing, naming the
    limit and raising it as a fix; with ``"auto"`` and room under the largest component, the smallest workable
    host budget is named with the limit, and more RAM as the fix."""
    folder, _ = saved
    set_host_overhead(monkeypatch, own=0, reserve=0)
    machine = container_v2(tmp_path / "machine", GIB, GIB - 2**16)
    monkeypatch.setattr(host_budget, "available_ram", lambda: machine.available())
    monkeypatch.setattr(host_budget, "anonymous_bytes", lambda: 0)  # auto's budget: 80 % of the room alone
    pipe = load(folder)
    limit = r"the cgroup memory limit \(a container's, Slurm job's or systemd unit's: /sys/fs/cgroup/memory.max\)"
    none = rf"is available \({limit} is 1.00 GiB, 64.00 KiB of it free\): leave .* or free host memory or raise that"
    with pytest.raises(ft.HostBudgetError, match=none):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget=None)
    auto = rf'host_budget="auto" \(--host-budget auto\) is .* of the RAM available \({limit} is 1.00 GiB, 64.00 KiB'
    auto += r".* the smallest workable host budget is .*; raise that limit or free memory, or pass host_budget=None"
    with pytest.raises(ft.HostBudgetError, match=auto):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", cache_dir=tmp_path)
    assert ft.pipeline_offload(pipe) is None
