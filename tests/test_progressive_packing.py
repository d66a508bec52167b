"""Raw host copies packed while the model is already in use: set-up returns at once, the first forward waits only
for the units it reaches, and nothing a user does meanwhile (edit a weight, read the state dict, remove the
offload, interrupt a forward) sees a unit half packed or loses an edit."""

from __future__ import annotations

import threading

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import host_copies
from tests.models import Stack, assert_same, snapshot
from tests.test_engine import make, native

HELD = "blocks.2"  # the unit whose packing a test holds


def forward(model: Stack, x: torch.Tensor, device: str) -> torch.Tensor:
    with torch.inference_mode():
        return model(x.to(device)).cpu()


def offload(model: Stack, device: str) -> ft.OffloadHandle:
    """Offloaded to stream its blocks (none resident: activating at set-up copies the base only)."""
    return ft.offload(model, include_patterns=["blocks.*"], gpu_budget=150_000, device=device)


@pytest.fixture(autouse=True)
def eight_packing_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of eight units whatever the machine's cores (a held unit must be reached without a forward)."""
    monkeypatch.setattr(host_copies, "PACK_THREADS", 8)


def hold_packing(
    monkeypatch: pytest.MonkeyPatch, name: str = HELD, before_copy: bool = False
) -> tuple[threading.Event, threading.Event]:
    """Hold the packing thread of unit ``name`` after it copied the unit's bytes (or before), until the second
    event is set; the first is set once it is held."""
    copied, go_on = threading.Event(), threading.Event()
    real = host_copies.copy_into

    def held(unit, buffer) -> None:
        if not before_copy:
            real(unit, buffer)
        if unit.name == name:
            copied.set()
            assert go_on.wait(60), "the test never let the packing go on"
        if before_copy:
            real(unit, buffer)

    monkeypatch.setattr(host_copies, "copy_into", held)
    return copied, go_on


def pending(handle: ft.OffloadHandle) -> set[int]:
    packing = handle.host._progressive
    return set() if packing is None else set(packing.pending)


def test_set_up_returns_before_packing_ends_and_the_first_forward_waits(device: str, monkeypatch) -> None:
    model, x = make()
    ref = native(model, x, device)
    copied, go_on = hold_packing(monkeypatch)
    handle = offload(model, device)
    assert copied.wait(30)
    assert 3 in pending(handle)  # set-up returned with blocks.2 still being packed
    threading.Timer(0.2, go_on.set).start()
    assert torch.equal(forward(model, x, device), ref)  # waited for blocks.2 at its gate
    assert not pending(handle) and handle.host.host_gate is None  # the last unit adopted ends the gate
    assert torch.equal(forward(model, x, device), ref)
    assert handle.stats().setup_ms["pack"] > 0
    handle.remove()


def test_packing_holds_at_most_a_window_of_units_ahead_of_their_use(monkeypatch) -> None:
    """Until a unit is adopted its own tensors stay alive too: a model not used yet has at most the window's
    units packed, and its tensors are still its own."""
    monkeypatch.setattr(host_copies, "PACK_THREADS", 2)
    model, x = make(depth=8)
    ref = native(model, x, "cpu")
    handle = offload(model, "cpu")
    packing = handle.host._progressive
    assert packing is not None
    with packing._cond:  # woken at each unit packed
        assert packing._cond.wait_for(lambda: len(packing._ready) == 2, timeout=60)
        # A unit is handed to a thread only by `_submit_more`, under this lock, at set-up and at each adoption or
        # failure; none came yet (both packed units wait to be adopted): what was handed out is all there will be.
        adopted = len(handle.host.positions) - len(packing.pending)
        assert packing._next == adopted + 2 and not packing._failed
    assert len(packing._ready) == 2 and len(packing.pending) >= 7  # the base adopted, maybe one block
    waiting = [handle.host.positions[p] for p in packing.pending]
    storages = [packed.tensor.untyped_storage().data_ptr() for unit in waiting for packed in unit.tensors]
    assert len(set(storages)) == len(storages)  # their tensors are still their own
    assert torch.equal(forward(model, x, "cpu"), ref)
    assert not pending(handle)
    handle.wait_until_packed()
    handle.remove()


