"""Engine options that change behaviour: each test fails if its option were ignored."""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.engine.planner import Call, WorkloadProfile, memory_needed, plan_residency
from tests.clocks import ManualClock, drive_handles_by
from tests.models import Stack, assert_same, device_headroom, snapshot

BASE = 14_848  # fp32 Stack(dim=32): tied embedding + pos buffer, outside units
UNIT = 35_328  # one Block(32) in its flat buffer, fp32, on the CPU (64-byte grid with room for any class)
CUDA_UNIT = 37_376  # the same on CUDA (512-byte grid, weights moved there at class 0)


def unit_bytes(device: str) -> int:
    return UNIT if device == "cpu" else CUDA_UNIT


BLOCKS = ["blocks.*"]


headroom = device_headroom


def make(depth: int = 4) -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(dim=32, depth=depth), torch.randint(0, 50, (2, 16))


def native(model: Stack, x: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    model.to(device)
    with torch.no_grad():
        out = model(x.to(device)).cpu()
    model.to("cpu")
    return out


def run(model: Stack, x: torch.Tensor, n: int, device: str = "cpu") -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(x.to(device)).cpu() for _ in range(n)]


def all_equal(outs: list[torch.Tensor], ref: torch.Tensor) -> bool:
    return all(torch.equal(o, ref) for o in outs)


# ------------------------------------------------------------------------------------ exclude_patterns


def test_excluded_block_and_its_children_stay_in_the_base() -> None:
    """An excluded block (and its submodules) is no unit, its bytes join the resident base, numerics are native."""
    model, x = make()
    ref = native(model, x)
    before = snapshot(model)
    exclude = ["blocks.1", "blocks.1.*"]
    handle = ft.offload(model, include_patterns=BLOCKS, exclude_patterns=exclude, gpu_budget=10**9, device="cpu")
    assert [u.name for u in handle.units] == ["blocks.0", "blocks.2", "blocks.3"]
    assert handle.resident_weight_bytes == BASE + UNIT
    assert all_equal(run(model, x, 4), ref)
    assert handle.phase is Phase.STEADY
    handle.remove()
    assert_same(before, model)


def test_excluding_a_block_by_its_name_keeps_it_whole() -> None:
    """exclude_patterns=["blocks.1"] keeps block 1 whole and resident, as an excluded block."""
    model, _ = make()
    handle = ft.offload(model, include_patterns=BLOCKS, exclude_patterns=["blocks.1"], gpu_budget=10**9, device="cpu")
    try:
        assert not any(u.name.startswith("blocks.1") for u in handle.units)
        assert handle.resident_weight_bytes == BASE + UNIT
    finally:
        handle.remove()


def test_exclude_that_leaves_nothing_to_stream_is_a_pattern_error() -> None:
    """Excluding every include match is refused with a PatternError, and the model is untouched."""
    model, _ = make()
    before = snapshot(model)
    with pytest.raises(ft.PatternError, match="only excluded"):
        ft.offload(model, include_patterns=BLOCKS, exclude_patterns=["blocks.*"], gpu_budget=10**9, device="cpu")
    assert_same(before, model)


# ------------------------------------------------------------------------------------ max_slots


def bursty_profile() -> WorkloadProfile:
    """Uneven units and compute, for which a third slot (deeper prefetch) is the fastest plan."""
    sizes = [150, 200, 200, 200, 100, 200, 150, 150]
    compute = [3, 1, 3, 0.1, 0.1, 3, 0.1, 3]
    return WorkloadProfile(
        unit_names=[f"u{i}" for i in range(len(sizes))],
        unit_bytes=sizes,
        calls=[Call(unit=i, compute_ms=c) for i, c in enumerate(compute)],
        tail_ms=0.0,
        bandwidth_bytes_per_ms=100.0,
        activation_peak_bytes=0,
        resident_bytes=0,
    )


