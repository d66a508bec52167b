"""Modules that are not plain diffusers blocks: every scenario is bitwise equal to native, or refused at once.

Each test runs the same sequence of calls and edits on a native model and on its offloaded twin, at the
smallest budget (every unit streams through two slots) and at a budget that keeps every unit resident, and
compares every output, every gradient and the final weights byte for byte. A scenario refused at its first call
runs at the set-up minimum instead (weights outside units and two slots): far under four times the weights
(`phases.PROFILE_RESIDENT_SHARE`), so the units stream from the first forward on, whatever else the process
holds, and the refusal comes before any activation is measured. On CUDA the smallest budget is measured in a
device state of the test's own (`tests.device_state.settle_cuda`, also run before every GPU test).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import flextensor_diffusers as ft
from flextensor_diffusers.engine import FlexTensorError, InferenceOnlyError
from tests.device_state import settle_cuda
from tests.models import assert_same, measured_smallest, setup_minimum, snapshot

PATTERNS = ["blocks.*"]
RESIDENT = 10**9  # bytes: every unit of these models fits, so the plan keeps them all on the device
BUDGETS = ["smallest", "resident"]
#: For scenarios refused at their first call on CUDA: the units stream from it on (see the module docstring).
FIRST_CALL_BUDGETS = ["set-up minimum", "resident"]
DIM = 512


class MLPBlock(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """Float inputs (so autograd can reach them), four blocks, a head outside the blocks."""

    def __init__(self, block: Callable[[], nn.Module] = MLPBlock, depth: int = 4, dim: int = DIM) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(depth)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def twins(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    native = factory().requires_grad_(False)
    return native, copy.deepcopy(native)


def smallest_budget(model: nn.Module, device: str) -> int:
    """The least budget in which ``model`` streams every unit: on the CPU the set-up minimum (it refuses 1 byte
    naming it, before packing); on CUDA the minimum once a copy of it has measured its activations, in a device
    state of its own (what earlier tests left is given back first: it would count as activations)."""
    if device == "cpu":
        return setup_minimum(model, device)

    def run(probe: nn.Module) -> None:
        with torch.no_grad():
            for x in inputs(2, device):
                probe(x)

    settle_cuda()
    # activations measured again vary by some KiB; a MiB is far from a third slot
    return measured_smallest(model, run, device) + 2**20


def offload(model: nn.Module, budget: str, device: str, **config) -> ft.OffloadHandle:
    """``model`` offloaded at ``budget``: "smallest", "set-up minimum" (the units stream from the first forward on,
    checked here) or "resident"."""
    if budget == "set-up minimum":
        handle = ft.offload(model, include_patterns=PATTERNS, gpu_budget=setup_minimum(model, device), device=device)
        assert handle.phases.current.layout() is None, "the units should stream from the first forward on"
        return handle
    bytes_ = smallest_budget(model, device) if budget == "smallest" else RESIDENT
    return ft.offload(model, include_patterns=PATTERNS, gpu_budget=bytes_, device=device, **config)


def inputs(n: int = 5, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, DIM, generator=g).to(device) for _ in range(n)]


def assert_outputs_equal(native: list[torch.Tensor], offloaded: list[torch.Tensor]) -> None:
    assert len(native) == len(offloaded)
    for k, (a, b) in enumerate(zip(native, offloaded, strict=True)):
        assert torch.equal(a, b), f"forward {k}: max-abs {(a - b).abs().max().item():.3g}"


# ------------------------------------------------------------------------------------ calls outside __call__


class DirectForwardStack(MLPStack):
    """Calls each block's ``forward`` directly, as some models and wrappers do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.forward(x)
        return self.head(x)


class CallOverridingBlock(MLPBlock):
    """A class that overrides ``__call__`` and computes without going through ``nn.Module.__call__``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x) * 1.0


class ReadsAChildWeight(MLPStack):
    """Its own forward reads a block's weights outside that block's call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + self.blocks[0].fc2.bias + self.blocks[2].norm.weight


OUTSIDE_A_CALL = {
    "direct-forward": DirectForwardStack,
    "call-override": lambda: MLPStack(CallOverridingBlock),
    "parent-reads-weight": ReadsAChildWeight,
}


@pytest.mark.parametrize("budget", FIRST_CALL_BUDGETS)
@pytest.mark.parametrize("scenario", list(OUTSIDE_A_CALL))
def test_weights_used_outside_their_units_call_are_right_or_refused(device: str, scenario: str, budget: str) -> None:
    """A unit's tensors view its own bytes or its host copy: on the CPU that computes natively; on CUDA a
    streamed unit used outside its call is refused with the fix (its weights are in host memory then)."""
    native, model = twins(OUTSIDE_A_CALL[scenario])
    native.to(device)
    handle = offload(model, budget, device)
    with torch.no_grad():
        if device == "cuda" and budget == "set-up minimum":
            with pytest.raises(FlexTensorError, match=r"outside that unit's call.*exclude_patterns"):
                model(inputs(1, device)[0])
        else:
            assert_outputs_equal([native(x) for x in inputs(4, device)], [model(x) for x in inputs(4, device)])
    handle.remove()


# ------------------------------------------------------------------------------------ reads between calls