@pytest.mark.parametrize("edited_before_copy", [False, True])
def test_in_place_edit_while_packing_reaches_the_outputs(device: str, monkeypatch, edited_before_copy: bool) -> None:
    """An edit of a weight made after set-up returned, before its unit was adopted: while its bytes were already
    copied (its edit count tells, and it is copied again), or before its unit's copy began."""
    model, x = make()
    expected_model, _ = make()
    with torch.no_grad():
        expected_model.blocks[2].qkv.weight.mul_(2)
    expected = native(expected_model, x, device)
    copied, go_on = hold_packing(monkeypatch, before_copy=edited_before_copy)
    handle = offload(model, device)
    assert copied.wait(30)
    with torch.no_grad():
        model.blocks[2].qkv.weight.mul_(2)  # blocks.2 is copied already, or its copy waits to begin
    go_on.set()
    assert torch.equal(forward(model, x, device), expected)
    assert torch.equal(forward(model, x, device), expected)
    handle.remove()
    assert torch.equal(native(model, x, device), expected)


def test_state_dict_while_packing_gives_the_weights(monkeypatch) -> None:
    model, _ = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copied, go_on = hold_packing(monkeypatch)
    handle = offload(model, "cpu")
    assert copied.wait(30)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    go_on.set()
    handle.remove()


def test_a_unit_that_fails_to_pack_is_refused_when_reached_and_remove_restores(monkeypatch) -> None:
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    real = host_copies.copy_into

    def failing(unit, buffer) -> None:
        if unit.name == HELD:
            raise MemoryError("simulated: host memory exhausted while packing")
        real(unit, buffer)

    monkeypatch.setattr(host_copies, "copy_into", failing)
    handle = offload(model, "cpu")
    for _ in range(2):  # every forward that reaches it says so
        with pytest.raises(ft.FlexTensorError, match=r"packing 'blocks\.2' into host memory failed .*simulated"):
            forward(model, x, "cpu")
    with pytest.raises(ft.FlexTensorError, match=r"blocks\.2"):
        handle.wait_until_packed()
    handle.remove()
    assert_same(before, model)
    assert torch.equal(native(model, x, "cpu"), ref)


def test_remove_while_packing_is_under_way_leaves_every_tensor_as_it_was(monkeypatch) -> None:
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    copied, go_on = hold_packing(monkeypatch)
    earlier = set(threading.enumerate())  # other tests' handles, never removed, may still hold packing threads
    handle = offload(model, "cpu")
    assert copied.wait(30)
    threading.Timer(0.2, go_on.set).start()  # removal waits for the pack under way
    handle.remove()
    assert not [t for t in set(threading.enumerate()) - earlier if t.name.startswith("flextensor-pack")]
    assert_same(before, model)
    storages = [t.untyped_storage().data_ptr() for t in model.parameters()]
    assert len(set(storages)) == len(storages)  # each in a storage of its own again
    assert torch.equal(native(model, x, "cpu"), ref)


def test_an_interrupted_adoption_goes_on_at_the_next_forward(monkeypatch) -> None:
    """Ctrl-C while the gate adopts a unit: that forward stops, and the next one adopts it and computes right."""
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    real = host_copies.ProgressivePacking._adopt
    interrupted: list[int] = []

    def adopt(self, position, copy) -> None:
        if position == 3 and not interrupted:
            interrupted.append(position)
            raise KeyboardInterrupt
        real(self, position, copy)

    monkeypatch.setattr(host_copies.ProgressivePacking, "_adopt", adopt)
    handle = offload(model, "cpu")
    with pytest.raises(KeyboardInterrupt):
        forward(model, x, "cpu")
    assert interrupted and 3 in pending(handle)
    assert torch.equal(forward(model, x, "cpu"), ref)
    assert torch.equal(forward(model, x, "cpu"), ref)
    handle.remove()
    assert_same(before, model)


def test_progressive_packing_with_a_host_budget_is_refused_before_packing(tmp_path) -> None:
    """A host tier packs before set-up returns (it keeps the process under a budget); asking for progressive
    packing there is refused at once, naming the fix, with nothing packed."""
    from flextensor_diffusers.recipes.models import build_pipeline

    pipe = build_pipeline("wan22_t2v", "tiny")
    before = snapshot(pipe.transformer)
    with pytest.raises(ft.FlexTensorError, match=r"progressive_packing=True .* drop progressive_packing"):
        pipe.enable_flextensor_offload(
            budget=10**9, device="cpu", host_budget="1GiB", cache_dir=tmp_path, progressive_packing=True
        )
    assert ft.pipeline_offload(pipe) is None
    assert_same(before, pipe.transformer)