def test_planner_keeps_slots_under_max_slots() -> None:
    """Where three slots are fastest, max_slots=2 caps the plan at two."""
    profile = bursty_profile()
    assert plan_residency(profile, 742, max_slots=6, margin=0.0).num_slots == 3
    capped = plan_residency(profile, 742, max_slots=2, margin=0.0)
    assert capped.num_slots == 2 and capped.memory_bytes <= 742


def test_handle_plans_at_most_max_slots() -> None:
    """A budget room for six slots, max_slots=2: the handle's plan has at most two, numerics native."""
    model, x = make(depth=6)
    ref = native(model, x)
    budget = BASE + 6 * UNIT - 1  # not everything resident; six slots would fit
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget=budget, max_slots=2, device="cpu")
    assert all_equal(run(model, x, 4), ref)
    assert handle.phase is Phase.STEADY and 0 < handle.plan.num_slots <= 2
    handle.remove()


def test_max_slots_one_is_refused() -> None:
    """One slot cannot load and compute at once: max_slots=1 is a FlexTensorError naming the option."""
    with pytest.raises(ft.FlexTensorError, match="max_slots must be at least 2"):
        ft.OffloadConfig(include_patterns=BLOCKS, max_slots=1)


# ------------------------------------------------------------------------------------ activation_margin


def activations_profile() -> WorkloadProfile:
    return WorkloadProfile(
        unit_names=["a", "b", "c", "d"],
        unit_bytes=[1000] * 4,
        calls=[Call(unit=i, compute_ms=1.0) for i in range(4)],
        tail_ms=0.0,
        bandwidth_bytes_per_ms=1000.0,
        activation_peak_bytes=2000,
        resident_bytes=500,
    )


def test_activation_margin_enters_the_memory_the_plan_needs() -> None:
    """Margin 0.5 adds half the activation peak to a plan's memory, and a budget exact at 0 no longer fits."""
    profile = activations_profile()
    none = frozenset()
    assert memory_needed(profile, none, 2, 0.5) - memory_needed(profile, none, 2, 0.0) == 1000
    tight = memory_needed(profile, none, 2, 0.0)  # the smallest workable budget without margin
    plan = plan_residency(profile, tight, margin=0.0)
    assert plan.num_slots == 2 and plan.memory_bytes == tight
    with pytest.raises(ft.BudgetError, match=str(memory_needed(profile, none, 2, 0.5))):
        plan_residency(profile, tight, margin=0.5)
    roomy = memory_needed(profile, frozenset({0}), 2, 0.0)  # one resident unit without margin
    assert len(plan_residency(profile, roomy, margin=0.0).resident) == 1
    assert len(plan_residency(profile, roomy, margin=0.5).resident) == 0


@pytest.mark.parametrize("margin", [1.5, 1.0, -0.1])
def test_activation_margin_out_of_range_is_refused(margin: float) -> None:
    """A margin outside [0, 1) is refused when the config is made."""
    with pytest.raises(ft.FlexTensorError, match="activation_margin"):
        ft.OffloadConfig(include_patterns=BLOCKS, activation_margin=margin)


# ------------------------------------------------------------------------------------ measure_stalls


def test_measure_stalls_off_keeps_numerics_and_records_no_stall(device: str) -> None:
    """measure_stalls=False: native outputs; on CUDA no stall or copy time is recorded."""
    model, x = make(depth=6)
    ref = native(model, x, device)
    budget = BASE + 3 * unit_bytes(device) + headroom(device, model, x)  # streams most blocks
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget=budget, measure_stalls=False, device=device)
    assert all_equal(run(model, x, 5, device), ref)
    assert handle.phase is Phase.STEADY and handle.plan.num_slots >= 2
    stats = handle.stats()
    assert stats.bytes_streamed > 0
    assert stats.between_units_ms == 0
    if device == "cuda":
        assert stats.stall_ms == 0 and stats.copy_ms == 0
        assert all(u.stall_ms == 0 for u in stats.units)
    handle.remove()