@pytest.mark.parametrize("budget", BUDGETS)
def test_weights_read_between_forwards_are_that_units_own(device: str, budget: str) -> None:
    native, model = twins(MLPStack)
    native.to(device)
    handle = offload(model, budget, device)
    with torch.no_grad():
        for x in inputs(4, device):
            assert torch.equal(model(x), native(x))
            for (name, a), (_, b) in zip(native.named_parameters(), model.named_parameters(), strict=True):
                assert torch.equal(a.cpu(), b.cpu()), name  # read by user code between forwards
    handle.remove()


class ReturnsAViewOfItsBuffer(MLPBlock):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(16.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), self.table[:4]


class KeepsViews(MLPStack):
    def __init__(self) -> None:
        super().__init__(ReturnsAViewOfItsBuffer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        views = []
        for block in self.blocks:
            x, view = block(x)
            views.append(view)
        return self.head(x), views


def test_a_streamed_unit_returning_a_view_of_its_weights_is_refused_at_its_first_call(device: str) -> None:
    _, model = twins(KeepsViews)
    before = snapshot(model)
    handle = offload(model, "set-up minimum", device)
    with pytest.raises(FlexTensorError, match=r"blocks\.0.*exclude_patterns"), torch.no_grad():
        model(inputs(1, device)[0])
    handle.remove()
    assert_same(before, model)


def test_a_resident_unit_returning_a_view_of_its_weights_stays_right(device: str) -> None:
    native, model = twins(KeepsViews)
    native.to(device)
    handle = offload(model, "resident", device)
    with torch.no_grad():
        for x in inputs(3, device):
            (a, views_a), (b, views_b) = native(x), model(x)
            assert torch.equal(a, b)
            assert all(torch.equal(u, v) for u, v in zip(views_a, views_b, strict=True))
    handle.remove()


# ------------------------------------------------------------------------------------ autograd to the inputs


def test_autograd_to_the_inputs_through_a_streamed_unit_is_refused(device: str) -> None:
    _, model = twins(MLPStack)
    handle = offload(model, "set-up minimum", device)
    x = inputs(1, device)[0].requires_grad_(True)
    with pytest.raises(InferenceOnlyError, match=r"no_grad.*exclude_patterns"):
        model(x)
    with torch.no_grad():  # the handle goes on working
        model(x)
    handle.remove()


def test_autograd_to_the_inputs_through_resident_units_is_native(device: str) -> None:
    native, model = twins(MLPStack)
    native.to(device)
    handle = offload(model, "resident", device)
    for x in inputs(3, device):
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        native(xa).square().sum().backward()
        model(xb).square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    handle.remove()


# ------------------------------------------------------------------------------------ forwards that update state


class CountingBlock(MLPBlock):
    """Updates a buffer of its own in every forward, and computes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * self.calls


class NormingBlock(nn.Module):
    """BatchNorm: running statistics updated in train mode."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.fc(x))


def assert_same_state(native: nn.Module, model: nn.Module) -> None:
    for (name, a), (_, b) in zip(native.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(
    "factory", [lambda: MLPStack(CountingBlock), lambda: MLPStack(NormingBlock)], ids=["counter", "batchnorm"]
)
def test_a_forward_that_updates_its_own_buffers_keeps_every_update(device: str, factory, budget: str) -> None:
    native, model = twins(factory)
    native.to(device)
    native.train(), model.train()
    handle = offload(model, budget, device)
    with torch.no_grad():
        assert_outputs_equal([native(x) for x in inputs(5, device)], [model(x) for x in inputs(5, device)])
        native.eval(), model.eval()
        assert_outputs_equal([native(x) for x in inputs(2, device)], [model(x) for x in inputs(2, device)])
    assert_same_state(native, model)
    handle.remove()
    assert_same_state(native, model)


# ------------------------------------------------------------------------------------ units calling units


class CallsItsPeer(MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peer = self.__dict__.get("peer")
        return super().forward(x) if peer is None else peer(super().forward(x))


def test_a_unit_calling_another_unit_through_a_plain_reference_is_refused(device: str) -> None:
    _, model = twins(lambda: MLPStack(CallsItsPeer))
    object.__setattr__(model.blocks[0], "peer", model.blocks[2])  # not a submodule: a plain attribute
    before = snapshot(model)
    handle = offload(model, "set-up minimum", device)
    with pytest.raises(FlexTensorError, match=r"blocks\.2.*inside.*blocks\.0"), torch.no_grad():
        model(inputs(1, device)[0])
    handle.remove()
    assert_same(before, model)


# ------------------------------------------------------------------------------------ in-place edits


def edit(model: nn.Module, step: int) -> None:
    """In-place edits outside ``editing()``, on streamed units, a unit used last, and the head."""
    with torch.no_grad():
        model.blocks[1].fc1.weight.mul_(1.5)
        model.blocks[3].norm.bias.add_(0.25 * step)
        model.head.weight[0].fill_(step)


@pytest.mark.parametrize("compression", ["none", "lossless"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_in_place_edits_outside_editing_reach_the_outputs(device: str, budget: str, compression: str) -> None:
    native, model = twins(MLPStack)
    native.to(device)
    handle = offload(model, budget, device, compression=compression)
    with torch.no_grad():
        for step, x in enumerate(inputs(6, device)):
            if step in (2, 3, 5):
                edit(native, step), edit(model, step)
            assert torch.equal(model(x), native(x)), f"forward {step}"
    assert_same_state(native, model)
    handle.remove()
    with torch.no_grad():
        x = inputs(1, device)[0]
        assert torch.equal(model.to(device)(x), native(x))
