"""The planner on synthetic profiles: pure functions, no model."""

from __future__ import annotations

import pytest
import torch

from flextensor_diffusers.engine import BudgetError
from flextensor_diffusers.engine.planner import (
    Call,
    WorkloadProfile,
    assign_slots,
    lower_bound,
    memory_needed,
    plan_residency,
    schedule_loads,
    simulate,
)
from flextensor_diffusers.engine.profiler import Clock, ProfiledRun, Profiler

MB = 10**6


def profile(
    sizes: list[int],
    compute: list[float],
    bw_bytes_per_ms: float = 50 * MB,
    act: int = 100 * MB,
    base: int = 50 * MB,
    order: list[int] | None = None,
) -> WorkloadProfile:
    order = order if order is not None else list(range(len(sizes)))
    return WorkloadProfile(
        unit_names=[f"b{i}" for i in range(len(sizes))],
        unit_bytes=sizes,
        calls=[Call(u, compute[u], 0.1) for u in order],
        tail_ms=0.5,
        bandwidth_bytes_per_ms=bw_bytes_per_ms,
        activation_peak_bytes=act,
        resident_bytes=base,
    )


def test_everything_resident_when_the_budget_allows() -> None:
    p = profile([100 * MB] * 8, [5.0] * 8)
    plan = plan_residency(p, budget=10**10)
    assert plan.resident == frozenset(range(8)) and plan.num_slots == 0
    assert plan.predicted_ms == pytest.approx(p.compute_ms)


def test_never_over_budget_and_monotone_in_budget() -> None:
    p = profile([100 * MB] * 12, [1.0] * 12)
    previous = None
    for budget in range(500 * MB, 1600 * MB, 100 * MB):
        plan = plan_residency(p, budget)
        assert plan.memory_bytes <= budget
        assert memory_needed(p, plan.resident, plan.num_slots, 0.05) == plan.memory_bytes
        if previous is not None:
            assert plan.predicted_ms <= previous + 1e-6  # more memory never predicts slower
        previous = plan.predicted_ms


def test_slowest_to_hide_units_become_resident_first() -> None:
    # Unit 3 is five times larger than the others: its load cannot hide behind one block's compute.
    sizes = [100 * MB] * 12
    sizes[3] = 500 * MB
    p = profile(sizes, [2.0] * 12, act=0, base=0)
    budget = 2 * 500 * MB + 500 * MB  # two slots of the largest unit + room for one more unit
    plan = plan_residency(p, budget, margin=0.0)
    assert 3 in plan.resident
    assert plan.slot_bytes == 100 * MB  # with it resident, slots shrink to the other units' size


def test_budget_below_two_slots_and_activations_is_refused_with_the_number() -> None:
    p = profile([100 * MB] * 4, [1.0] * 4, act=300 * MB, base=50 * MB)
    need = 50 * MB + 2 * 100 * MB + int(300 * MB * 1.05)
    with pytest.raises(BudgetError, match=str(need)):
        plan_residency(p, need - 1)
    assert plan_residency(p, need).num_slots == 2


def test_simulation_bounds() -> None:
    p = profile([100 * MB] * 10, [1.0] * 10)  # copy 2 ms per unit, compute 1 ms: bandwidth bound
    for slots in (2, 3, 4):
        t = simulate(p, frozenset(), slots)
        assert t >= lower_bound(p, frozenset(), slots) - 1e-9
        assert t == pytest.approx(10 * 2.0 + 1.0 + 0.1 + 0.5, rel=0.05)
    compute_bound = profile([10 * MB] * 10, [5.0] * 10)
    assert simulate(compute_bound, frozenset(), 2) == pytest.approx(compute_bound.compute_ms + 0.2, rel=0.01)


def test_repeated_unit_keeps_its_slot_and_loads_follow_the_order() -> None:
    order = [0, 1, 2, 1, 3]
    calls = [Call(u, 1.0) for u in order]
    slots = assign_slots(calls, frozenset(), 2, 4)
    assert slots == [0, 1, 0, 1]
    loads, first = schedule_loads(calls, slots)
    assert first == [(0, 0), (1, 1)]
    # after call 0 (unit 0, slot 0) unit 2 is loaded; unit 1 stays in slot 1 between its calls
    assert loads == [(0, 2), None, (0, 0), (1, 3), (1, 1)]


def test_compute_bound_workload_hides_all_transfers() -> None:
    p = profile([100 * MB] * 20, [10.0] * 20)  # 2 ms to load, 10 ms to compute
    plan = plan_residency(p, 50 * MB + 2 * 100 * MB + 105 * MB + 1)
    assert len(plan.streamed) == 20
    assert plan.predicted_ms <= 1.02 * plan.lower_bound_ms + 4.0  # only the very first load is exposed


def test_a_units_decode_time_is_its_fastest_profiled_decode() -> None:
    """One slow sample (a Triton kernel compiled at its first launch, a stall) must not make decoding look
    slower than the link, which would plan every load raw."""
    profiler = Profiler(torch.device("cpu"), Clock(torch.device("cpu")))
    profiler.cuda = True  # the per-unit rule is the GPU's; the CPU plans decodes as free
    calls = tuple(Call(u, 1.0) for u in range(3))
    # three profiled forwards of one order; unit 0 decoded in each (the first one slow), unit 2 once, unit 1 never
    for decoded in ({0: 2500.0, 2: 0.4}, {0: 0.2}, {0: 0.3}):
        profiler.runs.append(ProfiledRun(calls, 0.5, 1.0, 100, 0, decoded))
    measured = profiler.workload_profile(["b0", "b1", "b2"], [100, 100, 100], 0, lambda: pytest.fail("measured"))
    assert measured.decode_ms == pytest.approx([0.2, 0.3, 0.4])  # unit 1 from the others' time per byte