class PausingStack(Stack):
    """A `Stack` whose forward pauses ``pause_s`` on the host before each block but the first, by the test's clock
    (`ManualClock`): time between unit calls that no load explains, as a host thread holding the calling thread back
    would make. Each block's own compute takes ``compute_s`` by the same clock, and the host ``outside_s`` before
    and after the blocks."""

    def __init__(self, clock: ManualClock, pause_s: float, dim: int = 32, depth: int = 4) -> None:
        super().__init__(dim=dim, depth=depth)
        self.clock, self.pause_s = clock, pause_s
        for block in self.blocks:  # inside the unit's call
            block.norm.register_forward_pre_hook(lambda *_: clock.advance(COMPUTE_S))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.clock.advance(OUTSIDE_S)
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for i, block in enumerate(self.blocks):
            if i:
                self.clock.advance(self.pause_s)
            x = block(x)
        for _ in range(self.repeat):
            x = self.blocks[1](x)
        self.clock.advance(OUTSIDE_S)
        return self.head(x)


COMPUTE_S = 0.002  # a block's compute, by the test's clock
OUTSIDE_S = 0.5  # before the first block and after the last: no unit's neighbour


def between_units_ms(device: str, pause_s: float, monkeypatch) -> tuple[float, int]:
    """Six forwards of a streamed 4-block `PausingStack`, the handle driven by the test's clock: the time between
    unit calls and the steady forwards."""
    clock = ManualClock()
    drive_handles_by(monkeypatch, clock)
    torch.manual_seed(0)
    model, x = PausingStack(clock, pause_s), torch.randint(0, 50, (2, 16))
    budget = BASE + 3 * unit_bytes(device) + headroom(device, model, x)
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget=budget, device=device)
    run(model, x, 6, device)
    stats = handle.stats()
    handle.remove()
    return stats.between_units_ms, stats.measured_forwards


def test_time_between_unit_calls_shows_a_host_that_falls_behind(device: str, monkeypatch) -> None:
    """``between_units_ms`` counts the steady forwards' time from one unit's compute to the next one's, which no
    stall counts: three 50 ms host pauses a forward show in full, and nothing else does (neither the blocks' own
    compute nor the time before the first block and after the last); without them it is none."""
    paused, forwards = between_units_ms(device, 0.05, monkeypatch)
    assert forwards >= 3
    assert paused == pytest.approx(forwards * 3 * 50)
    unpaused, _ = between_units_ms(device, 0.0, monkeypatch)
    assert unpaused == 0.0


# ------------------------------------------------------------------------------------ set_budget


def test_set_budget_replans_in_steady_state_and_keeps_numerics() -> None:
    """Lower budget: fewer resident units; higher: all resident; too low: BudgetError, previous plan kept."""
    model, x = make(depth=6)
    ref = native(model, x)
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget="10MiB", device="cpu")
    assert all_equal(run(model, x, 3), ref)
    assert handle.phase is Phase.STEADY and len(handle.plan.resident) == 6

    middle = BASE + 4 * UNIT
    plan = handle.set_budget(middle)
    assert plan is handle.plan and handle.budget_bytes == middle
    assert len(plan.resident) < 6 and plan.num_slots >= 2 and plan.memory_bytes <= middle
    assert all_equal(run(model, x, 3), ref)

    smallest = BASE + 2 * UNIT
    plan = handle.set_budget(smallest)
    assert len(plan.resident) == 0 and plan.num_slots == 2 and plan.memory_bytes <= smallest
    assert all_equal(run(model, x, 3), ref)

    plan = handle.set_budget("10MiB")
    assert handle.budget_bytes == 10 * 2**20
    assert len(plan.resident) == 6 and plan.num_slots == 0
    assert all_equal(run(model, x, 3), ref)

    with pytest.raises(ft.BudgetError, match=f"gpu_budget >= {smallest}"):
        handle.set_budget(smallest - 1)
    assert handle.plan is plan and handle.budget_bytes == 10 * 2**20
    assert all_equal(run(model, x, 2), ref)
    assert handle.phase is Phase.STEADY
    handle.remove()


