"""The package's promise measured on a GPU: peak allocated memory stays within the budget."""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.engine.planner import memory_needed
from tests import models
from tests.models import Stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCKS = ["blocks.*"]
DEPTH = 8
#: At 512 tokens the text encoder's activations (~18 MB) need more than all weights: 16 tokens.
WAN_KW = dict(num_inference_steps=2, max_sequence_length=16)


def big_stack() -> tuple[Stack, torch.Tensor]:
    """About 17 MB of bf16 weights per block and well under 1 MB of activations: weights dominate."""
    torch.manual_seed(0)
    return Stack(dim=1024, depth=DEPTH, dtype=torch.bfloat16), torch.randint(0, 50, (4, 64), device="cuda")


def needs(handle) -> tuple[int, int]:
    """(smallest workable budget, budget with every unit resident) for the handle's measured profile."""
    margin = handle.config.activation_margin
    profile = handle.profile
    if profile is None:  # no units: the whole module is resident while active
        return handle.resident_weight_bytes, handle.resident_weight_bytes
    everything = frozenset(range(len(profile.unit_bytes)))
    return memory_needed(profile, frozenset(), 2, margin), memory_needed(profile, everything, 0, margin)


def stack_budgets(model: Stack, x: torch.Tensor) -> list[int]:
    """Smallest workable, middle and everything-resident budgets, from one profiled run."""
    with pytest.raises(ft.BudgetError, match=r"gpu_budget >= \d+"):
        ft.offload(model, include_patterns=BLOCKS, gpu_budget=1, device="cuda")
    handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget="4GiB", device="cuda")
    with torch.inference_mode():
        for _ in range(2):
            model(x)
    smallest, everything = needs(handle)
    handle.remove()
    return [smallest, (smallest + everything) // 2, everything]


def reset_peak() -> None:
    torch.cuda.synchronize()
    ft.reset_peak_memory_stats()


def process_peak() -> int:
    """The process's peak of allocated device memory since `reset_peak`: what a budget bounds (the package's: the
    profiling forwards reset torch's counter, and their resets are folded in)."""
    torch.cuda.synchronize()
    return ft.max_memory_allocated()


def compiled_stack() -> tuple[Stack, torch.Tensor]:
    """The stack with every block compiled (regional compilation), as users compile diffusers models."""
    model, x = big_stack()
    for block in model.blocks:
        block.compile(fullgraph=True)
    return model, x


@pytest.mark.parametrize("build", [big_stack, compiled_stack], ids=["eager", "compiled"])
def test_stack_peak_memory_stays_within_three_budgets(build) -> None:
    """Smallest workable, middle and all-resident budgets: the process's peak allocated memory, from before
    set-up to the last steady forward (its inputs included), never exceeds the budget."""
    model, x = build()
    budgets = stack_budgets(model, x)
    assert budgets[0] < budgets[1] < budgets[2]
    for budget in budgets:
        reset_peak()
        handle = ft.offload(model, include_patterns=BLOCKS, gpu_budget=budget, device="cuda")
        try:
            with torch.inference_mode():
                for _ in range(4):  # discovery, profiling, steady
                    model(x)
            peak = process_peak()
            plan = handle.plan
            assert handle.phase is Phase.STEADY and plan.memory_bytes <= budget
            weights = handle.resident_weight_bytes + plan.num_slots * plan.slot_bytes
            weights += sum(handle.units[u].nbytes for u in plan.resident)
            assert weights <= peak <= budget, f"budget {budget}: peak {peak}, plan {plan.summary()}"
            if budget == budgets[0]:
                assert plan.num_slots == 2 and not plan.resident
            if budget == budgets[2]:
                assert len(plan.resident) == DEPTH and plan.num_slots == 0
        finally:
            handle.remove()


@pytest.fixture(scope="module", params=["eager", "compiled"])
def wan(request):
    from flextensor_diffusers.pipelines.compile import compile_pipeline
    from flextensor_diffusers.recipes.models import build_pipeline

    pipe = build_pipeline("wan22_t2v", "tiny", seed=0, init_device="cpu")
    if request.param == "compiled":
        compile_pipeline(pipe, "regional")
    return pipe


def wan_latents(pipe) -> torch.Tensor:
    return models.wan_latents(pipe, **WAN_KW)


@pytest.fixture(scope="module")
def wan_budgets(wan) -> dict[str, int]:
    """Smallest workable, middle and everything-resident budgets: every component gets the whole
    budget, so each is the largest of the components' own, from one profiled run."""
    wan.enable_flextensor_offload(budget="4GiB", device="cuda")
    try:
        for _ in range(2):
            wan_latents(wan)
        per_component = [needs(h) for h in ft.pipeline_offload(wan).handles.values()]
    finally:
        wan.disable_flextensor_offload()
    smallest = max(s for s, _ in per_component)
    everything = max(e for _, e in per_component)
    assert smallest < everything  # the transformers stream at the smallest
    smallest += smallest // 100  # activations measured again vary by some KiB between runs of one process
    return {"smallest": smallest, "middle": (smallest + everything) // 2, "everything": everything}


@pytest.mark.parametrize("which", ["smallest", "middle", "everything"])
def test_wan_pipeline_peak_memory_stays_within_the_budget(wan, wan_budgets, which: str) -> None:
    """Tiny Wan2.2, latents of 9 frames 32x32 in 2 steps, eager and regionally compiled: the process's peak
    allocated memory from before `enable_flextensor_offload` to the end of three generations (profiling ones
    included) never exceeds the budget."""
    budget = wan_budgets[which]
    reset_peak()
    wan.enable_flextensor_offload(budget=budget, device="cuda")
    try:
        for _ in range(3):  # discovery and profiling of every component, then steady
            wan_latents(wan)
        peak = process_peak()
        report = wan.flextensor_report()
        ran = {name: c for name, c in report["components"].items() if name != "vae"}  # latents: no decode
        assert all(c["phase"] == "steady" for c in ran.values())
        assert peak <= budget, f"{which} budget {budget}: peak {peak}\n{wan.flextensor_report(as_text=True)}"
    finally:
        wan.disable_flextensor_offload()


def test_auto_budget_stays_under_a_per_process_memory_cap() -> None:
    """Under set_per_process_memory_fraction (a ~12 GB cap), gpu_budget="auto" resolves within the cap."""
    total = torch.cuda.get_device_properties(0).total_memory
    cap = 12 * 10**9
    if total < 2 * cap:
        pytest.skip("needs a GPU of at least 24 GB for a 12 GB cap to be a real limit")
    fraction = cap / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        model, x = big_stack()
        handle = ft.offload(model, ft.OffloadConfig(include_patterns=BLOCKS, gpu_budget="auto", device="cuda"))
        try:  # a handle dropped without remove() leaves its host buffers registered with CUDA
            assert 0 < handle.budget_bytes <= int(fraction * total)
            with torch.inference_mode():
                for _ in range(3):
                    model(x)
            assert handle.phase is Phase.STEADY
        finally:
            handle.remove()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