# ------------------------------------------------------------------------------------ bandwidth fallback


def test_bandwidth_is_measured_when_profiling_loaded_nothing() -> None:
    """A single unit stays in the profiling slot, so no load is timed: bandwidth is measured directly."""
    model, x = make()
    ref = native(model, x)
    handle = ft.offload(model, include_patterns=["blocks.0"], gpu_budget=BASE + 3 * UNIT + 2**20, device="cpu")
    assert len(handle.units) == 1
    assert all_equal(run(model, x, 3), ref)
    assert handle.phase is Phase.STEADY and handle.plan is not None
    assert handle.profile.bandwidth_bytes_per_ms > 0
    handle.remove()


# ------------------------------------------------------------------------------------ profiling_runs


def test_profiling_runs_two_measures_two_forwards_before_the_plan() -> None:
    """profiling_runs=2: discovery, two profiling forwards, then steady."""
    model, x = make()
    ref = native(model, x)
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget=BASE + 3 * UNIT, profiling_runs=2, device="cpu")
    outs = run(model, x, 2)
    assert handle.phase is Phase.PROFILING and handle.plan is None
    outs += run(model, x, 2)
    assert handle.phase is Phase.STEADY
    assert handle.counters["discovery"] == 1 and handle.counters["profiling"] == 2
    assert handle.counters["steady"] == 1 and handle.counters["plans"] == 1
    assert all_equal(outs, ref)
    handle.remove()


def test_profiling_runs_zero_is_refused() -> None:
    """At least one profiling forward is needed to plan."""
    with pytest.raises(ft.FlexTensorError, match="profiling_runs"):
        ft.OffloadConfig(include_patterns=BLOCKS, profiling_runs=0)


# ------------------------------------------------------------------------------------ pin_memory


def test_pin_memory_off_works_and_pins_nothing(device: str) -> None:
    """pin_memory=False: native outputs, exact restore, and no time spent page-locking."""
    model, x = make()
    ref = native(model, x, device)
    before = snapshot(model)
    budget = BASE + 2 * unit_bytes(device) + headroom(device, model, x)
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget=budget, pin_memory=False, device=device)
    handle.wait_until_packed()  # set-up returns while units are packed
    assert not any(u.pinned_in_place or u.host.is_pinned() for u in handle.host.positions)  # base too
    assert all_equal(run(model, x, 4, device), ref)
    assert handle.phase is Phase.STEADY
    handle.remove()
    assert_same(before, model)


# ------------------------------------------------------------------------------------ budget forms


def test_budget_as_string_is_parsed() -> None:
    """gpu_budget="300KiB" is 307200 bytes and runs natively."""
    model, x = make()
    ref = native(model, x)
    handle = ft.offload(model, ft.OffloadConfig(include_patterns=BLOCKS, gpu_budget="300KiB", device="cpu"))
    assert handle.budget_bytes == 300 * 1024
    assert all_equal(run(model, x, 3), ref)
    assert handle.plan.memory_bytes <= 300 * 1024
    handle.remove()


def test_auto_budget_on_cpu_uses_available_memory() -> None:
    """gpu_budget="auto" on the CPU resolves to a positive budget that holds this small model whole."""
    model, x = make()
    ref = native(model, x)
    handle = ft.offload(model, ft.OffloadConfig(include_patterns=BLOCKS, gpu_budget="auto", device="cpu"))
    assert handle.budget_bytes > BASE + 4 * UNIT
    assert all_equal(run(model, x, 3), ref)
    assert len(handle.plan.resident) == 4 and handle.plan.num_slots == 0
    handle.remove()
